"""``muxq``: the outlier set, exponents and stacked weight on hand-built data; the rewrite (both
forms, and the llm-int8 comparator) equals the original graph before quantization on tiny llama
and gpt2 exports; after static INT8 it beats the same quantization without the split."""

import numpy as np
import pytest
from toy import random_feeds, single_linear

from edgeq.graph import ir
from edgeq.calib.observers import ChannelStatsObserver
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import FLOAT_EQUIV_RTOL, PassContext
from edgeq.passes.muxq import MuxqConfig, MuxqPass, channel_exponents, outlier_channels
from edgeq.passmanager.pipeline import Pipeline
from edgeq.passmanager.registry import get_pass


def _stats(x):
    obs = ChannelStatsObserver()
    obs.update(np.asarray(x, np.float32))
    return obs


def test_outlier_rules_and_cap():
    x = np.random.default_rng(0).uniform(-1, 1, (200, 32))
    x[3, 4], x[7, 9], x[9, 20] = 50.0, -8.0, 6.5
    stats = _stats(x)
    np.testing.assert_array_equal(outlier_channels(stats, MuxqConfig()), [4, 9])  # largest first, cap 1/16 of 32 = 2
    np.testing.assert_array_equal(outlier_channels(stats, MuxqConfig(max_fraction=0.5)), [4, 9, 20])
    np.testing.assert_array_equal(outlier_channels(stats, MuxqConfig(threshold=10.0)), [4])
    z = np.random.default_rng(1).standard_normal((500, 32))
    z[:, 11] *= 30.0  # one channel with a far larger spread
    np.testing.assert_array_equal(outlier_channels(_stats(z), MuxqConfig(rule="zscore", max_fraction=1.0)), [11])


def test_exponents_fixed_and_auto():
    absmax = np.array([1.0, 2.0, 40.0, 3.0, 3000.0])
    chans = np.array([4, 2])
    np.testing.assert_array_equal(channel_exponents(absmax, chans, MuxqConfig()), [2, 2])
    # auto: bring 3000 and 40 down to the largest ordinary channel (3.0): 2^10 and 2^4
    np.testing.assert_array_equal(channel_exponents(absmax, chans, MuxqConfig(exponent_mode="auto")), [10, 4])


def test_config_rejects_bad_values():
    for bad in ({"method": "smooth"}, {"rule": "pct"}, {"exponent": 0}, {"form": "three"}, {"max_fraction": 0.0},
                {"threshold": -1.0}, {"exponent_mode": "max"}):
        with pytest.raises(UserInputError):
            MuxqConfig(**bad)


def _hand_built(k=16, n=6, seed=0):
    return single_linear(k, n, seed)


def _batches(k=16, outliers=((2, 20.0), (5, -50.0)), count=3, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.uniform(-1, 1, (1, 24, k)).astype(np.float32)
        for c, v in outliers:
            x[0, :, c] *= abs(v)
            x[0, 1, c] = v
        out.append({"x": x})
    return out


def _ctx(batches, path):
    return PassContext(Calibrator(CalibrationSet(batches, f"hand:{len(batches)}", "hand-built", len(batches)), cache_dir=path))


@pytest.mark.parametrize("form", ["concat", "two-gemm"])
def test_hand_built_outliers_and_stacked_weight(form, tmp_path):
    model, w = _hand_built()
    batches = _batches()
    out, rec = Pipeline([MuxqPass(MuxqConfig(form=form, max_fraction=0.25))]).run(model, _ctx(batches, tmp_path))
    entry = rec[0]["summary"]["per_input"]["x"]
    assert entry["channels"] == [5, 2] and entry["exponents"] == [2] and entry["body_scale"] == "Mul"
    graph = ir.to_graph(out)
    if form == "concat":
        (node,) = [n for n in graph.nodes if n.name == "lin"]
        stacked = node.inputs[1].values
        np.testing.assert_allclose(stacked, np.concatenate([w, 3.0 * w[[5, 2]]]), rtol=1e-6)
        assert node.inputs[0].inputs[0].op == "Concat"
    else:
        assert any(n.name == "lin_muxq_aux_e2_branch" for n in graph.nodes)
        assert any(n.name == "lin_muxq_aux_e2_branch_gain" and float(n.inputs[1].values) == 3.0 for n in graph.nodes)
    x = _batches(seed=5)[0]["x"]
    (ref,) = ir.make_session(model).run(None, {"x": x})
    (got,) = ir.make_session(out).run(None, {"x": x})
    np.testing.assert_allclose(got, ref, rtol=0, atol=FLOAT_EQUIV_RTOL * float(np.abs(ref).max()))
    again, rec2 = Pipeline([MuxqPass(MuxqConfig(form=form))]).run(out, _ctx(batches, tmp_path))
    assert rec2[0]["modified"] is False


def test_static_int8_error_naive_vs_muxq_vs_llm_int8(tmp_path):
    """One outlier channel of magnitude 60 in 64: MUXQ and LLM.int8() both beat naive static INT8."""
    model, _ = _hand_built(k=64, n=32)
    batches = _batches(k=64, outliers=((7, 60.0),))
    x = _batches(k=64, outliers=((7, 60.0),), seed=9)[0]["x"]
    (ref,) = ir.make_session(model).run(None, {"x": x})
    qdq = get_pass("qdq")

    def err(passes, sub):
        out, _ = Pipeline(passes).run(model, _ctx(batches, tmp_path / sub))
        (got,) = ir.make_session(out).run(None, {"x": x})
        return float(np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))

    naive = err([qdq()], "naive")
    muxq = err([MuxqPass(), qdq()], "muxq")
    llm = err([MuxqPass(MuxqConfig(method="llm-int8")), qdq()], "llm")
    assert llm < muxq < naive


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("variant", [{}, {"form": "two-gemm"}, {"method": "llm-int8"}, {"exponent_mode": "auto"}])
def test_tiny_exports_are_float_equivalent(arch, variant, tiny_models, tmp_path):
    model = ir.load_model(tiny_models[arch])
    specs = ir.make_session(model).get_inputs()
    feeds = random_feeds(specs, seed=4, batch=2, seq=7)
    reference = ir.make_session(model).run(None, feeds)
    ctx = _ctx([random_feeds(specs, seed=s) for s in range(2)], tmp_path)
    cfg = MuxqConfig(threshold=0.5, max_fraction=0.25, **variant)  # low threshold: random weights have no real outliers
    out, rec = Pipeline([MuxqPass(cfg)]).run(model, ctx)
    summary = rec[0]["summary"]
    assert summary["decomposed"] >= 3, summary
    if arch == "llama" and "method" not in variant:
        assert summary["folded_into_norm"] >= 2  # q/k/v and gate/up inputs come from RMSNorms with gamma
    for ref, got in zip(reference, ir.make_session(out).run(None, feeds)):
        np.testing.assert_allclose(got, ref, rtol=0, atol=FLOAT_EQUIV_RTOL * max(float(np.abs(ref).max()), 1.0))


def test_composes_after_rotation(tiny_models, tmp_path):
    """muxq after fuse-norms, ln-to-rms and rotate (norms weightless: Body is a Mul) stays exact."""
    model = ir.load_model(tiny_models["llama"])
    specs = ir.make_session(model).get_inputs()
    feeds = random_feeds(specs, seed=8, batch=1, seq=9)
    reference = ir.make_session(model).run(None, feeds)
    ctx = _ctx([random_feeds(specs, seed=s) for s in range(2)], tmp_path)
    chain = [get_pass(n)() for n in ("fuse-norms", "ln-to-rms", "rotate")]
    out, rec = Pipeline(chain + [MuxqPass(MuxqConfig(threshold=0.3, max_fraction=0.25, exponent_mode="auto"))]).run(model, ctx)
    summary = rec[-1]["summary"]
    assert summary["decomposed"] >= 3 and summary["folded_into_norm"] == 0
    for ref, got in zip(reference, ir.make_session(out).run(None, feeds)):
        np.testing.assert_allclose(got, ref, rtol=0, atol=FLOAT_EQUIV_RTOL * max(float(np.abs(ref).max()), 1.0))


def test_concat_is_quantized_in_the_integer_domain_and_fused(tiny_models, tmp_path, monkeypatch):
    """qdq quantizes Body once and concatenates the 8-bit tensors: the same integers as
    quantizing the float Concat (checked against that path), and onnxruntime still turns every
    linear into MatMulIntegerToFloat."""
    import collections
    import tempfile
    from pathlib import Path

    import onnx
    import onnxruntime as ort

    import edgeq.passes.methods.static_qdq as qdq_module

    model = ir.load_model(tiny_models["llama"])
    specs = ir.make_session(model).get_inputs()
    feeds = random_feeds(specs, seed=2, batch=1, seq=9)
    batches = [random_feeds(specs, seed=s) for s in range(2)]
    passes = lambda: [MuxqPass(MuxqConfig(threshold=0.5, max_fraction=0.25)),  # noqa: E731
                      get_pass("qdq")(get_pass("qdq").Config(activation_dtype="uint8"))]
    out, rec = Pipeline(passes()).run(model, _ctx(batches, tmp_path / "a"))
    graph = ir.to_graph(out)
    int_concats = [n for n in graph.nodes if n.op == "Concat" and n.outputs[0].dtype == np.uint8]
    assert len(int_concats) == rec[0]["summary"]["decomposed"]
    monkeypatch.setattr(qdq_module, "_self_concat_body", lambda index, tensor: None)
    ref_out, _ = Pipeline(passes()).run(model, _ctx(batches, tmp_path / "b"))
    for a, b in zip(ir.make_session(out).run(None, feeds), ir.make_session(ref_out).run(None, feeds)):
        np.testing.assert_array_equal(a, b)
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        so.log_severity_level = 3
        ort.InferenceSession(out.SerializeToString(), so, providers=["CPUExecutionProvider"])
        counts = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
    assert counts["MatMulIntegerToFloat"] == rec[1]["summary"]["linears_quantized"], counts
