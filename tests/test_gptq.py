"""GPTQ: the algorithm lowers a layer's output error against round-to-nearest (per channel, per
group, with act-order), its integers and scales are exactly what the graph dequantizes, and the
pass writes int4 block-quantized weights that a later qdq keeps while quantizing activations."""

from __future__ import annotations

import numpy as np
import pytest
from toy import random_feeds

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.errors import UserInputError
from edgeq.passes.methods.gptq import gptq_quantize
from references import layer_error
from edgeq.passmanager.passbase import PassContext
from edgeq.passmanager.pipeline import Pipeline, PipelineOptions
from edgeq.quantize.quant import QuantSpec, dequantize_weight, quantize_weight
from edgeq.passmanager.registry import get_pass
from edgeq.quantize.sqnr import sqnr_db


@pytest.fixture(scope="module")
def layer():
    """Correlated inputs with a few wide channels (what real linears see) and a random weight."""
    rng = np.random.default_rng(0)
    k, n = 256, 96
    x = rng.standard_normal((4096, k)) @ (np.eye(k) + 0.3 * rng.standard_normal((k, k)))
    x[:, :4] *= 8.0
    w = rng.standard_normal((k, n)).astype(np.float32)
    return x, w, 2.0 * x.T @ x / len(x)


@pytest.mark.parametrize("group,act_order", [(0, False), (0, True), (64, False), (64, True), (96, False)])
def test_gptq_beats_round_to_nearest_on_one_layer(layer, group, act_order):
    x, w, h = layer
    spec = QuantSpec("int4", True, axis=0 if group else 1, block_size=group)
    rtn = dequantize_weight(*quantize_weight(w, spec), spec)
    res = gptq_quantize(w, h, spec, group_size=group, act_order=act_order)
    assert layer_error(x, w, res.dequantized) < 0.5 * layer_error(x, w, rtn)
    # the integers and scales are exactly what DequantizeLinear computes with
    np.testing.assert_array_equal(dequantize_weight(res.q, res.scale, res.zero_point, spec), res.dequantized)
    assert res.q.min() >= spec.qmin and res.q.max() <= spec.qmax
    assert res.scale.shape == ((-(-w.shape[0] // group), w.shape[1]) if group else (w.shape[1],))  # 96: ragged last group


def test_gptq_mse_range_and_asymmetric(layer):
    x, w, h = layer
    spec = QuantSpec("uint4", False, axis=0, block_size=64)
    plain = gptq_quantize(w, h, spec, group_size=64)
    searched = gptq_quantize(w, h, spec, group_size=64, mse=True)
    assert layer_error(x, w, searched.dequantized) <= 1.05 * layer_error(x, w, plain.dequantized)
    np.testing.assert_array_equal(dequantize_weight(searched.q, searched.scale, searched.zero_point, spec), searched.dequantized)


def _ctx(model, tmp_path):
    specs = ir.make_session(model).get_inputs()
    batches = [random_feeds(specs, seed=s, seq=32) for s in range(4)]
    return PassContext(Calibrator(CalibrationSet(batches, "gptq-test", "random", 4), cache_dir=tmp_path / "cache"))


def _gptq(**cfg):
    cls = get_pass("gptq")
    return cls(cls.Config(**cfg))


def _qdq(**cfg):
    cls = get_pass("qdq")
    return cls(cls.Config(activation_dtype="int16", **cfg))


def test_gptq_pass_then_qdq_on_tiny_llama(tiny_models, tmp_path):
    """W4 per-channel GPTQ + 16-bit activations is closer to float than RTN W4 + the same
    activations; qdq keeps gptq's weight initializers and adds the activation Q/DQ."""
    model = ir.load_model(tiny_models["llama"])
    ctx = _ctx(model, tmp_path)
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=99, seq=32)
    ref = ir.make_session(model, optimize=False).run(None, feeds)[0]
    gptq_out, records = Pipeline([_gptq(weight_granularity="channel"), _qdq()], PipelineOptions(verify=True)).run(model, ctx)
    rtn_out, _ = Pipeline([_qdq(weight_dtype="int4")]).run(model, ctx)
    gptq_sqnr = sqnr_db(ref, ir.make_session(gptq_out, optimize=False).run(None, feeds)[0])
    rtn_sqnr = sqnr_db(ref, ir.make_session(rtn_out, optimize=False).run(None, feeds)[0])
    assert gptq_sqnr > rtn_sqnr + 1.0, (gptq_sqnr, rtn_sqnr)
    g, q = records[0]["summary"], records[1]["summary"]
    assert g["linears_quantized"] == q["linears_quantized"] > 0 and q["weights_quantized"] == 0
    assert g["output_error_vs_rtn"]["median"] < 1.0
    assert any(n.op_type == "DequantizeLinear" and any(i.endswith("_int4") for i in n.input) for n in gptq_out.graph.node)
    again, rec = Pipeline([_gptq(weight_granularity="channel")]).run(gptq_out, ctx)
    assert rec[0]["modified"] is False


def test_gptq_defaults_are_int4_groups_of_128():
    cfg = get_pass("gptq").Config()
    assert cfg.weight_granularity == "group" and cfg.group_size == 128 and cfg.weight_dtype == "int4"
    spec = get_pass("gptq")(cfg).spec(stored_nk=False)
    assert spec.axis == 0 and spec.block_size == 128


@pytest.mark.parametrize("kwargs,needle", [
    ({"weight_dtype": "int3"}, "weight_dtype"),
    ({"group_size": 48}, "group_size"),
    ({"block_size": 100}, "block_size"),
    ({"damp": 1.5}, "damp"),
])
def test_gptq_bad_config(kwargs, needle):
    with pytest.raises(UserInputError, match=needle):
        get_pass("gptq").Config(**kwargs)


def _weight_dqs(model) -> list[tuple[int, int, int]]:
    """(K, block_size, scale count) of every constant int4 weight DequantizeLinear, K along axis 0."""
    import onnx

    inits = {t.name: t for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and inits.get(node.input[0]) is not None \
                and inits[node.input[0]].data_type == onnx.TensorProto.INT4:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            scale = np.prod(inits[node.input[1]].dims)
            out.append((inits[node.input[0]].dims[0], attrs.get("block_size", 0), int(scale)))
    return out


def test_gptq_whole_blocks_quantizes_a_k_blocks_do_not_divide_per_channel(tiny_models, tmp_path):
    """whole_blocks (mquant-w4a16, for Qualcomm's HTP, which computes a partial last block wrongly):
    blocks of 128 divide the tiny llama's K = 128 (down_proj) but not K = 64 (every other linear),
    which get one scale per output channel instead; without it they end in a partial block, which
    ``edgeq check --target qnn-htp`` reports."""
    from edgeq.targets.check import check_model
    from edgeq.targets.profile import load_target

    model = ir.load_model(tiny_models["llama"])
    ctx = _ctx(model, tmp_path)
    whole, records = Pipeline([_gptq(group_size=128, whole_blocks=True)], PipelineOptions(verify=True)).run(model, ctx)
    dqs = _weight_dqs(whole)
    assert {k for k, _, _ in dqs} == {64, 128}
    assert all(block == 128 for k, block, _ in dqs if k == 128)
    assert all(block == 0 for k, block, _ in dqs if k == 64)
    assert len(records[0]["summary"]["per_channel_partial_k"]) == sum(k == 64 for k, _, _ in dqs)
    partial, _ = Pipeline([_gptq(group_size=128)]).run(model, ctx)
    assert all(block == 128 for _, block, _ in _weight_dqs(partial))
    def rule(m):
        return [v for v in check_model(m, load_target("qnn-htp")).violations if v.rule == "partial-block"]
    assert len(rule(partial)) == sum(k == 64 for k, _, _ in _weight_dqs(partial)) and not rule(whole)
    for bad in ({"whole_blocks": True, "weight_granularity": "channel"},
                {"whole_blocks": True, "lowering": "matmulnbits"}):
        with pytest.raises(UserInputError, match="whole_blocks"):
            get_pass("gptq").Config(**bad)


def test_gptq_full_range_uses_all_int4_levels(layer):
    """full_range: the largest-magnitude value of every group sits exactly on -8 (signed scale),
    the dequantized weight is what DequantizeLinear computes, and the layer error is lower than
    with the restricted +-7 grid."""
    x, w, h = layer
    spec = QuantSpec("int4", True, axis=0, block_size=64)
    full = gptq_quantize(w, h, spec, group_size=64, full_range=True)
    restricted = gptq_quantize(w, h, spec, group_size=64)
    assert full.q.min() == -8 and (full.scale < 0).any()
    np.testing.assert_array_equal(dequantize_weight(full.q, full.scale, full.zero_point, spec), full.dequantized)
    assert layer_error(x, w, full.dequantized) < layer_error(x, w, restricted.dequantized)
    with pytest.raises(UserInputError, match="full_range"):
        get_pass("gptq").Config(full_range=True, weight_symmetric=False)


def test_gptq_full_range_positive_scales(layer):
    """positive_scales (for the HTP, which computes negative scales wrongly): every scale > 0, -8
    reached in groups whose extreme is negative, error between the restricted and the signed grid."""
    from edgeq.passes.methods.gptq import IntColumns

    x, w, h = layer
    spec = QuantSpec("int4", True, axis=0, block_size=64)
    positive = gptq_quantize(w, h, spec, group_size=64, columns=IntColumns(spec, full_range=True, positive=True))
    restricted = gptq_quantize(w, h, spec, group_size=64)
    assert (positive.scale > 0).all() and positive.q.min() == -8 and positive.q.max() <= 7
    np.testing.assert_array_equal(dequantize_weight(positive.q, positive.scale, positive.zero_point, spec), positive.dequantized)
    assert layer_error(x, w, positive.dequantized) < layer_error(x, w, restricted.dequantized)
    with pytest.raises(UserInputError, match="positive_scales"):
        get_pass("gptq").Config(positive_scales=True)


def test_hessian_observer_weights_the_first_token():
    """The first token of every sequence (the attention sink) can be counted ``w`` times; the
    plain Hessian is unchanged, and the state survives the calibration cache."""
    from edgeq.calib.observers import HessianObserver, observer_from_state, observer_state

    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((2, 5, 6)) for _ in range(3)]
    obs = HessianObserver()
    for x in xs:
        obs.update(x.astype(np.float32))
    flat = np.concatenate([x.reshape(-1, 6) for x in xs])
    first = np.concatenate([x[:, 0] for x in xs])
    np.testing.assert_allclose(obs.hessian, 2 * flat.T @ flat / 30, rtol=1e-6)
    want = 2 * (flat.T @ flat + 63 * first.T @ first) / 30
    np.testing.assert_allclose(obs.hessian_with_sink(64.0), want, rtol=1e-6)
    again = observer_from_state(observer_state(obs))
    np.testing.assert_array_equal(again.hessian_with_sink(64.0), obs.hessian_with_sink(64.0))
    flat_only = HessianObserver()
    flat_only.update(flat)  # 2-D input: no sequence axis, so no first token to weight
    np.testing.assert_array_equal(flat_only.hessian_with_sink(64.0), flat_only.hessian)


def test_hessian_observer_consumed_by_its_last_reader_gives_the_same_hessian():
    """``consume=True`` builds the Hessian in the observer's own accumulator (no K x K copy) and
    leaves the observer empty: same values as the copying form, with and without the sink term."""
    from edgeq.calib.observers import HessianObserver

    rng = np.random.default_rng(4)
    for weight in (1.0, 16.0):
        obs = HessianObserver()
        for _ in range(2):
            obs.update(rng.standard_normal((2, 4, 5)).astype(np.float32))
        want = obs.hessian_with_sink(weight)
        np.testing.assert_array_equal(obs.hessian_with_sink(weight, consume=True), want)
        assert obs.xtx is None and obs.first_xtx is None


@pytest.mark.parametrize("k", [5, 256, 300, 777])
def test_inverse_hessian_factor_is_the_upper_cholesky_factor_of_the_inverse(k):
    """The in-place factor (one Cholesky of the reversed Hessian, a blocked triangular inverse)
    equals the textbook chain (damp, Cholesky, inverse, Cholesky of the inverse) in any visiting
    order, dead inputs (zero rows) given a unit diagonal; the Hessian passed in is not changed."""
    from edgeq.passes.methods.gptq import inverse_hessian_factor

    rng = np.random.default_rng(k)
    x = rng.standard_normal((2 * k, k)) * rng.uniform(0.1, 10.0, k)
    h = 2.0 * x.T @ x / len(x)
    h[1] = h[:, 1] = 0.0
    before = h.copy()
    perm = rng.permutation(k)
    want = h[np.ix_(perm, perm)].copy()
    dead = np.diag(want) == 0
    want[dead, dead] = 1.0
    want[np.diag_indices(k)] += 0.01 * np.mean(np.diag(want))
    want = np.linalg.cholesky(np.linalg.inv(want)).T
    u, got_dead = inverse_hessian_factor(h, perm, 0.01)
    np.testing.assert_array_equal(got_dead, dead)
    np.testing.assert_allclose(u, want, rtol=0, atol=1e-9 * np.abs(want).max())
    np.testing.assert_array_equal(np.triu(u), u)  # upper triangular
    np.testing.assert_array_equal(h, before)
    with pytest.raises(np.linalg.LinAlgError):
        inverse_hessian_factor(-np.eye(k), np.arange(k), 0.0)


@pytest.mark.parametrize("kwargs,needle", [
    ({"order": "random"}, "order"),
    ({"order": "gar", "weight_granularity": "channel"}, "gar"),
    ({"sink_weight": 0.5}, "sink_weight"),
    ({"lowering": "matmulnbits", "weight_dtype": "int8"}, "matmulnbits"),
    ({"lowering": "custom"}, "lowering"),
])
def test_gptq_bad_order_sink_lowering(kwargs, needle):
    with pytest.raises(UserInputError, match=needle):
        get_pass("gptq").Config(**kwargs)


def test_gptq_matmulnbits_lowering_equals_dequantize_form(tiny_models, tmp_path):
    """lowering = "matmulnbits": every linear becomes onnxruntime's MatMulNBits (accuracy level
    0) and computes what the DequantizeLinear + MatMul form computes, optimizations off."""
    model = ir.load_model(tiny_models["llama"])
    ctx = _ctx(model, tmp_path)
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=5, seq=32)
    cfg = dict(group_size=32, full_range=True, order="gar", skip_roles=("lm_head",))
    dq_form, _ = Pipeline([_gptq(**cfg)]).run(model, ctx)
    nbits, rec = Pipeline([_gptq(lowering="matmulnbits", **cfg)]).run(model, ctx)
    ops = [n.op_type for n in nbits.graph.node]
    assert ops.count("MatMulNBits") == rec[0]["summary"]["matmulnbits"] == rec[0]["summary"]["linears_quantized"]
    assert "DequantizeLinear" not in ops
    a = ir.make_session(dq_form, optimize=False).run(None, feeds)[0]
    b = ir.make_session(nbits, optimize=False).run(None, feeds)[0]
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * float(np.abs(a).max()))
