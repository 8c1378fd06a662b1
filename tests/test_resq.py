"""ResQ: the projections keep fp32 outputs (tiny llama / qwen2 with every basis and rank, SmolLM2
with the PCA basis), the baseline basis picks the widest channels, GPTQ with one grid per
subspace, and resq-qdq's mixed-precision weights and activations."""

import numpy as np
import onnx
import pytest
from toy import random_feeds

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.calib.dataset import build_calibration_set
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.errors import UserInputError
from edgeq.passes.methods.gptq import IntColumns, gptq_quantize
from edgeq.passmanager.passbase import FLOAT_EQUIV_RTOL, PassContext
from edgeq.passes.resq import ResqConfig, ResqPass
from references import layer_error
from edgeq.passes.resq_qdq import ResqQDQConfig, ResqQDQPass
from edgeq.passmanager.pipeline import Pipeline
from edgeq.quantize.quant import QuantSpec, dequantize_weight, quantize_weight
from edgeq.passmanager.registry import get_pass
from edgeq.passes.methods.resq import linf_basis
from edgeq.quantize.sqnr import sqnr_db

DATA = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "wikitext-2"


def _ctx(model, tmp_path):
    specs = ir.make_session(model).get_inputs()
    data = CalibrationSet([random_feeds(specs, seed=s) for s in range(3)], "random:resq", "random", samples=3)
    return PassContext(Calibrator(data, cache_dir=tmp_path / "cache"))


def _prefix():
    return [get_pass("fuse-norms")(), get_pass("ln-to-rms")()]


def _close(got, ref):
    scale = max(float(np.abs(ref).max()), 1.0)
    np.testing.assert_allclose(got, ref, rtol=0, atol=FLOAT_EQUIV_RTOL * scale)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("basis,divisor", [("pca", 8), ("pca", 4), ("pca", 16), ("linf", 8), ("hadamard", 8)])
def test_projections_are_float_equivalent(arch, basis, divisor, tiny_models, tmp_path):
    model = ir.load_model(tiny_models[arch])
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=7)
    (ref, *_) = ir.make_session(model).run(None, feeds)
    out, records = Pipeline(_prefix() + [ResqPass(ResqConfig(basis=basis, rank_divisor=divisor))]).run(model, _ctx(model, tmp_path))
    summary = records[-1]["summary"]
    assert summary["attention_layers"] == 2 and summary["online"]["hadamard"] == 2
    layout = facts.RESQ.get(ir.to_graph(out))
    assert layout["hidden_rank"] == (0 if basis == "hadamard" else 64 // divisor)
    assert all(layer["rank"] == max(16 // divisor, 1) for layer in layout["layers"])
    (got, *_) = ir.make_session(out).run(None, feeds)
    _close(got, ref)
    if basis == "pca":  # the high subspace holds more than its share of the variance
        assert summary["high_energy_fraction"]["U_A"] > 1 / divisor


def test_values_and_keys_are_projected(tiny_models, tmp_path):
    """U_B turns v_proj's per-head outputs, U_C the post-RoPE keys, into their PCA bases: the
    second moment of the projected keys is diagonal with ascending entries (up to damping)."""
    model = ir.load_model(tiny_models["llama"])
    out, _ = Pipeline(_prefix() + [ResqPass(ResqConfig(damp=0.0))]).run(model, _ctx(model, tmp_path))
    layout = facts.RESQ.get(ir.to_graph(out))
    k_name = layout["layers"][0]["k"]
    probe = onnx.ModelProto()
    probe.CopyFrom(out)
    probe.graph.output.append(onnx.helper.make_tensor_value_info(k_name, onnx.TensorProto.FLOAT, None))
    specs = ir.make_session(model).get_inputs()
    ks = [ir.make_session(probe).run([k_name], random_feeds(specs, seed=s))[0] for s in range(3)]
    flat = np.concatenate([k.reshape(-1, k.shape[-1]) for k in ks]).astype(np.float64)
    d = flat.shape[1]
    r = layout["layers"][0]["rank"]
    cov = flat.T @ flat / len(flat)
    # within each subspace the seeded rotation mixes directions, but no energy crosses subspaces
    cross = np.abs(cov[: d - r, d - r:]).max() / np.abs(cov).max()
    assert cross < 1e-5
    assert np.trace(cov[d - r:, d - r:]) / r > np.trace(cov[: d - r, : d - r]) / (d - r)


def test_linf_basis_puts_the_widest_channels_last():
    absmax = np.array([1.0, 9.0, 2.0, 7.0, 3.0, 0.5, 4.0, 8.0])
    b = linf_basis(absmax, 3, seed=0)
    np.testing.assert_allclose(b.u.T @ b.u, np.eye(8), atol=1e-12)
    high = np.abs(b.u[:, 5:]).sum(1) > 1e-12  # input channels feeding the high block
    assert set(np.flatnonzero(high)) == {1, 3, 7}
    with pytest.raises(ValueError, match="rank"):
        linf_basis(absmax, 8)


def test_gptq_with_one_grid_per_subset():
    rng = np.random.default_rng(0)
    k, n, r = 64, 24, 8
    x = rng.standard_normal((2048, k)) @ rng.standard_normal((k, k)) * 0.3
    w = rng.standard_normal((k, n))
    h = 2 * x.T @ x / len(x)
    low, high = QuantSpec("int4", True, axis=1), QuantSpec("int8", True, axis=1)
    subsets = [(np.arange(k - r), IntColumns(low)), (np.arange(k - r, k), IntColumns(high))]
    res = gptq_quantize(w, h, low, subsets=subsets)
    assert res.scale.shape == (2, n)
    assert res.q[: k - r].min() >= -8 and res.q[: k - r].max() <= 7
    assert np.abs(res.q[k - r:]).max() > 7  # the high rows use the 8-bit grid
    np.testing.assert_allclose(res.dequantized[: k - r], res.q[: k - r] * res.scale[0], rtol=1e-6)
    np.testing.assert_allclose(res.dequantized[k - r:], res.q[k - r:] * res.scale[1], rtol=1e-6)
    rtn = np.concatenate([dequantize_weight(*quantize_weight(w[rows].astype(np.float32), sp), sp)
                          for rows, sp in ((slice(0, k - r), low), (slice(k - r, k), high))])
    assert layer_error(x, w, res.dequantized) < 0.7 * layer_error(x, w, rtn)


def _resq_qdq(model, tmp_path, **kw):
    passes = _prefix() + [ResqPass(), ResqQDQPass(ResqQDQConfig(**kw))]
    return Pipeline(passes).run(model, _ctx(model, tmp_path))


@pytest.mark.parametrize("activations,weights", [("dynamic", "gptq"), ("static", "rtn")])
def test_resq_qdq_mixed_weights_and_sites(activations, weights, tiny_models, tmp_path):
    model = ir.load_model(tiny_models["llama"])
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=3)
    (ref, *_) = ir.make_session(model).run(None, feeds)
    out, records = _resq_qdq(model, tmp_path, activations=activations, weights=weights)
    s = records[-1]["summary"]
    assert s["mixed_sites"] == 12 and s["uniform_sites"] == 2 and s["kv_sites"] == 4  # q/k/v/o/gate/up x 2; down x 2
    assert s["u_c_quantized"] == 4  # the online key projection of q and k, per layer, at 8 bits
    g = out.graph
    sub = [n for n in g.node if n.op_type == "SubspaceQDQ"]
    assert len(sub) == 2 * 2 + 2 + 4  # stream inputs (attention, mlp) + o_proj + K/V, per layer
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in sub[0].attribute}
    assert attrs["dynamic"] == int(activations == "dynamic") and attrs["symmetric"] == 0
    inits = {t.name: t for t in g.initializer}
    concat_weights = [n for n in g.node if n.op_type == "Concat" and n.name.endswith("_weight_Concat")]
    assert len(concat_weights) == 12
    for c in concat_weights:
        types = [inits[next(d for d in g.node if d.output[0] == i).input[0]].data_type for i in c.input]
        assert types == [onnx.TensorProto.INT4, onnx.TensorProto.INT8]
    (got, *_) = ir.make_session(out).run(None, feeds)
    assert sqnr_db(ref, got) > 10.0


def test_resq_qdq_errors_and_idempotence(tiny_models, tmp_path):
    model = ir.load_model(tiny_models["llama"])
    with pytest.raises(UserInputError, match="put fuse-norms, ln-to-rms, resq before resq-qdq"):
        Pipeline([ResqQDQPass()]).run(model, _ctx(model, tmp_path))
    with pytest.raises(UserInputError, match="activations"):
        ResqQDQConfig(activations="token")
    with pytest.raises(UserInputError, match="low_bits"):
        ResqQDQConfig(low_bits=1)
    with pytest.raises(UserInputError, match="basis"):
        ResqConfig(basis="svd")
    out, _ = _resq_qdq(model, tmp_path, weights="rtn")
    again, records = Pipeline([ResqPass(), ResqQDQPass()]).run(out, _ctx(model, tmp_path))
    assert [r["modified"] for r in records] == [False, False]


@pytest.mark.slow
def test_resq_projection_is_float_equivalent_on_smollm2(smollm2_dir, tmp_path):
    model = ir.load_model(smollm2_dir / "model.onnx")
    data = build_calibration_set(DATA / "valid.txt", ir.input_specs(model), smollm2_dir, 2, 128)
    ids = np.random.default_rng(0).integers(0, 49152, (1, 48))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(48)[None]}
    (ref,) = ir.make_session(model).run(None, feeds)
    ctx = PassContext(Calibrator(data, cache_dir=tmp_path / "cache"))
    out, records = Pipeline(_prefix() + [ResqPass()]).run(model, ctx)
    assert records[-1]["summary"]["attention_layers"] == 30
    assert records[-1]["summary"]["hidden_rank"] == 72
    (got,) = ir.make_session(out).run(None, feeds)
    _close(got, ref)


def test_integer_lowering_equals_subspace_form_and_fuses(tiny_models, tmp_path):
    """Static resq-w4a8 settings: the split-GEMM form (two static Q/DQ, int8-stored weights) gives
    the SubspaceQDQ form's outputs, and onnxruntime turns every mixed linear's two GEMMs and every
    uniform one into MatMulIntegerToFloat."""
    import collections
    import tempfile
    from pathlib import Path

    import onnxruntime as ort

    model = ir.load_model(tiny_models["llama"])
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=5)
    kw = dict(activations="static", weights="rtn", low_bits=8, down_proj_bits=8, kv_low_bits=8, kv_high_bits=8)
    ref_model, _ = _resq_qdq(model, tmp_path, **kw)
    out, records = _resq_qdq(model, tmp_path, lowering="integer", **kw)
    (ref, *_) = ir.make_session(ref_model).run(None, feeds)
    (got, *_) = ir.make_session(out).run(None, feeds)
    _close(got, ref)
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        so.log_severity_level = 3
        ort.InferenceSession(out.SerializeToString(), so, providers=["CPUExecutionProvider"])
        counts = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
    # low + high GEMM of 12 mixed linears, 2 down_proj, the U_C projection of q and k in 2 layers
    assert counts["MatMulIntegerToFloat"] == 2 * 12 + 2 + 4
    with pytest.raises(UserInputError, match="static"):
        ResqQDQConfig(lowering="integer")


def test_uniform_token_quantizer_matches_the_subspace_reference():
    """down_proj's uniform per-token asymmetric quantizer is SubspaceQDQ's dynamic formula."""
    import onnx_graphsurgeon as gs

    from edgeq.quantize.qdq_nodes import insert_token_fake_quant_asymmetric
    from edgeq.runtime_ops.subspace_qdq import _dynamic_qdq

    x = gs.Variable("x", dtype=np.float32, shape=["b", "s", 32])
    graph = gs.Graph(inputs=[x], opset=18)
    y = insert_token_fake_quant_asymmetric(graph, ir.GraphIndex(graph), x, 4)
    y.dtype, y.shape = np.float32, ["b", "s", 32]
    graph.outputs = [y]
    data = np.random.default_rng(1).standard_normal((2, 5, 32)).astype(np.float32) * 3
    data[0, 0] = np.abs(data[0, 0])  # an all-positive token: zero still representable
    (got,) = ir.make_session(ir.to_model(graph)).run(None, {"x": data})
    np.testing.assert_array_equal(got, _dynamic_qdq(data, 4, symmetric=False))


def test_channel_minmax_observer_subset_ranges():
    from edgeq.calib.observers import ChannelMinMaxObserver, observer_from_state, observer_state

    obs = ChannelMinMaxObserver()
    a = np.random.default_rng(0).standard_normal((2, 7, 6))
    obs.update(a[:1])
    obs.update(a[1:])
    flat = a.reshape(-1, 6)
    assert obs.subset_range(np.array([1, 4])) == (flat[:, [1, 4]].min(), flat[:, [1, 4]].max())
    back = observer_from_state(observer_state(obs))
    np.testing.assert_array_equal(back.lo, obs.lo)
    assert back.range() == (flat.min(), flat.max())
