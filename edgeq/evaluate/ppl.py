"""Perplexity of a causal LM exported to ONNX, on token windows of a text file, with onnxruntime CPU.

Protocol (``data/wikitext-2/README.md``): tokenize the whole file (as one ``encode`` call with the
tokenizer's special tokens, see ``edgeq.textdata``), cut non-overlapping windows of
``seq_len`` tokens, evaluate windows ``[offset, offset + windows)``; each window predicts its
tokens 2..seq_len from the logits at positions 1..seq_len-1, so a window gives ``seq_len - 1``
predictions; perplexity = exp(total NLL / total predicted tokens).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import numpy as np

from edgeq.errors import UserInputError
from edgeq.runtime.nll import window_nll
from edgeq.runtime.ort_session import open_session, session_options
from edgeq.runtime.progress import progress
from edgeq.textdata import feeds_for_windows, token_windows, window_convention


def _logits_output(session: Any) -> str:
    names = [o.name for o in session.get_outputs()]
    return "logits" if "logits" in names else names[0]


def perplexity(
    model_path: str | os.PathLike,
    text_path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    windows: int | None = None,
    offset: int = 0,
    seq_len: int = 512,
    batch_size: int = 1,
    threads: int | None = None,
    special_tokens: bool = True,
    session_config: dict[str, str] | None = None,
    exact_qdq: bool = False,
    optimize: bool = True,
) -> dict:
    """Perplexity of ``model_path`` on the text; see the module docstring for the protocol.
    ``session_config``: onnxruntime session config entries (e.g.
    ``{"session.qdq_matmulnbits_accuracy_level": "0"}``); ``exact_qdq``: Q/DQ evaluated as
    written (no integer-kernel fusion), the reference for the kernels' result; ``optimize=False``:
    no graph optimization at all (the same arithmetic in another float summation order).

    Returns ``ppl``, ``nll`` (total, nats), ``tokens`` (predicted tokens), ``windows``, ``offset``,
    ``seq_len``, ``batch_size``, ``special_tokens`` and ``seconds`` (model runs and NLL, not
    tokenization or loading).
    """
    if batch_size < 1:
        raise UserInputError(f"batch_size must be >= 1, got {batch_size}")
    ids = token_windows(
        text_path, tokenizer_dir, seq_len=seq_len, windows=windows, offset=offset, special_tokens=special_tokens
    )
    options = session_options(threads, optimize=optimize, exact_qdq=exact_qdq)
    for key, value in (session_config or {}).items():
        options.add_session_config_entry(key, value)
    session = open_session(model_path, options=options)
    specs = session.get_inputs()
    out_name = _logits_output(session)
    # build the feeds once up front so input problems surface before any compute
    feeds_for_windows(specs, ids[:1])

    n = ids.shape[0]
    starts = list(range(0, n, batch_size))
    total_nll = 0.0
    start_time = time.perf_counter()
    for b0 in progress(starts, total=len(starts), desc="ppl"):
        batch = ids[b0 : b0 + batch_size]
        feeds = feeds_for_windows(specs, batch)
        try:
            (logits,) = session.run([out_name], feeds)
        except Exception as exc:  # onnxruntime's own error types (out of memory, bad shapes, ...)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserInputError(f"onnxruntime failed on windows {b0}..{b0 + len(batch) - 1}: {first[:300]}") from None
        if logits.ndim != 3 or logits.shape[:2] != batch.shape:
            raise UserInputError(
                f"model output '{out_name}' has shape {list(logits.shape)}, expected "
                f"[batch, seq_len, vocab] = [{batch.shape[0]}, {batch.shape[1]}, vocab]"
            )
        if b0 == 0 and ids.max() >= logits.shape[-1]:
            raise UserInputError(
                f"token id {int(ids.max())} is outside the model's vocab of {logits.shape[-1]}: "
                "wrong tokenizer for this model?"
            )
        if not logits.flags.writeable or logits.dtype not in (np.float32, np.float64):
            logits = np.array(logits, dtype=np.float32)
        for row in range(batch.shape[0]):
            total_nll += window_nll(logits[row], batch[row])
        del logits
    seconds = time.perf_counter() - start_time
    tokens = n * (seq_len - 1)
    return {
        "ppl": math.exp(total_nll / tokens),
        "nll": total_nll,
        "tokens": tokens,
        "windows": n,
        "offset": offset,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "special_tokens": special_tokens,
        "window_convention": window_convention(tokenizer_dir, special_tokens),
        "seconds": seconds,
        "qdq": "exact" if exact_qdq else "kernels",
        "model": str(model_path),
        "text": str(text_path),
    }
