"""Qualcomm's HTP as a deployment target (``--target qnn-htp``): the options its deployment of a
static pair takes (``--context-binary``, ``--max-context-mb``, ``--share-weights``, ``--htp-arch``),
parsed and checked here, and the stages that turn the written pair into what a device loads.

The profile (``profiles/qnn-htp.toml``) says what the graphs may hold and which lowering passes get
them there; this object says what is made from them once written. Its stages run in the output's
staging folder after the writer has put the pair there (Qualcomm's compiler reads files), in order:

- ``qnn-parts`` (``--max-context-mb``): each graph cut into parts whose weights fit the budget
  (``edgeq.static.split``), saved beside it over the same ``weights.data`` and proven to load;
  ``static.parts`` in report.json;
- ``qnn-context-binaries`` (``--context-binary``): the graphs (or their parts) prepared by the vendor
  (``edgeq.targets.qnn_context``), each loaded back on the HTP unless the weights are shared;
  ``qnn_context`` in report.json.

Each stage gets its own record (name, seconds, files it added) in report.json's ``output_stages``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edgeq.errors import UserInputError

if TYPE_CHECKING:
    import onnx

    from edgeq.targets.qnn_context import QnnContextSection


class ReportSections(Protocol):
    """The parts of the compile report these stages fill (``edgeq.artifacts.report.CompileReport``,
    not imported: the artifacts package sits above the targets)."""

    static: dict | None
    qnn_context: QnnContextSection | None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``edgeq compile``'s options of this target."""
    parser.add_argument("--context-binary", action="store_true",
                        help="with --static and --target qnn-htp: also prepare both graphs with Qualcomm's own compiler "
                             "(onnxruntime-qnn, `pip install 'edgeq[qnn]'`) into OUT/qnn/prefill_ctx.onnx and "
                             "OUT/qnn/decode_ctx.onnx, EPContext models with their HTP context binaries beside them, "
                             "each loaded back with CPU fallback disabled before anything is written (exit 3 if the "
                             "HTP refuses). Minutes for a 135M model")
    parser.add_argument("--max-context-mb", type=float, metavar="MB",
                        help="with --context-binary: cut each static graph into consecutive parts (embedding and first "
                             "blocks ... last blocks and head) whose weights each fit MB megabytes, cut where one hidden "
                             "state carries the residual stream; written as OUT/<role>_part{i}of{n}.onnx over the same "
                             "weights file and prepared as OUT/qnn/<role>_part{i}of{n}_ctx.onnx. `edgeq eval ppl` and "
                             "`edgeq generate` with --provider qnn-htp run the parts in sequence. A block larger than MB "
                             "exits 2 naming it")
    parser.add_argument("--share-weights", action="store_true",
                        help="with --context-binary: prepare the prefill and decode graphs (or each pair of parts) into "
                             "one QNN context binary that holds the weights once, as devices load them. No "
                             "onnxruntime-qnn release loads such a binary on x86-64 (\"Shared weights buffer isn't "
                             "supported on this platform\"), so it is written without being loaded back; without this "
                             "flag each graph gets its own binary (two copies of the weights), which loads here")
    parser.add_argument("--htp-arch", type=int, metavar="N",
                        help="the HTP generation the context binaries are prepared for: 73 (Snapdragon 8 Gen 2), "
                             "75 (8 Gen 3), 79 (8 Elite, default)")


@dataclass(frozen=True)
class QnnHtpOptions:
    """What ``--target qnn-htp`` makes of a static pair beyond its graphs (all off by default)."""

    context_binary: bool = False  # OUT/qnn/*_ctx.onnx prepared by the vendor's HTP compiler
    htp_arch: int | None = None  # the HTP generation they are prepared for (default: DEFAULT_HTP_ARCH)
    max_context_mb: float | None = None  # each graph cut into parts whose weights fit MB
    share_weights: bool = False  # prefill and decode (part i) in one binary, weights once

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> QnnHtpOptions:
        return cls(args.context_binary, args.htp_arch, args.max_context_mb, args.share_weights)

    @property
    def budget_bytes(self) -> int | None:
        """The parts' weight budget in bytes (``--max-context-mb``), or None when not split."""
        return None if self.max_context_mb is None else int(self.max_context_mb * 2**20)

    def validate(self, static: bool, vendor: str | None) -> None:
        """Refused before any work: a setting without ``--context-binary``, a budget that is not a
        positive number, ``--context-binary`` off a static pair for the HTP (``vendor``: the target
        profile's), an unknown HTP generation, or Qualcomm's compiler missing."""
        if not self.context_binary:
            for given, flag in ((self.htp_arch is not None, "--htp-arch"), (self.max_context_mb is not None, "--max-context-mb"),
                                (self.share_weights, "--share-weights")):
                if given:
                    raise UserInputError(f"{flag} is a setting of --context-binary (with --static ... --target qnn-htp)")
            return
        if self.max_context_mb is not None and not (self.max_context_mb > 0 and math.isfinite(self.max_context_mb)):
            raise UserInputError(f"--max-context-mb must be a positive number of megabytes, got {self.max_context_mb:g}")
        from edgeq.targets.qnn_vendor import HTP_SOCS, vendor_version

        if not static or vendor != "qnn-htp":
            raise UserInputError("--context-binary prepares a static pair for Qualcomm's HTP: "
                                 "use it with --static prefill=S,context=C --target qnn-htp")
        if self.htp_arch is not None and self.htp_arch not in HTP_SOCS:
            raise UserInputError(f"--htp-arch {self.htp_arch}: known HTP generations are {', '.join(map(str, HTP_SOCS))}")
        if vendor_version() is None:
            raise UserInputError("--context-binary needs Qualcomm's compiler: pip install 'edgeq[qnn]' (onnxruntime-qnn)")

    def output_stages(self, models: dict[str, onnx.ModelProto]) -> list[QnnParts | QnnContextBinaries]:
        """The stages that run on the written pair ``models`` (file name -> graph, as the writer
        leaves them: weights pointing at ``weights.data``), in order."""
        if not self.context_binary:
            return []
        parts = QnnParts(models, self.max_context_mb) if self.max_context_mb is not None else None
        return [*([parts] if parts is not None else []),
                QnnContextBinaries(list(models), self.htp_arch, self.share_weights, parts)]


@dataclass
class QnnParts:
    """``qnn-parts``: each graph cut into parts whose weights fit ``max_context_mb`` (the decode
    graph at the prefill graph's cuts), saved beside it over the same weights file and proven to load;
    their records go into report.json's ``static.parts``."""

    models: dict[str, onnx.ModelProto]
    max_context_mb: float
    name: str = "qnn-parts"
    files: list[list[str]] = field(default_factory=list)  # per graph, its parts' files in run order (after run)

    def run(self, folder: Path, report: ReportSections) -> None:
        import onnx

        from edgeq.graph.ir import check_loads
        from edgeq.static.split import boundaries_of, split_graph

        budget = QnnHtpOptions(max_context_mb=self.max_context_mb).budget_bytes
        assert budget is not None  # (a parts stage has a budget)
        records: dict[str, Any] = {}
        cuts = None
        for name, model in self.models.items():
            role = Path(name).stem
            parts = split_graph(model, budget, role, cuts)
            cuts = boundaries_of(parts)
            names = [p.file_name(role, k + 1, len(parts)) for k, p in enumerate(parts)]
            for part, file in zip(parts, names):
                onnx.save_model(part.model, str(folder / file))
                check_loads(folder / file)
            self.files.append(names)
            records[role] = [{"file": f, "weight_bytes": p.weight_bytes, "blocks": p.blocks, "inputs": p.inputs,
                              "outputs": p.outputs} for f, p in zip(names, parts)]
        report.static = {**(report.static or {}), "parts": {"max_context_mb": self.max_context_mb, "boundaries": cuts,
                                                            **records}}


@dataclass
class QnnContextBinaries:
    """``qnn-context-binaries``: the graphs (``parts``' files when split) prepared by Qualcomm's
    compiler into ``qnn/`` (``edgeq.targets.qnn_context``); report.json's ``qnn_context``."""

    graphs: list[str]
    htp_arch: int | None
    share_weights: bool
    parts: QnnParts | None = None
    name: str = "qnn-context-binaries"

    def run(self, folder: Path, report: ReportSections) -> None:
        from edgeq.targets.qnn_context import write_context_binaries

        roles = self.parts.files if self.parts is not None else [[g] for g in self.graphs]
        groups = [list(group) for group in zip(*roles)] if self.share_weights else None
        report.qnn_context = write_context_binaries(folder, [f for files in roles for f in files], self.htp_arch, groups)
        if self.parts is not None:
            report.qnn_context.max_context_mb = self.parts.max_context_mb


@dataclass(frozen=True)
class QnnLayout:
    """What ``--context-binary`` added to an output folder, as its report.json records it (the
    ``qnn_context`` section the stages wrote, and ``static.parts``): for each graph role
    (``prefill``, ``decode``, ``vision``), its EPContext models in run order (one, or its parts'),
    and the folder onnxruntime-genai opens when that pipeline was written. ``edgeq.load``,
    ``edgeq generate`` and ``edgeq eval`` open the binaries through it, never by looking for files."""

    htp_arch: int | None
    contexts: dict[str, list[Path]]
    weights_shared: bool
    genai_folder: Path | None

    @classmethod
    def of(cls, folder: Path, report: dict) -> QnnLayout | None:
        """The layout ``report`` (report.json's object) records for ``folder``, or None when the
        compile prepared no context binaries."""
        section = report.get("qnn_context")
        if not section:
            return None
        graphs = section.get("graphs") or {}
        parts = (report.get("static") or {}).get("parts") or {}

        def models(graph: str) -> list[Path]:
            return [folder / f for f in (graphs.get(graph) or {}).get("files", []) if f.endswith(".onnx")]

        split = {role: records for role, records in parts.items() if role not in ("max_context_mb", "boundaries")}
        part_files = {p["file"] for records in split.values() for p in records}
        contexts = {Path(g).stem: models(g) for g in graphs if g not in part_files}
        contexts.update({role: [m for p in records for m in models(p["file"])] for role, records in split.items()})
        genai = section.get("genai") or {}
        genai_folder = folder / Path(genai["config"]).parent if genai.get("written") and genai.get("config") else None
        return cls(section.get("htp_arch"), contexts, bool(section.get("weights_shared")), genai_folder)

    def missing(self) -> list[Path]:
        """The EPContext models the report records that the folder lacks."""
        return [c for files in self.contexts.values() for c in files if not c.is_file()]

    @classmethod
    def read(cls, folder: Path) -> QnnLayout | None:
        """``of`` on ``folder``'s report.json; None when the folder has no compile report."""
        from edgeq.files.folder_kind import read_report

        report = read_report(folder)
        return None if report is None else cls.of(folder, report)
