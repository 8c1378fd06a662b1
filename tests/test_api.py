"""The Python API (``edgeq.compile``, ``edgeq.load``): the same outputs as the command line, the
typed report, folders opened through the layout report.json records, the CLI's exit codes as
exception types."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import edgeq
from edgeq.artifacts.report import CompileReport
from edgeq.cli import main


def test_import_stays_light():
    """``import edgeq`` loads neither onnx nor numpy (the API is loaded on first use)."""
    code = "import sys, edgeq; print('onnx' in sys.modules or 'numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_compile_writes_what_the_command_line_writes(tiny_past, tmp_path, capsys):
    model, calib = tiny_past / "model" / "model.onnx", tiny_past / "calib.txt"
    report = edgeq.compile(model, out=tmp_path / "api", recipe="w8a8", calib=calib, seq_len=32, calib_windows=2,
                           use_cache=False)
    assert isinstance(report, CompileReport) and report.recipe.name == "w8a8"
    assert main(["compile", str(model), "--recipe", "w8a8", "--calib", str(calib), "--seq-len", "32",
                 "--calib-windows", "2", "--no-cache", "-o", str(tmp_path / "cli")]) == 0
    capsys.readouterr()
    for name in ("model.onnx", "encodings.json"):
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name
    written = json.loads((tmp_path / "api" / "report.json").read_text())
    assert [p["name"] for p in written["passes"]] == [p["name"] for p in report.passes]
    out = edgeq.load(tmp_path / "api")
    assert out.kind == "model" and out.recipe == "w8a8" and out.target is None
    assert set(out.graphs) == {"model"} and out.parts == {} and out.qnn is None
    session = out.session()
    assert {i.name for i in session.get_inputs()} >= {"input_ids", "attention_mask"}
    decoder = out.decoder()  # a dynamic graph with a KV cache decodes too
    assert np.isfinite(decoder.prefill([1, 2, 3])).all()


def test_load_opens_a_static_pair_through_its_layout(tiny_past, tmp_path):
    report = edgeq.compile(tiny_past / "model" / "model.onnx", out=tmp_path / "pair", recipe="fp32",
                           static=(8, 32))
    assert report.static is not None
    out = edgeq.load(tmp_path / "pair")
    assert out.kind == "static-pair" and set(out.graphs) == {"prefill", "decode"}
    logits = out.decoder().prefill(list(range(1, 12)))
    assert logits.ndim == 1 and np.isfinite(logits).all()
    assert {i.name for i in out.session("decode").get_inputs()} >= {"input_ids"}
    with pytest.raises(edgeq.UserInputError, match="no graph 'vision'"):
        out.session("vision")


def test_errors_are_the_command_lines_exit_codes(tiny_past, tmp_path):
    model = tiny_past / "model" / "model.onnx"
    with pytest.raises(edgeq.UserInputError) as info:
        edgeq.compile(model, out=tmp_path / "out", recipe="no-such-recipe")
    assert info.value.exit_code == 2 and not (tmp_path / "out").exists()
    with pytest.raises(edgeq.UserInputError, match="static"):
        edgeq.compile(model, out=tmp_path / "out", recipe="fp32", static=(8, -1))
    with pytest.raises(TypeError, match="context_binnary"):
        edgeq.compile(model, out=tmp_path / "out", recipe="fp32", context_binnary=True)
    assert issubclass(edgeq.TargetUnreachable, edgeq.EdgeqError) and edgeq.TargetUnreachable.exit_code == 3
    assert edgeq.EssentialPassNotApplied.exit_code == 4 and edgeq.PassFailure.exit_code == 1


def test_load_refuses_what_edgeq_did_not_write(tiny_past, tmp_path):
    with pytest.raises(edgeq.UserInputError, match="not an edgeq output folder"):
        edgeq.load(tiny_past / "model")
    edgeq.compile(tiny_past / "model" / "model.onnx", out=tmp_path / "out", recipe="fp32")
    (tmp_path / "out" / "model.onnx").unlink()
    with pytest.raises(edgeq.UserInputError, match="model.onnx is recorded in report.json but missing"):
        edgeq.load(tmp_path / "out")


def test_the_readme_example_runs(tiny_past, tmp_path, monkeypatch):
    """The README's example as written, on the tiny with-past model (its paths and shape swapped in)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Python API", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    swaps = {"artifacts/smollm2-past/model.onnx": str(tiny_past / "model" / "model.onnx"),
             "data/wikitext-2/valid.txt": str(tiny_past / "calib.txt"), "prefill=128,context=1024": "prefill=8,context=32",
             'recipe="w8a16",': 'recipe="w8a16", seq_len=32, calib_windows=2,'}
    for old, new in swaps.items():
        assert old in code, old
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102
    assert scope["out"].kind == "static-pair" and scope["out"].qnn.contexts["prefill"]
    assert np.isfinite(scope["logits"]).all()


def test_readers_open_a_folder_by_its_record_not_its_files(tiny_past, tmp_path, capsys):
    """``edgeq generate``/``eval`` take a compile's folder for what its report.json says: a static pair
    with its decode graph gone is an incomplete folder (not a one-graph folder, as its files alone
    would suggest); a report.json of another tool's is no record, and the files decide."""
    import json
    import shutil

    from edgeq.cli import main
    from edgeq.files.folder_kind import recorded_kind

    pair = tmp_path / "pair"
    edgeq.compile(tiny_past / "model" / "model.onnx", out=pair, recipe="fp32", static=(8, 32))
    assert recorded_kind(pair) == "static-pair"
    shutil.copy(tiny_past / "model" / "model.onnx", pair / "model.onnx")  # a stray graph beside the pair
    (pair / "decode.onnx").unlink()
    assert main(["generate", str(pair), "--prompt", "a b", "--max-new-tokens", "2"]) == 2
    assert "decode.onnx is recorded in report.json (static-pair) but missing" in capsys.readouterr().err
    export = tmp_path / "export"
    shutil.copytree(tiny_past / "model", export)
    (export / "report.json").write_text(json.dumps({"tool": "someone else's"}))
    assert recorded_kind(export) is None
    assert main(["generate", str(export), "--prompt", "a b", "--max-new-tokens", "2"]) == 0
