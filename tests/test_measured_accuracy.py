"""``edgeq/accuracy/measured.toml``: every ratio is the one its results file holds, and compile
reports it (``measured_accuracy``) and warns above ``sane_ratio`` (``accuracy_warning``, one line)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from toy import write_text, write_tokenizer

from edgeq.cli import main

REPO = Path(__file__).resolve().parents[1]
TABLE = tomllib.loads((REPO / "edgeq" / "accuracy" / "measured.toml").read_text())


def _ratio_in(results: dict, recipe: str) -> float:
    if "recipes" in results:  # benchmarks/family_recipes.py
        return results["recipes"][recipe]["default_x_fp32"]
    if "ort-cpu" in results[recipe]:  # benchmarks/npu_handoff.py: perplexity on onnxruntime CPU
        return results[recipe]["ort-cpu"]["ppl"] / results["fp32"]
    return results[recipe]["x_fp32"]  # benchmarks/rotation.py, weight_quant.py, resq.py


@pytest.mark.parametrize("family", [k for k, v in TABLE.items() if isinstance(v, dict)])
def test_every_ratio_is_its_results_files(family):
    for recipe, measured in TABLE[family]["ratios"].items():
        results = json.loads((REPO / measured["results"]).read_text())
        assert measured["x_fp32"] == pytest.approx(_ratio_in(results, recipe), abs=5e-4), (family, recipe)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from edgeq.models.tiny import export_tiny

    folder = tmp_path_factory.mktemp("measured")
    export_tiny("llama", folder / "m")
    write_tokenizer(folder / "m")
    write_text(folder / "calib.txt", 600)
    return folder


def _compile(folder, recipe, out):
    return main(["compile", str(folder / "m" / "model.onnx"), "--recipe", recipe, "--calib", str(folder / "calib.txt"),
                 "--seq-len", "32", "--calib-windows", "2", "--no-cache", "-o", str(out)])


def test_compile_warns_where_the_family_measured_far_off(tiny_llama, tmp_path, capsys):
    assert _compile(tiny_llama, "w8a8", tmp_path / "w8a8") == 0
    err = capsys.readouterr().err
    report = json.loads((tmp_path / "w8a8" / "report.json").read_text())
    assert report["measured_accuracy"]["ppl_x_fp32"] == TABLE["llama"]["ratios"]["w8a8"]["x_fp32"] > TABLE["sane_ratio"]
    warnings = [line for line in err.splitlines() if line.startswith("edgeq: warning:")]
    assert len(warnings) == 1 and "w8a8 measured 2.17x fp32" in warnings[0] and "SmolLM2" in warnings[0]
    assert report["accuracy_warning"] in warnings[0]


def test_compile_reports_a_sane_measurement_without_warning(tiny_llama, tmp_path, capsys):
    assert _compile(tiny_llama, "mquant-w8a8", tmp_path / "mq") == 0
    assert "edgeq: warning" not in capsys.readouterr().err
    report = json.loads((tmp_path / "mq" / "report.json").read_text())
    assert report["measured_accuracy"]["sane"] and "accuracy_warning" not in report


def test_unmeasured_family_or_recipe_file_claims_nothing(tiny_llama, tmp_path, capsys):
    recipe = tmp_path / "w8a8.toml"  # a file of the user's, whatever its name: no claim about it
    recipe.write_text('[[pass]]\nname = "qdq"\n')
    assert _compile(tiny_llama, str(recipe), tmp_path / "file") == 0
    assert "measured_accuracy" not in json.loads((tmp_path / "file" / "report.json").read_text())
    config = tiny_llama / "m" / "config.json"
    saved = config.read_text()
    try:
        config.write_text(json.dumps({**json.loads(saved), "model_type": "mamba"}))
        assert _compile(tiny_llama, "w8a8", tmp_path / "other") == 0
    finally:
        config.write_text(saved)
    assert "measured_accuracy" not in json.loads((tmp_path / "other" / "report.json").read_text())
    assert "edgeq: warning" not in capsys.readouterr().err
