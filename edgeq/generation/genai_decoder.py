"""A ``--target ort-genai`` folder run through onnxruntime-genai: the decoder ``edgeq generate`` and
``edgeq eval ppl`` use for such a folder.

The logits are the ones onnxruntime-genai itself returns (``Generator.get_output("logits")``): the
model runs under genai's own loop (its KV buffer of ``max_length`` slots, shared between past and
present, its session options), so the perplexity measured here is that of what a genai user runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from edgeq.errors import UserInputError
from edgeq.generation.decoder_base import Decoder


def require_genai():
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise UserInputError("this folder is for onnxruntime-genai, which is not installed: "
                             "pip install 'edgeq[genai]'") from None
    return og


def open_genai_model(folder: str | os.PathLike, threads: int | None = None):
    """onnxruntime-genai's Model on the CPU; ``threads``: intra-op threads (genai's default otherwise)."""
    og = require_genai()
    config = og.Config(str(folder))
    config.clear_providers()
    if threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": int(threads)}}}}))
    try:
        return og.Model(config)
    except Exception as exc:  # onnxruntime-genai's own error types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserInputError(f"onnxruntime-genai cannot open {folder}: {first[:300]}") from None


class GenaiDecoder(Decoder):
    """A genai folder as an edgeq ``Decoder``: ``prefill_all`` appends tokens to a Generator and reads
    every position's logits; ``step`` appends one. A Generator holds ``max_length`` cache slots
    (default: the folder's ``search.max_length``)."""

    mode = "genai"

    def __init__(self, folder: str | os.PathLike, threads: int | None = None, max_length: int | None = None) -> None:
        super().__init__()
        self.og = require_genai()
        config = json.loads((Path(folder) / "genai_config.json").read_text(encoding="utf-8"))
        self.model = open_genai_model(folder, threads)
        limit = int(config["search"]["max_length"])
        self.context = min(max_length, limit) if max_length else limit
        self.vocab = int(config["model"]["vocab_size"])
        self.generator = None

    def reset(self) -> None:
        super().reset()
        self.generator = None

    def _append(self, ids: np.ndarray) -> np.ndarray:
        self._check_fits(ids.size)
        if self.generator is None:
            params = self.og.GeneratorParams(self.model)
            params.set_search_options(max_length=self.context, do_sample=False)
            self.generator = self.og.Generator(self.model, params)
        self.generator.append_tokens(ids.astype(np.int32).reshape(1, -1))
        self.position += ids.size
        logits = np.asarray(self.generator.get_output("logits"), np.float32)
        return logits.reshape(-1, logits.shape[-1])[-ids.size:]

    def prefill_all(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return self._append(np.asarray(ids, np.int64).reshape(-1))

    def step(self, token: int) -> np.ndarray:
        return self._append(np.array([int(token)], np.int64))[-1]
