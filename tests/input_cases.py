"""What the bad-input tests share (tests/test_input_validation.py and tests/test_model_load_checks.py):
a quiet progress line and a private cache, the toy model, and the check that a refused command is
exit 2 with one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from toy import run_cli, toy_with_calib, write_tokenizer

from edgeq.graph import ir

COMPILE = ["--recipe", "w8a8", "--calib-windows", "1", "--seq-len", "16", "--no-cache"]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEQ_PROGRESS", "0")  # stderr must hold the error line only
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def toy(tmp_path):
    """(model.onnx with its weights in model.onnx.data, calibration text)."""
    return toy_with_calib(tmp_path)


_run = run_cli


def _refused(capsys, *argv, match: str = "") -> str:
    """Run the CLI; it must exit 2 with exactly one 'edgeq: error:' line containing ``match``."""
    code, err, _ = _run(capsys, *argv)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("edgeq: error: "), err
    assert match in err, err
    return err


def _save(model: onnx.ModelProto, folder: Path) -> Path:
    """``model`` saved as ``edgeq export`` would (weights external, the toy's tokenizer beside it)."""
    ir.save_model(model, folder / "model.onnx", size_threshold=0)
    write_tokenizer(folder)
    return folder / "model.onnx"


def _set_initializer(model: onnx.ModelProto, name: str, value: np.ndarray) -> None:
    init = next(t for t in model.graph.initializer if t.name == name)
    init.CopyFrom(numpy_helper.from_array(value, name))


def _embedded(model: onnx.ModelProto, folder: Path) -> Path:
    """``model`` saved with its weights inside the protobuf (raw_data), the toy's tokenizer beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(folder / "model.onnx"))
    write_tokenizer(folder)
    return folder / "model.onnx"


def _node(proto: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in proto.graph.node if n.name == name)
