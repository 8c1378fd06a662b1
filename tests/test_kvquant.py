"""``kvquant``: the decode graph over a packed visual KV cache.

Exactness: without logit calibration, post-scaled attention over the packed codes is attention
over the dequantized cache, so one decode step of the kvquant graph (fed by
``edgeq.kv_cache.visual_cache_feeds``) must equal the float graph fed the same cache with its
visual rows quantized and dequantized in numpy, for every scheme and bit width and with clipping
(fp32 tolerance, onnxruntime optimizations off). Calibration: the chosen clip factors and taus are
what the node attributes, the metadata and the summary say. Plus the harness duties (idempotence,
save/load with external data) and one-line errors. The slow test runs the real composed VLM.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.errors import UserInputError
from edgeq.kv_cache import SCHEMES, VisualCacheSpec, visual_cache_feeds
from edgeq.models import kv_export as kv
from edgeq.passmanager.passbase import PassContext
from edgeq.passmanager.pipeline import Pipeline, PipelineOptions
from edgeq.passmanager.registry import get_pass
from edgeq.runtime_ops.visual_kv_codes import dequantize_channelwise as dequantize, quantize_rows
from edgeq.textdata import empty_cache_feeds

SEQ, VS, VL = 16, 2, 8  # tiny prompt: tokens [2, 10) play the image
KVQ = get_pass("kvquant")
FIXED = {"calibrate": False, "tau_search": False, "clip_search": False, "visual_start": VS, "visual_len": VL}


@pytest.fixture(scope="module")
def tiny_past(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kvq") / "llama"
    kv.export_tiny_with_past("llama", folder, seed=0)
    return ir.load_model(folder / "model.onnx")


def _prompt(seed: int = 0) -> dict:
    ids = np.random.default_rng(seed).integers(0, 200, (1, SEQ)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((1, SEQ), np.int64), "position_ids": np.arange(SEQ)[None]}


def _prefill(model, seed: int = 0) -> dict:
    session = ir.make_session(model)
    caches = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    outs = [o.name for o in session.get_outputs()]
    return dict(zip(outs, session.run(outs, {**_prompt(seed), **empty_cache_feeds(caches, 1)})))


def _step(token: int, text_past: int) -> dict:
    return {"input_ids": np.array([[token]], np.int64), "position_ids": np.array([[SEQ]], np.int64),
            "attention_mask": np.ones((1, text_past + 1), np.int64)}


def _compile(model, ctx=None, **options):
    out, records = Pipeline([KVQ(KVQ.Config(**{**FIXED, **options}))], PipelineOptions(verify=True)).run(model, ctx or PassContext())
    return out, records[0]


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_decode_step_equals_float_attention_over_the_dequantized_cache(tiny_past, scheme, bits):
    clip = 0.6 if bits == 1 else 1.0
    qmodel, record = _compile(tiny_past, bits=bits, scheme=scheme, k_clip=clip, v_clip=clip)
    assert record["modified"] and record["summary"]["layers"] == 2
    spec = VisualCacheSpec.from_model(qmodel)
    assert spec == VisualCacheSpec(bits, scheme, clip, clip)
    op = "VisualKVAttentionKIVI" if scheme == "kivi" else "VisualKVAttention"
    assert sum(n.op_type == op for n in qmodel.graph.node) == 2
    assert not any(n.op_type == "Softmax" for n in qmodel.graph.node)

    presents = {k: v for k, v in _prefill(tiny_past).items() if k.startswith("present.")}
    token = 7
    got = ir.make_session(qmodel).run(["logits"], {**_step(token, SEQ - VL), **visual_cache_feeds(presents, [VS], [VL], spec)})[0]
    fake = {}
    for name, value in presents.items():
        axis = spec.axes[0] if name.endswith(".key") else spec.axes[1]
        value = value.copy()
        codes, alpha, scale = quantize_rows(value[:, :, VS:VS + VL], bits, axis, clip)
        value[:, :, VS:VS + VL] = dequantize(codes, alpha, scale)
        fake["past_key_values." + name[len("present."):]] = value
    want = ir.make_session(tiny_past).run(["logits"], {**_step(token, SEQ), **fake})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_visual_cache_is_packed_and_text_stays_float(tiny_past):
    presents = {k: v for k, v in _prefill(tiny_past).items() if k.startswith("present.")}
    feeds = visual_cache_feeds(presents, [VS], [VL], VisualCacheSpec(1))
    d = presents["present.0.key"].shape[-1]
    assert feeds["visual_key_values.0.key_codes"].shape == (1, 2, VL, d // 8)
    assert feeds["visual_key_values.0.key_codes"].dtype == np.uint8
    text = feeds["past_key_values.0.key"]
    np.testing.assert_array_equal(text, np.concatenate([presents["present.0.key"][:, :, :VS],
                                                        presents["present.0.key"][:, :, VS + VL:]], axis=2))
    with pytest.raises(UserInputError, match="outside the cache"):
        visual_cache_feeds(presents, [10], [VL], VisualCacheSpec(1))


def _calibrator(model, tmp_path, samples: int = 3) -> PassContext:
    specs = ir.make_session(model).get_inputs()
    caches = [s for s in specs if s.name.startswith("past_key_values.")]
    batches = [{**_prompt(100 + i), **empty_cache_feeds(caches, 1)} for i in range(samples)]
    return PassContext(Calibrator(CalibrationSet(batches, "kvq:test", "random prompts", samples), cache_dir=tmp_path))


def test_calibration_choices_reach_graph_metadata_and_summary(tiny_past, tmp_path):
    ctx = _calibrator(tiny_past, tmp_path)
    qmodel, record = _compile(tiny_past, ctx, bits=1, calibrate=True, tau_search=True, clip_search=True, query_tokens=4)
    s = record["summary"]
    cal = s["calibration"]
    assert cal["samples"] == 3 * 2  # prompts x layers
    assert s["k_clip"] in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1)
    assert (s["tau1"], s["tau2"]) in {(float(a), float(b)) for a in range(4) for b in range(4)}
    assert len(cal["tau"]["errors"]) == 16
    assert cal["tau"]["error"] == min(cal["tau"]["errors"].values())
    assert cal["clip"]["errors"][f"k={s['k_clip']:g},v={s['v_clip']:g}"] == cal["clip"]["error"]
    nodes = [n for n in qmodel.graph.node if n.op_type == "VisualKVAttention"]
    for node in nodes:
        attrs = {a.name: a for a in node.attribute}
        assert attrs["bits"].i == 1 and attrs["calibrate"].i == 1
        assert attrs["tau1"].f == s["tau1"] and attrs["tau2"].f == s["tau2"]
    meta = json.loads({p.key: p.value for p in qmodel.metadata_props}["edgeq.kvquant"])
    assert meta["k_clip"] == s["k_clip"] and meta["tau2"] == s["tau2"]


def test_idempotent_and_survives_save_load(tiny_past, tmp_path):
    qmodel, _ = _compile(tiny_past, bits=2)
    again, records = Pipeline([KVQ(KVQ.Config(**FIXED))]).run(qmodel, PassContext())
    assert records[0]["modified"] is False
    presents = {k: v for k, v in _prefill(tiny_past).items() if k.startswith("present.")}
    feeds = {**_step(3, SEQ - VL), **visual_cache_feeds(presents, [VS], [VL], VisualCacheSpec(2))}
    got = ir.make_session(qmodel).run(None, feeds)
    path = ir.save_model(qmodel, tmp_path / "saved" / "model.onnx")
    assert (tmp_path / "saved" / "model.onnx.data").exists()
    for a, b in zip(got, ir.make_session(ir.load_model(path)).run(None, feeds)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got, ir.make_session(again).run(None, feeds)):
        np.testing.assert_array_equal(a, b)


def test_errors_are_one_line(tiny_past, tiny_models):
    with pytest.raises(UserInputError, match="needs a decoder graph with a KV cache"):
        _compile(ir.load_model(tiny_models["llama"]))
    with pytest.raises(UserInputError, match="needs calibration data"):
        _compile(tiny_past, clip_search=True)
    with pytest.raises(UserInputError, match="needs the visual span"):
        _compile(tiny_past, PassContext(Calibrator(CalibrationSet([], "x", "x", 0))), clip_search=True, visual_start=-1)
    with pytest.raises(UserInputError, match="bits must be one of"):
        KVQ.Config(bits=3)
    with pytest.raises(UserInputError, match="scheme must be one of"):
        KVQ.Config(scheme="per-tensor")
    with pytest.raises(UserInputError, match="k_clip must be in"):
        KVQ.Config(k_clip=0.0)


@pytest.mark.slow
def test_composed_vlm_decode_graph_and_compile_cli(composed_vlm_past_dir, tmp_path):
    """The real composed VLM: ``edgeq compile --recipe calibquant-kv2`` on its calibration npz
    writes the decode graph and the chosen values; that graph, fed the packed cache of a float
    prefill, decodes greedily, and with calibration off it equals float decoding over the
    dequantized cache."""
    from edgeq.cli import main
    from edgeq.evaluate.generate import greedy_decode

    d = composed_vlm_past_dir
    out = tmp_path / "kv2"
    assert main(["compile", str(d / "model.onnx"), "--recipe", "calibquant-kv2", "--calib", str(d / "calib.npz"),
                 "--calib-windows", "2", "-o", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    summary = next(p for p in report["passes"] if p["name"] == "kvquant")["summary"]
    assert summary["bits"] == 2 and summary["layers"] == 30 and summary["calibration"]["samples"] == 2 * 30

    model = ir.load_model(d / "model.onnx")
    qmodel, _ = _compile(model, bits=2, visual_start=-1)
    data = np.load(d / "eval.npz")
    embed = np.load(d / "embed_tokens.npy")
    feeds = {k: data[k][:1] for k in data.files}
    session = ir.make_session(model)
    names = [i.name for i in session.get_inputs()]
    caches = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    outs = [o.name for o in session.get_outputs()]
    res = dict(zip(outs, session.run(outs, {**{k: v for k, v in feeds.items() if k in names}, **empty_cache_feeds(caches, 1)})))
    presents = {k: v for k, v in res.items() if k.startswith("present.")}
    vs, vl, seq = feeds["visual_start"], feeds["visual_len"], feeds["inputs_embeds"].shape[1]
    token = int(res["logits"][0, -1].argmax())
    step = {"inputs_embeds": embed[token][None, None].astype(np.float32), "position_ids": feeds["position_ids"][:, -1:] + 1,
            "visual_start": vs, "visual_len": vl}
    spec = VisualCacheSpec(2)
    qfeeds = {**step, "attention_mask": np.ones((1, seq - int(vl[0]) + 1), np.int64), **visual_cache_feeds(presents, vs, vl, spec)}
    qsession = ir.make_session(qmodel)
    decoded = greedy_decode(qsession, qfeeds, 8, embed)
    assert decoded.tokens.shape == (8,) and np.all(np.isfinite(decoded.logits))
    fake = {}
    for name, value in presents.items():
        value = value.copy()
        s, n = int(vs[0]), int(vl[0])
        value[:, :, s:s + n] = dequantize(*quantize_rows(value[:, :, s:s + n], 2, "channel"))
        fake["past_key_values." + name[len("present."):]] = value
    want = session.run(["logits"], {**step, "attention_mask": np.ones((1, seq + 1), np.int64), **fake})[0]
    got = qsession.run(["logits"], qfeeds)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
