"""What an output folder holds, as its compile recorded it: the one reader of that record.

An edgeq compile writes ``report.json`` into every output folder; its sections say what the folder
is (``genai``: the folder onnxruntime-genai opens; ``static`` with ``vlm``: a static VLM deployment;
``static``: the static prefill/decode pair; neither: one graph). ``edgeq.load``, ``edgeq generate``
and ``edgeq eval`` ask this module, not the files present. A folder edgeq's compile did not write
(an export, onnxruntime-genai's own builder output, the genai folder ``OUT/qnn`` inside an output)
has no record; the readers then recognize it by its files, as any tool would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from edgeq.errors import UserInputError

FolderKind = Literal["model", "static-pair", "static-vlm", "genai"]
REPORT_FILE = "report.json"
# each kind's graph files (role -> file), as the writer names them
GRAPH_FILES: dict[str, dict[str, str]] = {
    "model": {"model": "model.onnx"},
    "genai": {"model": "model.onnx"},
    "static-pair": {"prefill": "prefill.onnx", "decode": "decode.onnx"},
    "static-vlm": {"prefill": "prefill.onnx", "decode": "decode.onnx", "vision": "vision.onnx"},
}


def read_report(folder: str | os.PathLike) -> dict | None:
    """``folder/report.json`` as written by a compile, or None when the folder has none (or a
    report.json of another tool's); one that cannot be read is a one-line error."""
    path = Path(folder) / REPORT_FILE
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserInputError(f"{path} cannot be read: {exc}") from None
    if not isinstance(report, dict) or "edgeq_version" not in report or "recipe" not in report:
        return None  # (not a compile's report)
    return report


def kind_of_report(report: dict) -> FolderKind:
    """The kind of folder ``report`` (report.json's object) describes."""
    static = report.get("static")
    if report.get("genai") is not None:
        return "genai"
    if static is not None:
        return "static-vlm" if "vlm" in static else "static-pair"
    return "model"


def recorded_kind(folder: str | os.PathLike) -> FolderKind | None:
    """The kind ``folder``'s compile recorded, with its graph files checked present; None for a
    folder without a report (not a compile's output, or a path to a file)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    report = read_report(folder)
    if report is None:
        return None
    kind = kind_of_report(report)
    missing = [f for f in GRAPH_FILES[kind].values() if not (folder / f).is_file()]
    if missing:
        raise UserInputError(f"{folder}: {missing[0]} is recorded in report.json ({kind}) but missing: "
                             "the folder is incomplete")
    return kind
