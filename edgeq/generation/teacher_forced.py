"""Teacher-forced NLL through a decoder: perplexity of the graphs a deployment runs (a static pair's
prefill.onnx and decode.onnx), comparable with ``edgeq eval ppl model.onnx``.

The windows and the NLL are those of ``edgeq.evaluate.ppl`` (``edgeq.textdata.token_windows``,
``edgeq.runtime.nll.window_nll``): a window of ``L`` tokens predicts tokens 2..L from the logits at positions
1..L-1. Those logits come from feeding the window's own (true) tokens 1..L-1; the last token is never
fed (nothing reads its logits), so a window needs ``L - 1`` cache slots. Two ways through the decoder:

- ``prefill``: the ``L - 1`` tokens through ``decoder.prefill_all`` (a static pair: prefill.onnx in
  prefill-length chunks, the last one padded; a dynamic graph: one run);
- ``decode``: the first ``min(S, L - 1)`` tokens through the prefill (``S`` the static pair's prefill
  length; 1 for a dynamic graph with a KV cache), then every next true token one at a time through
  ``decoder.step`` (decode.onnx), each step's logits read. This is the path generation takes, so a
  quantized cache or a decode-only rewrite shows up here and not in ``prefill``.

On a dynamic graph with a KV cache both equal the plain full-window NLL up to float summation order.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from edgeq.errors import UserInputError
from edgeq.generation.decoders import Decoder, open_decoder
from edgeq.runtime.nll import window_nll
from edgeq.runtime.progress import progress
from edgeq.textdata import token_windows, window_convention

THROUGH = ("prefill", "decode")


def window_logits(decoder: Decoder, ids: np.ndarray, through: str = "decode") -> np.ndarray:
    """float32 [L, vocab] logits of the window ``ids`` [L] fed through ``decoder`` (reset first); the
    last row, which no prediction reads, is zeros (see the module docstring)."""
    if through not in THROUGH:
        raise UserInputError(f"through must be one of {', '.join(THROUGH)}, got {through!r}")
    ids = np.asarray(ids, np.int64).reshape(-1)
    n = ids.size
    if n < 2:
        raise UserInputError(f"a window needs at least 2 tokens, got {n}")
    if decoder.context is not None and n - 1 > decoder.context:
        raise UserInputError(f"windows of {n} tokens need {n - 1} cache slots, the model's context holds "
                             f"{decoder.context}: use --seq-len {decoder.context + 1} or less")
    if through == "decode" and decoder.mode == "dynamic":
        raise UserInputError("through decode needs a graph with a KV cache (this model.onnx has none)")
    decoder.reset()
    fed = ids[:-1]
    if through == "prefill":
        head = decoder.prefill_all(fed)
        out = np.zeros((n, head.shape[1]), np.float32)
        out[: n - 1] = head
        return out
    first = min(decoder.prefill_length or 1, n - 1)
    head = decoder.prefill_all(fed[:first])
    out = np.zeros((n, head.shape[1]), np.float32)
    out[:first] = head
    for t in range(first, n - 1):
        out[t] = decoder.step(int(fed[t]))
    return out


def teacher_forced_nll(decoder: Decoder, ids: np.ndarray, through: str = "decode") -> float:
    """Total NLL (nats, float64) of ``ids[1:]`` for one window through ``decoder``."""
    logits = window_logits(decoder, ids, through)
    if int(np.max(ids)) >= logits.shape[1]:
        raise UserInputError(f"token id {int(np.max(ids))} is outside the model's vocab of {logits.shape[1]}: "
                             "wrong tokenizer for this model?")
    return window_nll(logits, np.asarray(ids, np.int64).reshape(-1))


def perplexity_through(
    model_path: str | os.PathLike,
    text_path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    windows: int | None = None,
    offset: int = 0,
    seq_len: int = 512,
    threads: int | None = None,
    special_tokens: bool = True,
    through: str = "decode",
    exact_qdq: bool = False,
    optimize: bool = True,
    provider: str = "cpu",
    htp_arch: int | None = None,
) -> dict:
    """Perplexity of the decoder at ``model_path`` (a static pair's folder, or a model.onnx) on the
    text, fed window by window ``through`` the prefill or the decode graph; the keys of
    ``edgeq.evaluate.ppl.perplexity`` plus ``through`` and ``mode`` (batch 1 always)."""
    if through not in THROUGH:
        raise UserInputError(f"through must be one of {', '.join(THROUGH)}, got {through!r}")
    ids = token_windows(text_path, tokenizer_dir, seq_len=seq_len, windows=windows, offset=offset,
                        special_tokens=special_tokens)
    decoder = open_decoder(model_path, threads=threads, optimize=optimize, exact_qdq=exact_qdq, provider=provider,
                           htp_arch=htp_arch, max_length=seq_len)
    if decoder.context is not None and seq_len - 1 > decoder.context:
        raise UserInputError(f"--seq-len {seq_len} needs {seq_len - 1} cache slots, the model's context holds "
                             f"{decoder.context}: use --seq-len {decoder.context + 1} or less")
    if through == "decode" and decoder.mode == "dynamic":
        raise UserInputError("--through decode needs a graph with a KV cache (this model.onnx has none)")
    total = 0.0
    start = time.perf_counter()
    for row in progress(range(ids.shape[0]), total=ids.shape[0], desc=f"ppl ({through})"):
        total += teacher_forced_nll(decoder, ids[row], through)
    seconds = time.perf_counter() - start
    tokens = ids.shape[0] * (seq_len - 1)
    return {
        "ppl": math.exp(total / tokens),
        "nll": total,
        "tokens": tokens,
        "windows": int(ids.shape[0]),
        "offset": offset,
        "seq_len": seq_len,
        "batch_size": 1,
        "special_tokens": special_tokens,
        "window_convention": window_convention(tokenizer_dir, special_tokens),
        "seconds": seconds,
        "qdq": "exact" if exact_qdq else "kernels",
        "model": str(model_path),
        "text": str(text_path),
        "through": through,
        "mode": decoder.mode,
        "provider": provider,
    }
