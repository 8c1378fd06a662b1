"""The weight-quantization recipes (gptq-w4a16, dpq-w4a8, mquant-w4a8) run end to end on a tiny
llama: every pass of the recipe, onnxruntime loads and runs the result, the output stays near
float, and the graph has the promised form (MatMulNBits; W4A8Linear; int8 activations)."""

from __future__ import annotations

import pytest
from toy import random_feeds

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.passmanager.passbase import PassContext
from edgeq.passmanager.pipeline import Pipeline
from edgeq.recipes import load_recipe
from edgeq.passmanager.registry import get_pass
from edgeq.quantize.sqnr import sqnr_db


@pytest.mark.parametrize("recipe,min_db,needle", [
    ("gptq-w4a16", 12.0, "MatMulNBits"),
    ("dpq-w4a8", 12.0, "W4A8Linear"),
    ("mquant-w4a8", 8.0, "QuantizeLinear"),
])
def test_weight_recipe_on_tiny_llama(tiny_models, tmp_path, recipe, min_db, needle):
    model = ir.load_model(tiny_models["llama"])
    specs = ir.make_session(model).get_inputs()
    batches = [random_feeds(specs, seed=s, seq=32) for s in range(4)]
    ctx = PassContext(Calibrator(CalibrationSet(batches, recipe, "random", 4), cache_dir=tmp_path / "cache"))
    passes = [get_pass(p.name)(p.config) for p in load_recipe(recipe).passes]
    out, records = Pipeline(passes).run(model, ctx)
    feeds = random_feeds(specs, seed=42, seq=32)
    ref = ir.make_session(model, optimize=False).run(None, feeds)[0]
    got = ir.make_session(out, optimize=False).run(None, feeds)[0]
    assert sqnr_db(ref, got) > min_db
    weight_pass = next(r for r in records if r["name"] in ("gptq", "dpq"))
    assert weight_pass["summary"]["linears_quantized"] > 0
    ops = [n.op_type for n in out.graph.node]
    assert needle in ops
    if recipe == "dpq-w4a8":
        assert ops.count("W4A8Linear") == weight_pass["summary"]["linears_quantized"]
    if recipe == "gptq-w4a16":
        assert ops.count("MatMulNBits") == weight_pass["summary"]["linears_quantized"]
    # the shipped graph loads and runs at onnxruntime's default optimization level too
    ir.make_session(out).run(None, feeds)
