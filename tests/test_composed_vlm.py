"""The multimodal test models: the tiny Qwen2-VL language model (fast) and the composed
SmolLM2 + CRAFT-features VLM (slow: real weights, about two minutes to build once, cached).

Both take embeddings plus the visual span inputs that the MSQ/AIFS passes will consume; these
tests pin that interface, the sample files and the fp32 behaviour the passes must preserve.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgeq.errors import UserInputError
from edgeq.models import composed_vlm as cv
from edgeq.models import craft_vision as vision
from edgeq.models import embeds_export as ee
from edgeq.models.tiny_qwen2vl import HIDDEN, MROPE_SECTION, VOCAB, build_tiny_qwen2vl, mrope_position_ids, text_decoder


def _run(session, feeds):
    return session.run(["logits"], feeds)[0]


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _tiny_feeds(batch=2, prefix=3, grid=(2, 3), suffix=4, pad=(0, 2), seed=0):
    """Left-padded "text, image, text" feeds for the tiny model with Qwen2-VL M-RoPE ids."""
    rng = np.random.default_rng(seed)
    length = prefix + grid[0] * grid[1] + suffix
    seq = length + max(pad)
    feeds = {
        "inputs_embeds": rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32),
        "attention_mask": np.zeros((batch, seq), np.int64),
        "position_ids": np.ones((3, batch, seq), np.int64),
        "visual_start": np.zeros(batch, np.int64),
        "visual_len": np.full(batch, grid[0] * grid[1], np.int64),
    }
    ids = mrope_position_ids(prefix, grid, suffix)
    for r in range(batch):
        p = seq - length
        feeds["attention_mask"][r, p:] = 1
        feeds["position_ids"][:, r, p:] = ids
        feeds["visual_start"][r] = p + prefix
    return feeds


# ---------------------------------------------------------------------------------------------
# Tiny Qwen2-VL (fast)
# ---------------------------------------------------------------------------------------------


def test_tiny_qwen2vl_interface(tiny_qwen2vl):
    assert (tiny_qwen2vl.parent / "config.json").is_file()
    assert json.loads((tiny_qwen2vl.parent / "config.json").read_text())["model_type"] == "qwen2_vl"
    model = onnx.load(str(tiny_qwen2vl), load_external_data=False)
    inputs = {i.name: i for i in model.graph.input}
    assert list(inputs) == list(ee.MODEL_INPUTS)
    assert _dims(inputs["inputs_embeds"]) == ["batch_size", "sequence_length", HIDDEN]
    assert _dims(inputs["attention_mask"]) == ["batch_size", "sequence_length"]
    assert _dims(inputs["position_ids"]) == [3, "batch_size", "sequence_length"]
    assert _dims(inputs["visual_start"]) == _dims(inputs["visual_len"]) == ["batch_size"]
    types = {name: vi.type.tensor_type.elem_type for name, vi in inputs.items()}
    assert types["inputs_embeds"] == onnx.TensorProto.FLOAT
    assert all(types[n] == onnx.TensorProto.INT64 for n in ee.MODEL_INPUTS[1:])
    assert [o.name for o in model.graph.output] == ["logits"]
    assert _dims(model.graph.output[0]) == ["batch_size", "sequence_length", VOCAB]
    assert {p.key: p.value for p in model.metadata_props}[ee.SPAN_METADATA_KEY] == "visual_start,visual_len"
    assert (tiny_qwen2vl.parent / "model.onnx.data").is_file()
    opset = next(i.version for i in model.opset_import if i.domain in ("", "ai.onnx"))
    assert opset == ee.OPSET


def test_tiny_qwen2vl_matches_torch_with_padding_and_mrope(tiny_qwen2vl):
    import torch

    feeds = _tiny_feeds()
    logits = _run(ee.ort_session(tiny_qwen2vl), feeds)
    decoder, head = text_decoder(build_tiny_qwen2vl(seed=0))
    with torch.no_grad():
        hidden = decoder(
            inputs_embeds=torch.from_numpy(feeds["inputs_embeds"]),
            attention_mask=torch.from_numpy(feeds["attention_mask"]),
            position_ids=torch.from_numpy(feeds["position_ids"]),
            use_cache=False,
        ).last_hidden_state
        reference = head(hidden).numpy()
    assert logits.shape == (2, feeds["inputs_embeds"].shape[1], VOCAB)
    real = feeds["attention_mask"].astype(bool)
    np.testing.assert_allclose(logits[real], reference[real], rtol=1e-4, atol=1e-4)


def test_each_position_row_changes_the_output(tiny_qwen2vl):
    """All three M-RoPE rows reach the graph: moving the image in any one row changes the logits.

    (Shifting a whole row would not: RoPE only sees position differences.)
    """
    session = ee.ort_session(tiny_qwen2vl)
    feeds = _tiny_feeds(batch=1, pad=(0,))
    base = _run(session, feeds)
    flat = dict(feeds, position_ids=np.broadcast_to(feeds["position_ids"][:1], feeds["position_ids"].shape).copy())
    assert np.abs(_run(session, flat) - base).max() > 1e-4, "M-RoPE ids behave like 1-D ids"
    start, length = int(feeds["visual_start"][0]), int(feeds["visual_len"][0])
    for row in range(3):
        moved = feeds["position_ids"].copy()
        moved[row, :, start:start + length] += 3
        assert np.abs(_run(session, dict(feeds, position_ids=moved)) - base).max() > 1e-4, row


def test_span_inputs_are_accepted_and_unused(tiny_qwen2vl):
    model = onnx.load(str(tiny_qwen2vl), load_external_data=False)
    consumed = {name for node in model.graph.node for name in node.input}
    assert not consumed & set(ee.SPAN_INPUTS)
    session = ee.ort_session(tiny_qwen2vl)
    feeds = _tiny_feeds()
    base = _run(session, feeds)
    other = dict(feeds, visual_start=np.array([0, 7], np.int64), visual_len=np.array([1, 2], np.int64))
    np.testing.assert_array_equal(_run(session, other), base)


def test_mrope_position_ids_follow_qwen2vl():
    ids = mrope_position_ids(2, (2, 3), 2)
    assert ids.shape == (3, 2 + 6 + 2) and ids.dtype == np.int64
    np.testing.assert_array_equal(ids[:, :2], [[0, 1]] * 3)
    np.testing.assert_array_equal(ids[0, 2:8], [2] * 6)  # temporal
    np.testing.assert_array_equal(ids[1, 2:8], [2, 2, 2, 3, 3, 3])  # height
    np.testing.assert_array_equal(ids[2, 2:8], [2, 3, 4, 2, 3, 4])  # width
    np.testing.assert_array_equal(ids[:, 8:], [[5, 6]] * 3)  # one past the image's largest index
    assert sum(MROPE_SECTION) == HIDDEN // 4 // 2  # head_dim / 2


def _fake_composed_dir(folder: Path, n=4, prefix=4, visual=6, suffix=5, hidden=HIDDEN, seed=0) -> Path:
    """calib/eval npz + meta files in the exported format, with random embeddings."""
    rng = np.random.default_rng(seed)
    seq = prefix + visual + suffix
    for split in ("calib", "eval"):
        is_visual = np.zeros((n, seq), bool)
        is_visual[:, prefix:prefix + visual] = True
        text_ids = np.where(is_visual, -1, rng.integers(0, 100, (n, seq)))
        np.savez(folder / f"{split}.npz",
                 inputs_embeds=rng.standard_normal((n, seq, hidden)).astype(np.float32),
                 attention_mask=np.ones((n, seq), np.int64),
                 position_ids=np.tile(np.arange(seq, dtype=np.int64), (n, 1)),
                 visual_start=np.full(n, prefix, np.int64), visual_len=np.full(n, visual, np.int64))
        np.savez(folder / f"{split}_meta.npz", text_ids=text_ids, is_visual=is_visual,
                 is_pad=np.zeros((n, seq), bool), image_index=np.arange(n),
                 pad_embedding=rng.standard_normal(hidden).astype(np.float32))
    return folder


def test_variable_span_batch_layout(tmp_path):
    folder = _fake_composed_dir(tmp_path)
    full, meta = cv.load_split(folder, "eval")
    feeds, extra = cv.variable_span_batch(folder, prefix_lens=(4, 2, 0), suffix_lens=(5, 1, 3))
    assert list(feeds) == list(ee.MODEL_INPUTS)
    np.testing.assert_array_equal(extra["pad_len"], [0, 6, 6])
    np.testing.assert_array_equal(feeds["visual_start"], [4, 8, 6])
    np.testing.assert_array_equal(feeds["visual_len"], [6, 6, 6])
    for r, (pad, start) in enumerate(zip(extra["pad_len"], feeds["visual_start"])):
        assert not feeds["attention_mask"][r, :pad].any() and feeds["attention_mask"][r, pad:].all()
        assert extra["is_pad"][r, :pad].all() and not extra["is_pad"][r, pad:].any()
        np.testing.assert_array_equal(feeds["position_ids"][r, pad:], np.arange(15 - pad))
        assert (feeds["position_ids"][r, :pad] == 1).all()
        np.testing.assert_array_equal(np.flatnonzero(extra["is_visual"][r]), np.arange(start, start + 6))
        assert (extra["text_ids"][r][~extra["is_visual"][r] & ~extra["is_pad"][r]] >= 0).all()
        assert (extra["text_ids"][r][extra["is_visual"][r] | extra["is_pad"][r]] == -1).all()
        pads = np.broadcast_to(meta["pad_embedding"], (pad, HIDDEN))
        np.testing.assert_array_equal(feeds["inputs_embeds"][r, :pad], pads)
        # the visual block is the sample's own visual block, moved
        np.testing.assert_array_equal(feeds["inputs_embeds"][r, start:start + 6], full["inputs_embeds"][r, 4:10])
    with pytest.raises(UserInputError):
        cv.variable_span_batch(folder, prefix_lens=(5,))


def test_variable_span_batch_is_padding_invariant_on_tiny_qwen2vl(tiny_qwen2vl, tmp_path):
    """Each padded row gives the logits its unpadded sequence gives alone (the mask is right)."""
    folder = _fake_composed_dir(tmp_path)
    feeds, extra = cv.variable_span_batch(folder, prefix_lens=(4, 2, 0), suffix_lens=(5, 1, 3))
    feeds["position_ids"] = np.broadcast_to(feeds["position_ids"], (3, *feeds["position_ids"].shape)).copy()
    session = ee.ort_session(tiny_qwen2vl)
    batch = _run(session, feeds)
    for r, pad in enumerate(extra["pad_len"]):
        single = {
            "inputs_embeds": feeds["inputs_embeds"][r:r + 1, pad:],
            "attention_mask": feeds["attention_mask"][r:r + 1, pad:],
            "position_ids": feeds["position_ids"][:, r:r + 1, pad:],
            "visual_start": feeds["visual_start"][r:r + 1] - pad,
            "visual_len": feeds["visual_len"][r:r + 1],
        }
        np.testing.assert_allclose(batch[r, pad:], _run(session, single)[0], rtol=1e-4, atol=1e-5)


def test_cli_knows_composed_vlm_and_tiny_qwen2vl(tmp_path):
    from edgeq.models.cli import register

    parser = argparse.ArgumentParser(prog="edgeq")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["export", "composed-vlm", "-o", str(tmp_path / "v")])
    assert (args.calib_samples, args.eval_samples, args.seed) == (16, 32, 0)
    assert (args.prefix_tokens, args.suffix_tokens) == (cv.DEFAULT_PREFIX_TOKENS, cv.DEFAULT_SUFFIX_TOKENS)
    args = parser.parse_args(["export", "tiny", "qwen2vl", "-o", str(tmp_path / "q")])
    assert args.arch == "qwen2vl"
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "composed-vlm", "-o", str(tmp_path / "v"), "--calib-samples", "0"])


def test_tiny_qwen2vl_is_not_in_the_generic_harness():
    from edgeq.models.tiny import TINY_ARCHS

    assert "qwen2vl" not in TINY_ARCHS


# ---------------------------------------------------------------------------------------------
# Vision side pieces (fast: no language model)
# ---------------------------------------------------------------------------------------------


def test_image_splits_are_disjoint_and_load_offline():
    assert not set(cv.CALIB_IMAGES) & set(cv.EVAL_IMAGES)
    for name in cv.CALIB_IMAGES + cv.EVAL_IMAGES:
        image = vision.load_image(name)
        assert image.ndim == 3 and image.shape[2] == 3 and image.dtype == np.float32
        assert 0.0 <= image.min() and image.max() <= 1.0 and image.std() > 0.01, name


def test_crops_round_robin_then_seeded_augmentation():
    shapes = {"a": (100, 200), "b": (300, 300)}
    crops = vision.sample_crops(("a", "b"), shapes, 6, np.random.default_rng(3))
    assert [c.image for c in crops] == ["a", "b"] * 3
    assert crops[0] == vision.Crop("a", 0, 0, 100, 200, False) and crops[1] == vision.Crop("b", 0, 0, 300, 300, False)
    for c in crops[2:]:
        h, w = shapes[c.image]
        assert 0 <= c.top and c.top + c.height <= h and 0 <= c.left and c.left + c.width <= w
    assert crops == vision.sample_crops(("a", "b"), shapes, 6, np.random.default_rng(3))


def test_projector_is_seeded_and_unit_gain():
    a, b = cv.projector_matrix(0), cv.projector_matrix(1)
    assert a.shape == (vision.FEATURE_CHANNELS, 576)
    np.testing.assert_array_equal(a, cv.projector_matrix(0))
    assert not np.allclose(a, b)
    assert abs(a.var() * vision.FEATURE_CHANNELS - 1.0) < 0.02


def test_craft_backbone_gives_196_visual_tokens():
    layers = vision.load_vgg_backbone()
    assert sum(layer[0] == "conv" for layer in layers) == 12 and sum(layer[0] == "pool" for layer in layers) == 4
    assert [layer[-1] for layer in layers if layer[0] == "conv"][-1] is False  # slice4 ends before ReLU
    image = vision.render_crop(vision.Crop("text", 0, 0, 172, 448, False), vision.load_image("text"))
    feats = vision.vgg_features(layers, image[None])
    assert feats.shape == (1, vision.GRID, vision.GRID, vision.FEATURE_CHANNELS) and vision.GRID * vision.GRID == vision.VISUAL_TOKENS
    assert np.isfinite(feats).all() and (feats < 0).any() and feats.std() > 0.05


# ---------------------------------------------------------------------------------------------
# The composed SmolLM2 VLM (slow)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_composed_vlm_interface_and_files(composed_vlm_dir):
    names = {p.name for p in composed_vlm_dir.iterdir()}
    assert {"model.onnx", "model.onnx.data", "config.json", "tokenizer.json", "calib.npz", "eval.npz",
            "calib_meta.npz", "eval_meta.npz", "samples.json", "composed.json"} <= names
    model = onnx.load(str(composed_vlm_dir / "model.onnx"), load_external_data=False)
    inputs = {i.name: i for i in model.graph.input}
    assert list(inputs) == list(ee.MODEL_INPUTS)
    assert _dims(inputs["inputs_embeds"]) == ["batch_size", "sequence_length", 576]
    assert _dims(inputs["position_ids"]) == ["batch_size", "sequence_length"]
    assert _dims(inputs["visual_start"]) == ["batch_size"]
    assert [o.name for o in model.graph.output] == ["logits"]
    assert _dims(model.graph.output[0]) == ["batch_size", "sequence_length", 49152]
    assert sum(n.op_type == "Softmax" for n in model.graph.node) == 30


@pytest.mark.slow
def test_composed_vlm_npz_layout(composed_vlm_dir):
    from edgeq.graph import ir
    from edgeq.textdata import load_npz_samples

    manifest = json.loads((composed_vlm_dir / "composed.json").read_text())
    layout = manifest["layout"]
    seq = layout["seq_len"]
    assert seq == layout["prefix"] + 196 + layout["suffix"]
    specs = ir.input_specs(ir.load_model(composed_vlm_dir / "model.onnx", load_external=False))
    for split, count in manifest["samples"].items():
        inputs, meta = cv.load_split(composed_vlm_dir, split)
        assert list(inputs) == list(ee.MODEL_INPUTS)
        assert inputs["inputs_embeds"].shape == (count, seq, 576) and inputs["inputs_embeds"].dtype == np.float32
        for name in ("attention_mask", "position_ids"):
            assert inputs[name].shape == (count, seq) and inputs[name].dtype == np.int64
        np.testing.assert_array_equal(inputs["visual_start"], layout["prefix"])
        np.testing.assert_array_equal(inputs["visual_len"], 196)
        assert meta["text_ids"].shape == meta["is_visual"].shape == (count, seq)
        assert (meta["text_ids"] == -1).sum() == meta["is_visual"].sum() == count * 196
        assert (meta["text_ids"][~meta["is_visual"]] >= 0).all()
        assert meta["is_visual"][:, layout["prefix"]:layout["prefix"] + 196].all()
        samples = load_npz_samples(composed_vlm_dir / f"{split}.npz", specs)  # what --calib/--npz read
        assert len(samples) == count and samples[0]["inputs_embeds"].shape == (1, seq, 576)
    stats = manifest["token_stats"]["calib"]
    ratio = stats["visual"]["rms"] / stats["text"]["rms"]
    assert abs(ratio - manifest["projector"]["visual_to_text_rms_target"]) < 1e-3


@pytest.mark.slow
def test_composed_vlm_images_are_disjoint(composed_vlm_dir):
    manifest = json.loads((composed_vlm_dir / "composed.json").read_text())
    calib, evaluation = set(manifest["images"]["calib"]), set(manifest["images"]["eval"])
    assert calib and evaluation and not calib & evaluation
    records = json.loads((composed_vlm_dir / "samples.json").read_text())
    for split, allowed in (("calib", calib), ("eval", evaluation)):
        mine = [r for r in records if r["split"] == split]
        assert len(mine) == manifest["samples"][split]
        assert {r["image"] for r in mine} == allowed  # every image used, none from the other split
        assert {r["text_file"] for r in mine} == {cv.SPLIT_TEXT[split]}
        _, meta = cv.load_split(composed_vlm_dir, split)
        np.testing.assert_array_equal(meta["image_index"], [manifest["images"][split].index(r["image"]) for r in mine])


@pytest.mark.slow
def test_composed_vlm_vision_onnx_gives_the_eval_visual_tokens(composed_vlm_dir):
    """vision.onnx on eval_pixels.npz (the rendered crops) gives eval.npz's visual spans."""
    from edgeq.evaluate.vqa import visual_tokens
    from edgeq.runtime.ort_session import open_session

    inputs, _ = cv.load_split(composed_vlm_dir, "eval")
    with np.load(composed_vlm_dir / cv.EVAL_PIXELS_FILE) as npz:
        pixels = npz["pixels"]
    assert pixels.shape == (len(inputs["inputs_embeds"]), 224, 224, 3) and pixels.dtype == np.float32
    session = open_session(composed_vlm_dir / "vision.onnx")
    assert session.get_inputs()[0].shape[1:] == [224, 224, 3]
    got = visual_tokens(session, pixels[:4])
    start, length = int(inputs["visual_start"][0]), int(inputs["visual_len"][0])
    want = inputs["inputs_embeds"][:4, start:start + length]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.slow
def test_composed_vlm_onnx_matches_torch(composed_vlm_dir):
    import torch

    inputs, meta = cv.load_split(composed_vlm_dir, "eval")
    feeds = {k: v[:2] for k, v in inputs.items()}
    onnx_logits = _run(ee.ort_session(composed_vlm_dir / "model.onnx"), feeds)
    model = cv.load_language_model()
    with torch.no_grad():
        torch_logits = model(**{k: torch.from_numpy(feeds[k]) for k in ee.EMBED_INPUTS}, use_cache=False).logits.numpy()
    agree = onnx_logits.argmax(-1) == torch_logits.argmax(-1)
    assert agree.mean() >= 0.99, agree.mean()
    assert np.abs(onnx_logits - torch_logits).max() < 1e-2
    sanity = json.loads((composed_vlm_dir / "composed.json").read_text())["sanity"]
    assert sanity["onnx_vs_torch_top1_all_positions"] >= 0.99


@pytest.mark.slow
def test_composed_vlm_variable_span_batch_matches_unpadded(composed_vlm_dir):
    feeds, extra = cv.variable_span_batch(composed_vlm_dir)
    assert len(set(feeds["visual_start"].tolist())) == 3 and extra["pad_len"].max() > 0
    session = ee.ort_session(composed_vlm_dir / "model.onnx")
    batch = _run(session, feeds)
    for r, pad in enumerate(extra["pad_len"]):
        single = {k: (v[r:r + 1, pad:] if v.ndim > 1 else v[r:r + 1]) for k, v in feeds.items()}
        single["visual_start"] = single["visual_start"] - pad
        alone = _run(session, single)[0]
        assert np.abs(batch[r, pad:] - alone).max() < 1e-3
        assert (batch[r, pad:].argmax(-1) == alone.argmax(-1)).all()


@pytest.mark.slow
def test_composed_vlm_calib_npz_compiles_with_w8a8(composed_vlm_dir, tmp_path, capsys):
    from edgeq.cli import main

    out = tmp_path / "w8a8"
    code = main(["compile", str(composed_vlm_dir / "model.onnx"), "--recipe", "w8a8", "--calib",
                 str(composed_vlm_dir / "calib.npz"), "--calib-windows", "4", "--no-cache", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["calibration"]["samples"] == 4
    assert report["passes"][0]["summary"]["linears_quantized"] == 211
    compiled = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert [i.name for i in compiled.graph.input] == list(ee.MODEL_INPUTS)  # span inputs survive


def test_composed_vlm_mquant_vlm_recipe(composed_vlm_dir, tmp_path, capsys):
    """The mquant-w8a8-vlm recipe end to end on the real composed model (4 calibration samples):
    AIFS + MSQ with the integer lowering, onnxruntime fuses every linear into an integer kernel,
    and the text after the image keeps the fp32 model's next-token choice almost everywhere."""
    from edgeq.cli import main
    from edgeq.evaluate.fidelity import Fidelity

    out = tmp_path / "vlm"
    code = main(["compile", str(composed_vlm_dir / "model.onnx"), "--recipe", "mquant-w8a8-vlm", "--calib",
                 str(composed_vlm_dir / "calib.npz"), "--calib-windows", "4", "--no-cache", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    msq = next(p for p in report["passes"] if p["name"] == "msq")["summary"]
    assert msq["layout"].startswith("prefix") and msq["lowering"] == "integer"
    assert msq["linears_quantized"] >= 211  # + the massive-split GEMV branches msq quantizes
    inputs, _ = cv.load_split(composed_vlm_dir, "eval")
    feeds = {k: v[:2] for k, v in inputs.items()}
    after = np.arange(feeds["attention_mask"].shape[1])[None] >= (feeds["visual_start"] + feeds["visual_len"])[:, None]
    fid = Fidelity()
    fid.update(cv.ort_session(composed_vlm_dir / "model.onnx").run(None, feeds)[0],
               cv.ort_session(out / "model.onnx").run(None, feeds)[0], after)
    assert fid.positions == int(after.sum())
    assert fid.top1 > 0.8 and fid.mean_kl < 0.2, fid.as_dict()
