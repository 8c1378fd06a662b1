"""``msq`` (MQuant's modality-specific static scales) on tiny Qwen2-VL: calibration split by the
same visual mask the graph uses, the three lowerings agree with each other, AIFS and the interleaved
fallback quantize every token alike, and the pass keeps the harness's promises (verified, lossy
but close, idempotent, save/load with external data)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from toy import qwen_vl_feeds

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import PassContext
from edgeq.passes.msq import MSQ_KEY
from edgeq.passmanager.pipeline import Pipeline, PipelineOptions
from edgeq.passmanager.registry import get_pass
from edgeq.quantize.sqnr import sqnr_db
from edgeq.structure import find_linears

VISUAL_GAIN = 20.0  # four visual channels 20x wider than text: the case MSQ is for
CALIB_ROWS = [[(3, (2, 3), 4)], [(5, (2, 2), 2), (1, (3, 3), 3)], [(0, (2, 2), 6)]]


def _context(tmp_path) -> PassContext:
    batches = [qwen_vl_feeds(rows, seed=10 + i, visual_gain=VISUAL_GAIN) for i, rows in enumerate(CALIB_ROWS)]
    return PassContext(Calibrator(CalibrationSet(batches, "msq-test", "tiny qwen2vl feeds", len(batches)), cache_dir=tmp_path / "cache"))


def _msq(**cfg):
    cls = get_pass("msq")
    return cls(cls.Config(activation_dtype="uint8", activation_observer="minmax", **cfg))


def _compile(model, passes, ctx):
    out, records = Pipeline(passes, PipelineOptions(verify=True)).run(model, ctx)
    return out, records[-1]


def _logits(model, feeds):
    return ir.make_session(model, optimize=False).run(["logits"], feeds)[0]


@pytest.fixture(scope="module")
def model(tiny_qwen2vl):
    return ir.load_model(tiny_qwen2vl)


@pytest.fixture(scope="module")
def eval_feeds():
    return qwen_vl_feeds([(4, (2, 3), 3), (2, (3, 3), 1)], seed=7, visual_gain=VISUAL_GAIN)


@pytest.fixture(scope="module")
def compiled(model, tmp_path_factory):
    """Every lowering and layout, compiled once, with their reports."""
    ctx = _context(tmp_path_factory.mktemp("msq"))
    aifs = get_pass("aifs")
    out = {}
    for name, passes in {
        "integer+aifs": [aifs(), _msq()],
        "custom+aifs": [aifs(), _msq(lowering="custom")],
        "select": [_msq(lowering="select")],
        "integer": [_msq()],
        "single": [get_pass("qdq")(get_pass("qdq").Config(activation_dtype="uint8", activation_observer="minmax"))],
    }.items():
        out[name] = _compile(model, passes, ctx)
    return out


def _site_values(model, names, batches):
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for n in names:
        copy.graph.output.append(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
    sess = ir.make_session(copy, optimize=False)
    return [dict(zip(names, sess.run(names, f))) for f in batches]


def _visual_mask(feeds) -> np.ndarray:
    s = np.arange(feeds["attention_mask"].shape[1])[None]
    start, end = feeds["visual_start"][:, None], (feeds["visual_start"] + feeds["visual_len"])[:, None]
    return ((s >= start) & (s < end)) | (feeds["attention_mask"] == 0)


def test_calibration_is_split_by_modality(model, compiled):
    """The visual / text ranges msq records equal numpy's min/max over the visual / text tokens of
    the calibration batches (interleaved layout: original token order)."""
    _, record = compiled["integer"]
    ranges = record["summary"]["modality_ranges"]
    sites = sorted({lin.input for lin in find_linears(ir.to_graph(model))})
    assert sorted(ranges) == sites
    batches = [qwen_vl_feeds(rows, seed=10 + i, visual_gain=VISUAL_GAIN) for i, rows in enumerate(CALIB_ROWS)]
    values = _site_values(model, sites, batches)
    wider = 0
    for name in sites:
        vis = np.concatenate([v[name][_visual_mask(f)] for v, f in zip(values, batches)])
        txt = np.concatenate([v[name][~_visual_mask(f)] for v, f in zip(values, batches)])
        np.testing.assert_allclose(ranges[name]["visual"], [vis.min(), vis.max()], rtol=1e-5)
        np.testing.assert_allclose(ranges[name]["text"], [txt.min(), txt.max()], rtol=1e-5)
        assert ranges[name]["tokens"] == [int(vis.shape[0]), int(txt.shape[0])]
        wider += np.abs(vis).max() > 1.5 * np.abs(txt).max()
    assert wider >= len(sites) // 2  # the fixture really has a wider visual modality


def test_aifs_layout_uses_the_same_ranges(compiled):
    """After AIFS the prefix mask selects the same tokens: identical calibrated ranges."""
    a = compiled["integer"][1]["summary"]["modality_ranges"]
    b = dict(compiled["integer+aifs"][1]["summary"]["modality_ranges"])
    (head,) = [n for n in b if n.startswith("/aifs/Unpermute_")]  # AIFS restores the order before the head
    b[head.removeprefix("/aifs/Unpermute_").removesuffix("_output_0")] = b.pop(head)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(b[name]["visual"], a[name]["visual"], rtol=1e-5)
        np.testing.assert_allclose(b[name]["text"], a[name]["text"], rtol=1e-5)
    assert compiled["integer+aifs"][1]["summary"]["layout"].startswith("prefix")
    assert compiled["integer"][1]["summary"]["layout"].startswith("interleaved")


@pytest.mark.parametrize("name", ["integer+aifs", "custom+aifs", "integer"])
def test_lowerings_match_the_select_reference(compiled, eval_feeds, name):
    """``select`` is MSQ spelled out in standard ops (two static QDQs, per-token select); the
    integer rescaling and the ModalityQDQ op (with or without AIFS) give the same logits up to
    rounding-tie flips in the quantizer."""
    ref = _logits(compiled["select"][0], eval_feeds)
    got = _logits(compiled[name][0], eval_feeds)
    scale = float(np.abs(ref).max())
    assert np.abs(got - ref).max() < 2e-3 * scale
    assert np.mean(np.abs(got - ref) > 1e-4 * scale) < 0.01


def test_msq_beats_one_scale_on_a_wider_visual_modality(model, compiled, eval_feeds):
    """At text positions (where one shared scale, stretched by the visual outlier channels, costs
    the most) the per-modality scales are clearly closer to float."""
    text = ~_visual_mask(eval_feeds)
    ref = _logits(model, eval_feeds)[text]
    single = sqnr_db(ref, _logits(compiled["single"][0], eval_feeds)[text])
    msq = sqnr_db(ref, _logits(compiled["integer+aifs"][0], eval_feeds)[text])
    print(f"text-position SQNR: msq {msq:.1f} dB, one scale {single:.1f} dB")
    assert msq > single + 3.0, (msq, single)


def test_integer_lowering_keeps_the_integer_kernel_pattern(compiled):
    """One QuantizeLinear per site with the text scale, after a per-row gain; every linear reads
    its own DequantizeLinear and is followed by the inverse gain."""
    m = compiled["integer+aifs"][0]
    ops = [n.op_type for n in m.graph.node]
    linears = sum(1 for n in m.graph.node if n.op_type == "MatMul" and any("DequantizeLinear" in p for p in _producers(m, n)))
    assert ops.count("QuantizeLinear") == compiled["integer+aifs"][1]["summary"]["activation_sites"]
    assert linears == compiled["integer+aifs"][1]["summary"]["linears_quantized"]
    assert sum(1 for n in m.graph.node if n.name.endswith("_ModalityUnscale")) == linears
    assert not any(n.domain == "edgeq" for n in m.graph.node)


def _producers(model, node):
    by_output = {o: n for n in model.graph.node for o in n.output}
    return [by_output[i].op_type for i in node.input if i in by_output]


def test_custom_lowering_uses_modality_qdq(compiled):
    """ModalityQDQ at every site in AIFS's visual-first order; the vocab head's input, which AIFS
    un-permutes early (original order), gets the standard-op select form."""
    m, record = compiled["custom+aifs"]
    summary = record["summary"]
    ops = [n.op_type for n in m.graph.node if n.domain == "edgeq"]
    assert ops and set(ops) == {"ModalityQDQ"}
    assert len(summary["original_order_sites"]) == 1
    assert len(ops) == summary["activation_sites"] - 1
    assert sum(n.op_type == "QuantizeLinear" for n in m.graph.node) == 2
    assert any(f.name == "ModalityQDQ" for f in m.functions)


def test_msq_is_idempotent_and_survives_save_load(compiled, eval_feeds, tmp_path):
    out, _ = compiled["integer+aifs"]
    assert MSQ_KEY in {p.key for p in out.metadata_props}
    again, record = Pipeline([_msq()]).run(out, PassContext())
    assert record[0]["modified"] is False
    np.testing.assert_array_equal(_logits(again, eval_feeds), _logits(out, eval_feeds))
    path = ir.save_model(out, tmp_path / "saved" / "model.onnx")
    assert (tmp_path / "saved" / "model.onnx.data").exists()
    np.testing.assert_array_equal(_logits(ir.load_model(path), eval_feeds), _logits(out, eval_feeds))


def test_clear_errors(model, tiny_models, tmp_path):
    ctx = _context(tmp_path)
    with pytest.raises(UserInputError, match="run aifs before msq"):
        Pipeline([_msq(lowering="custom")]).run(model, ctx)
    with pytest.raises(UserInputError, match="symmetric"):
        _msq(activation_symmetric=False)
    with pytest.raises(UserInputError, match="static per-tensor"):
        _msq(activation_granularity="token")
    with pytest.raises(UserInputError, match="min_scale_ratio"):
        _msq(min_scale_ratio=0.5)
    with pytest.raises(UserInputError, match="lowering must be one of"):
        _msq(lowering="slices")
    with pytest.raises(UserInputError, match="visual span inputs"):
        Pipeline([_msq()]).run(ir.load_model(tiny_models["llama"]), ctx)


def test_min_scale_ratio_shares_one_scale_where_the_modalities_agree(model, compiled, eval_feeds, tmp_path):
    """With a ratio no site reaches, every site shares one scale covering both modalities: the
    same graph numbers as qdq with min/max calibration; with the default, every site has two."""
    assert compiled["integer+aifs"][1]["summary"]["shared_scale_sites"] == 0
    out, record = _compile(model, [_msq(min_scale_ratio=1e6)], _context(tmp_path))
    assert record["summary"]["two_scale_sites"] == 0
    assert not any(n.name.endswith("_ModalityUnscale") for n in out.graph.node)
    np.testing.assert_array_equal(_logits(out, eval_feeds), _logits(compiled["single"][0], eval_feeds))
