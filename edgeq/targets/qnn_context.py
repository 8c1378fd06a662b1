"""``compile --static ... --target qnn-htp --context-binary``: the static pair prepared by
Qualcomm's own compiler, as a device loads it.

For each graph of the pair, onnxruntime-qnn's HTP backend prepares the graph for one HTP
generation and writes an EPContext model (``OUT/qnn/<graph>_ctx.onnx``, a single node that
points at its context binary) with the binary beside it (``OUT/qnn/<graph>_ctx_qnn.bin``). Each
is loaded back with CPU fallback disabled before the folder is published, so a binary that the
runtime cannot open is never written.

Weights: by default each graph gets its own binary with its own copy of the weights. QNN can put
the graphs in one binary that holds the weights once (``ep.share_ep_contexts``, generated in one
process: ``--share-weights``), but no onnxruntime-qnn release on the index (2.3.0 to 2.7.0) loads
such a binary on x86-64: QNN says "Shared weights buffer isn't supported on this platform" (error
1000; 2.6.0 and 2.7.0 then crash the process), measured by ``benchmarks/qnn_weight_sharing.py``.
So the shared form is written for devices and cannot be loaded back here: the report says so.

Parts (``--max-context-mb``, ``edgeq.static.split``): each part of each graph is prepared the same
way into ``OUT/qnn/<role>_part{i}of{n}_ctx.onnx``; with ``--share-weights`` part i of the prefill
graph and part i of the decode graph share one binary (they hold the same weights), as Qualcomm's
AI Hub links each part's prompt and token graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeq.targets.qnn_vendor import DEFAULT_HTP_ARCH, HTP_SOCS, VendorRefused, prepare_context, prepare_shared_context, vendor_version

CONTEXT_FOLDER = "qnn"
SHARED_UNVERIFIED = ("QNN weight sharing: the binary holds the weights once; no onnxruntime-qnn release (2.3.0-2.7.0) "
                     "loads a shared binary on x86-64 (\"Shared weights buffer isn't supported on this platform\"), "
                     "so it was not loaded back here: load it on the device")


@dataclass
class QnnContextSection:
    """report.json's ``qnn_context``: the HTP generation and vendor the binaries were prepared with,
    whether the weights are shared (and so not loaded back here), per graph its files, bytes and
    prepare/load seconds, the shared binaries' sizes, the parts' budget, and genai's pipeline record."""

    htp_arch: int
    soc_model: int
    vendor: str
    weights_shared: bool
    loaded_back: bool
    graphs: dict[str, dict[str, Any]]
    note: str | None = None
    binaries: dict[str, int] | None = None
    max_context_mb: float | None = None  # --max-context-mb: the parts were prepared instead of the graphs
    genai: dict[str, Any] | None = None  # onnxruntime-genai's pipeline over the binaries (edgeq.genai.qnn_config)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"htp_arch": self.htp_arch, "soc_model": self.soc_model, "vendor": self.vendor,
                               "weights_shared": self.weights_shared, "loaded_back": self.loaded_back}
        if self.note is not None:
            out["note"] = self.note
        if self.binaries is not None:
            out["binaries"] = self.binaries
        out["graphs"] = self.graphs
        if self.max_context_mb is not None:
            out["max_context_mb"] = self.max_context_mb
        if self.genai is not None:
            out["genai"] = self.genai
        return out


def context_name(graph: str) -> str:
    """``prefill.onnx`` -> ``prefill_ctx.onnx`` (``prefill_part1of3.onnx`` -> ``prefill_part1of3_ctx.onnx``)."""
    return f"{Path(graph).stem}_ctx.onnx"


def write_context_binaries(folder: Path, graphs: list[str], htp_arch: int | None = None,
                           share_groups: list[list[str]] | None = None) -> QnnContextSection:
    """Prepare each ``folder/<graph>`` into ``folder/qnn/<stem>_ctx.onnx`` + binary; the report's
    ``qnn_context`` section (per graph: files, sizes, prepare and load seconds). ``share_groups``:
    graphs prepared together into one binary each group (``--share-weights``; not loaded back)."""
    arch = htp_arch or DEFAULT_HTP_ARCH
    out = folder / CONTEXT_FOLDER
    out.mkdir()
    records = {}
    if share_groups:
        for group in share_groups:
            names = ", ".join(group)
            print(f"  qnn: preparing {names} into one shared binary for HTP v{arch} (onnxruntime-qnn {vendor_version()})",
                  flush=True)
            result = prepare_shared_context([folder / g for g in group], [out / context_name(g) for g in group], arch)
            if not result.get("ok"):
                raise VendorRefused(f"QNN HTP v{arch} did not prepare {names} into one binary: {result.get('error', '')}; "
                                    "nothing written")
            for graph in group:
                records[graph] = {"files": [f"{CONTEXT_FOLDER}/{context_name(graph)}"],
                                  "binary": f"{CONTEXT_FOLDER}/{result['binary']}",
                                  "bytes": (out / context_name(graph)).stat().st_size,
                                  "prepare_seconds": round(result["prepare_seconds"], 2), "load_seconds": None}
        binaries = sorted({r["binary"] for r in records.values()})
        return QnnContextSection(arch, HTP_SOCS[arch], f"onnxruntime-qnn {vendor_version()}", weights_shared=True,
                                 loaded_back=False, graphs=records, note=SHARED_UNVERIFIED,
                                 binaries={b: (folder / b).stat().st_size for b in binaries})
    for graph in graphs:
        stem = Path(graph).stem
        ctx_model = out / context_name(graph)
        print(f"  qnn: preparing {graph} for HTP v{arch} (onnxruntime-qnn {vendor_version()})", flush=True)
        result = prepare_context(folder / graph, ctx_model, arch)
        if not result.get("ok"):
            raise VendorRefused(f"QNN HTP v{arch} did not prepare {graph}: {result.get('error', '')}; nothing written "
                                f"(`edgeq check {graph} --target qnn-htp` lists the nodes it refuses)")
        files = sorted(p.name for p in out.iterdir() if p.name.startswith(f"{stem}_ctx"))
        records[graph] = {"files": [f"{CONTEXT_FOLDER}/{f}" for f in files],
                          "bytes": sum((out / f).stat().st_size for f in files),
                          "prepare_seconds": round(result["prepare_seconds"], 2),
                          "load_seconds": round(result["load_seconds"], 2)}
    return QnnContextSection(arch, HTP_SOCS[arch], f"onnxruntime-qnn {vendor_version()}", weights_shared=False,
                             loaded_back=True, graphs=records)
