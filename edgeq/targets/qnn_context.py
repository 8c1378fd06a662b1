"""``compile --static ... --target qnn-htp --context-binary``: the static pair prepared by
Qualcomm's own compiler, as a device loads it.

For each graph of the pair, onnxruntime-qnn's HTP backend prepares the graph for one HTP
generation and writes an EPContext model (``OUT/qnn/<graph>_ctx.onnx``, a single node that
points at its context binary) with the binary beside it (``OUT/qnn/<graph>_ctx_qnn.bin``). Each
is loaded back with CPU fallback disabled before the folder is published, so a binary that the
runtime cannot open is never written.

Weights are not shared between the two binaries. QNN can put both graphs in one binary
(``ep.share_ep_contexts``), and onnxruntime-qnn 2.7.0 writes it, but on x86-64 loading that
shared binary back crashes the process (segmentation fault, measured on the tiny pair): each
graph gets its own binary, with its own copy of the weights.
"""

from __future__ import annotations

from pathlib import Path

from edgeq.targets.qnn_vendor import DEFAULT_HTP_ARCH, HTP_SOCS, VendorRefused, prepare_context, vendor_version

CONTEXT_FOLDER = "qnn"


def write_context_binaries(folder: Path, graphs: list[str], htp_arch: int | None = None) -> dict:
    """Prepare each ``folder/<graph>`` into ``folder/qnn/<stem>_ctx.onnx`` + binary; the report's
    ``qnn_context`` section (per graph: files, sizes, prepare and load seconds)."""
    arch = htp_arch or DEFAULT_HTP_ARCH
    out = folder / CONTEXT_FOLDER
    out.mkdir()
    records = {}
    for graph in graphs:
        stem = Path(graph).stem
        ctx_model = out / f"{stem}_ctx.onnx"
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
    return {"htp_arch": arch, "soc_model": HTP_SOCS[arch], "vendor": f"onnxruntime-qnn {vendor_version()}",
            "weights_shared": False, "graphs": records}
