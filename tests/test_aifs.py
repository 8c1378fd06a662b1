"""``aifs`` (MQuant's Attention-Invariant Flexible Switching): the reordered graph gives the
original logits at every original position, the embeddings reaching the first layer are
visual-first (left padding counted as visual, appendix A.4), and ordinary models are left alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from toy import qwen_vl_feeds

from edgeq.graph import ir
from edgeq.models import composed_vlm as cv
from edgeq.models import embeds_export as ee
from edgeq.passmanager.passbase import FLOAT_EQUIV_RTOL, PassContext
from edgeq.passes.aifs import AIFS_KEY, PERMUTED_EMBEDS
from edgeq.passmanager.pipeline import Pipeline, PipelineOptions
from edgeq.passmanager.registry import get_pass


def _aifs(model: onnx.ModelProto):
    out, records = Pipeline([get_pass("aifs")()], PipelineOptions(verify=True)).run(model, PassContext())
    return out, records[0]


def _logits(model, feeds):
    return ir.make_session(model).run(["logits"], feeds)[0]


def _assert_float_equiv(new, ref):
    scale = max(float(np.abs(ref).max()), 1.0)
    np.testing.assert_allclose(new, ref, rtol=0, atol=FLOAT_EQUIV_RTOL * scale)


def _expected_order(feeds) -> np.ndarray:
    """perm [b, s] in numpy: left padding, then the visual span, then the text in order."""
    mask = feeds["attention_mask"]
    rows = []
    for r in range(mask.shape[0]):
        s = mask.shape[1]
        pad = int((mask[r] == 0).sum())
        assert not mask[r, :pad].any() and mask[r, pad:].all()  # left padding only
        start, length = int(feeds["visual_start"][r]), int(feeds["visual_len"][r])
        first = [i for i in range(s) if i < pad or start <= i < start + length]
        rows.append(first + [i for i in range(s) if i not in set(first)])
    return np.asarray(rows, np.int64)


def _nodes(model: onnx.ModelProto) -> list:
    return sorted((n.name, n.op_type, tuple(n.input), tuple(n.output)) for n in model.graph.node)


def _with_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return copy


@pytest.fixture(scope="module")
def qwen2vl_pair(tiny_qwen2vl):
    model = ir.load_model(tiny_qwen2vl)
    out, record = _aifs(model)
    return model, out, record


# ---------------------------------------------------------------------------------------------
# Tiny Qwen2-VL (fast, M-RoPE)
# ---------------------------------------------------------------------------------------------


def test_aifs_rewrites_the_shared_mask(qwen2vl_pair):
    _, out, record = qwen2vl_pair
    assert record["modified"] and record["verified"]
    summary = record["summary"]
    assert summary["position_rows"] == 3 and summary["unpermuted_outputs"] == ["logits"]
    assert summary["mask"]["comparison"] == "/model/LessOrEqual" and summary["mask"]["where"] == "/model/Where_1"
    assert summary["softmax_layers"] == 2
    assert [i.name for i in out.graph.input] == list(ee.MODEL_INPUTS)
    assert [o.name for o in out.graph.output] == ["logits"]
    assert {p.key for p in out.metadata_props} >= {AIFS_KEY}
    # the span inputs are read now
    consumed = {name for node in out.graph.node for name in node.input}
    assert set(ee.SPAN_INPUTS) <= consumed
    cmp = next(n for n in out.graph.node if n.name == "/model/LessOrEqual")
    assert list(cmp.input) == [summary["mask"]["key_index"], summary["mask"]["query_index"]]
    # the padding part reads the permuted attention_mask (and nothing else reads the original)
    readers = [n.name for n in out.graph.node if summary["reordered_inputs"]["attention_mask"] in n.input]
    assert "/model/Cast_1" in readers
    assert all(n.name.startswith("/aifs/") for n in out.graph.node if "attention_mask" in n.input)
    assert all(n.name.startswith("/aifs/") for n in out.graph.node if "position_ids" in n.input)


def test_aifs_tiny_qwen2vl_batch1_is_float_equivalent(qwen2vl_pair):
    model, out, _ = qwen2vl_pair
    feeds = qwen_vl_feeds([(5, (2, 3), 6)])
    assert (_expected_order(feeds)[0] != np.arange(feeds["attention_mask"].shape[1])).any()
    _assert_float_equiv(_logits(out, feeds), _logits(model, feeds))


def test_aifs_tiny_qwen2vl_batch3_spans_and_left_padding(qwen2vl_pair):
    model, out, _ = qwen2vl_pair
    feeds = qwen_vl_feeds([(7, (2, 3), 2), (1, (3, 3), 4), (3, (2, 2), 0)], seed=1)
    assert len(set(feeds["visual_start"].tolist())) == 3
    assert sorted((feeds["attention_mask"] == 0).sum(1).tolist()) == [0, 1, 8]
    _assert_float_equiv(_logits(out, feeds), _logits(model, feeds))


def test_aifs_tiny_qwen2vl_without_padding_or_image(qwen2vl_pair):
    """Edge spans: an image at position 0, and a row with an empty span (identity order)."""
    model, out, _ = qwen2vl_pair
    feeds = qwen_vl_feeds([(0, (2, 2), 5), (3, (1, 1), 5)], seed=2)
    feeds["visual_len"][1] = 0
    _assert_float_equiv(_logits(out, feeds), _logits(model, feeds))


def test_aifs_embeddings_reach_the_layers_visual_first(qwen2vl_pair):
    _, out, record = qwen2vl_pair
    name = record["summary"]["reordered_inputs"]["inputs_embeds"]
    assert name == PERMUTED_EMBEDS
    feeds = qwen_vl_feeds([(7, (2, 3), 2), (1, (3, 3), 4), (3, (2, 2), 0)], seed=1)
    first_norm = [n for n in out.graph.node if n.name.startswith("/model/layers.0/") and name in n.input]
    assert first_norm, "the first layer does not read the reordered embeddings"
    assert not any("inputs_embeds" in n.input for n in out.graph.node if not n.name.startswith("/aifs/"))
    session = ir.make_session(_with_output(out, name))
    _, got = session.run(["logits", name], feeds)
    perm = _expected_order(feeds)
    expected = np.take_along_axis(feeds["inputs_embeds"], perm[:, :, None], axis=1)
    np.testing.assert_array_equal(got, expected)
    # and the visual rows form one contiguous prefix after the padding
    for r in range(3):
        pad = int((feeds["attention_mask"][r] == 0).sum())
        start, length = int(feeds["visual_start"][r]), int(feeds["visual_len"][r])
        np.testing.assert_array_equal(got[r, pad:pad + length], feeds["inputs_embeds"][r, start:start + length])


def test_aifs_is_idempotent_and_survives_save_load(qwen2vl_pair, tmp_path):
    _, out, _ = qwen2vl_pair
    again, record = _aifs(out)
    assert record["modified"] is False and "already_applied" in record["summary"]
    feeds = qwen_vl_feeds([(2, (2, 2), 3), (4, (1, 2), 1)], seed=3)
    ref = _logits(out, feeds)
    np.testing.assert_array_equal(_logits(again, feeds), ref)
    path = ir.save_model(out, tmp_path / "m" / "model.onnx")
    np.testing.assert_array_equal(_logits(ir.load_model(path), feeds), ref)


def test_aifs_is_not_applicable_on_tiny_llama(tiny_models):
    model = ir.load_model(tiny_models["llama"])
    before = _nodes(model)
    out, record = _aifs(model)
    assert record["modified"] is False
    assert "not_applicable" in record["summary"] and "span" in record["summary"]["not_applicable"]
    assert _nodes(out) == before and [o.name for o in out.graph.output] == [o.name for o in model.graph.output]


def test_aifs_is_not_applicable_without_the_causal_pattern(tiny_qwen2vl):
    """Span inputs present but the comparison gone: refuse rather than guess."""
    model = ir.load_model(tiny_qwen2vl)
    for node in model.graph.node:
        if node.op_type == "LessOrEqual":
            node.op_type = "Equal"  # no longer one of the recognised index comparisons
            node.name = "/model/NotACausalCompare"
    before = _nodes(model)
    out, record = _aifs(model)
    assert record["modified"] is False and "comparison" in record["summary"]["not_applicable"]
    assert _nodes(out) == before and [o.name for o in out.graph.output] == [o.name for o in model.graph.output]


# ---------------------------------------------------------------------------------------------
# Composed SmolLM2 VLM (slow, 1-D RoPE, real weights)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def composed_pair(composed_vlm_dir):
    model = ir.load_model(composed_vlm_dir / "model.onnx")
    out, record = _aifs(model)
    assert record["modified"] and record["summary"]["softmax_layers"] == 30
    assert record["summary"]["position_rows"] == 1
    return model, out


@pytest.mark.slow
def test_aifs_composed_vlm_batch1(composed_pair, composed_vlm_dir):
    model, out = composed_pair
    inputs, _ = cv.load_split(composed_vlm_dir, "eval")
    feeds = {k: v[:1] for k, v in inputs.items()}
    assert int(feeds["visual_start"][0]) > 0  # text before the image: the order really changes
    _assert_float_equiv(_logits(out, feeds), _logits(model, feeds))


@pytest.mark.slow
def test_aifs_composed_vlm_batch3_variable_spans(composed_pair, composed_vlm_dir):
    model, out = composed_pair
    feeds, extra = cv.variable_span_batch(composed_vlm_dir)
    assert len(set(feeds["visual_start"].tolist())) == 3 and extra["pad_len"].max() > 0
    ref = _logits(model, feeds)
    got = ir.make_session(_with_output(out, PERMUTED_EMBEDS)).run(["logits", PERMUTED_EMBEDS], feeds)
    _assert_float_equiv(got[0], ref)
    perm = _expected_order(feeds)
    np.testing.assert_array_equal(got[1], np.take_along_axis(feeds["inputs_embeds"], perm[:, :, None], axis=1))
    for r in range(3):  # padding + visual block first, as in meta's masks
        n_first = int(extra["pad_len"][r] + feeds["visual_len"][r])
        assert (extra["is_pad"][r] | extra["is_visual"][r])[perm[r, :n_first]].all()
        assert not (extra["is_pad"][r] | extra["is_visual"][r])[perm[r, n_first:]].any()


def test_each_part_of_the_rewrite_is_needed(qwen2vl_pair):
    """Sensitivity of the checks above: in the rewritten graph, compare plain new positions
    (arange) instead of original ones, or feed RoPE the unpermuted position ids, and the logits
    move well outside the tolerance (>10x)."""
    model, out, record = qwen2vl_pair
    summary = record["summary"]
    feeds = qwen_vl_feeds([(7, (2, 3), 2), (1, (3, 3), 4)], seed=4)
    ref = _logits(model, feeds)
    scale = max(float(np.abs(ref).max()), 1.0)
    arange = next(n for n in out.graph.node if n.name == "/aifs/Range").output[0]  # arange(S)
    for part in ("causal", "positions"):
        broken = onnx.ModelProto()
        broken.CopyFrom(out)
        nodes = list(broken.graph.node)
        if part == "causal":
            at = next(i for i, n in enumerate(nodes) if n.name == summary["mask"]["comparison"])
            extra = [
                onnx.helper.make_node("Constant", [], ["q_axes"], value=onnx.numpy_helper.from_array(np.array([0, 1, 3], np.int64))),
                onnx.helper.make_node("Constant", [], ["k_axes"], value=onnx.numpy_helper.from_array(np.array([0, 1, 2], np.int64))),
                onnx.helper.make_node("Unsqueeze", [arange, "q_axes"], ["plain_q"]),
                onnx.helper.make_node("Unsqueeze", [arange, "k_axes"], ["plain_k"]),
            ]
            nodes[at:at] = extra
            swap = {summary["mask"]["query_index"]: "plain_q", summary["mask"]["key_index"]: "plain_k"}
        else:
            swap = {summary["reordered_inputs"]["position_ids"]: "position_ids"}
        for node in nodes:
            node.input[:] = [swap.get(name, name) for name in node.input]
        del broken.graph.node[:]
        broken.graph.node.extend(nodes)
        assert np.abs(_logits(broken, feeds) - ref).max() > 10 * FLOAT_EQUIV_RTOL * scale, part
