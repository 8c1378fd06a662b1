"""The interface every decoder kind implements (``edgeq.generation.decoders``, and the
onnxruntime-genai folder's ``edgeq.generation.genai_decoder``): its own module so that a decoder
kind can live in a file of its own without importing the module that opens them all."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

from edgeq.errors import UserInputError


class Decoder(abc.ABC):
    """One interface over the graph kinds (see the module docstring). Subclasses set ``mode``,
    ``context`` (tokens the cache holds; None: unbounded), ``prefill_length`` (S of a static pair,
    else None) and ``vocab``."""

    mode: str = ""
    context: int | None = None
    prefill_length: int | None = None
    vocab: int = 0

    def __init__(self) -> None:
        self.position = 0

    def room(self) -> int | None:
        """Tokens the decoder can still take (None: no bound)."""
        return None if self.context is None else self.context - self.position

    def _check_fits(self, count: int) -> None:
        room = self.room()
        if room is not None and count > room:
            raise UserInputError(
                f"{count} tokens do not fit: the context holds {self.context} tokens and {self.position} are used"
            )

    def reset(self) -> None:
        self.position = 0

    def prefill(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Feed ``ids`` after the tokens held (normally after ``reset``); float32 [vocab] logits of the last."""
        return self.prefill_all(ids)[-1]

    @abc.abstractmethod
    def prefill_all(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Feed ``ids``; float32 [len(ids), vocab] logits of every one of them."""

    @abc.abstractmethod
    def step(self, token: int) -> np.ndarray:
        """Feed one token; float32 [vocab] logits of it."""
