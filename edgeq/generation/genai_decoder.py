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
from typing import Any
from collections.abc import Sequence

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
    """onnxruntime-genai's Model on the CPU; ``threads``: intra-op threads (genai's default otherwise).

    A ``decoder-pipeline`` folder whose stages name the QNN provider (``edgeq.genai.qnn_config``:
    a static pair's context binaries in ``OUT/qnn``) keeps its providers: onnxruntime-qnn's plugin
    EP is registered with genai first, and its HTP stages run there, the helper stages on the CPU."""
    og = require_genai()
    config = og.Config(str(folder))
    written = json.loads((Path(folder) / "genai_config.json").read_text(encoding="utf-8"))
    if (written.get("model") or {}).get("type") == "decoder-pipeline":
        from edgeq.genai.qnn_config import register_qnn_plugin, uses_qnn

        if uses_qnn(written):
            register_qnn_plugin(og)
    else:
        config.clear_providers()
    if threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": int(threads)}}}}))
    try:
        if (written.get("model") or {}).get("type") == "decoder-pipeline":
            from edgeq.targets.qnn_vendor import vendor_stdout_to_stderr

            with vendor_stdout_to_stderr():  # QNN's banner on stdout would corrupt --json
                return og.Model(config)
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
        self.generator: Any = None  # an og.Generator (None until the first tokens)
        window = (config["model"].get("decoder") or {}).get("sliding_window")
        # genai's windowed prompt (a decoder-pipeline of fixed-shape graphs, ``edgeq.genai.qnn_config``):
        # the cache is the graphs' (max_length slots, whatever is asked), the prompt is left-padded to
        # whole windows (the pads count against max_length) and fed once per Generator; after it
        # genai takes one token at a time only from its own search (``generate_next_token``)
        self.window = int(window["window_size"]) if window and window.get("slide_inputs", True) else 0
        if self.window:
            self.limit = self.context = limit
            eos = config["model"].get("eos_token_id")
            self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
            self.ended = False

    def reset(self) -> None:
        super().reset()
        self.generator = None
        if self.window:
            self.context = self.limit
            self.ended = False

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

    def _prompt(self, ids: np.ndarray) -> np.ndarray:
        """The windowed prompt (once per Generator): logits [1, W, vocab] of its last window."""
        if self.generator is not None:
            raise UserInputError("an onnxruntime-genai folder with a windowed prompt takes one prompt per "
                                 "generation (genai restarts its positions on a second one): reset first")
        pads = -ids.size % self.window
        self._check_fits(ids.size + pads)
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.limit, do_sample=False)
        self.generator = self.og.Generator(self.model, params)
        self.generator.append_tokens(ids.astype(np.int32).reshape(1, -1))
        self.position += ids.size
        self.context = self.limit - pads  # the pads hold genai's sequence slots
        return np.asarray(self.generator.get_output("logits"), np.float32).reshape(-1, self.vocab)

    def _forced(self, token: int) -> np.ndarray:
        """Feed ``token`` as genai's next token: its search (greedy) made to pick it, then the model
        runs on it; the token's logits [vocab]."""
        self._check_fits(1)
        if self.ended:  # genai's search feeds pad_token_id after its end-of-sequence id, whatever is asked
            raise UserInputError("onnxruntime-genai ended this sequence at its end-of-sequence id: a genai "
                                 "pipeline folder does not generate past it (drop --ignore-eos)")
        forced = np.full((1, self.vocab), np.finfo(np.float32).min, np.float32)
        forced[0, int(token)] = 0.0
        self.generator.set_logits(forced)
        self.generator.generate_next_token()
        self.position += 1
        self.ended = int(token) in self.eos
        return np.asarray(self.generator.get_logits(), np.float32).reshape(-1)[-self.vocab:]

    def prefill(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        if not self.window:
            return super().prefill(ids)
        return self._prompt(np.asarray(ids, np.int64).reshape(-1))[-1]

    def prefill_all(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(ids, np.int64).reshape(-1)
        if not self.window:
            return self._append(arr)
        # one whole window as the prompt (every row of it comes back), the rest one token at a time
        head = self._prompt(arr[: self.window])[-min(arr.size, self.window):]
        return np.concatenate([head] + [self._forced(t)[None] for t in arr[self.window:]], axis=0)

    def step(self, token: int) -> np.ndarray:
        if self.window:
            return self._forced(token)
        return self._append(np.array([int(token)], np.int64))[-1]
