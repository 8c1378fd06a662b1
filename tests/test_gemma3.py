"""Gemma 3 270M, the second real model (a family other than Llama), on real weights:

- ``edgeq export gemma3`` writes a folder whose tokenizer says ``add_bos_token`` (its GGUF's word),
  so every calibration and evaluation window starts with BOS (``window_convention``);
- the default recipe keeps the sandwich family's norm scales out of the weights (``fuse-norms``
  ``sandwich = "keep"``, ``rotate`` at the norm outputs) and stays within 1.05x of fp32 perplexity
  with onnxruntime's defaults and with exact QDQ (4 calibration and 4 test windows here; 40 test
  windows in docs/model-families.md: 0.931x).
"""

from __future__ import annotations

import json

import pytest

from edgeq.cli import main
from edgeq.textdata import token_windows, window_convention

pytestmark = pytest.mark.slow


def test_gemma3_windows_start_with_bos(gemma3_dir):
    config = json.loads((gemma3_dir / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and json.loads((gemma3_dir / "config.json").read_text())["model_type"] == "gemma3_text"
    assert window_convention(gemma3_dir) == "bos-each-window"
    ids = token_windows(_data("test.txt"), gemma3_dir, seq_len=512, windows=3)
    bos = json.loads((gemma3_dir / "config.json").read_text())["bos_token_id"]
    assert (ids[:, 0] == bos).all() and (ids[:, 1:] != bos).all()


def _data(name):
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "data" / "wikitext-2" / name


def _ppl(model, tokenizer, capsys, *extra):
    assert main(["eval", "ppl", str(model), "--text", str(_data("test.txt")), "--tokenizer", str(tokenizer),
                 "--windows", "4", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_gemma3_default_recipe_within_5_percent_of_fp32(gemma3_dir, tmp_path, capsys):
    out = tmp_path / "mq"
    assert main(["compile", str(gemma3_dir / "model.onnx"), "--calib", str(_data("valid.txt")), "--calib-windows", "4",
                 "-o", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    rotate = next(r for r in report["passes"] if r["name"] == "rotate")
    assert rotate["modified"] and rotate["summary"]["placement"] == "norm-outputs"
    assert report["measured_accuracy"]["sane"] and "accuracy_warning" not in report
    capsys.readouterr()
    fp32 = _ppl(gemma3_dir / "model.onnx", gemma3_dir, capsys)
    assert fp32["window_convention"] == "bos-each-window"
    assert 100 < fp32["ppl"] < 300  # 173.56 measured (4 BOS-led windows; 610-class without BOS)
    for extra in ((), ("--exact-qdq",)):
        quant = _ppl(out / "model.onnx", gemma3_dir, capsys, *extra)
        assert quant["ppl"] / fp32["ppl"] <= 1.05, (extra, quant["ppl"], fp32["ppl"])
