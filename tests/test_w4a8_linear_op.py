"""``edgeq::W4A8Linear`` (DPQ): onnxruntime running the function body, the ReferenceEvaluator
running the body and running the numpy reference (``reference_evaluator_ops``) agree, for uint4
asymmetric and int4 symmetric weights, K a multiple of block_size and not (short last group).

Tolerance: every path rounds x and w onto the same FP8 grids (the FP8 steps are exact in fp32),
so they differ only in the matmul's fp32 accumulation order: rtol 1e-5 and atol 1e-5 * max|y|.
Each case also checks that the FP8 rounding is visible (the output is far from x @ wf), so an
implementation that skipped it could not pass.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from edgeq.runtime_ops import SCHEMAS, W4A8_LINEAR, ensure_functions, reference_evaluator_ops
from edgeq.runtime_ops.w4a8_linear import dequantize_blocked, make_w4a8_linear_node, w4a8_linear_reference

N = 24
S8 = 2.0 ** -6  # the weight's power-of-two FP8 scale


def _model(k: int, n: int, params: dict, opset: int = 21, with_block_size: bool = True) -> onnx.ModelProto:
    node, inits = make_w4a8_linear_node("x", "y", **params)
    if not with_block_size:
        del node.attribute[:]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _params(k: int, block: int, signed: bool, seed: int = 0) -> dict:
    """Random 4-bit weights whose dequantized values land inside the FP8 range (|wf / s8| <= 60)."""
    rng = np.random.default_rng(seed)
    groups = -(-k // block)
    if signed:
        w, zp = rng.integers(-8, 8, (k, N)), np.zeros((groups, N), np.int64)
    else:
        w, zp = rng.integers(0, 16, (k, N)), rng.integers(3, 13, (groups, N))
    w_scale = (rng.uniform(1.0, 4.0, (groups, N)) * S8).astype(np.float32)  # s_g * s8
    return dict(w=w, w_scale=w_scale, w_zero_point=zp, w_fp8_scale=S8, x_scale=0.0371, block_size=block, signed=signed)


def _ref(x, p):
    return w4a8_linear_reference(x, p["w"], p["w_scale"], p["w_zero_point"], np.float32(p["w_fp8_scale"]),
                                 np.float32(p["x_scale"]), p["block_size"])[0]


def _session(model, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _close(y, ref):
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("k,block", [(96, 32), (160, 64)])
@pytest.mark.parametrize("signed", [False, True], ids=["uint4_asym", "int4_sym"])
def test_three_ways_agree(k, block, signed):
    p = _params(k, block, signed, seed=k + signed)
    model = ensure_functions(_model(k, N, p))
    onnx.checker.check_model(model, full_check=True)
    x = (np.random.default_rng(k).standard_normal((2, 5, k)) * 3).astype(np.float32)
    ref = _ref(x, p)
    assert ref.shape == (2, 5, N) and ref.dtype == np.float32
    _close(_session(model).run(None, {"x": x})[0], ref)
    # onnxruntime's default level too: its QDQ fusions must leave the FP8 emulation intact
    _close(_session(model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL).run(None, {"x": x})[0], ref)
    _close(ReferenceEvaluator(model).run(None, {"x": x})[0], ref)
    ref_op = ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(ref_op, ref)
    # the FP8 rounding of x and w is visible: far from the unrounded x @ wf
    plain = x.astype(np.float64) @ dequantize_blocked(p["w"], p["w_scale"], p["w_zero_point"], block)
    assert np.abs(plain - ref).max() > 1e-3 * np.abs(ref).max()


def test_saturation_not_nan():
    """|wf / s8| up to 960 and |x / x_scale| up to 1e6 saturate to 448 steps (QuantizeLinear's
    saturate=1; a bare float8 cast would give NaN)."""
    k, n, block = 32, 32, 32
    rng = np.random.default_rng(5)
    w = rng.integers(0, 16, (k, n))
    # first: read the rounded weight back through x = I (1.0 = 256 x_scale, exact in FP8)
    p = dict(w=w, w_scale=np.full((1, n), 64 * S8, np.float32), w_zero_point=np.zeros((1, n), np.int64),
             w_fp8_scale=S8, x_scale=1 / 256, block_size=block)
    model = ensure_functions(_model(k, n, p))
    x = np.eye(k, dtype=np.float32)[None]
    expected = np.minimum(w * 64, 448) * S8  # w * 64 steps: 0, 64, ..., 960 -> capped at 448
    assert (w * 64 > 448).any()
    for y in (_session(model).run(None, {"x": x})[0], ReferenceEvaluator(model).run(None, {"x": x})[0],
              ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, {"x": x})[0], _ref(x, p)):
        np.testing.assert_array_equal(y[0], expected)
    # second: the activation, read back through w = I (int4 symmetric, scale s8: wr = I * s8)
    p = dict(w=np.eye(k, dtype=np.int64), w_scale=np.full((1, k), S8, np.float32), w_zero_point=np.zeros((1, k), np.int64),
             w_fp8_scale=S8, x_scale=0.5, block_size=block, signed=True)
    model = ensure_functions(_model(k, k, p))
    x = np.linspace(-1e6, 1e6, 4 * k, dtype=np.float32).reshape(1, 4, k)
    x[0, 0, :3] = [224.0, -224.0, 0.25]  # exactly +-448 steps, and an unsaturated value
    for y in (_session(model).run(None, {"x": x})[0], ReferenceEvaluator(model).run(None, {"x": x})[0], _ref(x, p)):
        assert np.isfinite(y).all()
        np.testing.assert_array_equal(np.abs(y[0, 1:]), 448 * 0.5 * S8)
        np.testing.assert_array_equal(y[0, 0, :3], np.array([224.0, -224.0, 0.25], np.float32) * S8)


def test_default_block_size():
    """A node without block_size uses the schema default 128 in onnxruntime (it applies the
    function's attribute default) and in the numpy op (``reference_evaluator_ops`` fills it in).
    onnx 1.23's ReferenceEvaluator, running the body, does not apply function attribute defaults
    (the linked block_size stays unresolved); make_w4a8_linear_node always writes the attribute."""
    p = _params(256, 128, signed=True, seed=3)
    model = ensure_functions(_model(256, N, p, with_block_size=False))
    x = np.random.default_rng(4).standard_normal((1, 3, 256)).astype(np.float32)
    ref = _ref(x, p)
    _close(_session(model).run(None, {"x": x})[0], ref)
    _close(ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, {"x": x})[0], ref)
    with pytest.raises(ValueError, match="linked attributes"):
        ReferenceEvaluator(model).run(None, {"x": x})


def test_dequantize_matmul_body_breaks_onnxruntime():
    """Why the body dequantizes FP8 with Cast + Mul: onnxruntime 1.31's QDQ selector turns
    DequantizeLinear(fp8) -> MatMul <- DequantizeLinear(fp8) into MatMulIntegerToFloat, which has
    no float8 kernel or schema, and the session fails to load at ORT_ENABLE_EXTENDED and up.
    onnxruntime 1.32 no longer does (measured): there the optimized session must load and compute
    the dequantized product."""
    zero = helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0.0])
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["x8"]), helper.make_node("DequantizeLinear", ["x8", "s", "z"], ["xr"]),
             helper.make_node("QuantizeLinear", ["w", "s", "z"], ["w8"]), helper.make_node("DequantizeLinear", ["w8", "s", "z"], ["wr"]),
             helper.make_node("MatMul", ["xr", "wr"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor("s", TensorProto.FLOAT, [], [0.5]), zero,
                               onnx.numpy_helper.from_array(np.ones((4, 3), np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    _session(model)  # loads with optimizations off
    if tuple(int(p) for p in ort.__version__.split(".")[:2]) <= (1, 31):
        with pytest.raises(Exception, match="MatMulIntegerToFloat"):
            _session(model, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
        return
    x = (np.arange(8, dtype=np.float32).reshape(2, 4) / 3).astype(np.float32)
    (y,) = _session(model, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED).run(None, {"x": x})
    import ml_dtypes

    xr = (x / np.float32(0.5)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(0.5)
    np.testing.assert_allclose(y, xr @ np.ones((4, 3), np.float32), rtol=1e-6)


def test_schema_and_opset_guard():
    schema = SCHEMAS[W4A8_LINEAR]
    assert [a.name for a in schema.attributes] == ["block_size"] and schema.attributes[0].default == 128
    assert [i.name for i in schema.inputs] == list(schema.function_builder(21).input)
    with pytest.raises(ValueError, match="opset >= 21"):
        ensure_functions(_model(96, N, _params(96, 32, signed=True), opset=19))
    with pytest.raises(ValueError, match="uint4 range"):
        make_w4a8_linear_node("x", "y", np.full((4, 2), 16), np.ones((1, 2)), np.zeros((1, 2)), S8, 1.0, block_size=4)
    # the node carries the 4-bit types onnx packs two per byte
    _, inits = make_w4a8_linear_node("x", "y", np.zeros((4, 2)), np.ones((1, 2)), np.zeros((1, 2)), S8, 1.0, block_size=4, signed=True)
    assert inits[0].data_type == TensorProto.INT4 and inits[2].data_type == TensorProto.INT4


def test_fp8_rounding_matches_bit_for_bit():
    """Every finite float8 e4m3fn value and every midpoint between neighbours (ties to even),
    subnormals included, read back through w = I with unit scales: onnxruntime, the body in the
    ReferenceEvaluator and the numpy reference give the same float32 values."""
    import ml_dtypes

    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    k = 32
    values = np.concatenate([grid, mids])
    x = np.resize(values, (1, -(-values.size // k), k)).astype(np.float32)
    p = dict(w=np.eye(k, dtype=np.int64), w_scale=np.ones((1, k), np.float32), w_zero_point=np.zeros((1, k), np.int64),
             w_fp8_scale=1.0, x_scale=1.0, block_size=k, signed=True)
    model = ensure_functions(_model(k, k, p))
    ref = _ref(x, p)
    assert set(np.unique(ref)) <= set(grid)
    np.testing.assert_array_equal(_session(model).run(None, {"x": x})[0], ref)
    np.testing.assert_array_equal(ReferenceEvaluator(model).run(None, {"x": x})[0], ref)
