"""The rotation family on graphs whose residual stream starts at a graph input (embeddings
computed outside the graph, as in the composed vision-language model): ``rotate`` adds one
``x @ Q`` at the input, ``ln-to-rms`` one online centring, and the fp32 graph is unchanged
within FLOAT_EQUIV_RTOL (graph optimizations off)."""

import numpy as np
import pytest
from test_composed_vlm import _tiny_feeds

from edgeq.graph import ir
from edgeq.passmanager.passbase import FLOAT_EQUIV_RTOL, PassContext
from edgeq.passmanager.pipeline import Pipeline
from edgeq.passmanager.registry import get_pass

CHAIN = ["fuse-norms", "ln-to-rms", "rotate"]
HIDDEN = 64  # the tiny GPT-2 width (edgeq.models.tiny)


def _close(model, out, feeds):
    for ref, got in zip(ir.make_session(model).run(None, feeds), ir.make_session(out).run(None, feeds)):
        np.testing.assert_allclose(got, ref, rtol=0, atol=FLOAT_EQUIV_RTOL * max(float(np.abs(ref).max()), 1.0))


def test_rotation_chain_on_tiny_qwen2vl(tiny_qwen2vl):
    model = ir.load_model(tiny_qwen2vl)
    out, records = Pipeline([get_pass(n)() for n in CHAIN]).run(model, PassContext())
    rotate = records[-1]["summary"]
    assert rotate["stream_sources"] == ["input"] and rotate["online"]["hadamard"] == 2
    graph = ir.to_graph(out)
    (first,) = [n for n in graph.nodes if n.name == "inputs_embeds_rotated"]
    assert first.op == "MatMul" and [t.name for t in graph.inputs][0] == "inputs_embeds"
    _close(model, out, _tiny_feeds(batch=2, pad=(0, 2)))


def test_rotation_chain_then_aifs_on_tiny_qwen2vl(tiny_qwen2vl):
    """The multimodal order: rotate the stream first, then reorder the tokens (aifs gathers the
    graph input, which the rotation MatMul now reads)."""
    model = ir.load_model(tiny_qwen2vl)
    out, records = Pipeline([get_pass(n)() for n in CHAIN + ["aifs"]]).run(model, PassContext())
    assert records[2]["modified"] and records[-1]["modified"], records[-1]["summary"]
    _close(model, out, _tiny_feeds(batch=3, pad=(0, 1, 3), seed=4))


def _gpt2_from_embeddings(path):
    """Tiny GPT-2 with its token+position embedding sum cut off: the stream starts at a new graph
    input ``inputs_embeds`` (a LayerNorm model whose source ln-to-rms must centre online)."""
    graph = ir.to_graph(ir.load_model(path))
    index = ir.GraphIndex(graph)
    from edgeq.structure import analyze

    first_norm = min(analyze(graph).norms, key=lambda n: [x.name for x in graph.nodes].index(n.nodes[0]))
    stream = index.tensors[first_norm.input]
    stream.inputs.clear()
    stream.dtype, stream.shape = np.float32, ["batch", "seq", HIDDEN]
    graph.inputs = [stream] + list(graph.inputs)  # input_ids still gives the shapes the graph reads
    graph.cleanup().toposort()
    return ir.to_model(graph)


@pytest.mark.parametrize("seed", [0, 1])
def test_ln_to_rms_centres_an_input_stream(seed, tiny_models):
    model = _gpt2_from_embeddings(tiny_models["gpt2"])
    names = [i.name for i in ir.make_session(model).get_inputs()]
    rng = np.random.default_rng(seed)
    stream_name = names[0]
    feeds = {stream_name: (rng.standard_normal((2, 5, HIDDEN)) + 0.7).astype(np.float32)}  # not zero-mean
    for name in names[1:]:
        feeds[name] = np.ones((2, 5), np.int64) if "mask" in name else np.arange(5)[None].repeat(2, 0)
    # sanity: the embeddings really are an input now (changing them changes the output)
    base = ir.make_session(model).run(None, feeds)[0]
    moved = ir.make_session(model).run(None, {**feeds, stream_name: feeds[stream_name] * 1.5})[0]
    assert np.abs(base - moved).max() > 1e-3
    out, records = Pipeline([get_pass(n)() for n in CHAIN]).run(model, PassContext())
    assert records[1]["summary"]["sources_centred"] == ["input"], records[1]["summary"]
    assert records[2]["summary"].get("stream_sources") == ["input-matmul"], records[2]["summary"]
    (centre,) = [n for n in ir.to_graph(out).nodes if n.name.endswith("_zero_mean")]
    assert centre.op == "MatMul"  # rotate folded Q into the centring matrix: one MatMul at the input
    _close(model, out, feeds)


@pytest.mark.slow
def test_rotation_chain_and_aifs_on_the_composed_vlm(composed_vlm_dir):
    """The real composed model: rotated (one x @ Q at inputs_embeds) and reordered, logits equal."""
    model = ir.load_model(composed_vlm_dir / "model.onnx")
    data = np.load(composed_vlm_dir / "eval.npz")
    feeds = {k: data[k][:1] for k in data.files}
    (reference,) = ir.make_session(model).run(None, feeds)
    out, records = Pipeline([get_pass(n)() for n in CHAIN + ["aifs"]]).run(model, PassContext(), consume=True)
    assert records[2]["summary"]["stream_sources"] == ["input"] and records[2]["summary"]["online"]["hadamard"] == 30
    assert records[3]["modified"]
    (got,) = ir.make_session(out).run(None, feeds)
    np.testing.assert_allclose(got, reference, rtol=0, atol=FLOAT_EQUIV_RTOL * float(np.abs(reference).max()))
    assert (got.argmax(-1) == reference.argmax(-1)).mean() > 0.99
