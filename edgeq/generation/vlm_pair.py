"""The host side of a static VLM deployment (``compile --static`` of a VLM: ``edgeq.static.vlm``).

The folder holds ``vision.onnx`` (pixels [1, S, S, 3] -> visual tokens [1, V, hidden]),
``prefill.onnx`` and ``decode.onnx`` on ``inputs_embeds`` over a fixed cache, and the embedding
table (``embed_tokens.npy``). A prompt with one image runs as the deployment's contract says:

- the prefill window holds the visual tokens in rows ``[0, V)`` (the fixed slice MSQ's visual
  scales are compiled for) and then the prompt's text tokens in their order, as many as fit
  (``P - V``), padding last; ``position_ids`` are every row's original position in the prompt
  (the image's rows ``m .. m + V - 1``), which the graph's causal mask and RoPE read (AIFS);
- text tokens that do not fit in the window follow through ``decode.onnx`` one at a time (text
  scales); so do the generated tokens. A prompt needs its text before the image inside the window
  (``P >= V + m``): a later text token must never precede a cached one.

A deployment of a recipe with msq but no aifs (``order: original`` in its layout) takes the
prompt in its own order instead: the first P tokens with the image at the graph's visual rows
``[m, m + V)`` (a prompt with its image elsewhere is refused), positions 0, 1, ...

Everything about the cache (slots, mask, the new entries written back) is ``StaticPairDecoder``'s;
this class only says which rows go where. The cache slot order is not the position order after
an AIFS prefill; attention reads every filled slot, so that order does not matter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import numpy as np

from edgeq.errors import UserInputError
from edgeq.files.vlm_folder import VISION_FILE
from edgeq.generation.decoders import STATIC_FILES, StaticPairDecoder, _htp_sessions
from edgeq.static.vlm import VLM_KEY

VLM_FILES = (VISION_FILE, *STATIC_FILES)


class StaticVlmDecoder(StaticPairDecoder):
    """A static VLM pair (see the module docstring): ``prefill_image`` for the prompt with its
    image, then ``step`` per token (inherited; a token enters as its row of the embedding table)."""

    mode = "static-vlm"
    token_input = "inputs_embeds"

    def __init__(self, prefill_session: Any, decode_session: Any, table: np.ndarray,
                 labels: tuple[str, str] = STATIC_FILES) -> None:
        super().__init__(prefill_session, decode_session, labels)
        self.layout = vlm_meta(prefill_session, self.labels["prefill"])
        self.visual_tokens = int(self.layout["visual_tokens"])
        self.order = self.layout.get("order", "aifs")
        self.visual_start = int(self.layout.get("visual_rows", [0])[0])
        if table.ndim != 2 or table.shape[1] != int(self.layout["hidden"]):
            raise UserInputError(f"the embedding table has shape {list(table.shape)}, the graphs take rows of "
                                 f"{self.layout['hidden']}")
        self.table = table

    def _embed(self, ids: np.ndarray, width: int) -> np.ndarray:
        rows = np.zeros((1, width, self.table.shape[1]), np.float32)
        rows[0, :ids.size] = self.table[ids]
        return rows

    def _chunk(self, role: str, ids: np.ndarray) -> np.ndarray:
        return self._window(role, {"inputs_embeds": self._embed(ids, self.width(role))},
                            self.position + np.arange(ids.size, dtype=np.int64))

    def prefill_image(self, prompt: np.ndarray, start: int, visual: np.ndarray) -> np.ndarray:
        """Feed a prompt (token ids; anything at ``[start, start + V)``, where the image's ``visual``
        tokens [V, hidden] go) after ``reset``; float32 [vocab] logits of its last token."""
        prompt = np.asarray(prompt, np.int64).reshape(-1)
        v, width = self.visual_tokens, self.prefill_length
        if visual.shape != (v, self.table.shape[1]):
            raise UserInputError(f"the image gives visual tokens {list(visual.shape)}, the prefill graph's fixed "
                                 f"slice takes [{v}, {self.table.shape[1]}]")
        if start < 0 or start + v > prompt.size:
            raise UserInputError(f"the visual span [{start}, {start + v}) lies outside the {prompt.size}-token prompt")
        if self.order == "original":
            return self._prefill_in_order(prompt, start, visual)
        if width < v + start:
            raise UserInputError(f"the prompt has {start} text tokens before the image: the prefill window "
                                 f"({width}) holds {width - v} beside the {v} visual rows")
        self._check_fits(prompt.size)
        text = np.concatenate([np.arange(start), np.arange(start + v, prompt.size)]).astype(np.int64)
        first, rest = text[:width - v], text[width - v:]
        rows = np.zeros((1, width, self.table.shape[1]), np.float32)
        rows[0, :v] = visual
        rows[0, v:v + first.size] = self.table[prompt[first]]
        positions = np.concatenate([np.arange(start, start + v), first]).astype(np.int64)
        logits = self._window("prefill", {"inputs_embeds": rows}, positions)
        last = logits[int(np.argmax(positions))]
        for token in prompt[rest]:
            last = self.step(int(token))
        return last


    def _prefill_in_order(self, prompt: np.ndarray, start: int, visual: np.ndarray) -> np.ndarray:
        """``prefill_image`` of a deployment in the prompt's order (``order: original``: a recipe with
        msq but not aifs): the prompt's first P tokens at positions 0.., the image where the graph's
        visual rows are; the rest through ``decode.onnx``."""
        v, m = self.visual_tokens, self.visual_start
        if start != m:
            raise UserInputError(f"this deployment keeps the image at prompt rows [{m}, {m + v}) (msq without aifs: "
                                 f"its visual scales are compiled there); the prompt has it at [{start}, {start + v})")
        self._check_fits(prompt.size)
        first = min(prompt.size, self.prefill_length)
        rows = np.zeros((1, self.prefill_length, self.table.shape[1]), np.float32)
        ids = prompt[:first]
        rows[0, :first] = self.table[np.where(ids < 0, 0, ids)]
        rows[0, m:m + v] = visual
        last = self._window("prefill", {"inputs_embeds": rows}, np.arange(first, dtype=np.int64))[-1]
        for token in prompt[first:]:
            last = self.step(int(token))
        return last


def vlm_meta(session: Any, label: str) -> dict:
    """The ``edgeq.static_vlm`` layout of a graph of a static VLM deployment, checked."""
    raw = session.get_modelmeta().custom_metadata_map.get(VLM_KEY)
    if raw is None:
        raise UserInputError(f"{label} has no {VLM_KEY} metadata: not a static VLM deployment "
                             "(edgeq compile VLM/with-past/model.onnx --static ...)")
    try:
        meta = json.loads(raw)
        for key in ("visual_tokens", "hidden", "image_size"):
            if not isinstance(meta[key], int) or meta[key] < 1:
                raise ValueError(f"{key} = {meta[key]!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise UserInputError(f"{label}: bad {VLM_KEY} metadata ({exc})") from None
    return meta


def is_static_vlm(folder: str | Path) -> bool:
    """A folder holding a static VLM deployment's graphs (vision, prefill, decode)."""
    return Path(folder).is_dir() and all((Path(folder) / f).is_file() for f in VLM_FILES)


def open_static_vlm(folder: str | Path, table: np.ndarray, provider: str = "cpu", threads: int | None = None,
                    htp_arch: int | None = None) -> tuple[Any, StaticVlmDecoder]:
    """(the vision session, the decoder) of the static VLM deployment in ``folder``: onnxruntime
    CPU, or ``qnn-htp``: the folder's prepared context binaries (``qnn/*_ctx.onnx``) on the
    (emulated) HTP, CPU fallback disabled, as ``edgeq generate`` opens a static pair."""
    from edgeq.graph.ir import check_model_file

    files = [check_model_file(Path(folder) / f) for f in VLM_FILES]
    if provider == "qnn-htp":
        from edgeq.targets.qnn_vendor import DEFAULT_HTP_ARCH, open_htp_session, vendor_version

        if vendor_version() is None:
            raise UserInputError("--provider qnn-htp needs onnxruntime-qnn: pip install 'edgeq[qnn]'")
        arch = htp_arch or DEFAULT_HTP_ARCH
        sessions, labels = _htp_sessions(files, lambda f: open_htp_session(f, arch))
    else:
        from edgeq.runtime.ort_session import open_session

        sessions, labels = [open_session(f, threads=threads) for f in files], tuple(str(f) for f in files)
    vision, prefill, decode = sessions
    return vision, StaticVlmDecoder(prefill, decode, table, labels=cast("tuple[str, str]", labels[1:]))

