"""``edgeq generate`` and the generation runtime (``edgeq.generation``) on the tiny random llama.

The three decoder kinds must agree: the dynamic graph with a KV cache, the one without (every step
re-runs the sequence) and a static pair. No static pair exists in these tests' reach yet (``edgeq
compile --static`` writes it), so ``FakeStaticSession`` stands in for one: it obeys the static-pair
contract of ``edgeq.generation.decoders`` on the outside (fixed shapes, metadata, cache slots fed
in and only the new entries out) and runs the with-past graph inside, asserting on every run that
the host fed the masks, positions and cache the contract asks for. Its padded outputs are garbage
on purpose, so a host that copies padding into its cache or reads padded logits fails.

The tokenizer is a byte-level BPE without merges: ``<unk>``=0, ``<s>``=1 (added in front, like
SmolLM2's ``<|im_start|>``), ``</s>``=2 (the config's eos), then the bytes, within the model's 256 ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgeq.cli import main
from edgeq.errors import UserInputError
from edgeq.evaluate.ppl import perplexity
from edgeq.generation import generate
from edgeq.generation import decoders as decmod
from edgeq.generation.decoders import PastDecoder, RecomputeDecoder, StaticPairDecoder, open_decoder
from edgeq.generation.sampling import next_token, nucleus_probs
from edgeq.generation.teacher_forced import teacher_forced_nll, window_logits
from edgeq.runtime.nll import window_nll
from edgeq.runtime.ort_session import open_session

pytest.importorskip("tokenizers")

PROMPT = "The quick brown fox jumps over the lazy dog, twice."
TEXT = " ".join(["Edge devices run quantized language models with static shapes and a host-side cache."] * 40)


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path / "cache"))


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    chars = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in "ýþÿ"]  # bytes 0xFD-0xFF: never in UTF-8
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(sorted(chars))}}
    assert len(vocab) == 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (folder / "chat_template.jinja").write_text(
        "{% for message in messages %}{{ bos_token + message['role'] + '\n' + message['content'] + eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}{{ bos_token + 'assistant\n' }}{% endif %}"
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Folders of the tiny llama exported with and without KV cache (same weights), with a tokenizer."""
    from edgeq.models.kv_export import export_tiny_with_past
    from edgeq.models.tiny import export_tiny

    root = tmp_path_factory.mktemp("gen")
    past = export_tiny_with_past("llama", root / "past", seed=0)
    plain = export_tiny("llama", root / "plain", seed=0)
    for folder in (past, plain):
        _write_tokenizer(folder)
    bare = root / "bare"  # a model folder without tokenizer
    bare.mkdir()
    shutil.copy(past / "model.onnx", bare / "model.onnx")
    text = root / "text.txt"
    text.write_text(TEXT)
    return {"past": past, "plain": plain, "bare": bare, "text": text}


# --------------------------------------------------------------------------------------------
# A static pair made of the with-past graph (the contract, checked on every run)
# --------------------------------------------------------------------------------------------


class _Spec:
    def __init__(self, name, shape, type_="tensor(float)"):
        self.name, self.shape, self.type = name, shape, type_


class _Meta:
    def __init__(self, meta):
        self.custom_metadata_map = {decmod.STATIC_KEY: json.dumps(meta)}


class FakeStaticSession:
    """prefill.onnx (``role="prefill"``, W = S) or decode.onnx (W = 1) of a static pair, run by the
    dynamic with-past session ``inner``."""

    def __init__(self, inner, role: str, prefill: int, context: int):
        self.inner = inner
        self.role = role
        self.width = prefill if role == "prefill" else 1
        self.context = context
        specs = inner.get_inputs()
        self.pasts = [s.name for s in specs if s.name.startswith("past_key_values.")]
        first = next(s for s in specs if s.name in self.pasts)
        self.heads, self.head_dim = first.shape[1], first.shape[3]
        self.vocab = next(o for o in inner.get_outputs() if o.name == "logits").shape[2]
        self.meta = {"role": role, "prefill": prefill, "context": context, "layers": len(self.pasts) // 2,
                     "kv_heads": self.heads, "head_dim": self.head_dim, "cache_dtype": "float32"}
        self.runs = 0

    def get_inputs(self):
        w, c = self.width, self.context
        return [_Spec("input_ids", [1, w], "tensor(int64)"), _Spec("attention_mask", [1, c + w], "tensor(int64)"),
                _Spec("position_ids", [1, w], "tensor(int64)"),
                *[_Spec(n, [1, self.heads, c, self.head_dim]) for n in self.pasts]]

    def get_outputs(self):
        return [_Spec("logits", [1, self.width, self.vocab]),
                *[_Spec("present." + n[len("past_key_values."):], [1, self.heads, self.width, self.head_dim])
                  for n in self.pasts]]

    def get_modelmeta(self):
        return _Meta(self.meta)

    def run(self, outputs, feeds):
        self.runs += 1
        w, c = self.width, self.context
        assert feeds["input_ids"].shape == (1, w) and feeds["attention_mask"].shape == (1, c + w)
        mask = feeds["attention_mask"][0]
        pos, n = int(mask[:c].sum()), int(mask[c:].sum())
        assert n >= 1 and mask[:pos].all() and not mask[pos:c].any() and mask[c : c + n].all()
        assert (feeds["position_ids"][0] == pos + np.arange(w)).all()
        assert (feeds["input_ids"][0, n:] == 0).all(), "padding ids must be 0"
        for name in self.pasts:
            cache = feeds[name]
            assert cache.shape == (1, self.heads, c, self.head_dim)
            assert not cache[:, :, pos:].any(), "cache slots past pos must still be zero"
        inner_feeds = {"input_ids": feeds["input_ids"][:, :n], "attention_mask": np.ones((1, pos + n), np.int64),
                       "position_ids": (pos + np.arange(n))[None],
                       **{name: np.ascontiguousarray(feeds[name][:, :, :pos]) for name in self.pasts}}
        names = ["logits"] + ["present." + p[len("past_key_values."):] for p in self.pasts]
        got = dict(zip(names, self.inner.run(names, inner_feeds)))
        out = {}
        logits = np.full((1, w, self.vocab), 1e4, np.float32)  # garbage in the padded rows
        logits[:, :n] = got["logits"]
        out["logits"] = logits
        for name in names[1:]:
            present = np.full((1, self.heads, w, self.head_dim), 7.0, np.float32)
            present[:, :, :n] = got[name][:, :, pos : pos + n]
            out[name] = present
        return [out[name] for name in outputs]


def fake_static(model: Path, prefill: int = 5, context: int = 64, optimize: bool = False) -> StaticPairDecoder:
    inner = open_session(model, optimize=optimize)
    return StaticPairDecoder(FakeStaticSession(inner, "prefill", prefill, context),
                             FakeStaticSession(inner, "decode", prefill, context))


def _run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(["generate", *map(str, argv)])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _gen_json(capsys, *argv) -> dict:
    code, out, err = _run_cli(capsys, *argv, "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def _prompt_ids(folder: Path, text: str = PROMPT) -> list[int]:
    from edgeq.textdata import load_tokenizer

    return load_tokenizer(folder).encode(text).ids


# --------------------------------------------------------------------------------------------
# Errors: one line, exit 2
# --------------------------------------------------------------------------------------------


def _one_line_exit_2(code, err, *needles):
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("edgeq") and "error" in err
    for needle in needles:
        assert needle in err, err


def test_missing_dir_exits_2(capsys, tmp_path):
    code, _, err = _run_cli(capsys, tmp_path / "nope", "--prompt", "hi")
    _one_line_exit_2(code, err, "not found")


def test_missing_tokenizer_exits_2(capsys, tiny):
    code, _, err = _run_cli(capsys, tiny["bare"], "--prompt", "hi")
    _one_line_exit_2(code, err, "tokenizer.json", "--tokenizer")
    code, _, err = _run_cli(capsys, tiny["bare"], "--prompt", "hi", "--tokenizer", tiny["bare"] / "nope")
    _one_line_exit_2(code, err, "not found")


def test_tokenizer_option(capsys, tiny):
    record = _gen_json(capsys, tiny["bare"] / "model.onnx", "--prompt", "hi", "--tokenizer", tiny["past"],
                       "--max-new-tokens", "3", "--ignore-eos")
    assert record["mode"] == "dynamic-with-past" and len(record["tokens"]) == 3


def test_folder_without_graphs_exits_2(capsys, tmp_path, tiny):
    code, _, err = _run_cli(capsys, tmp_path, "--prompt", "hi")
    _one_line_exit_2(code, err, "model.onnx")
    (tmp_path / "prefill.onnx").write_bytes(b"")
    code, _, err = _run_cli(capsys, tmp_path, "--prompt", "hi")
    _one_line_exit_2(code, err, "decode.onnx")


@pytest.mark.parametrize(
    "options, needle",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--max-new-tokens", "x"], "--max-new-tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--temperature", "nan"], "temperature"),
        (["--temperature", "1", "--top-p", "0"], "top-p"),
        (["--top-p", "1.5"], "top-p"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bad_options_exit_2(capsys, tiny, options, needle):
    code, _, err = _run_cli(capsys, tiny["past"], "--prompt", "hi", *options)
    _one_line_exit_2(code, err, needle)


def test_non_decoder_graph_exits_2(capsys, tiny, tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "model.onnx")
    shutil.copy(tiny["past"] / "tokenizer.json", tmp_path / "tokenizer.json")
    code, _, err = _run_cli(capsys, tmp_path, "--prompt", "hi")
    _one_line_exit_2(code, err, "not a decoder graph")


def _placeholder_pair(folder: Path) -> None:
    """prefill.onnx and decode.onnx that pass the loader's checks (resolve_model runs them), for a
    test whose fake ``open_decoder`` never opens them: one Identity each."""
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "placeholder",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 1])],
                              [helper.make_tensor_value_info("logits", TensorProto.INT64, [1, 1])])
    for name in ("prefill.onnx", "decode.onnx"):
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9),
                  str(folder / name))


def test_prompt_too_long_for_the_context_exits_2(capsys, tiny, monkeypatch, tmp_path):
    _placeholder_pair(tmp_path)  # found by resolve_model, opened by the fake below
    shutil.copy(tiny["past"] / "tokenizer.json", tmp_path / "tokenizer.json")
    monkeypatch.setattr(decmod, "open_decoder", lambda *a, **k: fake_static(tiny["past"] / "model.onnx", 4, 16))
    prompt_tokens = len(_prompt_ids(tiny["past"]))
    assert prompt_tokens >= 16
    code, _, err = _run_cli(capsys, tmp_path, "--prompt", PROMPT)
    _one_line_exit_2(code, err, f"{prompt_tokens} tokens", "16")
    # a prompt that fits runs, and stops when the cache is full: context - prompt + 1 tokens
    record = _gen_json(capsys, tmp_path, "--prompt", "abcdefghij", "--max-new-tokens", "100", "--ignore-eos")
    assert record["mode"] == "static-pair" and record["prompt_tokens"] == 11
    assert record["stopped"] == "context_full" and len(record["tokens"]) == 16 - 11 + 1


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


def test_json_keys_and_greedy_determinism(capsys, tiny):
    args = (tiny["past"], "--prompt", PROMPT, "--max-new-tokens", "12", "--ignore-eos")
    first = _gen_json(capsys, *args)
    for key in ("text", "tokens", "ttft_ms", "decode_tokens_per_s", "prompt_tokens", "mode", "stopped"):
        assert key in first
    assert first["mode"] == "dynamic-with-past" and first["stopped"] == "max_new_tokens"
    assert len(first["tokens"]) == 12 and first["prompt_tokens"] == len(_prompt_ids(tiny["past"]))
    assert first["ttft_ms"] > 0 and first["decode_tokens_per_s"] > 0
    assert _gen_json(capsys, *args)["tokens"] == first["tokens"]
    assert _gen_json(capsys, *args, "--temperature", "0")["tokens"] == first["tokens"]


def test_seeded_sampling_is_deterministic(capsys, tiny):
    args = (tiny["past"], "--prompt", PROMPT, "--max-new-tokens", "16", "--ignore-eos", "--temperature", "1.5")
    a = _gen_json(capsys, *args, "--seed", "3")
    assert a["sampling"] == {"temperature": 1.5, "top_p": 1.0, "seed": 3}
    assert _gen_json(capsys, *args, "--seed", "3")["tokens"] == a["tokens"]
    assert _gen_json(capsys, *args, "--seed", "4")["tokens"] != a["tokens"]
    nucleus = _gen_json(capsys, *args, "--seed", "3", "--top-p", "0.5")
    assert _gen_json(capsys, *args, "--seed", "3", "--top-p", "0.5")["tokens"] == nucleus["tokens"]


def test_stream_matches_json_text_and_stops_at_eos(capsys, tiny):
    code, out, err = _run_cli(capsys, tiny["past"], "--prompt", PROMPT, "--max-new-tokens", "10", "--ignore-eos")
    assert code == 0
    record = _gen_json(capsys, tiny["past"], "--prompt", PROMPT, "--max-new-tokens", "10", "--ignore-eos")
    assert out == record["text"] + "\n"
    assert err.startswith(f"prompt {record['prompt_tokens']} tokens, TTFT ") and "tokens/s (decode)" in err
    # with the first greedy token declared an eos, generation stops right there
    decoder = open_decoder(tiny["past"])
    ids = _prompt_ids(tiny["past"])
    result = generate(decoder, ids, max_new_tokens=10, eos={record["tokens"][0]})
    assert result.tokens == record["tokens"][:1] and result.stopped == "eos"
    assert result.decode_tokens_per_s is None


def test_chat_template(capsys, tiny):
    from edgeq.generation.chat import eos_ids, render_chat

    assert render_chat(tiny["past"], "hi") == "<s>user\nhi</s><s>assistant\n"
    assert eos_ids(tiny["past"]) == {2}
    record = _gen_json(capsys, tiny["past"], "--prompt", "hi", "--chat", "--max-new-tokens", "4", "--ignore-eos")
    assert record["prompt_tokens"] == len(_prompt_ids(tiny["past"], "<s>user\nhi</s><s>assistant\n")) - 1  # no extra <s>


def test_decoders_give_the_same_greedy_tokens(tiny):
    ids = _prompt_ids(tiny["past"])
    runs = {}
    for name, decoder in {
        "past": open_decoder(tiny["past"], optimize=False),
        "plain": open_decoder(tiny["plain"], optimize=False),
        "static": fake_static(tiny["past"] / "model.onnx", prefill=5, context=96),  # 52 prompt tokens: 11 chunks
        "static-wide": fake_static(tiny["past"] / "model.onnx", prefill=64, context=96),  # one padded chunk
    }.items():
        runs[name] = generate(decoder, ids, max_new_tokens=24).tokens
        assert decoder.mode == {"past": "dynamic-with-past", "plain": "dynamic"}.get(name, "static-pair")
    assert isinstance(open_decoder(tiny["plain"]), RecomputeDecoder)
    assert isinstance(open_decoder(tiny["past"] / "model.onnx"), PastDecoder)
    assert runs["past"] == runs["plain"] == runs["static"] == runs["static-wide"]


def test_decoder_reset_and_room(tiny):
    decoder = fake_static(tiny["past"] / "model.onnx", prefill=4, context=8)
    a = decoder.prefill([1, 5, 6])
    assert decoder.position == 3 and decoder.room() == 5
    decoder.step(7)
    decoder.reset()
    assert decoder.position == 0 and not any(v.any() for v in decoder.cache.values())
    np.testing.assert_array_equal(decoder.prefill([1, 5, 6]), a)
    with pytest.raises(UserInputError, match="do not fit"):
        decoder.prefill(list(range(3, 9)))


def test_sampling_math():
    logits = np.array([2.0, 1.0, 0.5, -1.0, 3.0])
    p = nucleus_probs(logits, 1.0)
    np.testing.assert_allclose(p, np.exp(logits) / np.exp(logits).sum())
    kept = nucleus_probs(logits, 1.0, top_p=0.7)  # 0.61 (id 4) + 0.22 (id 0) reach 0.7
    assert set(np.flatnonzero(kept)) == {4, 0} and kept.sum() == pytest.approx(1.0)
    assert next_token(logits) == 4
    rng = np.random.default_rng(0)
    draws = [next_token(logits, 1.0, 0.1, rng) for _ in range(20)]
    assert set(draws) == {4}


# --------------------------------------------------------------------------------------------
# Teacher-forced NLL
# --------------------------------------------------------------------------------------------


def test_teacher_forced_nll_equals_the_full_window_nll(tiny):
    from edgeq.textdata import token_windows

    ids = token_windows(tiny["text"], tiny["past"], seq_len=40, windows=2)
    full = open_session(tiny["plain"] / "model.onnx", optimize=False)
    decoders = {"past": open_decoder(tiny["past"], optimize=False),
                "static": fake_static(tiny["past"] / "model.onnx", prefill=6, context=48)}
    for window in ids:
        (logits,) = full.run(["logits"], {"input_ids": window[None], "attention_mask": np.ones((1, 40), np.int64),
                                          "position_ids": np.arange(40)[None]})
        reference = window_nll(logits[0].copy(), window)
        for name, decoder in decoders.items():
            for through in ("prefill", "decode"):
                got = teacher_forced_nll(decoder, window, through)
                assert got == pytest.approx(reference, abs=1e-4), (name, through)
    head = window_logits(decoders["static"], ids[0], "decode")
    assert head.shape == (40, 256) and not head[-1].any()
    with pytest.raises(UserInputError, match="needs a graph with a KV cache"):
        teacher_forced_nll(open_decoder(tiny["plain"]), ids[0], "decode")


def test_eval_ppl_through_a_static_pair_matches_model_onnx(capsys, tiny, monkeypatch, tmp_path):
    import edgeq.generation.teacher_forced as tf

    _placeholder_pair(tmp_path)
    real = tf.open_decoder

    def opener(path, *args, **kwargs):  # the empty prefill.onnx / decode.onnx of tmp_path: the fake pair
        if Path(path) == tmp_path:
            return fake_static(tiny["past"] / "model.onnx", 6, 48, optimize=True)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(tf, "open_decoder", opener)
    common = ["--text", str(tiny["text"]), "--tokenizer", str(tiny["past"]), "--seq-len", "40", "--windows", "3",
              "--json"]
    results = {}
    for label, argv in {
        "plain": ["eval", "ppl", str(tiny["plain"] / "model.onnx"), *common],
        "past": ["eval", "ppl", str(tiny["past"] / "model.onnx"), *common],  # the existing path, empty cache
        "past-decode": ["eval", "ppl", str(tiny["past"]), "--through", "decode", *common],
        "static": ["eval", "ppl", str(tmp_path), *common],  # --through decode by default
        "static-prefill": ["eval", "ppl", str(tmp_path), "--through", "prefill", *common],
    }.items():
        assert main(argv) == 0
        results[label] = json.loads(capsys.readouterr().out)
    assert results["static"]["through"] == "decode" and results["static"]["mode"] == "static-pair"
    assert results["static-prefill"]["through"] == "prefill"
    assert results["past-decode"]["mode"] == "dynamic-with-past" and "mode" not in results["past"]
    for label, result in results.items():
        assert result["tokens"] == 3 * 39 and result["ppl"] == pytest.approx(results["plain"]["ppl"], rel=1e-5), label
    assert main(["eval", "ppl", str(tmp_path), "--batch-size", "2", *common]) == 2
    assert "batch 1" in capsys.readouterr().err
    assert main(["eval", "ppl", str(tiny["plain"]), "--through", "decode", *common]) == 2
    assert "KV cache" in capsys.readouterr().err


def test_perplexity_api_unchanged_on_with_past(tiny):
    result = perplexity(tiny["past"] / "model.onnx", tiny["text"], tiny["past"], windows=2, seq_len=40)
    assert result["tokens"] == 78 and np.isfinite(result["ppl"])


def test_stream_prints_whole_characters(tiny):
    import io

    from edgeq.generation.cli import _Stream
    from edgeq.textdata import load_tokenizer

    tok = load_tokenizer(tiny["past"])
    ids = tok.encode("é€x", add_special_tokens=False).ids
    assert len(ids) == 6  # 2 + 3 + 1 byte tokens
    out = io.StringIO()
    stream = _Stream(tok, out)
    seen = []
    for i in range(1, len(ids) + 1):
        stream(ids[:i])
        seen.append(out.getvalue())
    assert seen == ["", "é", "é", "é", "é€", "é€x"]
    stream.finish(ids)
    assert out.getvalue() == "é€x\n"


def test_compiled_static_pair_matches_the_with_past_graph(capsys, tiny, tmp_path):
    """The real ``edgeq compile --static`` output (fp32 recipe) through ``edgeq generate``: the same
    greedy tokens as the with-past graph it came from, until its context is full."""
    out = tmp_path / "static"
    assert main(["compile", str(tiny["past"] / "model.onnx"), "--recipe", "fp32", "--static", "prefill=8,context=64",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    shutil.copy(tiny["past"] / "tokenizer.json", out / "tokenizer.json")
    args = ("--prompt", PROMPT, "--max-new-tokens", "30", "--ignore-eos")
    static = _gen_json(capsys, out, *args)
    dynamic = _gen_json(capsys, tiny["past"], *args)
    assert static["mode"] == "static-pair" and static["context"] == 64
    assert static["stopped"] == "context_full" and len(static["tokens"]) == 64 - static["prompt_tokens"] + 1
    assert static["tokens"] == dynamic["tokens"][: len(static["tokens"])]
    from edgeq.textdata import token_windows

    window = token_windows(tiny["text"], tiny["past"], seq_len=40, windows=1)[0]
    reference = teacher_forced_nll(open_decoder(tiny["past"], optimize=False), window, "prefill")
    pair = open_decoder(out, optimize=False)
    for through in ("prefill", "decode"):
        assert teacher_forced_nll(pair, window, through) == pytest.approx(reference, abs=1e-4)
