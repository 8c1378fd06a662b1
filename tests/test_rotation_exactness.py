"""The rotation family is float-equivalent: after fuse-norms, ln-to-rms, rotate (and rms) the
fp32 graph gives the original outputs within FLOAT_EQUIV_RTOL of the output scale, with
onnxruntime graph optimizations off, on every tiny architecture; and each step changes what it
claims to (norms weightless, LayerNorms gone, online Hadamards inserted)."""

import numpy as np
import pytest
from toy import random_feeds

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.models.tiny import TINY_ARCHS
from edgeq.passmanager.passbase import FLOAT_EQUIV_RTOL, PassContext
from edgeq.passmanager.pipeline import Pipeline
from edgeq.passmanager.registry import get_pass
from edgeq.structure import analyze
from edgeq.passes.methods.stream import analyze_stream
from edgeq.passes.methods.weights import is_weightless

CHAIN = ["fuse-norms", "ln-to-rms", "rotate"]
# Architectures whose residual stream the rotation family can rewrite; BERT is post-LN (the norm
# output is itself the stream), which the passes detect and leave alone.
ROTATABLE = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2", "opt", "phi", "vit")


def _outputs(model, feeds):
    return ir.make_session(model).run(None, feeds)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_chain_is_float_equivalent(arch, tiny_models):
    model = ir.load_model(tiny_models[arch])
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=11, batch=2, seq=7)
    reference = _outputs(model, feeds)
    out, records = Pipeline([get_pass(name)() for name in CHAIN]).run(model, PassContext())
    for ref, got in zip(reference, _outputs(out, feeds)):
        scale = max(float(np.abs(ref).max()), 1.0)
        np.testing.assert_allclose(got, ref, rtol=0, atol=FLOAT_EQUIV_RTOL * scale)
    rotate = records[-1]
    if arch in ROTATABLE:
        assert rotate["modified"], rotate["summary"]
        graph = ir.to_graph(out)
        s = analyze(graph)
        index = ir.GraphIndex(graph)
        stream = analyze_stream(graph)  # the rotated graph's stream is still recognised
        assert stream.norms and all(n.kind == "rms" and is_weightless(index, n) for n in stream.norms)
        n_online = sum(1 for node in graph.nodes if node.op == "OnlineHadamard")
        # one before each MLP output linear, one after each post-sublayer norm (Gemma: 2 a layer)
        assert n_online == len(s.mlp_blocks) + len(stream.post_norms)
        assert len(stream.post_norms) == (2 * s.num_layers if arch.startswith("gemma") else 0)
    else:
        assert not rotate["modified"] and "not_applicable" in rotate["summary"]


@pytest.mark.parametrize("arch", ROTATABLE)
def test_rms_split_is_float_equivalent(arch, tiny_models):
    """mode=all splits channel 0 of every online-Hadamard linear; with a float branch the graph
    must still equal the original."""
    from edgeq.passes.rms import RmsConfig, RmsPass

    model = ir.load_model(tiny_models[arch])
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=5, batch=1, seq=9)
    reference = _outputs(model, feeds)
    passes = [get_pass(name)() for name in CHAIN] + [RmsPass(RmsConfig(mode="all", branch="float"))]
    out, records = Pipeline(passes).run(model, PassContext())
    summary = records[-1]["summary"]
    assert summary["split"] == summary["online_hadamard_linears"] == 2
    for ref, got in zip(reference, _outputs(out, feeds)):
        scale = max(float(np.abs(ref).max()), 1.0)
        np.testing.assert_allclose(got, ref, rtol=0, atol=FLOAT_EQUIV_RTOL * scale)
    graph = ir.to_graph(out)
    assert len(facts.KEEP_FLOAT.names(graph)) == 2
    again, rec2 = Pipeline([RmsPass(RmsConfig(mode="all", branch="float"))]).run(out, PassContext())
    assert rec2[0]["modified"] is False


def test_eq9_columns_hand_built():
    from edgeq.passes.methods.eq9 import eq9_columns

    w = np.array([[1.0, 1.0, 3.0], [1.0, -1.0, -0.5], [1.0, 0.5, 0.2], [1.0, 0.0, 0.1]])
    # column 0: |sqrt(4) * 1| = 2 > 1 (meets); column 1: |2 * 0.125| < 1; column 2: 2*0.7=1.4 < 3
    np.testing.assert_array_equal(eq9_columns(w), [True, False, False])


@pytest.mark.slow
def test_smollm2_rotation_chain_is_float_equivalent(smollm2_dir):
    """On the real model: fuse-norms, ln-to-rms, rotate and rms (every layer split, float branch)
    keep the logits within the fp32 tolerance (graph optimizations off)."""
    from edgeq.passes.rms import RmsConfig, RmsPass

    model = ir.load_model(smollm2_dir / "model.onnx")
    ids = np.random.default_rng(0).integers(0, 49152, (1, 48))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(48)[None]}
    (reference,) = _outputs(model, feeds)
    passes = [get_pass(name)() for name in CHAIN] + [RmsPass(RmsConfig(mode="all", branch="float"))]
    out, records = Pipeline(passes).run(model, PassContext(), consume=True)
    assert records[2]["summary"]["online"]["hadamard"] == 30
    assert records[3]["summary"]["split"] == 30
    (got,) = _outputs(out, feeds)
    scale = max(float(np.abs(reference).max()), 1.0)
    np.testing.assert_allclose(got, reference, rtol=0, atol=FLOAT_EQUIV_RTOL * scale)
    assert (got.argmax(-1) == reference.argmax(-1)).mean() > 0.99
