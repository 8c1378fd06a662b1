"""Decoder graphs with a KV cache (``edgeq export ... --with-past``) and the greedy-decoding
harness (``edgeq.evaluate.generate``): the cached graph must give, at every prefill and decode
step, the logits the no-cache graph gives for the same prefix, and greedy decoding with the cache
must reproduce no-cache greedy decoding token for token.

Fast tests use tiny random models (structure only); the slow one exports the real SmolLM2.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgeq.cli import main
from edgeq.errors import UserInputError
from edgeq.evaluate.generate import greedy_decode
from edgeq.files.vlm_folder import EMBED_TABLE_FILE
from edgeq.models import kv_export as kv
from edgeq.models.embeds_export import MODEL_INPUTS, export_embeds_lm, ort_session

ATOL = RTOL = 1e-5  # fp32, onnxruntime graph optimizations off
TINY_LAYERS, TINY_KV_HEADS, TINY_HEAD_DIM, TINY_VOCAB, TINY_HIDDEN = 2, 2, 16, 256, 64
TINY_HEADS_BY_ARCH = {"llama": TINY_KV_HEADS, "qwen2": TINY_KV_HEADS, "gpt2": 4}  # gpt2 has no GQA


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _session(path: Path):
    return ort_session(path, threads=2)


@pytest.fixture(scope="module")
def tiny_past(tmp_path_factory) -> dict[str, Path]:
    """arch -> with-past ``model.onnx`` of the tiny model (seed 0, the weights of ``tiny_models``);
    llama goes through the CLI."""
    root = tmp_path_factory.mktemp("kv")
    out = {}
    for arch in kv.TINY_WITH_PAST:
        folder = root / arch
        if arch == "llama":
            assert main(["export", "tiny", arch, "--with-past", "-o", str(folder)]) == 0
        else:
            kv.export_tiny_with_past(arch, folder, seed=0)
        out[arch] = folder / "model.onnx"
    return out


@pytest.fixture(scope="module")
def tiny_embeds(tmp_path_factory) -> dict:
    """Tiny llama (eager attention) exported on embeddings twice: no cache and with past."""
    from edgeq.models.tiny import build_tiny

    model = build_tiny("llama", seed=0)
    model.set_attn_implementation("eager")
    root = tmp_path_factory.mktemp("kv-embeds")
    (root / "past").mkdir()
    (root / "nocache").mkdir()
    kv.export_embeds_lm_with_past(model.model, model.lm_head, root / "past")
    export_embeds_lm(model.model, model.lm_head, root / "nocache", TINY_HIDDEN)
    table = model.get_input_embeddings().weight.detach().numpy().astype(np.float32)
    return {"past": root / "past" / "model.onnx", "nocache": root / "nocache" / "model.onnx", "table": table}


def _empty_past(batch: int, layers=TINY_LAYERS, kv_heads=TINY_KV_HEADS, head_dim=TINY_HEAD_DIM) -> dict:
    return {n: np.zeros((batch, kv_heads, 0, head_dim), np.float32) for n in kv.past_names(layers)}


# ---------------------------------------------------------------------------------------------
# Interfaces
# ---------------------------------------------------------------------------------------------


def test_tiny_with_past_interface(tiny_past):
    model = onnx.load(str(tiny_past["llama"]))
    inputs = {i.name: _dims(i) for i in model.graph.input}
    outputs = {o.name: _dims(o) for o in model.graph.output}
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids", *kv.past_names(TINY_LAYERS)]
    assert list(outputs) == ["logits", *kv.present_names(TINY_LAYERS)]
    assert inputs["attention_mask"] == ["batch_size", kv.TOTAL_AXIS]
    assert inputs["past_key_values.1.value"] == ["batch_size", TINY_KV_HEADS, "past_sequence_length", TINY_HEAD_DIM]
    assert outputs["present.0.key"] == ["batch_size", TINY_KV_HEADS, kv.TOTAL_AXIS, TINY_HEAD_DIM]
    assert outputs["logits"] == ["batch_size", "sequence_length", TINY_VOCAB]
    assert (tiny_past["llama"].parent / "config.json").is_file()


def test_embeds_with_past_interface(tiny_embeds):
    model = onnx.load(str(tiny_embeds["past"]), load_external_data=False)
    inputs = {i.name: i for i in model.graph.input}
    assert list(inputs) == [*MODEL_INPUTS, *kv.past_names(TINY_LAYERS)]
    assert _dims(inputs["inputs_embeds"]) == ["batch_size", "sequence_length", TINY_HIDDEN]
    assert _dims(inputs["visual_start"]) == _dims(inputs["visual_len"]) == ["batch_size"]
    assert _dims(inputs["past_key_values.0.key"]) == ["batch_size", TINY_KV_HEADS, "past_sequence_length", TINY_HEAD_DIM]
    assert [o.name for o in model.graph.output] == ["logits", *kv.present_names(TINY_LAYERS)]
    assert _dims(model.graph.output[1]) == ["batch_size", TINY_KV_HEADS, kv.TOTAL_AXIS, TINY_HEAD_DIM]
    assert {p.key: p.value for p in model.metadata_props}["edgeq.visual_span_inputs"] == "visual_start,visual_len"
    assert (tiny_embeds["past"].parent / "model.onnx.data").is_file()


def test_present_for():
    assert kv.present_for("past_key_values.12.value") == "present.12.value"


# ---------------------------------------------------------------------------------------------
# Cached logits == no-cache logits at every step
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", kv.TINY_WITH_PAST)
def test_cached_logits_match_no_cache_at_every_step(tiny_models, tiny_past, arch):
    """Left-padded batch of 2: prefill 5 tokens, then 4 single-token decode steps."""
    past_sess, ref_sess = _session(tiny_past[arch]), _session(tiny_models[arch])
    rng = np.random.default_rng(1)
    batch, prompt, total = 2, 5, 9
    ids = rng.integers(0, TINY_VOCAB, (batch, total), dtype=np.int64)
    mask = np.ones((batch, total), np.int64)
    mask[1, :2] = 0  # row 1 is left padded
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int64)
    (ref,) = ref_sess.run(["logits"], {"input_ids": ids, "attention_mask": mask, "position_ids": positions})
    names = [o.name for o in past_sess.get_outputs()]
    heads = TINY_HEADS_BY_ARCH[arch]
    feeds = {"input_ids": ids[:, :prompt], "attention_mask": mask[:, :prompt],
             "position_ids": positions[:, :prompt], **_empty_past(batch, kv_heads=heads)}
    end = prompt
    while True:
        out = dict(zip(names, past_sess.run(names, feeds)))
        start = end - feeds["input_ids"].shape[1]
        valid = mask[:, start:end].astype(bool)
        np.testing.assert_allclose(out["logits"][valid], ref[:, start:end][valid], rtol=RTOL, atol=ATOL)
        assert out["present.0.key"].shape == (batch, heads, end, TINY_HEAD_DIM)
        if end == total:
            break
        feeds = {"input_ids": ids[:, end:end + 1], "attention_mask": mask[:, :end + 1],
                 "position_ids": positions[:, end:end + 1],
                 **{n: out[kv.present_for(n)] for n in kv.past_names(TINY_LAYERS)}}
        end += 1



def test_embeds_cached_logits_match_no_cache_at_every_step(tiny_embeds):
    past_sess, ref_sess = _session(tiny_embeds["past"]), _session(tiny_embeds["nocache"])
    rng = np.random.default_rng(2)
    total, prompt = 10, 6
    embeds = rng.standard_normal((1, total, TINY_HIDDEN)).astype(np.float32)
    span = {"visual_start": np.array([1]), "visual_len": np.array([3])}
    (ref,) = ref_sess.run(["logits"], {"inputs_embeds": embeds, "attention_mask": np.ones((1, total), np.int64),
                                       "position_ids": np.arange(total)[None], **span})
    names = [o.name for o in past_sess.get_outputs()]
    feeds = {"inputs_embeds": embeds[:, :prompt], "attention_mask": np.ones((1, prompt), np.int64),
             "position_ids": np.arange(prompt)[None], **span, **_empty_past(1)}
    out = dict(zip(names, past_sess.run(names, feeds)))
    np.testing.assert_allclose(out["logits"], ref[:, :prompt], rtol=RTOL, atol=ATOL)
    for t in range(prompt, total):
        feeds = {"inputs_embeds": embeds[:, t:t + 1], "attention_mask": np.ones((1, t + 1), np.int64),
                 "position_ids": np.array([[t]]), **span,
                 **{n: out[kv.present_for(n)] for n in kv.past_names(TINY_LAYERS)}}
        out = dict(zip(names, past_sess.run(names, feeds)))
        np.testing.assert_allclose(out["logits"][:, 0], ref[:, t], rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# greedy_decode
# ---------------------------------------------------------------------------------------------


def test_greedy_decode_with_cache_reproduces_no_cache(tiny_models, tiny_past):
    prompt = {"input_ids": np.random.default_rng(3).integers(0, TINY_VOCAB, (1, 7), dtype=np.int64)}
    cached = greedy_decode(_session(tiny_past["llama"]), prompt, steps=12)
    reference = greedy_decode(_session(tiny_models["llama"]), prompt, steps=12)
    assert cached.tokens.shape == (12,) and cached.tokens.dtype == np.int64
    assert cached.logits.shape == (12, TINY_VOCAB) and cached.logits.dtype == np.float32
    np.testing.assert_array_equal(cached.tokens, reference.tokens)
    np.testing.assert_allclose(cached.logits, reference.logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(cached.tokens, cached.logits.argmax(-1))


def test_greedy_decode_embeddings_graph(tiny_embeds):
    table = tiny_embeds["table"]
    ids = np.random.default_rng(4).integers(0, TINY_VOCAB, 6)
    prompt = {"inputs_embeds": table[ids][None], "visual_start": np.array([2]), "visual_len": np.array([2])}
    cached = greedy_decode(_session(tiny_embeds["past"]), prompt, steps=10, embed_table=table)
    reference = greedy_decode(_session(tiny_embeds["nocache"]), prompt, steps=10, embed_table=table)
    np.testing.assert_array_equal(cached.tokens, reference.tokens)
    np.testing.assert_allclose(cached.logits, reference.logits, rtol=RTOL, atol=ATOL)


def test_greedy_decode_force_tokens(tiny_past):
    """Teacher forcing: the logits after feeding given tokens are those of free decoding when the
    given tokens are the argmax ones, and differ otherwise."""
    session = _session(tiny_past["llama"])
    prompt = {"input_ids": np.arange(5, dtype=np.int64)[None]}
    free = greedy_decode(session, prompt, steps=6)
    forced = greedy_decode(session, prompt, steps=6, force_tokens=free.tokens)
    np.testing.assert_array_equal(forced.tokens, free.tokens)
    other = greedy_decode(session, prompt, steps=6, force_tokens=(free.tokens + 1) % TINY_VOCAB)
    assert other.tokens[0] == free.tokens[0]
    assert not np.allclose(other.logits[1:], free.logits[1:])


def test_greedy_decode_rejects_bad_feeds(tiny_past, tiny_embeds):
    tokens = _session(tiny_past["llama"])
    with pytest.raises(UserInputError, match="batch 1"):
        greedy_decode(tokens, {"input_ids": np.zeros((2, 3), np.int64)}, steps=2)
    with pytest.raises(UserInputError, match="no input_ids"):
        greedy_decode(tokens, {"inputs_embeds": np.zeros((1, 3, TINY_HIDDEN), np.float32)}, steps=2)
    with pytest.raises(UserInputError, match="steps"):
        greedy_decode(tokens, {"input_ids": np.zeros((1, 3), np.int64)}, steps=0)
    with pytest.raises(UserInputError, match="does not take"):
        greedy_decode(tokens, {"input_ids": np.zeros((1, 3), np.int64), "pixel_values": np.zeros(1)}, steps=2)
    embeds = _session(tiny_embeds["past"])
    prompt = {"inputs_embeds": np.zeros((1, 3, TINY_HIDDEN), np.float32),
              "visual_start": np.array([0]), "visual_len": np.array([1])}
    with pytest.raises(UserInputError, match="embed_table"):
        greedy_decode(embeds, prompt, steps=2)
    with pytest.raises(UserInputError, match="visual_len"):
        greedy_decode(embeds, {"inputs_embeds": prompt["inputs_embeds"], "visual_start": np.array([0])},
                      steps=2, embed_table=tiny_embeds["table"])


# ---------------------------------------------------------------------------------------------
# CLI errors
# ---------------------------------------------------------------------------------------------


def _assert_one_line_exit_2(capsys, tmp_path, code, needle):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert needle in err, err
    assert not list(tmp_path.iterdir()), "nothing may be written"


@pytest.mark.parametrize("arch", ["bert", "vit", "qwen2vl"])
def test_with_past_on_a_model_without_decoder_exits_2(tmp_path, capsys, arch):
    code = main(["export", "tiny", arch, "--with-past", "-o", str(tmp_path / "out")])
    _assert_one_line_exit_2(capsys, tmp_path, code, "causal decoder")


def test_hf_source_has_no_with_past_flag(tmp_path, capsys):
    """``export hf`` takes ``--task text-generation-with-past`` instead: the flag is a usage error."""
    with pytest.raises(SystemExit) as exc:
        main(["export", "hf", str(tmp_path / "nowhere"), "--with-past", "-o", str(tmp_path / "out")])
    _assert_one_line_exit_2(capsys, tmp_path, exc.value.code, "--with-past")


# ---------------------------------------------------------------------------------------------
# The real SmolLM2 (slow)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_with_past_matches_no_cache(smollm2_dir, smollm2_past_dir):
    """32 greedy tokens with the cache are the no-cache graph's, logits within fp32 tolerance."""
    from transformers import AutoTokenizer

    model = onnx.load(str(smollm2_past_dir / "model.onnx"), load_external_data=False)
    config = json.loads((smollm2_past_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    inputs = {i.name: _dims(i) for i in model.graph.input}
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids", *kv.past_names(layers)]
    assert inputs["past_key_values.0.key"] == ["batch_size", 3, "past_sequence_length", 64]
    assert [o.name for o in model.graph.output] == ["logits", *kv.present_names(layers)]
    del model

    tokenizer = AutoTokenizer.from_pretrained(smollm2_past_dir)
    prompt = {"input_ids": np.array([tokenizer("The capital of France is")["input_ids"]], np.int64)}
    cached = greedy_decode(_session(smollm2_past_dir / "model.onnx"), prompt, steps=32)
    reference = greedy_decode(_session(smollm2_dir / "model.onnx"), prompt, steps=32)
    np.testing.assert_array_equal(cached.tokens, reference.tokens)
    np.testing.assert_allclose(cached.logits, reference.logits, rtol=1e-4, atol=1e-3)
    assert tokenizer.decode(cached.tokens).startswith(" Paris")


@pytest.mark.slow
def test_composed_vlm_with_past_matches_no_cache(composed_vlm_dir, composed_vlm_past_dir):
    """The composed VLM on embeddings: same samples, the embedding table beside the graph, and 32
    greedy tokens after an eval sample with the cache equal to those of the no-cache graph."""
    folder = composed_vlm_past_dir
    manifest = json.loads((folder / "composed.json").read_text())
    layers = manifest["onnx"]["cache"]["layers"]
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    assert [i.name for i in model.graph.input] == [*MODEL_INPUTS, *kv.past_names(layers)]
    assert [o.name for o in model.graph.output] == ["logits", *kv.present_names(layers)]
    del model
    assert manifest["with_past"]["prefill_vs_no_cache_max_abs_logit_diff"] < 1e-3
    table = np.load(folder / EMBED_TABLE_FILE)
    assert table.shape == (49152, 576) and table.dtype == np.float32
    for split in ("calib", "eval"):
        ours, theirs = np.load(folder / f"{split}.npz"), np.load(composed_vlm_dir / f"{split}.npz")
        assert sorted(ours) == sorted(theirs) == sorted(MODEL_INPUTS)
        assert all(np.array_equal(ours[k], theirs[k]) for k in ours)

    samples = np.load(folder / "eval.npz")
    prompt = {k: v[:1] for k, v in samples.items()}
    cached = greedy_decode(_session(folder / "model.onnx"), prompt, steps=32, embed_table=table)
    reference = greedy_decode(_session(composed_vlm_dir / "model.onnx"), prompt, steps=32, embed_table=table)
    np.testing.assert_array_equal(cached.tokens, reference.tokens)
    np.testing.assert_allclose(cached.logits, reference.logits, rtol=1e-4, atol=1e-3)
