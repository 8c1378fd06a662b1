"""Real-model smoke test (CI): export SmolLM2, compile it with w8a8 on 4 calibration windows,
evaluate 4 windows of test, through the CLI a user runs.

The thresholds are loose on purpose (this is a smoke test, not the benchmark): fp32 must be in
the known range for these 4 windows and w8a8 must stay within 3x of it; the full figures come
from benchmarks/foundation.py.
"""

import json

import pytest

from edgeq.cli import main

DATA = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "wikitext-2"


def _ppl(capsys, model, tokenizer, windows=4):
    assert main(["eval", "ppl", str(model), "--text", str(DATA / "test.txt"), "--tokenizer", str(tokenizer),
                 "--windows", str(windows), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_compile_smollm2_w8a8_and_evaluate(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "w8a8"
    code = main(["compile", str(smollm2_dir / "model.onnx"), "--recipe", "w8a8", "--calib", str(DATA / "valid.txt"),
                 "--calib-windows", "4", "--no-cache", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    assert report["quantized_tensors"]["weights"] == 211  # (a block-wise pass summary counts the head once per block)
    assert report["calibration"]["samples"] == 4
    enc = json.loads((out / "encodings.json").read_text())
    assert len(enc["activations"]) == 121 and len(enc["weights"]) == 211

    fp32 = _ppl(capsys, smollm2_dir / "model.onnx", smollm2_dir)
    quant = _ppl(capsys, out / "model.onnx", smollm2_dir)
    assert fp32["tokens"] == quant["tokens"] == 4 * 511
    assert 15.0 < fp32["ppl"] < 40.0
    assert fp32["ppl"] < quant["ppl"] < 3.0 * fp32["ppl"]
