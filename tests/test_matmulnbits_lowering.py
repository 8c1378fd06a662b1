"""matmulnbits-to-qdq: com.microsoft::MatMulNBits back to an int4/uint4 weight, a block
DequantizeLinear (opset 21) and a MatMul.

Checked: on tiny llama after ``gptq`` with ``lowering="matmulnbits"`` the lowered graph has the
integers, scales and zero points of gptq's own DequantizeLinear form (same MatMul names, bitwise
equal outputs) and matches the MatMulNBits graph within 1e-4; the dequantized weights equal the
kernel's bit for bit (A = the identity matrix makes MatMulNBits output its weight), for signed int4
with negative scales, uint4 with zero points, a short last block, float16, a bias; models written
by onnxruntime's own MatMulNBits quantizer (symmetric and asymmetric, accuracy level 4) lower to
exactly what that tool writes in its QDQ format; nodes it cannot express are refused with their
reason; If bodies; the opset bump. Every case: idempotent and unchanged by save/load."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from toy import random_feeds

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.errors import UserInputError
from edgeq.passes.methods.matmulnbits import pack_matmulnbits
from edgeq.passmanager.passbase import FLOAT_EQUIV_RTOL, Exactness, PassContext
from edgeq.passes.matmulnbits_to_qdq import Refused, unpack_matmulnbits  # importing it registers the pass
from edgeq.passmanager.pipeline import Pipeline, PipelineOptions
from edgeq.passmanager.registry import get_pass

ort = pytest.importorskip("onnxruntime")

PASS = "matmulnbits-to-qdq"


def _outputs(model, feeds):
    return ir.make_session(model, optimize=False).run(None, feeds)


def _assert_close(got, ref, tol=FLOAT_EQUIV_RTOL):
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * scale)


def _lower(model, feeds_list, tmp_path):
    """Lower (verified), check idempotence and save/load; return (model, summary, outputs per feed)."""
    assert get_pass(PASS).exactness is Exactness.FLOAT_EQUIV
    out, records = Pipeline([get_pass(PASS)()], PipelineOptions(verify=True)).run(model, PassContext())
    got = [_outputs(out, f) for f in feeds_list]
    again, records2 = Pipeline([get_pass(PASS)()]).run(out, PassContext())
    assert records2[0]["modified"] is False
    assert records2[0]["summary"]["nodes_refused"] == records[0]["summary"]["nodes_refused"]
    path = ir.save_model(out, tmp_path / "saved" / "model.onnx")
    assert path.with_name("model.onnx.data").exists()
    loaded = ir.load_model(path)
    for f, outs in zip(feeds_list, got):
        for a, b, c in zip(outs, _outputs(again, f), _outputs(loaded, f)):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)
    return out, records[0]["summary"], got


def _ops(model):
    return [n.op_type for n in model.graph.node]


def _weights(model):
    """MatMul output name -> (MatMul name, q, scale, zero point, DQ attributes) for every MatMul
    reading a block DequantizeLinear of constants."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    found = {}
    for node in model.graph.node:
        dq = producer.get(node.input[1]) if node.op_type == "MatMul" else None
        if dq is not None and dq.op_type == "DequantizeLinear":
            zp = inits[dq.input[2]] if len(dq.input) > 2 and dq.input[2] else None
            attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
            found[node.output[0]] = (node.name, inits[dq.input[0]], inits[dq.input[1]], zp, attrs)
    return found


def _assert_single_domain(model):
    assert "MatMulNBits" not in _ops(model) and {n.domain for n in model.graph.node} <= {""}
    assert {imp.domain for imp in model.opset_import} == {""} and ir.default_opset(model) >= 21


# ---------------------------------------------------------------- gptq's MatMulNBits, back

def _ctx(model, tmp_path):
    specs = ir.make_session(model).get_inputs()
    batches = [random_feeds(specs, seed=s, seq=32) for s in range(4)]
    return PassContext(Calibrator(CalibrationSet(batches, "matmulnbits-lowering", "random", 4), cache_dir=tmp_path / "cache"))


def _gptq(**cfg):
    cls = get_pass("gptq")
    return cls(cls.Config(**cfg))


@pytest.mark.parametrize("cfg,dtype", [
    (dict(full_range=True, order="gar"), "int4"),
    (dict(weight_dtype="uint4", weight_symmetric=False), "uint4"),
], ids=["int4-full-range", "uint4-asymmetric"])
def test_gptq_matmulnbits_lowered_back(cfg, dtype, tiny_models, tmp_path):
    model = ir.load_model(tiny_models["llama"])
    ctx = _ctx(model, tmp_path)
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=5, seq=32)
    cfg = dict(group_size=32, skip_roles=("lm_head",), **cfg)
    dq_form, _ = Pipeline([_gptq(**cfg)]).run(model, ctx)
    nbits, rec = Pipeline([_gptq(lowering="matmulnbits", **cfg)]).run(model, ctx)
    count = rec[0]["summary"]["matmulnbits"]
    assert count == _ops(nbits).count("MatMulNBits") > 0
    nbits = ir.load_model(ir.save_model(nbits, tmp_path / "nbits" / "model.onnx"))  # packed weights as external data

    out, summary, (got,) = _lower(nbits, [feeds], tmp_path)
    assert summary == {"nodes_rewritten": count, "nodes_refused": {}, "weights": {dtype: count}, "bias_adds": 0}
    _assert_single_domain(out)
    _assert_close(got[0], _outputs(nbits, feeds)[0])
    # gptq's integers, scales and zero points, behind MatMuls of the original names: the very graph
    # gptq's DequantizeLinear form is, so the outputs are bitwise equal
    lowered, reference = _weights(out), _weights(dq_form)
    assert len(lowered) == len(reference) == count
    for name, (mm, q, scale, zp, attrs) in reference.items():
        mm2, q2, scale2, zp2, attrs2 = lowered[name]
        assert mm2 == mm and q2.dtype == q.dtype and np.dtype(q.dtype).name == dtype
        assert attrs2 == attrs == {"axis": 0, "block_size": 32}
        for a, b in ((q2, q), (scale2, scale), (zp2, zp)):
            np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
    for a, b in zip(got, _outputs(dq_form, feeds)):
        np.testing.assert_array_equal(a, b)
    assert facts.WEIGHTS_QUANTIZED_FIRST.names(ir.to_graph(out)) == facts.WEIGHTS_QUANTIZED_FIRST.names(ir.to_graph(dq_form))


# ---------------------------------------------------------------- single nodes, bit for bit

N = 24


def _weight(rng, k, g, signed):
    """(q [K, N], scale, zero point) as edgeq.passes.methods.gptq writes them (cf. tests/test_matmulnbits.py)."""
    kb = -(-k // g)
    if signed:  # full-range symmetric int4: zero point 0, scales of both signs
        s = rng.uniform(0.01, 0.05, (kb, N)) * rng.choice([-1.0, 1.0], (kb, N))
        return rng.integers(-8, 8, (k, N)), s.astype(np.float32), np.zeros((kb, N), np.int64)
    return rng.integers(0, 16, (k, N)), rng.uniform(0.01, 0.05, (kb, N)).astype(np.float32), rng.integers(0, 16, (kb, N))


def _nbits_model(nodes, inits, inputs, outputs, opset=21):
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    onnx.checker.check_model(model)
    return model


def _single(q, s, zp, k, g, signed, float_type=TensorProto.FLOAT, bias=None, opset=21):
    b, scales, zps = pack_matmulnbits(q, s, zp, g, signed)
    np_float = helper.tensor_dtype_to_np_dtype(float_type)
    inits = [numpy_helper.from_array(b, "w_B"), numpy_helper.from_array(scales.astype(np_float), "w_scales")]
    inputs = ["x", "w_B", "w_scales", "w_zero_points" if zps is not None else ""]
    if zps is not None:
        inits.append(numpy_helper.from_array(zps, "w_zero_points"))
    if bias is not None:
        inits.append(numpy_helper.from_array(bias.astype(np_float), "w_bias"))
        inputs += ["", "w_bias"]
    node = helper.make_node("MatMulNBits", inputs, ["y"], name="lin_MatMulNBits", domain="com.microsoft",
                            K=k, N=N, bits=4, block_size=g)
    return _nbits_model([node], inits, [helper.make_tensor_value_info("x", float_type, ["m", k])],
                        [helper.make_tensor_value_info("y", float_type, ["m", N])], opset)


@pytest.mark.parametrize("signed", [True, False], ids=["int4-negscale", "uint4-zp"])
@pytest.mark.parametrize("k,g", [(256, 128), (576, 128), (96, 32)])
def test_dequantized_weights_bitwise(k, g, signed, tmp_path):
    rng = np.random.default_rng(k + g + signed)
    q, s, zp = _weight(rng, k, g, signed)
    # the inverse of pack_matmulnbits
    uq, us, uzp, usigned = unpack_matmulnbits(*pack_matmulnbits(q, s, zp, g, signed), k, N, g)
    assert usigned == signed
    for a, b in ((uq, q), (us, s), (uzp, zp)):
        np.testing.assert_array_equal(a, b)

    model = _single(q, s, zp, k, g, signed)
    eye = {"x": np.eye(k, dtype=np.float32)}
    x = {"x": rng.standard_normal((7, k)).astype(np.float32)}
    out, summary, (w_low, y_low) = _lower(model, [eye, x], tmp_path)
    assert summary["nodes_rewritten"] == 1 and summary["weights"] == {"int4" if signed else "uint4": 1}
    _assert_single_domain(out)
    assert _ops(out) == ["DequantizeLinear", "MatMul"] and out.graph.node[1].name == "lin"
    w_kernel = _outputs(model, eye)[0]  # I @ W: the kernel's dequantized weight
    rows = np.arange(k) // g
    w_ref = ((q - zp[rows]).astype(np.float32) * s[rows]).astype(np.float32)
    np.testing.assert_array_equal(w_kernel, w_ref)
    np.testing.assert_array_equal(w_low[0], w_kernel)
    _assert_close(y_low[0], _outputs(model, x)[0])


@pytest.mark.parametrize("float_type,with_bias", [(TensorProto.FLOAT16, False), (TensorProto.FLOAT, True)],
                         ids=["float16", "bias"])
def test_float16_and_bias(float_type, with_bias, tmp_path):
    rng = np.random.default_rng(11)
    k, g = 96, 32
    np_float = helper.tensor_dtype_to_np_dtype(float_type)
    q, s, zp = _weight(rng, k, g, False)
    s = s.astype(np_float).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
    model = _single(q, s, zp, k, g, False, float_type, bias)
    eye = {"x": np.eye(k, dtype=np_float)}
    x = {"x": rng.standard_normal((5, k)).astype(np_float)}
    out, summary, (w_low, y_low) = _lower(model, [eye, x], tmp_path)
    assert summary["bias_adds"] == int(with_bias)
    assert _ops(out) == ["DequantizeLinear", "MatMul"] + ["Add"] * with_bias
    assert w_low[0].dtype == y_low[0].dtype == np_float
    ((_, q2, s2, zp2, _),) = _weights(out).values()
    assert s2.dtype == np_float
    np.testing.assert_array_equal(np.asarray(q2, np.int64), q)
    np.testing.assert_array_equal(np.asarray(zp2, np.int64), zp)
    if with_bias:  # the kernel adds the bias inside its GEMM: equal within fp32 rounding
        _assert_close(w_low[0], _outputs(model, eye)[0])
        _assert_close(y_low[0], _outputs(model, x)[0])
    else:  # float16: the weight bit for bit, the product within float16 rounding
        np.testing.assert_array_equal(w_low[0], _outputs(model, eye)[0])
        _assert_close(y_low[0].astype(np.float32), _outputs(model, x)[0].astype(np.float32), 2e-3)


# ---------------------------------------------------------------- onnxruntime's quantizer

def _ort_quantizer():
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer as quantizer
    except ImportError:
        try:
            from onnxruntime.quantization.matmul_4bits_quantizer import MatMul4BitsQuantizer as quantizer
        except ImportError:
            quantizer = None
    return quantizer


@pytest.mark.parametrize("symmetric,accuracy_level", [(True, None), (False, 4)], ids=["symmetric", "asymmetric-level4"])
def test_onnxruntime_quantizer_model(symmetric, accuracy_level, tiny_models, tmp_path):
    """A model written by onnxruntime's MatMulNBits quantizer (QOperator format) lowers to the
    weights the same tool writes in its QDQ format, bit for bit."""
    quantizer = _ort_quantizer()
    if quantizer is None:
        pytest.skip("onnxruntime.quantization's MatMulNBits quantizer cannot be imported (it needs onnx_ir)")
    from onnxruntime.quantization import QuantFormat

    model = ir.load_model(tiny_models["llama"])
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=3, seq=32)
    written = {}
    for fmt in (QuantFormat.QOperator, QuantFormat.QDQ):
        tool = quantizer(onnx.ModelProto.FromString(model.SerializeToString()), block_size=32, is_symmetric=symmetric,
                         accuracy_level=accuracy_level, quant_format=fmt)
        tool.process()
        written[fmt] = tool.model.model
    nbits, qdq = written[QuantFormat.QOperator], written[QuantFormat.QDQ]
    count = _ops(nbits).count("MatMulNBits")
    assert count > 0 and ir.default_opset(nbits) < 21  # the tool keeps the model's opset (18)

    out, summary, (got,) = _lower(nbits, [feeds], tmp_path)
    assert summary["nodes_rewritten"] == count and summary["nodes_refused"] == {}
    assert summary["weights"] == {"int4" if symmetric else "uint4": count}
    assert summary.get("accuracy_levels_dropped") == ({"4": count} if accuracy_level else None)
    _assert_single_domain(out)
    ref = _outputs(nbits, feeds)[0]
    if accuracy_level == 4:  # the kernel quantized A to int8 per block; the lowered graph is float
        _assert_close(got[0], ref, 3e-2)
    else:
        _assert_close(got[0], ref)
    ours, theirs = _weights(out), _weights(qdq)
    assert set(ours) == set(theirs) and len(ours) == count
    for name, (_, q, scale, zp, attrs) in theirs.items():
        _, q2, scale2, zp2, attrs2 = ours[name]
        assert q2.dtype == q.dtype and attrs2 == attrs
        np.testing.assert_array_equal(np.asarray(q2, np.int64), np.asarray(q, np.int64))
        np.testing.assert_array_equal(scale2, scale)
        np.testing.assert_array_equal(np.asarray(zp2, np.int64), np.zeros(scale.shape, np.int64) if zp is None else zp)
    for a, b in zip(got, _outputs(qdq, feeds)):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- refusals, subgraphs, opset

K, G = 64, 32


def _node(name, x, inputs, bits=4, k=K):
    return helper.make_node("MatMulNBits", [x, *inputs], [f"{name}_y"], name=name, domain="com.microsoft",
                            K=k, N=N, bits=bits, block_size=G)


def test_refusals_and_float_zero_points(tmp_path):
    rng = np.random.default_rng(5)
    q, s, zp = _weight(rng, K, G, False)
    b, scales, zps = pack_matmulnbits(q, s, zp, G, False)
    b8 = rng.integers(0, 256, (N, K // G, G)).astype(np.uint8)
    zf = np.ascontiguousarray(zp.T).astype(np.float32)
    plain = (np.arange(K) // G).astype(np.int32)
    inits = [numpy_helper.from_array(a, name) for a, name in (
        (b, "B"), (scales, "S"), (zps, "Z"), (zf, "Zf"), (zf + 0.25, "Zhqq"), (b8, "B8"),
        (plain, "gidx"), (rng.permutation(plain).astype(np.int32), "gidx_perm"))]
    nodes = [
        _node("float_zp", "x", ["B", "S", "Zf"]),  # integer-valued float zero points: lowered
        _node("twin", "x", ["B", "S", "Zf"]),  # the same weight: lowered, sharing the constants
        _node("plain_gidx", "x", ["B", "S", "", "gidx"]),  # g_idx = k // G, no zero points: lowered
        _node("eight_bits", "x", ["B8", "S"], bits=8),
        _node("dynamic_b", "x", ["B_in", "S", "Z"]),
        _node("hqq", "x", ["B", "S", "Zhqq"]),
        _node("act_order", "x", ["B", "S", "", "gidx_perm"]),
        _node("gidx_with_zp", "x", ["B", "S", "Z", "gidx"]),
    ]
    model = _nbits_model(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K]),
                                        helper.make_tensor_value_info("B_in", TensorProto.UINT8, [N, K // G, G // 2])],
                         [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, ["m", N]) for n in nodes], opset=18)
    feeds = {"x": rng.standard_normal((5, K)).astype(np.float32), "B_in": b}
    out, summary, (got,) = _lower(model, [feeds], tmp_path)
    refused = summary["nodes_refused"]
    assert summary["nodes_rewritten"] == 3 and summary["float_zero_points_converted"] == 2
    assert summary["weights"] == {"int4": 1, "uint4": 2}
    assert set(refused) == {"eight_bits", "dynamic_b", "hqq", "act_order", "gidx_with_zp"}
    assert "bits=8" in refused["eight_bits"]
    assert "'B_in' is not a constant" in refused["dynamic_b"]
    assert "not integers in [0, 15]" in refused["hqq"]
    assert "not contiguous blocks" in refused["act_order"]
    assert "ignores uint8 zero points" in refused["gidx_with_zp"]
    assert ir.default_opset(out) == 21 and "com.microsoft" in {imp.domain for imp in out.opset_import}
    assert sorted(n.name for n in out.graph.node if n.op_type == "MatMulNBits") == sorted(refused)
    ref = _outputs(model, feeds)
    for name, a, b in zip([n.name for n in nodes], got, ref):
        if name in refused:
            np.testing.assert_array_equal(a, b)
        else:
            _assert_close(a, b)
    # float_zp and twin read the same constants: one set of new constants, a DequantizeLinear each
    dq = {n.output[0]: n for n in out.graph.node if n.op_type == "DequantizeLinear"}
    readers = {n.name: dq[n.input[1]] for n in out.graph.node if n.op_type == "MatMul"}
    assert set(readers) == {"float_zp", "twin", "plain_gidx"} and len(dq) == 3
    assert readers["float_zp"].input == readers["twin"].input and readers["float_zp"].name != readers["twin"].name


def test_unpack_refuses_bad_layouts():
    rng = np.random.default_rng(2)
    q, s, zp = _weight(rng, K, G, False)
    b, scales, zps = pack_matmulnbits(q, s, zp, G, False)
    with pytest.raises(Refused, match="B has 767 bytes"):
        unpack_matmulnbits(b.reshape(-1)[:-1], scales, zps, K, N, G)
    with pytest.raises(Refused, match="scales have"):
        unpack_matmulnbits(b, scales[:, :1], zps, K, N, G)
    with pytest.raises(Refused, match="packed zero points"):
        unpack_matmulnbits(b, scales, zps[:-1], K, N, G)
    with pytest.raises(Refused, match="type int32"):
        unpack_matmulnbits(b, scales, zps.astype(np.int32), K, N, G)
    with pytest.raises(Refused, match="not packed uint8"):
        unpack_matmulnbits(b.astype(np.int32), scales, zps, K, N, G)


def test_inside_if_branch(tmp_path):
    """A MatMulNBits in an If body (weights in the main graph) is lowered in place."""
    rng = np.random.default_rng(8)
    k = 256  # a weight above save_model's external-data threshold
    q, s, zp = _weight(rng, k, G, True)
    b, scales, _ = pack_matmulnbits(q, s, zp, G, True)
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S")]
    branch = helper.make_graph([_node("inner", "x", ["B", "S"], k=k)], "then", [],
                               [helper.make_tensor_value_info("inner_y", TensorProto.FLOAT, ["m", N])])
    other = helper.make_graph([helper.make_node("Identity", ["x24"], ["other_y"])], "else", [],
                              [helper.make_tensor_value_info("other_y", TensorProto.FLOAT, ["m", N])])
    nodes = [helper.make_node("Slice", ["x", "zero", "n24", "one"], ["x24"]),
             helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=branch, else_branch=other)]
    inits += [numpy_helper.from_array(np.array([v], np.int64), name) for v, name in ((0, "zero"), (N, "n24"), (1, "one"))]
    model = _nbits_model(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k]),
                                        helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", N])])
    x = rng.standard_normal((3, k)).astype(np.float32)
    feeds = [{"x": x, "cond": np.array(c)} for c in (True, False)]
    out, summary, got = _lower(model, feeds, tmp_path)
    assert summary["nodes_rewritten"] == 1 and summary["weights"] == {"int4": 1}
    (if_node,) = [n for n in out.graph.node if n.op_type == "If"]
    then_graph = next(a.g for a in if_node.attribute if a.name == "then_branch")
    assert [n.op_type for n in then_graph.node] == ["DequantizeLinear", "MatMul"]
    assert {imp.domain for imp in out.opset_import} == {""}
    for f, outs in zip(feeds, got):
        _assert_close(outs[0], _outputs(model, f)[0])


def test_opset_upgrade_and_refusal(tmp_path):
    rng = np.random.default_rng(9)
    k = 256
    q, s, zp = _weight(rng, k, G, True)
    x = {"x": rng.standard_normal((2, k)).astype(np.float32)}
    out, _, _ = _lower(_single(q, s, zp, k, G, True, opset=18), [x], tmp_path)
    assert ir.default_opset(out) == 21
    with pytest.raises(UserInputError, match="opset 17"):
        Pipeline([get_pass(PASS)()]).run(_single(q, s, zp, k, G, True, opset=17), PassContext())
    # nothing to lower: an old graph is left as it is (no opset change, no error)
    b8 = np.zeros((N, K // G, G), np.uint8)
    inits = [numpy_helper.from_array(b8, "B8"), numpy_helper.from_array(np.ones((N, K // G), np.float32), "S")]
    only_refused = _nbits_model([_node("eight", "x", ["B8", "S"], bits=8)], inits,
                                [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K])],
                                [helper.make_tensor_value_info("eight_y", TensorProto.FLOAT, ["m", N])], opset=17)
    kept, records = Pipeline([get_pass(PASS)()]).run(only_refused, PassContext())
    assert records[0]["modified"] is False and ir.default_opset(kept) == 17
    assert list(records[0]["summary"]["nodes_refused"]) == ["eight"]
