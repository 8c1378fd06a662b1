"""Choosing the next token from one position's logits: greedy, or temperature + top-p sampling.

Greedy (``temperature`` None or 0) is the argmax (the first one on ties, as numpy gives it), so a
greedy run is a pure function of the model. Sampling draws from ``softmax(logits / temperature)``
restricted to the top-p nucleus: the most probable tokens, in descending order, up to and including
the first one at which their cumulative probability reaches ``top_p`` (so at least one token is
always kept), renormalized. The draw is one ``rng.random()`` per token from a
``numpy.random.default_rng(seed)`` generator, so a seed gives the same tokens on every machine that
computes the same logits. Probabilities are computed in float64.
"""

from __future__ import annotations

import math

import numpy as np

from edgeq.errors import UserInputError


def check_sampling(temperature: float | None, top_p: float) -> None:
    """Refuse settings that have no meaning (one line each)."""
    if temperature is not None and (not math.isfinite(temperature) or temperature < 0):
        raise UserInputError(f"temperature must be a finite number >= 0, got {temperature}")
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise UserInputError(f"top-p must be in (0, 1], got {top_p}")


def nucleus_probs(logits: np.ndarray, temperature: float, top_p: float = 1.0) -> np.ndarray:
    """float64 [vocab] probabilities of ``softmax(logits / temperature)`` kept to the top-p nucleus."""
    z = np.asarray(logits, np.float64) / temperature
    z -= z.max()
    probs = np.exp(z)
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = int(np.searchsorted(cumulative, top_p)) + 1  # first index reaching top_p, inclusive
        kept = np.zeros_like(probs)
        kept[order[:keep]] = probs[order[:keep]]
        probs = kept / kept.sum()
    return probs


def next_token(logits: np.ndarray, temperature: float | None = None, top_p: float = 1.0,
               rng: np.random.Generator | None = None) -> int:
    """The next token: argmax when ``temperature`` is None or 0, else a draw (see the module docstring)."""
    if not temperature:
        return int(np.argmax(logits))
    if rng is None:
        raise UserInputError("sampling needs a random generator (numpy.random.default_rng(seed))")
    probs = nucleus_probs(logits, temperature, top_p)
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    index = min(index, probs.size - 1)
    while probs[index] == 0.0 and index > 0:  # float edge at the top of the cumsum: step back to a kept token
        index -= 1
    return index
