"""Greedy decoding in onnxruntime, with or without a KV cache: the harness KV-cache quantization
is measured on (mean KL of the next-token distributions along the generated tokens, top-1
agreement, exact match of the generated tokens).

``greedy_decode`` takes an onnxruntime session on a decoder graph and the prefill feeds of one
sequence (batch 1), and generates ``steps`` tokens:

- step 0 is the prefill: the whole prompt in one run; its last position's logits pick token 0;
- step ``t >= 1`` is a decode run on the single token ``t - 1`` (so ``steps`` tokens take the
  prefill plus ``steps - 1`` decode runs; the last token is never fed back).

Graphs it runs (told apart by their input names):

- with a KV cache (``edgeq export ... --with-past``): inputs ``past_key_values.{i}.key`` /
  ``.value`` [batch, kv_heads, past, head_dim], outputs ``present.{i}.key`` / ``.value``. Prefill
  gets empty pasts (past length 0) unless ``prefill_feeds`` has them; each decode step feeds the
  presents of the previous run as pasts, one more ``attention_mask`` column of ones and
  ``position_ids`` = last position + 1;
- without one (the default exports): every step re-runs the whole sequence so far and reads the
  last position (quadratic; the reference the cached graph must reproduce).

Token-id graphs (``input_ids``) get the token itself; embedding graphs (``inputs_embeds``, the
composed VLM) get ``embed_table[token]`` (``embed_tokens.npy`` of a ``composed-vlm --with-past``
folder). ``visual_start`` / ``visual_len`` are passed unchanged at every step (they index the
whole sequence), and so is the packed visual cache of a ``kvquant`` decode graph
(``visual_key_values.*``; start such a graph at the first decode step, with the feeds of
``edgeq.kv_cache.visual_cache_feeds``). ``force_tokens`` feeds given tokens instead of the argmax (teacher forcing: run a
quantized graph along the float graph's tokens so that its per-step logits are compared on the same
prefixes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast
from collections.abc import Mapping, Sequence

import numpy as np

from edgeq.errors import UserInputError

from edgeq.kv_cache import PAST_PREFIX, PRESENT_PREFIX, VISUAL_PREFIX

SPAN_INPUTS = ("visual_start", "visual_len")
_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
          "tensor(bfloat16)": np.float32}


@dataclass
class GreedyResult:
    """``tokens`` int64 [steps]: the argmax at each step; ``logits`` float32 [steps, vocab]: the
    distribution step ``t`` picked from (step 0: the prefill's last position)."""

    tokens: np.ndarray
    logits: np.ndarray


def _past_feeds(session, batch: int) -> dict:
    """Empty past tensors (past length 0) for every cache input of ``session``."""
    feeds = {}
    for inp in session.get_inputs():
        if not inp.name.startswith(PAST_PREFIX):
            continue
        dims = list(inp.shape)
        if len(dims) != 4 or not all(isinstance(d, int) for d in (dims[1], dims[3])):
            raise UserInputError(f"cache input {inp.name} has shape {dims}, expected [batch, kv_heads, past, head_dim]")
        feeds[inp.name] = np.zeros((batch, dims[1], 0, dims[3]), _TYPES.get(inp.type, np.float32))
    return feeds


def _next_positions(position_ids: np.ndarray) -> np.ndarray:
    """The position of the token after the last one: ``[..., -1:] + 1`` ([batch, 1] or M-RoPE [3, batch, 1])."""
    return position_ids[..., -1:] + 1


def greedy_decode(session, prefill_feeds: Mapping[str, np.ndarray], steps: int,
                  embed_table: np.ndarray | None = None,
                  force_tokens: Sequence[int] | np.ndarray | None = None) -> GreedyResult:
    """Prefill then greedy decoding of ``steps`` tokens (see the module docstring).

    ``session``: an onnxruntime ``InferenceSession`` (graph optimizations off for exactness
    checks: ``edgeq.models.embeds_export.ort_session``) on a graph with a ``logits`` output
    [batch, seq, vocab] and inputs among ``input_ids`` or ``inputs_embeds``, ``attention_mask``,
    ``position_ids``, ``visual_start``, ``visual_len`` and the cache inputs. ``prefill_feeds``:
    the prompt, batch 1 (e.g. one sample of ``eval.npz``: ``{k: v[i:i+1]}``); ``attention_mask``
    and ``position_ids`` default to all ones and ``0..seq-1``. ``embed_table`` [vocab, hidden] is
    required for ``inputs_embeds`` graphs. ``force_tokens`` (``steps`` ids): feed these tokens
    back instead of the argmax; ``tokens`` still reports the argmax. Raises ``UserInputError`` on
    inputs that do not fit the graph.
    """
    if steps < 1:
        raise UserInputError(f"steps must be >= 1, got {steps}")
    names = [i.name for i in session.get_inputs()]
    if "logits" not in [o.name for o in session.get_outputs()]:
        raise UserInputError("the graph has no 'logits' output")
    token_input = "input_ids" if "input_ids" in names else "inputs_embeds" if "inputs_embeds" in names else None
    if token_input is None:
        raise UserInputError(f"the graph takes neither input_ids nor inputs_embeds (inputs: {', '.join(names)})")
    if token_input not in prefill_feeds:
        raise UserInputError(f"prefill_feeds has no {token_input}")
    if token_input == "inputs_embeds" and embed_table is None:
        raise UserInputError("an inputs_embeds graph needs embed_table (embed_tokens.npy) to feed generated tokens")
    known = {token_input, "attention_mask", "position_ids", *SPAN_INPUTS}
    unknown = [n for n in names if n not in known and not n.startswith((PAST_PREFIX, VISUAL_PREFIX))]
    if unknown:
        raise UserInputError(f"greedy_decode does not know how to advance the inputs {', '.join(unknown)}")
    extra = sorted(set(prefill_feeds) - set(names))
    if extra:
        raise UserInputError(f"prefill_feeds has {', '.join(extra)}, which the graph does not take")
    tokens_in = np.asarray(prefill_feeds[token_input])
    if tokens_in.shape[0] != 1:
        raise UserInputError(f"greedy_decode runs one sequence (batch 1), got batch {tokens_in.shape[0]}")
    if force_tokens is not None:
        force_tokens = np.asarray(force_tokens, np.int64).reshape(-1)
        if force_tokens.size < steps - 1:
            raise UserInputError(f"force_tokens has {force_tokens.size} tokens, {steps - 1} needed")
    seq = tokens_in.shape[1]
    cached = any(n.startswith(PAST_PREFIX) for n in names)
    unpaired = [n for n in names if n.startswith(PAST_PREFIX)
                and PRESENT_PREFIX + n[len(PAST_PREFIX):] not in [o.name for o in session.get_outputs()]]
    if unpaired:
        raise UserInputError(f"no present output for the cache inputs {', '.join(unpaired)}")

    feeds = {k: np.asarray(v) for k, v in prefill_feeds.items()}
    if "attention_mask" in names and "attention_mask" not in feeds:
        past_len = next((v.shape[2] for k, v in feeds.items() if k.startswith(PAST_PREFIX)), 0)
        feeds["attention_mask"] = np.ones((1, past_len + seq), np.int64)
    if "position_ids" in names and "position_ids" not in feeds:
        feeds["position_ids"] = np.arange(seq, dtype=np.int64)[None]
    if cached:
        feeds = {**_past_feeds(session, 1), **feeds}
    missing = [n for n in names if n not in feeds]
    if missing:
        raise UserInputError(f"prefill_feeds lacks {', '.join(missing)}")

    outputs = [o.name for o in session.get_outputs()] if cached else ["logits"]
    generated, step_logits = [], []
    for step in range(steps):
        result = dict(zip(outputs, session.run(outputs, feeds)))
        logits = np.asarray(result["logits"][0, -1], np.float32)
        token = int(logits.argmax())
        generated.append(token)
        step_logits.append(logits)
        if step == steps - 1:
            break
        fed = token if force_tokens is None else int(force_tokens[step])
        # (an inputs_embeds graph has an embed_table: checked above)
        piece = (np.array([[fed]], np.int64) if token_input == "input_ids"
                 else np.asarray(cast(np.ndarray, embed_table)[fed], feeds[token_input].dtype)[None, None])
        new = {}
        if cached:
            new[token_input] = piece
            for name in names:
                if name.startswith(PAST_PREFIX):
                    new[name] = result[PRESENT_PREFIX + name[len(PAST_PREFIX):]]
            if "position_ids" in names:
                new["position_ids"] = _next_positions(feeds["position_ids"])
        else:
            new[token_input] = np.concatenate([feeds[token_input], piece], axis=1)
            if "position_ids" in names:
                pos = feeds["position_ids"]
                new["position_ids"] = np.concatenate([pos, _next_positions(pos)], axis=-1)
        if "attention_mask" in names:
            mask = feeds["attention_mask"]
            new["attention_mask"] = np.concatenate([mask, np.ones((1, 1), mask.dtype)], axis=1)
        feeds = {**feeds, **new}
    return GreedyResult(np.array(generated, np.int64), np.stack(step_logits).astype(np.float32))
