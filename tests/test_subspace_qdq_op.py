"""``edgeq::SubspaceQDQ`` (ResQ's mixed precision): onnxruntime running the function body (graph
optimizations off and at the default level), onnx's ReferenceEvaluator running the body and
running the numpy reference (``reference_evaluator_ops``) agree with ``subspace_qdq_reference``,
static per-tensor (int8 symmetric, uint8 asymmetric) and dynamic per-token (asymmetric, the
paper's setting, and symmetric), x [2, 5, 64] with rank 8 and [3, 48] with rank 16.

Tolerance: none, the outputs are compared bit for bit. Static mode is QuantizeLinear / Clip /
DequantizeLinear, exact integer arithmetic around one float32 division and one product. Dynamic
mode is a fixed sequence of IEEE float32 operations (ReduceMin/Max, Sub, Div, Round half to even,
Add, Clip, Mul), each correctly rounded, which the numpy reference performs in the same order on
float32 values, so onnxruntime (Eigen's elementwise kernels) and numpy agree exactly; no fused or
reciprocal-approximated division is involved (observed: max difference 0.0 in every case).
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from edgeq.quantize.quant import QuantSpec, scale_zero_point
from edgeq.runtime_ops import (
    DOMAIN,
    SCHEMAS,
    SUBSPACE_QDQ,
    ensure_functions,
    make_subspace_qdq_node,
    reference_evaluator_ops,
    subspace_qdq_reference,
)

LEVELS = {
    "disable_all": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "default": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
SHAPES = [((2, 5, 64), 8, ["b", "s", 64]), ((3, 48), 16, ["n", 48])]
MODES = ["static_sym", "static_asym", "dynamic_asym", "dynamic_sym"]


def _x(shape, rank, seed=0) -> np.ndarray:
    """Gaussian coefficients, the last ``rank`` channels (the high-variance subspace) 8x larger,
    plus a few outliers in the low part so that static scales saturate somewhere."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., -rank:] *= 8.0
    flat = x.reshape(-1, shape[-1])
    flat[0, 0], flat[-1, 1] = 9.0, -11.0
    return x


def _static_params(x, rank, symmetric: bool) -> dict:
    """Calibrated the way the qdq pass would (``edgeq.quantize.quant.scale_zero_point``), on 70% of the
    observed range so that the extremes saturate."""
    split = x.shape[-1] - rank
    params = {}
    for part, xp, bits in (("low", x[..., :split], 4), ("high", x[..., split:], 8)):
        spec = QuantSpec("int8" if symmetric else "uint8", symmetric=symmetric, value_bits=bits if bits < 8 else 0)
        scale, zp = scale_zero_point(np.array(0.7 * xp.min()), np.array(0.7 * xp.max()), spec)
        params[f"{part}_scale"], params[f"{part}_zero_point"] = float(scale), int(zp)
    return params


def _node_kwargs(mode, x, rank) -> dict:
    symmetric = mode.endswith("_sym")
    if mode.startswith("dynamic"):
        return dict(symmetric=symmetric, dynamic=True)
    return dict(symmetric=symmetric, **_static_params(x, rank, symmetric))


def _model(node, inits, dims, opset=21) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)], inits)
    return ensure_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10))


def _reference(x, inits, node) -> np.ndarray:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    args = [onnx.numpy_helper.to_array(t) for t in inits] if inits else [None] * 4
    return subspace_qdq_reference(x, *args, **attrs)[0]


def _session(model, level="disable_all", optimized_path=None):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = LEVELS[level]
    if optimized_path:
        so.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,rank,dims", SHAPES, ids=["2x5x64_r8", "3x48_r16"])
def test_all_ways_agree(shape, rank, dims, mode):
    x = _x(shape, rank, seed=rank)
    node, inits = make_subspace_qdq_node("x", "y", rank, **_node_kwargs(mode, x, rank))
    model = _model(node, inits, dims)
    onnx.checker.check_model(model, full_check=True)
    ref = _reference(x, inits, node)
    assert ref.shape == x.shape and ref.dtype == np.float32
    for level in LEVELS:
        np.testing.assert_array_equal(_session(model, level).run(None, {"x": x})[0], ref, err_msg=level)
    np.testing.assert_array_equal(ReferenceEvaluator(model).run(None, {"x": x})[0], ref)
    np.testing.assert_array_equal(ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, {"x": x})[0], ref)
    # an independent check of the semantics: each part's error within its own step size
    split = shape[-1] - rank
    kwargs = _node_kwargs(mode, x, rank)
    for sl, part, bits in ((np.s_[..., :split], "low", 4), (np.s_[..., split:], "high", 8)):
        xp, err = x[sl], np.abs(ref[sl] - x[sl])
        assert err.max() > 0  # quantized, not passed through
        if mode.startswith("static"):
            s, z = kwargs[f"{part}_scale"], kwargs[f"{part}_zero_point"]
            qmin, qmax = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if kwargs["symmetric"] else (0, 2 ** bits - 1)
            inside = (xp >= (qmin - z) * s) & (xp <= (qmax - z) * s)
            assert inside.mean() > 0.5 and (err[inside] <= s / 2 * (1 + 1e-6)).all()
        else:
            lo, hi = np.minimum(xp.min(-1, keepdims=True), 0), np.maximum(xp.max(-1, keepdims=True), 0)
            step = (np.maximum(-lo, hi) / (2 ** (bits - 1) - 1)) if kwargs["symmetric"] else (hi - lo) / (2 ** bits - 1)
            assert (err <= step * (1 + 1e-6)).all()  # half a step, plus half a step of zero-point rounding


def _distinct(a: np.ndarray) -> int:
    return np.unique(a).size


@pytest.mark.parametrize("mode", MODES)
def test_levels_per_subspace(mode):
    """Static: the low part holds at most 16 distinct values in the whole tensor, on the grid
    (q - z) * s with q in the 4-bit range; the high part up to 256 (and more than 16, so it is
    not 4-bit). Dynamic: the same per token."""
    shape, rank = (4, 6, 128), 16
    x = _x(shape, rank, seed=3)
    kwargs = _node_kwargs(mode, x, rank)
    node, inits = make_subspace_qdq_node("x", "y", rank, **kwargs)
    y = _session(_model(node, inits, ["b", "s", 128]), "default").run(None, {"x": x})[0]
    np.testing.assert_array_equal(y, _reference(x, inits, node))
    split = shape[-1] - rank
    low, high = y[..., :split], y[..., split:]
    if mode.startswith("static"):
        assert 9 <= _distinct(low) <= 16 and 16 < _distinct(high) <= 256
        qmin, qmax = (-8, 7) if kwargs["symmetric"] else (0, 15)
        q = low / np.float32(kwargs["low_scale"]) + kwargs["low_zero_point"]
        np.testing.assert_allclose(q, np.round(q), atol=1e-3)
        assert qmin <= np.round(q).min() and np.round(q).max() <= qmax
        assert np.round(q).min() == qmin or np.round(q).max() == qmax  # the 70% range saturates
    else:
        for lo_row, hi_row in zip(low.reshape(-1, split), high.reshape(-1, rank)):
            assert _distinct(lo_row) <= 16 and _distinct(hi_row) <= 256
        # per token, not per tensor: the low part of the whole tensor spans many more levels
        assert _distinct(low) > 16
        assert max(_distinct(r) for r in high.reshape(-1, rank)) > 14  # 16 values on ~15+ levels at 8 bits


def test_round_half_to_even_and_saturation():
    """Ties x / s = k + 0.5 round to even in every path; values past the 4-bit range clip to
    [-8, 7] steps (int8 storage), to [-128, 127] at 8 bits."""
    s = 0.25  # a power of two: x / s is exact
    low = np.array([0.125, 0.375, -0.125, -0.375, 0.625, 1.875, 5.0, -5.0], np.float32)  # 0.5, 1.5, -0.5, -1.5, 2.5, 7.5, 20, -20 steps
    high = np.array([0.625, 100.0], np.float32)  # 2.5 and 400 steps
    x = np.concatenate([low, high])[None]
    node, inits = make_subspace_qdq_node("x", "y", 2, low_scale=s, low_zero_point=0, high_scale=s, high_zero_point=0)
    model = _model(node, inits, ["n", 10])
    expected = np.array([[0, 2, 0, -2, 2, 7, 7, -8, 2, 127]], np.float32) * np.float32(s)
    for y in (_session(model).run(None, {"x": x})[0], _session(model, "default").run(None, {"x": x})[0],
              ReferenceEvaluator(model).run(None, {"x": x})[0], _reference(x, inits, node)):
        np.testing.assert_array_equal(y, expected)


def test_dynamic_asymmetric_formula_and_zero_tokens():
    """Per token: s = (max(hi, 0) - min(lo, 0)) / 15, z = round(-lo / s); an all-zero token gives
    zeros (scale floored at float32 tiny), a positive-only token has z = 0."""
    x = np.zeros((3, 12), np.float32)
    x[1] = np.linspace(-1.0, 3.5, 12, dtype=np.float32)
    x[2] = np.linspace(0.5, 2.0, 12, dtype=np.float32)
    node, _ = make_subspace_qdq_node("x", "y", 4, symmetric=False, dynamic=True)
    model = _model(node, [], ["n", 12])
    y = _session(model).run(None, {"x": x})[0]
    np.testing.assert_array_equal(y, _reference(x, [], node))
    assert np.isfinite(y).all() and not y[0].any()
    row = x[1, :8]
    s = np.float32((row.max() - row.min()) / np.float32(15))
    z = np.round(-row.min() / s)
    np.testing.assert_array_equal(y[1, :8], ((np.clip(np.round(row / s) + z, 0, 15) - z) * s).astype(np.float32))
    assert np.abs(y[2] - x[2]).max() <= 2.0 / 15 / 2 + 1e-6  # z = 0, half a step of max / 15


def test_optional_inputs():
    """Dynamic mode: the scale and zero-point inputs as "" (the helper's form), left off the node
    (onnxruntime only), or given (ignored) all give the same result."""
    x = _x((2, 3, 64), 8, seed=9)
    node, _ = make_subspace_qdq_node("x", "y", 8, symmetric=False, dynamic=True)
    assert list(node.input) == ["x", "", "", "", ""]
    ref = _reference(x, [], node)
    for level in LEVELS:
        np.testing.assert_array_equal(_session(_model(node, [], ["b", "s", 64]), level).run(None, {"x": x})[0], ref)
    bare = onnx.NodeProto()
    bare.CopyFrom(node)
    del bare.input[1:]
    np.testing.assert_array_equal(_session(_model(bare, [], ["b", "s", 64])).run(None, {"x": x})[0], ref)
    static_node, inits = make_subspace_qdq_node("x", "y", 8, symmetric=False, **_static_params(x, 8, False))
    given = onnx.NodeProto()
    given.CopyFrom(static_node)
    next(a for a in given.attribute if a.name == "dynamic").i = 1
    model = _model(given, inits, ["b", "s", 64])
    for y in (_session(model).run(None, {"x": x})[0], ReferenceEvaluator(model).run(None, {"x": x})[0],
              ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, {"x": x})[0]):
        np.testing.assert_array_equal(y, ref)


def test_symbolic_last_dim_and_opset_18():
    """d symbolic in the graph (the body takes d - r from Shape at run time); the body at the
    opset of SmolLM2-style exports (18) in onnxruntime; older models are refused."""
    for mode in ("static_asym", "dynamic_asym"):
        x = _x((2, 4, 48), 16, seed=5)
        node, inits = make_subspace_qdq_node("x", "y", 16, **_node_kwargs(mode, x, 16))
        ref = _reference(x, inits, node)
        for opset in (18, 21):
            model = _model(node, inits, ["b", "s", "d"], opset=opset)
            onnx.checker.check_model(model, full_check=True)
            for level in LEVELS:
                np.testing.assert_array_equal(_session(model, level).run(None, {"x": x})[0], ref, err_msg=f"{mode} {opset} {level}")
    with pytest.raises(ValueError, match="opset >= 18"):
        _model(node, inits, ["b", "s", 48], opset=17)


def test_default_level_folds_the_mode_branch(tmp_path):
    """onnxruntime inlines the function and, at its default level, replaces the If on the
    (constant) mode by the taken branch: the static model is plain Q -> Clip -> DQ per part."""
    x = _x((1, 3, 64), 8)
    for mode, expect in (("static_sym", "QuantizeLinear"), ("dynamic_asym", "ReduceMin")):
        node, inits = make_subspace_qdq_node("x", "y", 8, **_node_kwargs(mode, x, 8))
        path = tmp_path / f"{mode}.onnx"
        _session(_model(node, inits, ["b", "s", 64]), "default", optimized_path=path)
        ops = [n.op_type for n in onnx.load(str(path)).graph.node]
        assert "If" not in ops and expect in ops and not any(n.domain == DOMAIN for n in onnx.load(str(path)).graph.node), ops
        if mode == "static_sym":
            assert ops.count("QuantizeLinear") == 2 and ops.count("Clip") == 2 and ops.count("DequantizeLinear") == 2


def test_attribute_defaults():
    """A node carrying only ``rank`` runs static, symmetric, 4/8 bits in onnxruntime (function
    attribute defaults) and in the numpy op (the schema's defaults)."""
    x = _x((2, 32), 4, seed=2)
    node, inits = make_subspace_qdq_node("x", "y", 4, **_static_params(x, 4, True))
    ref = _reference(x, inits, node)
    for a in list(node.attribute):
        if a.name != "rank":
            node.attribute.remove(a)
    model = _model(node, inits, ["n", 32])
    np.testing.assert_array_equal(_session(model).run(None, {"x": x})[0], ref)
    np.testing.assert_array_equal(ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, {"x": x})[0], ref)


def test_schema_and_validation():
    schema = SCHEMAS[SUBSPACE_QDQ]
    assert [i.name for i in schema.inputs] == list(schema.function_builder(18).input)
    assert [a.name for a in schema.attributes] == ["rank", "low_bits", "high_bits", "symmetric", "dynamic"]
    assert schema.min_opset == 18
    node, inits = make_subspace_qdq_node("x", "y", 8, low_scale=0.1, low_zero_point=3, high_scale=0.01,
                                         high_zero_point=200, symmetric=False)
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == dict(
        rank=8, low_bits=4, high_bits=8, symmetric=0, dynamic=0)
    assert [t.data_type for t in inits] == [TensorProto.FLOAT, TensorProto.UINT8, TensorProto.FLOAT, TensorProto.UINT8]
    with pytest.raises(ValueError, match="4-bit range"):
        make_subspace_qdq_node("x", "y", 8, low_scale=0.1, low_zero_point=16, high_scale=0.1, high_zero_point=0, symmetric=False)
    with pytest.raises(ValueError, match="4-bit range"):
        make_subspace_qdq_node("x", "y", 8, low_scale=0.1, low_zero_point=-9, high_scale=0.1, high_zero_point=0)
    with pytest.raises(ValueError, match="static mode"):
        make_subspace_qdq_node("x", "y", 8, low_scale=0.1)
    with pytest.raises(ValueError, match="rank"):
        make_subspace_qdq_node("x", "y", 0, dynamic=True)
    with pytest.raises(ValueError, match="rank"):
        subspace_qdq_reference(np.zeros((2, 8), np.float32), rank=8, dynamic=1)
    with pytest.raises(ValueError, match="stores in int8"):
        subspace_qdq_reference(np.zeros((2, 8), np.float32), 0.1, np.uint8(0), 0.1, np.uint8(0), rank=2)
