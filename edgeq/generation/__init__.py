"""Text generation on the host with onnxruntime CPU: the runtime ``edgeq generate`` runs, and the
teacher-forced perplexity of ``edgeq eval ppl`` on a static pair.

``open_decoder`` (``edgeq.generation.decoders``) opens a static pair, a dynamic graph with a KV
cache or one without behind one interface; ``generate`` runs the prefill and the decode loop on it:

- the prompt goes through ``decoder.prefill`` (a static pair cuts it into prefill-length chunks,
  the last one padded); the first token comes from the last prompt position's logits;
- every next token is fed back through ``decoder.step`` until ``max_new_tokens`` tokens are
  generated (``stopped="max_new_tokens"``), an end-of-sequence id is generated (``"eos"``, the id
  kept as the last of ``tokens``), or a bounded cache (a static pair's context ``C``) is full: the
  decoder holds ``C`` tokens, so the token just generated cannot be fed (``"context_full"``; at
  most ``C - prompt + 1`` tokens). A prompt of ``C`` or more tokens is refused up front;
- ``ttft_ms`` is the time from the start of the prefill to the first token's logits (tokenizing and
  opening sessions are not in it); ``decode_tokens_per_s`` is ``(tokens - 1)`` over the wall time
  after those logits (sampling and the ``on_token`` callback included: what a user sees), None
  when only one token was generated.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from edgeq.errors import UserInputError
from edgeq.generation.decoders import Decoder, open_decoder
from edgeq.generation.sampling import check_sampling, next_token

STOP_REASONS = ("eos", "max_new_tokens", "context_full")


@dataclass
class GenerationResult:
    """What one ``generate`` call did (see the package docstring for the timings)."""

    tokens: list[int]
    prompt_tokens: int
    mode: str
    stopped: str
    ttft_ms: float
    decode_seconds: float
    decode_tokens_per_s: float | None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def check_prompt_fits(prompt_tokens: int, context: int | None) -> None:
    """A prompt must leave the cache room for at least one decode step."""
    if prompt_tokens < 1:
        raise UserInputError("the prompt encodes to no tokens")
    if context is not None and prompt_tokens >= context:
        raise UserInputError(f"the prompt has {prompt_tokens} tokens, the model's context holds {context}: "
                             "a prompt must be shorter than the context")


def generate(
    decoder: Decoder,
    prompt_ids: Sequence[int] | np.ndarray,
    max_new_tokens: int = 64,
    temperature: float | None = None,
    top_p: float = 1.0,
    seed: int | None = None,
    eos: Iterable[int] = (),
    on_token: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (the decoder is reset first).

    Greedy when ``temperature`` is None or 0, else seeded temperature + top-p sampling
    (``edgeq.generation.sampling``). ``eos``: ids that end generation (empty: never stop early).
    ``on_token(tokens)`` is called with the list of generated ids after each new one.
    """
    if max_new_tokens < 1:
        raise UserInputError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
    check_sampling(temperature, top_p)
    prompt = np.asarray(prompt_ids, np.int64).reshape(-1)
    check_prompt_fits(prompt.size, decoder.context)
    eos = {int(e) for e in eos}
    rng = np.random.default_rng(seed) if temperature else None
    decoder.reset()
    start = time.perf_counter()
    logits = decoder.prefill(prompt)
    first = time.perf_counter()
    tokens: list[int] = []
    stopped = "max_new_tokens"
    while True:
        token = next_token(logits, temperature, top_p, rng)
        tokens.append(token)
        if on_token is not None:
            on_token(tokens)
        if token in eos:
            stopped = "eos"
            break
        if len(tokens) >= max_new_tokens:
            break
        if decoder.room() == 0:
            stopped = "context_full"
            break
        logits = decoder.step(token)
    end = time.perf_counter()
    decode_seconds = end - first
    rate = (len(tokens) - 1) / decode_seconds if len(tokens) > 1 and decode_seconds > 0 else None
    return GenerationResult(tokens=tokens, prompt_tokens=int(prompt.size), mode=decoder.mode, stopped=stopped,
                            ttft_ms=(first - start) * 1e3, decode_seconds=decode_seconds, decode_tokens_per_s=rate)


__all__ = ["generate", "GenerationResult", "open_decoder", "Decoder", "check_prompt_fits", "STOP_REASONS"]
