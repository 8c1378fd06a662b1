"""DPQ and GAR: two-level compensation beats "GPTQ then FP8", group-aware reordering beats the
stored order on the same layer, the numbers are exactly what the FP8 / INT4 Q/DQ graph computes,
and the dpq pass writes a graph onnxruntime runs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from toy import random_feeds

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.passes.methods.dpq import DpqColumns, gptq_then_fp8
from edgeq.errors import UserInputError
from edgeq.passes.methods.fp8 import DPQ_FP8_RANGE, power_of_two_scale, round_fp8
from edgeq.passes.methods.gptq import column_order, gptq_quantize
from references import dpq_dequantize, layer_error
from edgeq.passmanager.passbase import PassContext
from edgeq.passmanager.pipeline import Pipeline
from edgeq.quantize.quant import QuantSpec
from edgeq.passmanager.registry import get_pass
from edgeq.quantize.sqnr import sqnr_db


@pytest.fixture(scope="module")
def layer():
    """Correlated inputs whose channel scales span two orders of magnitude (skewed Hessian
    diagonal, as real linear inputs have) and a weight with a few large entries."""
    rng = np.random.default_rng(1)
    k, n = 512, 64
    mix = np.eye(k) + 0.2 * rng.standard_normal((k, k)) / np.sqrt(k) * 8
    x = (rng.standard_normal((4096, k)) @ mix) * np.exp(rng.normal(0, 1.0, k))
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    w[rng.integers(0, k, 20), rng.integers(0, n, 20)] *= 6
    return x, w, 2.0 * x.T @ x / len(x)


def test_round_fp8_is_e4m3fn_nearest_even_and_saturates():
    vals = np.array([0.0, 1.0, 1.0625, 1.1875, 447.0, 464.0, 1e6, -1e6, 2.0 ** -9, 2.0 ** -10])
    # 1.0625 is halfway between 1 and 1.125 (ties to even -> 1.0); 1.1875 -> 1.25 (even mantissa)
    np.testing.assert_array_equal(round_fp8(vals), [0.0, 1.0, 1.0, 1.25, 448.0, 448.0, 448.0, -448.0, 2.0 ** -9, 0.0])
    assert power_of_two_scale(DPQ_FP8_RANGE) == 1.0 and power_of_two_scale(DPQ_FP8_RANGE * 1.001) == 2.0
    assert power_of_two_scale(0.0) == 1.0


def test_gar_keeps_groups_consecutive():
    diag = np.array([1, 9, 2, 3, 8, 7, 0.5, 4.0])
    perm = column_order(diag, 2, "gar")
    assert sorted(perm.tolist()) == list(range(8))
    # groups (by max diag): {0,1}: 9, {4,5}: 8, {6,7}: 4, {2,3}: 3; inside by decreasing diag
    assert perm.tolist() == [1, 0, 4, 5, 7, 6, 3, 2]


@pytest.mark.parametrize("symmetric", [False, True])
def test_dpq_two_levels_exact_and_beats_gptq_then_fp8(layer, symmetric):
    x, w, h = layer
    cols = DpqColumns(w, 128, symmetric)
    res = gptq_quantize(w, h, cols.spec, group_size=128, order="gar", columns=cols)
    s8 = res.fp8_scale
    assert s8 == 2.0 ** round(np.log2(s8)) and np.abs(w).max() / s8 <= DPQ_FP8_RANGE
    # the stored integers, real group scales and s8 give back exactly the weight swept against
    np.testing.assert_array_equal(dpq_dequantize(res.q, res.scale, res.zero_point, s8, 128), res.dequantized)
    lo, hi = (-8, 7) if symmetric else (0, 15)
    assert res.q.min() >= lo and res.q.max() <= hi
    spec = QuantSpec("int4" if symmetric else "uint4", symmetric, axis=0, block_size=128)
    then_fp8, _ = gptq_then_fp8(gptq_quantize(w, h, spec, group_size=128, order="gar"))
    assert layer_error(x, w, res.dequantized) < 0.95 * layer_error(x, w, then_fp8)
    # nearest two-level value vs the paper's double rounding through fp8(w / s8) first
    paper = DpqColumns(w, 128, symmetric, paper_rounding=True)
    paper_res = gptq_quantize(w, h, paper.spec, group_size=128, order="gar", columns=paper)
    assert layer_error(x, w, res.dequantized) < layer_error(x, w, paper_res.dequantized)


@pytest.mark.parametrize("two_level", [True, False])
def test_gar_error_not_above_stored_order(layer, two_level):
    """The DPQ authors' check: on one layer, GAR's output error <= the stored order's."""
    x, w, h = layer
    spec = QuantSpec("uint4", False, axis=0, block_size=128)

    def run(order):
        cols = DpqColumns(w, 128) if two_level else None
        return layer_error(x, w, gptq_quantize(w, h, spec, group_size=128, order=order, columns=cols).dequantized)

    assert run("gar") <= run("natural")


def _ctx(model, tmp_path):
    specs = ir.make_session(model).get_inputs()
    batches = [random_feeds(specs, seed=s, seq=32) for s in range(4)]
    return PassContext(Calibrator(CalibrationSet(batches, "dpq-test", "random", 4), cache_dir=tmp_path / "cache"))


def _fetch(model, names, feeds):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for name in names:
        m.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return dict(zip(names, ir.make_session(m, optimize=False).run(names, feeds)))


@pytest.mark.parametrize("lowering", ["qdq", "custom"])
def test_dpq_pass_graph_equals_numpy(tiny_models, tmp_path, lowering):
    """onnxruntime computes exactly the two-level weight and the FP8 activation of the numpy
    reference; the output stays close to float; the pass is idempotent."""
    model = ir.load_model(tiny_models["llama"])
    ctx = _ctx(model, tmp_path)
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=7, seq=32)
    ref = ir.make_session(model, optimize=False).run(None, feeds)[0]
    cls = get_pass("dpq")
    out, rec = Pipeline([cls(cls.Config(group_size=32, lowering=lowering))]).run(model, ctx)
    got = ir.make_session(out, optimize=False).run(None, feeds)[0]
    assert sqnr_db(ref, got) > 15.0
    ops = {n.op_type for n in out.graph.node}
    if lowering == "custom":
        assert sum(n.op_type == "W4A8Linear" for n in out.graph.node) == rec[0]["summary"]["linears_quantized"]
        assert "DequantizeLinear" not in ops and "QuantizeLinear" not in ops
        # the fused op computes what the standard Q/DQ form computes
        qdq_form, _ = Pipeline([cls(cls.Config(group_size=32, lowering="qdq"))]).run(model, ctx)
        np.testing.assert_allclose(got, ir.make_session(qdq_form, optimize=False).run(None, feeds)[0], rtol=1e-5,
                                   atol=1e-5 * float(np.abs(got).max()))
        # and, unlike that form, loads at onnxruntime's default optimization level
        np.testing.assert_allclose(ir.make_session(out).run(None, feeds)[0], got, rtol=1e-4, atol=1e-4 * float(np.abs(got).max()))
    else:
        fp8 = [n for n in out.graph.node if n.op_type == "DequantizeLinear" and n.input[0].endswith("_fp8")]
        assert len(fp8) >= rec[0]["summary"]["linears_quantized"]
        # weights: onnxruntime's DQ(INT4) -> Q/DQ(FP8) equals the numpy two-level dequantization
        producer = {o: n for n in out.graph.node for o in n.output}
        inits = {i.name: onnx.numpy_helper.to_array(i) for i in out.graph.initializer}
        chains = [(producer[producer[n.input[0]].input[0]], producer[n.input[0]], n) for n in fp8
                  if getattr(producer.get(producer[n.input[0]].input[0]), "op_type", "") == "DequantizeLinear"]
        assert len(chains) == rec[0]["summary"]["weights_quantized"]
        for int4_dq, fp8_q, fp8_dq in chains[:4]:
            assert int4_dq.op_type == "DequantizeLinear" and fp8_q.op_type == "QuantizeLinear"
            q, scale, zp = (inits[i] for i in int4_dq.input)
            want = dpq_dequantize(q.astype(np.int64), scale, zp.astype(np.int64), float(inits[fp8_q.input[1]]), 32)
            np.testing.assert_array_equal(_fetch(out, [fp8_dq.output[0]], feeds)[fp8_dq.output[0]], want)
        # activations: static FP8 Q/DQ equals numpy's saturating nearest-even FP8
        act = [c for c in fp8 if c.input[0] not in {ch[1].output[0] for ch in chains}]
        assert act
        q_node = producer[act[0].input[0]]
        x_name, s_x = q_node.input[0], float(inits[q_node.input[1]])
        vals = _fetch(out, [x_name, act[0].output[0]], feeds)
        np.testing.assert_array_equal(vals[act[0].output[0]], (round_fp8(vals[x_name] / np.float32(s_x)) * s_x).astype(np.float32))
    again, rec2 = Pipeline([cls(cls.Config(group_size=32, lowering=lowering))]).run(out, ctx)
    assert rec2[0]["modified"] is False


@pytest.mark.parametrize("kwargs,needle", [
    ({"weight_granularity": "channel"}, "group"),
    ({"weight_dtype": "int8"}, "4-bit"),
    ({"weight_dtype": "int4"}, "symmetric"),
    ({"lowering": "matmulnbits"}, "lowering"),
    ({"full_range": True}, "full_range"),
])
def test_dpq_bad_config(kwargs, needle):
    with pytest.raises(UserInputError, match=needle):
        get_pass("dpq").Config(**kwargs)
