"""``massive-split``: channel detection on known data, the exact rewrite (float branch) on a
hand-built graph and after the rotation chain on tiny models, and the quantized branch's error."""

import numpy as np
import pytest
from toy import random_feeds, single_linear

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import FLOAT_EQUIV_RTOL, Exactness, PassContext
from edgeq.passes.massive_split import MassiveSplitConfig, MassiveSplitPass, massive_channels
from edgeq.passmanager.pipeline import Pipeline
from edgeq.passmanager.registry import get_pass

CHAIN = ["fuse-norms", "ln-to-rms", "rotate"]


def test_massive_channels_rule():
    absmax = np.array([1.0, 1.2, 0.9, 1.1, 50.0, 1.0, 30.0, 1.0, 2.0])
    np.testing.assert_array_equal(massive_channels(absmax, 20.0, 8), [4, 6])
    np.testing.assert_array_equal(massive_channels(absmax, 20.0, 1), [4])
    np.testing.assert_array_equal(massive_channels(absmax, 40.0, 8), [4])
    assert massive_channels(np.ones(16), 20.0, 8).size == 0


def test_config_rejects_bad_values():
    for bad in ({"ratio": 1.0}, {"max_channels": 0}, {"branch": "int3"}, {"roles": ()}):
        with pytest.raises(UserInputError):
            MassiveSplitConfig(**bad)
    assert MassiveSplitPass(MassiveSplitConfig(branch="float")).output_exactness is Exactness.FLOAT_EQUIV
    assert MassiveSplitPass().output_exactness is Exactness.LOSSY


def _hand_built(k=8, n=4, seed=0):
    return single_linear(k, n, seed)


def _batches(k=8, massive=(3,), seed=0):
    """Gaussian activations; the first token carries spikes of 300 in the ``massive`` channels."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(3):
        x = rng.standard_normal((1, 12, k)).astype(np.float32)
        x[0, 0, list(massive)] = 300.0
        out.append({"x": x})
    return out


def _ctx(batches, tmp_path):
    return PassContext(Calibrator(CalibrationSet(batches, "hand:massive", "hand-built", samples=len(batches)),
                                  cache_dir=tmp_path / "cache"))


def test_hand_built_split_is_exact_and_finds_the_spikes(tmp_path):
    model, w = _hand_built()
    batches = _batches(massive=(3, 6))
    p = MassiveSplitPass(MassiveSplitConfig(roles=("classifier",), branch="float"))
    out, records = Pipeline([p]).run(model, _ctx(batches, tmp_path))
    summary = records[0]["summary"]
    assert summary["per_linear"]["lin"]["channels"] in ([3, 6], [6, 3])
    graph = ir.to_graph(out)
    branch_w = next(t for t in graph.tensors().values() if t.name.startswith("lin_massive_branch_weight"))
    np.testing.assert_allclose(branch_w.values, w[summary["per_linear"]["lin"]["channels"]])
    x = _batches(massive=(3, 6), seed=7)[0]["x"]
    (ref,) = ir.make_session(model).run(None, {"x": x})
    (got,) = ir.make_session(out).run(None, {"x": x})
    np.testing.assert_allclose(got, ref, rtol=0, atol=FLOAT_EQUIV_RTOL * float(np.abs(ref).max()))
    again, rec2 = Pipeline([p]).run(out, _ctx(batches, tmp_path))
    assert rec2[0]["modified"] is False


def test_quantized_branch_beats_unsplit_static_int8(tmp_path):
    """With the spikes split off, static per-tensor W8A8 of the main GEMM keeps ordinary tokens
    accurate; without the split the per-tensor scale set by the spikes wipes them out."""
    model, _ = _hand_built(k=64, n=16)
    batches = _batches(k=64, massive=(5,))
    x = _batches(k=64, massive=(5,), seed=9)[0]["x"]
    (ref,) = ir.make_session(model).run(None, {"x": x})
    qdq = get_pass("qdq")

    def error(passes, sub):
        out, _ = Pipeline(passes).run(model, _ctx(batches, tmp_path / sub))
        (got,) = ir.make_session(out).run(None, {"x": x})
        return float(np.abs(got[0, 1:] - ref[0, 1:]).mean() / np.abs(ref[0, 1:]).mean())

    plain = error([qdq()], "plain")
    errors = {b: error([MassiveSplitPass(MassiveSplitConfig(roles=("classifier",), branch=b)), qdq()], b)
              for b in ("w8a16", "w8a8")}
    # an 8-bit branch rounds the ordinary tokens' values of the spiked channel (1 of 64) away
    assert errors["w8a16"] < 0.02 < errors["w8a8"] < 0.2 < plain


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_split_before_online_hadamard_is_float_equivalent(arch, tiny_models, tmp_path):
    """A low ratio forces splits on random weights; the float-branch graph must equal the original."""
    model = ir.load_model(tiny_models[arch])
    specs = ir.make_session(model).get_inputs()
    feeds = random_feeds(specs, seed=3, batch=2, seq=7)
    (reference, *_) = ir.make_session(model).run(None, feeds)
    batches = [random_feeds(specs, seed=s) for s in range(2)]
    ctx = _ctx(batches, tmp_path)
    split = MassiveSplitPass(MassiveSplitConfig(ratio=1.5, max_channels=3, branch="float"))
    out, records = Pipeline([get_pass(n)() for n in CHAIN] + [split]).run(model, ctx)
    summary = records[-1]["summary"]
    assert summary["linears"] == summary["split"] == 2
    graph = ir.to_graph(out)
    assert sum(n.op == "OnlineHadamard" for n in graph.nodes) == 2
    masks = [n for n in graph.nodes if n.name.endswith("_massive_mask")]
    assert all(m.o().op == "OnlineHadamard" for m in masks) and len(masks) == 2
    (got, *_) = ir.make_session(out).run(None, feeds)
    np.testing.assert_allclose(got, reference, rtol=0, atol=FLOAT_EQUIV_RTOL * max(float(np.abs(reference).max()), 1.0))
