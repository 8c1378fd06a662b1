"""edgeq.matmulnbits: our block-quantized 4-bit weights as onnxruntime's com.microsoft::MatMulNBits.

Checks, against a float64 numpy reference of Y = X @ W, that the packed op computes the same as
DequantizeLinear(block) + MatMul (graph optimizations disabled, so each model runs as written), for
symmetric signed int4 with negative scales and asymmetric uint4 with zero points, including K not a
multiple of the group size; and pins what onnxruntime's own optimizer does with the DQ + MatMul
form (it fuses it into MatMulNBits, at accuracy level 4 unless the session says otherwise).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeq.passes.methods.matmulnbits import insert_matmulnbits, matmulnbits_node, pack_matmulnbits

ort = pytest.importorskip("onnxruntime")
ml_dtypes = pytest.importorskip("ml_dtypes")

N = 48
SHAPES = [(256, 128), (576, 128), (96, 32)]  # (K, G): whole blocks, a 64-row last block, small blocks
LEVEL = ort.GraphOptimizationLevel


def make_weight(rng, k, g, signed):
    """(q [K, N], scale [ceil(K/G), N], zero point, W [K, N] float64) like edgeq.passes.methods.gptq produces."""
    kb = -(-k // g)
    if signed:  # symmetric 'full range' int4: zero point 0, scales of both signs
        q = rng.integers(-8, 8, (k, N))
        zp = np.zeros((kb, N), np.int64)
        s = (rng.uniform(0.01, 0.05, (kb, N)) * rng.choice([-1.0, 1.0], (kb, N))).astype(np.float32)
    else:
        q = rng.integers(0, 16, (k, N))
        zp = rng.integers(0, 16, (kb, N))
        s = rng.uniform(0.01, 0.05, (kb, N)).astype(np.float32)
    rows = np.arange(k) // g
    w = (q - zp[rows]) * s[rows].astype(np.float64)
    return q, s, zp, w


def _model(nodes, inits, k, opsets):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 7, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 7, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=10)
    onnx.checker.check_model(model)
    return model


def dq_matmul_model(q, s, zp, g, signed, k):
    dtype = ml_dtypes.int4 if signed else ml_dtypes.uint4
    inits = [numpy_helper.from_array(q.astype(dtype), "w_q"), numpy_helper.from_array(s, "w_scale"),
             numpy_helper.from_array(zp.astype(dtype), "w_zero_point")]
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero_point"], ["w"], axis=0, block_size=g),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    return _model(nodes, inits, k, [("", 21)])


def matmulnbits_model(q, s, zp, g, signed, k, accuracy_level=0):
    b, scales, zps = pack_matmulnbits(q, s, zp, g, signed)
    inits = [numpy_helper.from_array(b, "w_B"), numpy_helper.from_array(scales, "w_scales")]
    if zps is not None:
        inits.append(numpy_helper.from_array(zps, "w_zero_points"))
    node = matmulnbits_node("w_MatMulNBits", "x", "y", k, N, g, "w_B", "w_scales",
                            "w_zero_points" if zps is not None else None, accuracy_level)
    return _model([node], inits, k, [("", 21), ("com.microsoft", 1)])


def run(model, x, level, config=None):
    """(y, the optimized model onnxruntime saved)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.log_severity_level = 3  # saving an ORT_ENABLE_ALL model warns about hardware-specific ops
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    with tempfile.TemporaryDirectory() as tmp:
        so.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        y = sess.run(None, {"x": x})[0]
        optimized = onnx.load(so.optimized_model_filepath)
    return y, optimized


def assert_close(y, ref, tol=1e-4):
    scale = np.abs(ref).max()
    np.testing.assert_allclose(y, ref, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("signed", [True, False], ids=["int4_sym_negscale", "uint4_zp"])
@pytest.mark.parametrize("k,g", SHAPES)
def test_matmulnbits_matches_dequantize_matmul(k, g, signed):
    rng = np.random.default_rng(k + g + signed)
    q, s, zp, w = make_weight(rng, k, g, signed)
    if signed:
        assert (s < 0).any() and (s > 0).any()
    x = rng.standard_normal((2, 7, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w

    y_dq, _ = run(dq_matmul_model(q, s, zp, g, signed, k), x, LEVEL.ORT_DISABLE_ALL)
    y_nb, optimized = run(matmulnbits_model(q, s, zp, g, signed, k), x, LEVEL.ORT_DISABLE_ALL)
    assert [n.op_type for n in optimized.graph.node] == ["MatMulNBits"]
    assert_close(y_dq, ref)
    assert_close(y_nb, ref)


@pytest.mark.parametrize("signed", [True, False], ids=["int4_sym_negscale", "uint4_zp"])
@pytest.mark.parametrize("k,g", SHAPES)
def test_onnxruntime_fuses_dequantize_matmul(k, g, signed):
    """onnxruntime 1.31 (CPU, level >= EXTENDED) rewrites DQ(block) + MatMul into MatMulNBits
    itself, with the same packing as ours (its padding rows hold code 0, ours the zero point), and
    gives it accuracy_level 4 (int8 activations) unless session.qdq_matmulnbits_accuracy_level
    says otherwise."""
    rng = np.random.default_rng(1000 + k + g + signed)
    q, s, zp, w = make_weight(rng, k, g, signed)
    x = rng.standard_normal((2, 7, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w
    model = dq_matmul_model(q, s, zp, g, signed, k)

    y4, optimized = run(model, x, LEVEL.ORT_ENABLE_ALL)  # onnxruntime's default level
    ops = [n.op_type for n in optimized.graph.node]
    assert ops.count("MatMulNBits") == 1 and "DequantizeLinear" not in ops and "MatMul" not in ops
    (fused,) = optimized.graph.node
    attrs = {a.name: helper.get_attribute_value(a) for a in fused.attribute}
    assert (attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (k, N, 4, g, 4)
    inits = {i.name: numpy_helper.to_array(i) for i in optimized.graph.initializer}
    b, scales, _ = pack_matmulnbits(q, s, zp, g, signed)
    fused_b = inits[fused.input[1]].reshape(b.shape)
    full = k // g  # blocks without padding: byte-identical
    np.testing.assert_array_equal(fused_b[:, :full], b[:, :full])
    if k % g:
        tail = (k % g) // 2
        np.testing.assert_array_equal(fused_b[:, full, :tail], b[:, full, :tail])
    np.testing.assert_array_equal(inits[fused.input[2]].reshape(scales.shape), scales)
    # accuracy level 4 quantizes x to int8 per block (on CPUs with MLAS int8 kernels; ~0.5 % of
    # max|y| off the float result here): the same numbers as our node at accuracy_level=4 ...
    assert_close(y4, ref, tol=3e-2)
    y_ours4, _ = run(matmulnbits_model(q, s, zp, g, signed, k, accuracy_level=4), x, LEVEL.ORT_DISABLE_ALL)
    np.testing.assert_allclose(y_ours4, y4, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # ... and level 1 (fp32) is float-exact again
    y1, optimized = run(model, x, LEVEL.ORT_ENABLE_ALL, {"session.qdq_matmulnbits_accuracy_level": "1"})
    assert [n.op_type for n in optimized.graph.node] == ["MatMulNBits"]
    assert_close(y1, ref)


def test_basic_level_and_disabled_qdq_do_not_fuse():
    rng = np.random.default_rng(7)
    q, s, zp, _ = make_weight(rng, 256, 128, True)
    x = rng.standard_normal((2, 7, 256)).astype(np.float32)
    model = dq_matmul_model(q, s, zp, 128, True, 256)
    _, basic = run(model, x, LEVEL.ORT_ENABLE_BASIC)
    assert "MatMulNBits" not in [n.op_type for n in basic.graph.node]
    _, no_qdq = run(model, x, LEVEL.ORT_ENABLE_ALL, {"session.disable_quant_qdq": "1"})
    assert "MatMulNBits" not in [n.op_type for n in no_qdq.graph.node]


def test_pack_layout():
    """Nibble order (low = even row / even block), padding with the zero point, the default 8."""
    g, k = 16, 40  # 3 blocks, the last with 8 rows
    q = np.arange(k * 2).reshape(k, 2) % 16
    zp = np.array([[1, 2], [3, 4], [5, 6]])
    s = np.ones((3, 2), np.float32)
    b, scales, zps = pack_matmulnbits(q, s, zp, g, signed=False)
    assert b.shape == (2, 3, 8) and b.dtype == np.uint8 and scales.shape == (2, 3)
    assert b[0, 0, 0] == q[0, 0] | (q[1, 0] << 4)  # low nibble = even row
    assert b[1, 2, 3] == q[38, 1] | (q[39, 1] << 4)
    assert b[0, 2, 4] == 5 | (5 << 4) and b[1, 2, 7] == 6 | (6 << 4)  # padding = the block's zero point
    assert zps.tolist() == [1 | 3 << 4, 5, 2 | 4 << 4, 6]  # [N * ceil(3/2)], odd block count padded with 0

    qs = np.array([[-8], [7]] * 8)
    b, _, zps = pack_matmulnbits(qs, np.full((1, 1), -0.5, np.float32), None, g, signed=True)
    assert zps is None and b[0, 0, 0] == 0 | (15 << 4)
    _, _, zps = pack_matmulnbits(qs + 8, np.ones((1, 1), np.float32), np.full((1, 1), 8), g, signed=False)
    assert zps is None  # uint4 with zero point 8 everywhere is the op's default too

    with pytest.raises(ValueError, match="range"):
        pack_matmulnbits(qs + 8, np.ones((1, 1), np.float32), None, g, signed=True)
    with pytest.raises(ValueError, match="power of two"):
        pack_matmulnbits(qs, np.ones((1, 1), np.float32), None, 24, signed=True)


def test_insert_matmulnbits_graphsurgeon():
    gs = pytest.importorskip("onnx_graphsurgeon")
    k, g = 576, 128
    rng = np.random.default_rng(3)
    q, s, zp, w = make_weight(rng, k, g, False)
    x = gs.Variable("x", np.float32, [2, 7, k])
    y = gs.Variable("y", np.float32, [2, 7, N])
    graph = gs.Graph(inputs=[x], outputs=[y], opset=21)
    node = insert_matmulnbits(graph, x, y, q, s, zp, g, signed=False, base="lin")
    assert node.domain == "com.microsoft" and len(node.inputs) == 4
    model = gs.export_onnx(graph)
    model.ir_version = 10
    assert {o.domain for o in model.opset_import} == {"", "com.microsoft"}
    xv = rng.standard_normal((2, 7, k)).astype(np.float32)
    y_nb, _ = run(model, xv, LEVEL.ORT_DISABLE_ALL)
    assert_close(y_nb, xv.astype(np.float64) @ w)
