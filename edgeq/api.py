"""edgeq's Python API: ``edgeq.compile`` and ``edgeq.load``, what the command line is built on.

``compile`` takes what ``edgeq compile`` takes, as keywords, and returns the typed report it wrote
(``edgeq.artifacts.report.CompileReport``, the object behind report.json). ``load`` opens an output
folder through the layout its compile recorded in report.json (a single graph, a static pair, a
static VLM, an onnxruntime-genai folder, with the QNN context binaries and parts where written),
never by guessing from the files present.

Errors are the command line's, as exceptions: each is an ``edgeq.EdgeqError`` whose ``exit_code``
is the CLI's (``UserInputError`` 2, ``PassFailure`` 1, ``TargetUnreachable`` 3,
``EssentialPassNotApplied`` 4); nothing is written when one is raised.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeq.errors import UserInputError
from edgeq.files.folder_kind import FolderKind
from edgeq.targets.qnn_htp import QnnLayout

if TYPE_CHECKING:
    from edgeq.artifacts.report import CompileReport
    from edgeq.generation.decoder_base import Decoder

OutputKind = FolderKind  # "model", "static-pair", "static-vlm", "genai"

# the targets' options (``edgeq.targets.qnn_htp.QnnHtpOptions``, ``edgeq.targets.ort_genai.OrtGenaiOptions``),
# taken as keywords by ``compile``
QNN_HTP_OPTIONS = ("context_binary", "max_context_mb", "share_weights", "htp_arch")
ORT_GENAI_OPTIONS = ("accuracy_level", "lm_head_bits")
TARGET_OPTIONS = QNN_HTP_OPTIONS + ORT_GENAI_OPTIONS


def compile(model: str | os.PathLike, *, out: str | os.PathLike, recipe: str | None = None,  # noqa: A001
            calib: str | os.PathLike | None = None, target: str | None = None,
            tokenizer: str | os.PathLike | None = None, calib_windows: int | None = None, seq_len: int | None = None,
            static: str | tuple[int, int] | None = None, blockwise: str = "auto", force: bool = False,
            allow_partial: bool = False, use_cache: bool = True, verify: bool = False, check_numerics: bool = False,
            dump_each: str | os.PathLike | None = None, **target_options: Any) -> CompileReport:
    """Compile ``model`` into the folder ``out``, as ``edgeq compile MODEL -o OUT`` does; returns the
    report written as ``out/report.json``.

    ``static``: ``"prefill=128,context=1024"`` or ``(128, 1024)`` (``--static``). ``target_options``:
    the target's options (``TARGET_OPTIONS``: ``context_binary=True``, ``max_context_mb=450``, ...);
    any other keyword is a ``TypeError``, as for any Python function."""
    from edgeq.compiler import compile_model
    from edgeq.plan import BLOCKWISE_MODES, CompileRequest
    from edgeq.static.specialize import parse_static
    from edgeq.targets.ort_genai import OrtGenaiOptions
    from edgeq.targets.qnn_htp import QnnHtpOptions

    unknown = sorted(set(target_options) - set(TARGET_OPTIONS))
    if unknown:
        raise TypeError(f"compile() got unexpected keyword argument(s) {', '.join(unknown)} "
                        f"(target options: {', '.join(TARGET_OPTIONS)})")
    if blockwise not in BLOCKWISE_MODES:
        raise UserInputError(f"blockwise must be one of {', '.join(BLOCKWISE_MODES)}, got {blockwise!r}")
    shape = parse_static(static) if isinstance(static, str) else tuple(static) if static is not None else None
    if shape is not None and (len(shape) != 2 or not all(isinstance(v, int) and v > 0 for v in shape)):
        raise UserInputError(f"static must be 'prefill=N,context=M' or (N, M) with positive integers, got {static!r}")
    from edgeq.recipes import DEFAULT_RECIPE

    req = CompileRequest(
        model=Path(model), out_dir=Path(out), recipe=recipe or DEFAULT_RECIPE,
        calib=_path(calib), tokenizer=_path(tokenizer), calib_windows=calib_windows, seq_len=seq_len,
        dump_each=_path(dump_each), verify=verify, check_numerics=check_numerics, use_cache=use_cache,
        target=target, allow_partial=allow_partial, blockwise=blockwise,
        static=(shape[0], shape[1]) if shape is not None else None, force=force,
        qnn_htp=QnnHtpOptions(**{k: v for k, v in target_options.items() if k in QNN_HTP_OPTIONS and v is not None}),
        ort_genai=OrtGenaiOptions(**{k: v for k, v in target_options.items()
                                     if k in ORT_GENAI_OPTIONS and v is not None}))
    return compile_model(req)


def _path(value: str | os.PathLike | None) -> Path | None:
    return Path(value) if value is not None else None


@dataclass(frozen=True)
class Output:
    """An edgeq output folder, opened through the layout its compile recorded.

    ``kind``: ``model`` (one graph, ``graphs["model"]``), ``static-pair`` (``prefill``/``decode``
    over one weights file), ``static-vlm`` (the pair and ``vision``), ``genai`` (the folder
    onnxruntime-genai opens). ``parts``: each graph's parts in run order (``--max-context-mb``)."""

    folder: Path
    kind: OutputKind
    report: dict[str, Any]
    graphs: dict[str, Path]
    parts: dict[str, list[Path]] = field(default_factory=dict)
    qnn: QnnLayout | None = None

    @property
    def target(self) -> str | None:
        return (self.report.get("target") or {}).get("name")

    @property
    def recipe(self) -> str:
        return self.report["recipe"]["name"]

    def decoder(self, provider: str = "cpu", **options: Any) -> Decoder:
        """A decoder over the folder's language graphs (``edgeq generate``/``eval ppl`` use the same):
        the static pair, its QNN context binaries with ``provider="qnn-htp"``, or onnxruntime-genai's
        session for a genai folder. ``options``: ``threads``, ``exact_qdq``, ``max_length``, ..."""
        from edgeq.generation.decoders import open_decoder

        if self.kind == "model" and "past_key_values.0.key" not in _input_names(self.graphs["model"]):
            raise UserInputError(f"{self.folder} holds one graph without a KV cache: open it with .session()")
        return open_decoder(self.folder, provider=provider, **options)

    def session(self, graph: str | None = None, **options: Any) -> Any:
        """An onnxruntime CPU session of one of ``graphs`` (default: the only one, or ``prefill``)."""
        from edgeq.runtime.ort_session import open_session

        name = graph or ("model" if "model" in self.graphs else "prefill")
        if name not in self.graphs:
            raise UserInputError(f"{self.folder} has no graph '{name}' (it has {', '.join(self.graphs)})")
        return open_session(self.graphs[name], **options)


def load(out: str | os.PathLike) -> Output:
    """Open the edgeq output folder ``out`` (``edgeq.Output``); a folder edgeq did not write, or
    whose recorded files are missing, is a one-line ``UserInputError``."""
    from edgeq.files.folder_kind import GRAPH_FILES, kind_of_report, read_report

    folder = Path(out)
    report = read_report(folder) if folder.is_dir() else None
    if report is None:
        raise UserInputError(f"{folder} is not an edgeq output folder (no report.json)")
    kind = kind_of_report(report)
    graphs = {role: folder / file for role, file in GRAPH_FILES[kind].items()}
    static = report.get("static")
    split = (static or {}).get("parts") or {}
    parts = {role: [folder / p["file"] for p in split[role]] for role in ("prefill", "decode") if role in split}
    output = Output(folder, kind, report, graphs, parts, QnnLayout.of(folder, report))
    recorded = [*graphs.values(), *(f for files in parts.values() for f in files)]
    missing = [f for f in recorded if not f.is_file()] + (output.qnn.missing() if output.qnn else [])
    if missing:
        raise UserInputError(f"{folder}: {missing[0].name} is recorded in report.json but missing "
                             f"({len(missing)} file(s) missing): the folder is incomplete")
    return output


def _input_names(model: Path) -> set[str]:
    import onnx

    return {i.name for i in onnx.load(str(model), load_external_data=False).graph.input}


__all__ = ["Output", "QnnLayout", "TARGET_OPTIONS", "compile", "load"]
