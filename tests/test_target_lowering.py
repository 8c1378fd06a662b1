"""The target lowering passes on tiny models: expand-functions leaves onnxruntime's outputs bitwise
unchanged (OnlineHadamard after rotate, SubspaceQDQ static and dynamic after resq + resq-qdq, and a
model that lost its function bodies); pow2-scales makes every scale a power of two >= the old one,
keeps Q/DQ pairs equal, and reports the error a direct computation finds; symmetric-weights leaves
signed zero-point-0 weights (exactly, for midpoint-unsigned ones) and reports its error. Every
case: idempotent and unchanged by save/load with external data."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from lowering_checks import lower_checked, outputs
from toy import random_feeds

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.passmanager.passbase import PassContext
from edgeq.passes.qdq import QDQConfig, QDQPass
from edgeq.passes.resq_qdq import ResqQDQConfig, ResqQDQPass
from edgeq.passmanager.pipeline import Pipeline, PipelineOptions
from edgeq.quantize.qdq_encodings import collect_encodings
from edgeq.passmanager.registry import get_pass
from edgeq.quantize.sqnr import sqnr_db
from edgeq.targets import check_model, load_target
from edgeq.targets.check import is_power_of_two

LOSSY_MIN_SQNR_DB = 15.0  # the pass harness's floor for 8-bit lossy passes


def _ctx(model, tmp_path):
    specs = ir.make_session(model).get_inputs()
    data = CalibrationSet([random_feeds(specs, seed=s) for s in range(3)], "random:lowering", "random", samples=3)
    return PassContext(Calibrator(data, cache_dir=tmp_path / "cache"))


def _passes(*names):
    return [get_pass(n)() for n in names]


def _outputs(model, feeds):
    return outputs(model, feeds)


def _lower(model, name, feeds, tmp_path):
    """Run one lowering pass verified; check idempotence and save/load; return (model, summary, outputs)."""
    out, record, got, _ = lower_checked(model, name, feeds, tmp_path)
    return out, record, got


# ---------------------------------------------------------------- expand-functions

def _rotated(model, ctx):
    return Pipeline(_passes("fuse-norms", "ln-to-rms", "rotate")).run(model, ctx)[0]


def _resq(activations):
    def build(model, ctx):
        passes = _passes("fuse-norms", "ln-to-rms", "resq") + [ResqQDQPass(ResqQDQConfig(activations=activations, weights="rtn"))]
        return Pipeline(passes).run(model, ctx)[0]
    return build


@pytest.mark.parametrize("arch,build,expanded", [
    ("llama", _rotated, {"OnlineHadamard": 2}),
    ("qwen2", _rotated, {"OnlineHadamard": 2}),
    ("llama", _resq("static"), {"OnlineHadamard": 2, "SubspaceQDQ": 10}),
    ("llama", _resq("dynamic"), {"OnlineHadamard": 2, "SubspaceQDQ": 10}),
], ids=["rotate-llama", "rotate-qwen2", "resq-static", "resq-dynamic"])
def test_expand_functions_is_exact(arch, build, expanded, tiny_models, tmp_path):
    model = ir.load_model(tiny_models[arch])
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=5)
    custom = build(model, _ctx(model, tmp_path))
    assert any(n.domain == "edgeq" for n in custom.graph.node)
    reference = _outputs(custom, feeds)
    out, record, got = _lower(custom, "expand-functions", feeds, tmp_path)
    assert record["summary"]["nodes_expanded"] == expanded
    assert not [n for n in out.graph.node if n.domain == "edgeq"]
    assert not out.functions and "edgeq" not in {imp.domain for imp in out.opset_import}
    for ref, new in zip(reference, got):
        np.testing.assert_array_equal(new, ref)  # EXACT: the body onnxruntime itself inlines
    assert check_model(out, load_target("generic-qdq")).counts().get("op") is None


def test_expand_functions_without_carried_bodies(tiny_models, tmp_path):
    """A model that lost its edgeq function protos gets the schema table's bodies."""
    model = ir.load_model(tiny_models["llama"])
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=6)
    rotated = _rotated(model, _ctx(model, tmp_path))
    reference = _outputs(rotated, feeds)
    del rotated.functions[:]
    out, records = Pipeline(_passes("expand-functions"), PipelineOptions(verify=True)).run(rotated, PassContext())
    assert records[0]["summary"]["nodes_expanded"] == {"OnlineHadamard": 2}
    for ref, new in zip(reference, _outputs(out, feeds)):
        np.testing.assert_array_equal(new, ref)


def test_expand_functions_inside_subgraphs(tmp_path):
    """An edgeq node in an If branch is inlined into that branch (outer-scope inputs kept)."""
    from edgeq.runtime_ops import ensure_functions, make_online_hadamard_node

    top, inits = make_online_hadamard_node("x", "y", 8, name="top_hadamard")
    inner, _ = make_online_hadamard_node("y", "branch_y", 8, name="branch_hadamard")
    then_g = helper.make_graph([inner], "then", [], [helper.make_tensor_value_info("branch_y", onnx.TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["y"], ["else_y"])], "else", [],
                               [helper.make_tensor_value_info("else_y", onnx.TensorProto.FLOAT, None)])
    graph = helper.make_graph(
        [top, helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=then_g, else_branch=else_g)], "sub",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 8])], inits)
    model = ensure_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9))
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    feeds = [{"x": x, "cond": np.array(c)} for c in (True, False)]
    reference = [_outputs(model, f) for f in feeds]
    out, records = Pipeline(_passes("expand-functions"), PipelineOptions(verify=True)).run(model, PassContext())
    assert records[0]["summary"]["nodes_expanded"] == {"OnlineHadamard": 2}
    assert not out.functions and check_model(out, load_target("generic-qdq")).clean
    for f, ref in zip(feeds, reference):
        np.testing.assert_array_equal(_outputs(out, f)[0], ref[0])


# ---------------------------------------------------------------- helpers reading Q/DQ back

def _constants(model):
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _scales(model):
    """Q/DQ node name -> (scale input name, scale values, zero point values or None)."""
    c = _constants(model)
    return {n.name: (n.input[1], c[n.input[1]], c.get(n.input[2]) if len(n.input) > 2 else None)
            for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}


def _dequantized_weights(model):
    """DQ node name -> its float output, computed by running that DQ alone in onnxruntime."""
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            g = helper.make_graph([node], "dq", [], [helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)],
                                  [inits[i] for i in node.input if i])
            m = helper.make_model(g, opset_imports=model.opset_import, ir_version=model.ir_version)
            out[node.name] = ir.make_session(m).run(None, {})[0].astype(np.float64)
    return out


def _rel_rms(before, after):
    err = sum(float(np.sum((after[k] - before[k]) ** 2)) for k in before)
    ref = sum(float(np.sum(before[k] ** 2)) for k in before)
    worst = max(np.sqrt(np.sum((after[k] - before[k]) ** 2) / np.sum(before[k] ** 2)) for k in before)
    return np.sqrt(err / ref), worst


def _quantized(tiny_models, tmp_path, **cfg):
    model = ir.load_model(tiny_models["llama"])
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=7)
    (ref, *_) = _outputs(model, feeds)
    quant, _ = Pipeline([QDQPass(QDQConfig(**cfg))]).run(model, _ctx(model, tmp_path))
    return quant, feeds, ref


# ---------------------------------------------------------------- pow2-scales

@pytest.mark.parametrize("cfg", [
    dict(activation_dtype="int8"),
    dict(activation_dtype="int8", activation_symmetric=False, weight_dtype="uint8", weight_symmetric=False),
    dict(activation_dtype="uint8", activation_symmetric=False, activation_bits=6, weight_dtype="uint4",
         weight_symmetric=False, weight_granularity="group", group_size=16),
], ids=["int8-symmetric", "asymmetric-8bit", "narrowed-asymmetric-uint4-group"])
def test_pow2_scales(cfg, tiny_models, tmp_path):
    quant, feeds, ref = _quantized(tiny_models, tmp_path, **cfg)
    out, record, (got, *_) = _lower(quant, "pow2-scales", feeds, tmp_path)
    summary = record["summary"]
    before, after = _scales(quant), _scales(out)
    assert set(before) == set(after)
    rel = {}
    for name, (s_name, s_old, _) in before.items():
        s_new = after[name][1]
        assert is_power_of_two(s_new).all(), name
        assert (s_new >= s_old).all() and (s_new < 2 * s_old).all(), name
        rel[s_name] = (s_new.astype(np.float64) - s_old) / s_old  # shared scales counted once
    rel = np.concatenate([r.ravel() for r in rel.values()])
    assert summary["scales_changed"] == len(before) and summary["scale_elements"] == rel.size
    assert summary["max_rel_scale_change"] == pytest.approx(rel.max(), rel=1e-6)
    assert summary["mean_rel_scale_change"] == pytest.approx(rel.mean(), rel=1e-6)
    # a Q and the DQs of the same tensor keep identical parameters
    for node in out.graph.node:
        if node.op_type == "QuantizeLinear":
            readers = [n for n in out.graph.node if n.op_type == "DequantizeLinear" and n.input[1] == node.input[1]]
            assert readers and all(r.input[2] == node.input[2] for r in readers)
    w_before, w_after = _dequantized_weights(quant), _dequantized_weights(out)
    overall, worst = _rel_rms(w_before, w_after)
    assert summary["weights_requantized"] == len(w_before) == 15
    assert summary["weight_rel_rms_error"] == pytest.approx(overall, rel=1e-5)
    assert summary["weight_max_rel_rms_error"] == pytest.approx(worst, rel=1e-5)
    if not cfg.get("activation_symmetric", True):  # asymmetric zero points moved with the scale, still in range
        enc = collect_encodings(out)
        assert not all(e["symmetric"] for e in enc["activations"].values())
    if cfg.get("weight_granularity") != "group":  # 8-bit: the harness's lossy floor
        assert sqnr_db(ref, got) > LOSSY_MIN_SQNR_DB
    assert not check_model(out, load_target("pow2-int")).counts().get("pow2-scale")


# ---------------------------------------------------------------- symmetric-weights

def test_symmetric_weights_shifts_midpoint_uint8_exactly(tiny_models, tmp_path):
    quant, feeds, _ = _quantized(tiny_models, tmp_path, activation_dtype="uint8", weight_dtype="uint8", weight_symmetric=True)
    reference = _outputs(quant, feeds)
    out, record, got = _lower(quant, "symmetric-weights", feeds, tmp_path)
    assert record["summary"] == {"weights_shifted_exactly": 15, "weights_requantized": 0,
                                 "weight_rel_rms_error": 0.0, "weight_max_rel_rms_error": 0.0}
    for ref, new in zip(reference, got):
        np.testing.assert_array_equal(new, ref)
    weights = collect_encodings(out)["weights"]
    assert len(weights) == 15 and all(e["dtype"] == "int8" and set(e["zero_point"]) == {0} for e in weights.values())


@pytest.mark.parametrize("cfg,signed", [
    (dict(weight_dtype="int8", weight_symmetric=False), "int8"),
    (dict(weight_dtype="uint8", weight_symmetric=False), "int8"),
    (dict(weight_dtype="uint4", weight_symmetric=False, weight_granularity="group", group_size=16), "int4"),
], ids=["int8-asymmetric", "uint8-asymmetric", "uint4-group-asymmetric"])
def test_symmetric_weights_requantizes(cfg, signed, tiny_models, tmp_path):
    quant, feeds, ref = _quantized(tiny_models, tmp_path, activation_dtype="uint8", **cfg)
    out, record, (got, *_) = _lower(quant, "symmetric-weights", feeds, tmp_path)
    summary = record["summary"]
    assert summary["weights_requantized"] == 15 and summary["weights_shifted_exactly"] == 0
    weights = collect_encodings(out)["weights"]
    assert all(e["dtype"] == signed and e["symmetric"] and set(e["zero_point"]) == {0} for e in weights.values())
    overall, worst = _rel_rms(_dequantized_weights(quant), _dequantized_weights(out))
    assert summary["weight_rel_rms_error"] == pytest.approx(overall, rel=1e-5) and overall > 0
    assert summary["weight_max_rel_rms_error"] == pytest.approx(worst, rel=1e-5)
    if signed == "int8":
        assert sqnr_db(ref, got) > LOSSY_MIN_SQNR_DB
    htp = check_model(out, load_target("qnn-htp")).counts()
    assert not {k for k in htp if k.startswith("weight-")} - {"weight-granularity"}


# ---------------------------------------------------------------- positive-weight-scales

def _negate_channels(model, saturate_one=False):
    """Every other channel of each per-channel weight stored as (-q, -scale): the same real weights.
    ``saturate_one``: one negated code of the first weight set to qmin (-qmin does not fit)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    inits = {t.name: t for t in model.graph.initializer}
    first = True
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits:
            continue
        q, s = numpy_helper.to_array(inits[node.input[0]]).copy(), numpy_helper.to_array(inits[node.input[1]]).copy()
        if s.ndim != 1:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1) % q.ndim
        index = [slice(None)] * q.ndim
        index[axis] = slice(None, None, 2)
        s[::2] *= -1
        q[tuple(index)] *= -1
        if saturate_one and first:
            q[tuple(0 for _ in q.shape)] = np.iinfo(q.dtype).min
            first = False
        inits[node.input[0]].CopyFrom(numpy_helper.from_array(q, node.input[0]))
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(s, node.input[1]))
    return model


def test_positive_weight_scales_flips_exactly(tiny_models, tmp_path):
    quant, feeds, _ = _quantized(tiny_models, tmp_path, activation_dtype="uint8", weight_dtype="int8", weight_granularity="channel")
    negative = _negate_channels(quant)
    reference = _outputs(quant, feeds)
    for ref, same in zip(reference, _outputs(negative, feeds)):
        np.testing.assert_array_equal(same, ref)  # onnxruntime's CPU kernels compute negative scales exactly
    assert check_model(negative, load_target("qnn-htp")).counts()["positive-scale"] == 15
    out, record, got = _lower(negative, "positive-weight-scales", feeds, tmp_path)
    assert record["summary"]["weights_flipped"] == 15 and record["summary"]["codes_saturated"] == 0
    assert record["summary"]["weight_rel_rms_error"] == 0.0
    for ref, new in zip(reference, got):
        np.testing.assert_array_equal(new, ref)
    assert "positive-scale" not in check_model(out, load_target("qnn-htp")).counts()


def test_positive_weight_scales_saturates_what_does_not_fit(tiny_models, tmp_path):
    quant, feeds, _ = _quantized(tiny_models, tmp_path, activation_dtype="uint8", weight_dtype="int8", weight_granularity="channel")
    negative = _negate_channels(quant, saturate_one=True)
    out, record, _ = _lower(negative, "positive-weight-scales", feeds, tmp_path)
    assert record["summary"]["codes_saturated"] == 1
    overall, worst = _rel_rms(_dequantized_weights(negative), _dequantized_weights(out))
    assert record["summary"]["weight_rel_rms_error"] == pytest.approx(overall, rel=1e-5) and overall > 0
    assert record["summary"]["weight_max_rel_rms_error"] == pytest.approx(worst, rel=1e-5)
