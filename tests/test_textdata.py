"""Token windows, model feeds and .npz samples (edgeq.textdata), on a tiny WordLevel tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from edgeq.errors import UserInputError
from edgeq.textdata import (
    feeds_for_windows,
    load_npz_samples,
    random_feeds,
    token_windows,
    tokenize_file,
    window_convention,
)

tokenizers = pytest.importorskip("tokenizers")

VOCAB = {"[UNK]": 0, "<s>": 1, **{f"w{i}": i + 2 for i in range(10)}}  # w{i} -> id i + 2


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path / "cache"))


def make_tokenizer(folder, bos: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def write_text(path, n_words: int, lines_of: int = 7):
    words = [f"w{i % 10}" for i in range(n_words)]
    lines = [" ".join(words[i : i + lines_of]) for i in range(0, n_words, lines_of)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, np.array([i % 10 + 2 for i in range(n_words)], dtype=np.int64)


def spec(name, type_="tensor(int64)", shape=("batch_size", "sequence_length")):
    return SimpleNamespace(name=name, type=type_, shape=list(shape))


# --- token windows --------------------------------------------------------------------------


def test_windows_are_cut_from_the_start_without_overlap(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    text, ids = write_text(tmp_path / "t.txt", 27)
    got = token_windows(text, tok, seq_len=4)
    assert got.dtype == np.int64
    assert got.shape == (6, 4)  # 27 // 4, partial last window dropped
    np.testing.assert_array_equal(got, ids[:24].reshape(6, 4))


def test_windows_and_offset_select_a_range(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    text, ids = write_text(tmp_path / "t.txt", 27)
    got = token_windows(text, tok, seq_len=4, windows=2, offset=3)
    np.testing.assert_array_equal(got, ids[12:20].reshape(2, 4))
    # windows=None with an offset takes all the rest
    np.testing.assert_array_equal(token_windows(text, tok, seq_len=4, offset=4), ids[16:24].reshape(2, 4))


def test_special_tokens_are_added_once_for_the_whole_file(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", bos=True)
    text, ids = write_text(tmp_path / "t.txt", 12)
    with_bos = token_windows(text, tok, seq_len=4)
    np.testing.assert_array_equal(with_bos.reshape(-1), np.concatenate([[1], ids])[:12])
    plain = token_windows(text, tok, seq_len=4, special_tokens=False)
    np.testing.assert_array_equal(plain.reshape(-1), ids)


@pytest.mark.parametrize("settings,convention", [
    ({"add_bos_token": True, "bos_token": "<s>"}, "bos-each-window"),
    ({"add_bos_token": True, "bos_token": {"content": "<s>", "special": True}}, "bos-each-window"),
    ({"add_bos_token": False, "bos_token": "<s>"}, "one-stream"),  # SmolLM2's export: its GGUF says false
    ({"bos_token": "<s>"}, "one-stream"),
    ({"add_bos_token": True, "bos_token": "<nope>"}, "one-stream"),  # a BOS the vocabulary lacks
], ids=["string", "added-token-dict", "false", "absent", "unknown-token"])
def test_bos_leads_every_window_where_the_tokenizer_says(tmp_path, settings, convention):
    import json

    tok = make_tokenizer(tmp_path / "tok", bos=True)
    (tok / "tokenizer_config.json").write_text(json.dumps(settings))
    text, ids = write_text(tmp_path / "t.txt", 14)
    got = token_windows(text, tok, seq_len=4)
    assert window_convention(tok) == convention and window_convention(tok, special_tokens=False) == "raw-stream"
    if convention == "bos-each-window":  # BOS + 3 text tokens per window, the text never lost or repeated
        assert got.shape == (4, 4) and (got[:, 0] == 1).all()
        np.testing.assert_array_equal(got[:, 1:].reshape(-1), ids[:12])
        np.testing.assert_array_equal(token_windows(text, tok, seq_len=4, windows=1, offset=2)[0, 1:], ids[6:9])
    else:
        np.testing.assert_array_equal(got.reshape(-1), np.concatenate([[1], ids])[:12])
    np.testing.assert_array_equal(token_windows(text, tok, seq_len=4, special_tokens=False).reshape(-1), ids[:12])


def test_tokenizer_file_path_is_accepted(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    text, ids = write_text(tmp_path / "t.txt", 8)
    np.testing.assert_array_equal(token_windows(text, tok / "tokenizer.json", seq_len=8)[0], ids)


def test_cache_is_keyed_by_text_and_tokenizer(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    text, ids = write_text(tmp_path / "t.txt", 10)
    np.testing.assert_array_equal(tokenize_file(text, tok), ids)
    cached = list((tmp_path / "cache" / "tokens").glob("*.npy"))
    assert len(cached) == 1
    np.testing.assert_array_equal(tokenize_file(text, tok), ids)  # from the cache
    text.write_text("w9 w9 w9\n", encoding="utf-8")  # new content -> new key
    np.testing.assert_array_equal(tokenize_file(text, tok), [11, 11, 11])
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 2
    cached[0].write_bytes(b"garbage")  # a broken entry is recomputed
    write_text(text, 10)  # back to the first content, whose entry is now garbage
    np.testing.assert_array_equal(tokenize_file(text, tok), ids)


def test_cache_can_be_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEQ_CACHE_DIR", "")
    tok = make_tokenizer(tmp_path / "tok")
    text, ids = write_text(tmp_path / "t.txt", 10)
    np.testing.assert_array_equal(tokenize_file(text, tok), ids)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "n_words, kwargs, message",
    [
        (3, {"seq_len": 4}, "shorter than one window"),
        (12, {"seq_len": 4, "offset": 3}, "offset 3 is beyond the 3 windows"),
        (12, {"seq_len": 4, "windows": 4}, "has only 3 windows"),
        (12, {"seq_len": 1}, "seq_len must be at least 2"),
        (12, {"seq_len": 4, "windows": 0}, "windows must be >= 1"),
        (12, {"seq_len": 4, "offset": -1}, "offset must be >= 0"),
    ],
)
def test_window_errors(tmp_path, n_words, kwargs, message):
    tok = make_tokenizer(tmp_path / "tok")
    text, _ = write_text(tmp_path / "t.txt", n_words)
    with pytest.raises(UserInputError, match=message):
        token_windows(text, tok, **kwargs)


def test_missing_and_empty_inputs(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    with pytest.raises(UserInputError, match="text file not found"):
        token_windows(tmp_path / "nope.txt", tok, seq_len=4)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n", encoding="utf-8")
    with pytest.raises(UserInputError, match="text file is empty"):
        token_windows(empty, tok, seq_len=4)
    text, _ = write_text(tmp_path / "t.txt", 8)
    with pytest.raises(UserInputError, match="no tokenizer.json"):
        token_windows(text, tmp_path, seq_len=4)
    with pytest.raises(UserInputError, match="tokenizer folder not found"):
        token_windows(text, tmp_path / "missing", seq_len=4)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe w1")
    with pytest.raises(UserInputError, match="not UTF-8"):
        token_windows(bad, tok, seq_len=2)


# --- feeds for windows ----------------------------------------------------------------------


def test_feeds_match_inputs_by_name_and_dtype():
    ids = np.array([[5, 6, 7], [8, 9, 10]], dtype=np.int64)
    specs = [spec("position_ids", "tensor(int32)"), spec("input_ids"), spec("attention_mask")]
    feeds = feeds_for_windows(specs, ids)
    assert set(feeds) == {"input_ids", "attention_mask", "position_ids"}
    np.testing.assert_array_equal(feeds["input_ids"], ids)
    assert feeds["input_ids"].dtype == np.int64
    np.testing.assert_array_equal(feeds["attention_mask"], np.ones((2, 3)))
    assert feeds["attention_mask"].dtype == np.int64
    np.testing.assert_array_equal(feeds["position_ids"], [[0, 1, 2], [0, 1, 2]])
    assert feeds["position_ids"].dtype == np.int32


def test_kv_cache_inputs_start_empty_for_calibration():
    """A decoder with a KV cache calibrates on the prefill: its past inputs get past length 0."""
    ids = np.zeros((2, 4), dtype=np.int64)
    past = spec("past_key_values.0.key", "tensor(float)", ("batch_size", 3, "past_sequence_length", 64))
    feeds = feeds_for_windows([spec("input_ids"), past], ids)
    assert feeds["past_key_values.0.key"].shape == (2, 3, 0, 64)
    assert feeds["past_key_values.0.key"].dtype == np.float32


def test_feeds_reject_other_inputs_and_bad_shapes():
    ids = np.zeros((1, 4), dtype=np.int64)
    with pytest.raises(UserInputError, match=r"pixel_values.*\.npz"):
        feeds_for_windows([spec("input_ids"), spec("pixel_values", "tensor(float)")], ids)
    with pytest.raises(UserInputError, match="expected \\[batch, kv_heads, past, head_dim\\]"):
        feeds_for_windows([spec("input_ids"), spec("past_key_values.0.key", "tensor(float)")], ids)
    with pytest.raises(UserInputError, match="no 'input_ids'"):
        feeds_for_windows([spec("attention_mask")], ids)
    with pytest.raises(UserInputError, match="static dim 128 on axis 1"):
        feeds_for_windows([spec("input_ids", shape=(1, 128))], ids)
    with pytest.raises(UserInputError, match="expected int64 or int32"):
        feeds_for_windows([spec("input_ids", "tensor(float)")], ids)


# --- npz samples ----------------------------------------------------------------------------

NPZ_SPECS = [spec("input_ids"), spec("pixel", "tensor(float)", ("batch", 3, 2))]


def test_npz_stacked_and_batch_forms(tmp_path):
    path = tmp_path / "s.npz"
    ids = np.arange(3 * 1 * 5, dtype=np.int64).reshape(3, 1, 5)  # [samples, batch, seq]
    pixel = np.random.default_rng(0).standard_normal((3, 3, 2)).astype(np.float32)  # batch = sample axis
    np.savez(path, input_ids=ids, pixel=pixel)
    samples = load_npz_samples(path, NPZ_SPECS)
    assert len(samples) == 3
    for i, s in enumerate(samples):
        np.testing.assert_array_equal(s["input_ids"], ids[i])
        np.testing.assert_array_equal(s["pixel"], pixel[i : i + 1])
        assert s["pixel"].shape == (1, 3, 2)


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"input_ids": np.zeros((1, 1, 5), np.int64)}, "missing input.*pixel"),
        (
            {"input_ids": np.zeros((1, 1, 5), np.int64), "pixel": np.zeros((1, 3, 2), np.float32), "x": np.zeros(1)},
            "unknown key.*x",
        ),
        ({"input_ids": np.zeros((1, 1, 5), np.int32), "pixel": np.zeros((1, 3, 2), np.float32)}, "'input_ids' has dtype int32"),
        ({"input_ids": np.zeros((1, 1, 5), np.int64), "pixel": np.zeros((1, 4, 2), np.float32)}, "'pixel' sample shape.*axis 1"),
        ({"input_ids": np.zeros((5,), np.int64), "pixel": np.zeros((1, 3, 2), np.float32)}, "'input_ids' has rank 1"),
        (
            {"input_ids": np.zeros((2, 1, 5), np.int64), "pixel": np.zeros((3, 3, 2), np.float32)},
            "disagree on the number of samples",
        ),
    ],
)
def test_npz_validation_errors(tmp_path, arrays, message):
    path = tmp_path / "s.npz"
    np.savez(path, **arrays)
    with pytest.raises(UserInputError, match=message):
        load_npz_samples(path, NPZ_SPECS)


def test_npz_symbolic_dims_must_agree(tmp_path):
    specs = [spec("input_ids"), spec("attention_mask")]
    path = tmp_path / "s.npz"
    np.savez(path, input_ids=np.zeros((2, 1, 5), np.int64), attention_mask=np.ones((2, 1, 6), np.int64))
    with pytest.raises(UserInputError, match="'sequence_length' is 5 in 'input_ids' but 6 in 'attention_mask'"):
        load_npz_samples(path, specs)


def test_npz_not_found_or_not_npz(tmp_path):
    with pytest.raises(UserInputError, match=r"\.npz of model inputs not found"):
        load_npz_samples(tmp_path / "x.npz", NPZ_SPECS)
    npy = tmp_path / "a.npy"
    np.save(npy, np.zeros(3))
    with pytest.raises(UserInputError, match="single .npy array"):
        load_npz_samples(npy, NPZ_SPECS)
    junk = tmp_path / "j.npz"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(UserInputError, match="cannot read"):
        load_npz_samples(junk, NPZ_SPECS)


def test_random_feeds_follow_specs_and_seed():
    specs = [spec("input_ids"), spec("attention_mask"), spec("position_ids"), spec("x", "tensor(float)", ("b", 3))]
    a = random_feeds(specs, num_samples=2, seq_len=6, seed=3)
    b = random_feeds(specs, num_samples=2, seq_len=6, seed=3)
    assert len(a) == 2
    for s, t in zip(a, b):
        for k in s:
            np.testing.assert_array_equal(s[k], t[k])
    s = a[0]
    assert s["input_ids"].shape == (1, 6) and s["input_ids"].dtype == np.int64
    assert s["input_ids"].min() >= 0 and s["input_ids"].max() < 100
    np.testing.assert_array_equal(s["attention_mask"], np.ones((1, 6)))
    np.testing.assert_array_equal(s["position_ids"], [np.arange(6)])
    assert s["x"].shape == (1, 3) and s["x"].dtype == np.float32
    assert not np.array_equal(a[0]["input_ids"], a[1]["input_ids"])
