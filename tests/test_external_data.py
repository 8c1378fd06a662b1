"""Every external-data layout a user's model may come in (issue 52), through every command and route.

optimum writes a model above 2 GB with every weight a Constant node whose value lies in
``model.onnx_data``; ``onnx.save_model(..., convert_attribute=True)`` puts attribute tensors
(a ConstantOfShape's value) outside the proto too; other tools name the file ``model.onnx.data`` or
write one file per tensor. A tiny model saved each of these ways must compile (in memory, block-wise,
``--static``, ``--target ort-genai``, ``--context-binary``), evaluate and check to the same outputs as
the same model with its weights inline. The real model this stands for (Qwen2.5-0.5B, 2.5 GB) is
measured by benchmarks/family_recipes.py (benchmarks/results/qwen25-recipes-2026-12-02.json).
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from edgeq.cli import main
from edgeq.graph import ir

LAYOUTS = ("optimum-constants", "onnx.data-attributes", "one-file-per-tensor")


def relayout(src: Path, dst: Path, layout: str) -> Path:
    """``src``'s folder copied to ``dst`` with ``model.onnx`` saved in ``layout``; returns the new model."""
    shutil.copytree(src.parent, dst, ignore=shutil.ignore_patterns("*.onnx", "*.onnx_data", "*.data"))
    model = onnx.load(str(src))
    if layout == "optimum-constants":  # every weight a Constant node, as optimum exports > 2 GB
        constants = [helper.make_node("Constant", [], [t.name], name=f"/const/{t.name}", value=t)
                     for t in model.graph.initializer]
        del model.graph.initializer[:]
        nodes = constants + list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        onnx.save_model(model, str(dst / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx_data", size_threshold=1024, convert_attribute=True)
    elif layout == "onnx.data-attributes":  # everything outside the proto, scalars and attributes too
        onnx.save_model(model, str(dst / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=0, convert_attribute=True)
    else:
        onnx.save_model(model, str(dst / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=False,
                        size_threshold=0, convert_attribute=True)
    saved = onnx.load(str(dst / "model.onnx"), load_external_data=False)
    from onnx.external_data_helper import _get_all_tensors
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in _get_all_tensors(saved))
    return dst / "model.onnx"


def _logits(model: Path, feeds: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]


@pytest.fixture(scope="module")
def feeds(tmp_path_factory) -> tuple[Path, dict]:
    rng = np.random.default_rng(0)
    data = {"input_ids": rng.integers(0, 256, (3, 24)), "attention_mask": np.ones((3, 24), np.int64),
            "position_ids": np.tile(np.arange(24), (3, 1))}
    path = tmp_path_factory.mktemp("calib") / "calib.npz"
    np.savez(path, **data)
    return path, data


def _compile(capsys, model: Path, out: Path, *extra: str) -> None:
    code = main(["compile", str(model), "-o", str(out), "--no-cache", *extra])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("route", ["off", "on", "off-via-files"])
def test_compile_equals_the_inline_model(tiny_models, feeds, tmp_path, capsys, monkeypatch, layout, route):
    """mquant-w8a8 on the tiny qwen2 (q/k/v biases): in memory, block-wise, and in memory with every
    session built through a temporary folder (what a model above 2 GB takes): the same logits and
    encodings as the inline model's compile."""
    calib, data = feeds
    if route == "off-via-files":
        monkeypatch.setattr(ir, "VIA_FILE_BYTES", 0)
        monkeypatch.setattr(ir, "CONSUME_VIA_FILE_BYTES", 0)
    mode = route.split("-")[0]
    model = relayout(tiny_models["qwen2"], tmp_path / "in", layout)
    args = ("--recipe", "mquant-w8a8", "--calib", str(calib), "--blockwise", mode)
    _compile(capsys, tiny_models["qwen2"], tmp_path / "inline", *args)
    _compile(capsys, model, tmp_path / "out", *args)
    np.testing.assert_array_equal(_logits(tmp_path / "out" / "model.onnx", data),
                                  _logits(tmp_path / "inline" / "model.onnx", data))
    enc = [json.loads((tmp_path / d / "encodings.json").read_text()) for d in ("inline", "out")]
    assert enc[0]["activations"] == enc[1]["activations"] and enc[0]["weights"] == enc[1]["weights"]
    # the input's data files are named in the manifest as inputs and left as they were
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert "model.onnx" in json.dumps(manifest["input"] if "input" in manifest else manifest)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eval_and_check_equal_the_inline_model(tiny_models, tmp_path, capsys, layout):
    """``eval ppl`` and ``check`` read the model as onnxruntime and edgeq's loader see it: same figures."""
    from toy import write_text, write_tokenizer

    inline = tmp_path / "inline"
    shutil.copytree(tiny_models["qwen2"].parent, inline)
    write_tokenizer(inline)
    write_text(tmp_path / "text.txt", 300)
    model = relayout(inline / "model.onnx", tmp_path / "ext", layout)
    results = []
    for m in (inline / "model.onnx", model):
        assert main(["eval", "ppl", str(m), "--text", str(tmp_path / "text.txt"), "--tokenizer", str(inline),
                     "--seq-len", "16", "--windows", "2", "--json"]) == 0, capsys.readouterr().err
        ppl = json.loads(capsys.readouterr().out)["ppl"]
        code = main(["check", str(m), "--target", "ort-cpu", "--json"])
        verdict = json.loads(capsys.readouterr().out)
        assert verdict.pop("model") == str(m)
        results.append((ppl, code, verdict))
    assert results[0] == results[1]


@pytest.fixture(scope="module")
def past_layouts(tiny_past, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("past-layouts")
    return {layout: relayout(tiny_past / "model" / "model.onnx", base / layout, layout) for layout in LAYOUTS}


def _ppl(folder: Path, tiny_past: Path, capsys, *extra: str) -> float:
    assert main(["eval", "ppl", str(folder), "--text", str(tiny_past / "calib.txt"), "--tokenizer", str(folder),
                 "--seq-len", "17", "--windows", "2", "--json", *extra]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["ppl"]


def _past_args(tiny_past: Path, recipe: str, *extra: str) -> tuple[str, ...]:
    return ("--recipe", recipe, "--calib", str(tiny_past / "calib.txt"), "--seq-len", "32", "--calib-windows", "2",
            *extra)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("blockwise", ["off", "on"])
def test_static_pair_equals_the_inline_models(tiny_past, past_layouts, tmp_path, capsys, layout, blockwise):
    args = _past_args(tiny_past, "mquant-w8a8", "--static", "prefill=8,context=48", "--target", "qnn-htp",
                      "--blockwise", blockwise)
    _compile(capsys, tiny_past / "model" / "model.onnx", tmp_path / "inline", *args)
    _compile(capsys, past_layouts[layout], tmp_path / "out", *args)
    for role in ("prefill", "decode"):
        a, b = (onnx.load(str(tmp_path / d / f"{role}.onnx")) for d in ("inline", "out"))
        # (a Constant whose value was external data is read as an initializer: the rest is the same)
        assert Counter(n.op_type for n in a.graph.node if n.op_type != "Constant") == \
            Counter(n.op_type for n in b.graph.node if n.op_type != "Constant")
    capsys.readouterr()
    assert _ppl(tmp_path / "out", tiny_past, capsys, "--through", "prefill") == \
        _ppl(tmp_path / "inline", tiny_past, capsys, "--through", "prefill")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_genai_folder_equals_the_inline_models(tiny_past, past_layouts, tmp_path, capsys, layout):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is the genai extra (make test installs it)")
    args = _past_args(tiny_past, "gptq-w4a16", "--target", "ort-genai")
    _compile(capsys, tiny_past / "model" / "model.onnx", tmp_path / "inline", *args)
    _compile(capsys, past_layouts[layout], tmp_path / "out", *args)
    capsys.readouterr()
    assert _ppl(tmp_path / "out", tiny_past, capsys) == _ppl(tmp_path / "inline", tiny_past, capsys)


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.version_info < (3, 11) or not sys.platform.startswith("linux"),
                    reason="onnxruntime-qnn emulates the HTP on x86-64 Linux, Python >= 3.11 only")
def test_context_binaries_from_optimums_layout(tiny_past, past_layouts, tmp_path, capsys):
    """``--context-binary`` on the layout optimum writes above 2 GB: each graph prepared whole by the
    HTP, and the HTP's perplexity equal to what it gives for the inline model's binaries."""
    args = _past_args(tiny_past, "mquant-w8a8", "--static", "prefill=8,context=48", "--target", "qnn-htp",
                      "--context-binary")
    _compile(capsys, tiny_past / "model" / "model.onnx", tmp_path / "inline", *args)
    _compile(capsys, past_layouts["optimum-constants"], tmp_path / "out", *args)
    for role in ("prefill", "decode"):
        assert [n.op_type for n in onnx.load(str(tmp_path / "out" / "qnn" / f"{role}_ctx.onnx")).graph.node] == ["EPContext"]
    capsys.readouterr()
    htp = [_ppl(tmp_path / d, tiny_past, capsys, "--through", "prefill", "--provider", "qnn-htp") for d in ("inline", "out")]
    assert htp[0] == htp[1]
