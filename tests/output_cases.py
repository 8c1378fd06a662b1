"""What the output-safety tests share (tests/test_output_safety.py: what ``-o`` may replace;
tests/test_output_leftovers.py: signals, staging leftovers, file modes): the toy model, a quiet
progress line, and the checks that a refused command is one line and touched nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from toy import toy_model_dir, write_text

from edgeq.cli import main

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPILE = ["--recipe", "w8a8", "--calib-windows", "1", "--seq-len", "16", "--no-cache"]


@pytest.fixture(autouse=True)
def _no_progress(monkeypatch):
    monkeypatch.setenv("EDGEQ_PROGRESS", "0")  # stderr must hold the error line only


@pytest.fixture
def toy(tmp_path):
    """(model.onnx with all weights in model.onnx.data, calibration text), in tmp_path/in."""
    model = toy_model_dir(tmp_path / "in" / "toy")
    calib = write_text(tmp_path / "in" / "calib.txt", 400)
    return model, calib


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err.strip(), captured.out


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones too) with its content (None for folders)."""
    return {p.relative_to(root).as_posix(): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def _refused(capsys, root: Path, argv, needle: str) -> str:
    before = _snapshot(root)
    code, err, out = _run(capsys, *argv)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("edgeq: error:"), err
    assert needle in err, err
    assert out == "", "refused after work had started"
    assert _snapshot(root) == before, "a refused command touched files"
    return err


def _foreign(folder: Path) -> Path:
    """A folder of the user's: not empty, not written by edgeq."""
    (folder / "notes").mkdir(parents=True)
    (folder / "notes" / "todo.txt").write_text("keep me")
    (folder / "photo.jpg").write_bytes(b"\xff\xd8 jpeg")
    return folder


def _llama_calib(model: Path, folder: Path) -> Path:
    names = {i.name for i in onnx.load(str(model), load_external_data=False).graph.input}
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 256, (2, 16)), "attention_mask": np.ones((2, 16), np.int64),
             "position_ids": np.tile(np.arange(16), (2, 1))}
    path = folder / "calib.npz"
    np.savez(path, **{k: v for k, v in feeds.items() if k in names})
    return path
