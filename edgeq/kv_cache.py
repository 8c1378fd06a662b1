"""The quantized visual KV cache of CalibQuant (paper 001, section 4.1) on the host side: what runs
between the float prefill and the ``kvquant`` decode graph.

Why on the host: the cache is written once, after prefill, and read at every decode step. The
decode graph (``kvquant``) therefore takes the packed cache as inputs; producing it is one
quantization per layer of the prefill's ``present`` keys and values, which this module does with
the exact conventions of ``edgeq::VisualKVAttention`` (min/max ranges, round half to even, MSB-first
packing). A runtime or an NPU host program does the same step; the numbers here are the reference.

Schemes (what one (alpha, scale) pair covers, for keys / values; both over the visual tokens of one
batch row and KV head):

- ``calibquant``: K and V channel-wise (one pair per head_dim channel, min/max over the tokens);
- ``global-v``: K channel-wise, V with one pair per head (the "without channel-wise V" ablation);
- ``kivi``: K channel-wise, V per token (one pair per token over its channels; KIVI's layout,
  run by ``edgeq::VisualKVAttentionKIVI``).

``clip`` < 1 shrinks a range about its midpoint before quantizing (values outside saturate): the
released CalibQuant code clips 1-bit ranges this way; ``kvquant`` searches the factors.

Decode-graph inputs for layer ``i`` (``VISUAL_PREFIX`` = ``visual_key_values.``):
``visual_key_values.{i}.key_codes`` / ``value_codes`` uint8 [B, KVH, Nv, D * b / 8],
``...key_alpha`` / ``key_scale`` float32 [B, KVH, 1, D], ``...value_alpha`` / ``value_scale``
float32 [B, KVH, 1, D] (calibquant), [B, KVH, 1, 1] (global-v) or [B, KVH, Nv, 1] (kivi); the
text-only cache stays in ``past_key_values.{i}.key`` / ``.value``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Mapping

import numpy as np

from edgeq.errors import UserInputError
from edgeq.graph.facts import KVQUANT
from edgeq.runtime_ops.visual_kv_codes import pack_codes, quantize_rows

VISUAL_PREFIX = "visual_key_values."  # a kvquant decode graph's packed visual cache
PAST_PREFIX = "past_key_values."  # optimum's cache names (text-generation-with-past)
PRESENT_PREFIX = "present."
FIELDS = ("key_codes", "key_alpha", "key_scale", "value_codes", "value_alpha", "value_scale")
SCHEMES = {"calibquant": ("channel", "channel"), "global-v": ("channel", "global"), "kivi": ("channel", "token")}
BITS = (1, 2, 4, 8)
METADATA_KEY = KVQUANT.key


@dataclass(frozen=True)
class VisualCacheSpec:
    """How the visual cache is quantized: bit width, scheme, range clipping of K and V."""

    bits: int = 2
    scheme: str = "calibquant"
    k_clip: float = 1.0
    v_clip: float = 1.0

    def __post_init__(self):
        if self.bits not in BITS:
            raise UserInputError(f"visual KV cache bits must be one of {BITS}, got {self.bits}")
        if self.scheme not in SCHEMES:
            raise UserInputError(f"visual KV cache scheme must be one of {', '.join(SCHEMES)}, got '{self.scheme}'")
        for label, c in (("k_clip", self.k_clip), ("v_clip", self.v_clip)):
            if not 0.0 < float(c) <= 1.0:
                raise UserInputError(f"{label} must be in (0, 1], got {c}")

    @property
    def axes(self) -> tuple[str, str]:
        return SCHEMES[self.scheme]

    @classmethod
    def from_model(cls, model) -> VisualCacheSpec:
        """The spec a ``kvquant`` decode graph was compiled for (its metadata)."""
        for prop in model.metadata_props:
            if prop.key == METADATA_KEY:
                meta = json.loads(prop.value)
                return cls(**{k: meta[k] for k in ("bits", "scheme", "k_clip", "v_clip")})
        raise UserInputError("the model is not a kvquant decode graph (no edgeq.kvquant metadata)")


def quantize_visual_kv(k: np.ndarray, v: np.ndarray, spec: VisualCacheSpec) -> dict[str, np.ndarray]:
    """The six decode inputs of one layer (``FIELDS``) from its visual keys and values [B, KVH, Nv, D]."""
    k_axis, v_axis = spec.axes
    kc, ka, ks = quantize_rows(k, spec.bits, k_axis, spec.k_clip)
    vc, va, vs = quantize_rows(v, spec.bits, v_axis, spec.v_clip)
    return {"key_codes": pack_codes(kc, spec.bits), "key_alpha": ka, "key_scale": ks,
            "value_codes": pack_codes(vc, spec.bits), "value_alpha": va, "value_scale": vs}


def split_visual_rows(x: np.ndarray, visual_start, visual_len) -> tuple[np.ndarray, np.ndarray]:
    """(visual rows, text rows) of a cache tensor [B, KVH, T, D]; every batch row must have the
    same visual length (the packed cache is one tensor). Text rows keep their order."""
    starts = np.asarray(visual_start, np.int64).reshape(-1)
    lens = np.asarray(visual_len, np.int64).reshape(-1)
    if starts.size != x.shape[0] or lens.size != x.shape[0]:
        raise UserInputError(f"visual_start/visual_len need one entry per batch row ({x.shape[0]})")
    if len(set(lens.tolist())) != 1 or lens[0] < 1:
        raise UserInputError(f"every batch row needs the same visual length >= 1, got {lens.tolist()}")
    t = x.shape[2]
    vis, txt = [], []
    for b, (s, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        if s < 0 or s + n > t:
            raise UserInputError(f"visual span [{s}, {s + n}) is outside the cache of length {t}")
        vis.append(x[b, :, s:s + n])
        txt.append(np.concatenate([x[b, :, :s], x[b, :, s + n:]], axis=1))
    return np.stack(vis), np.stack(txt)


def visual_cache_feeds(presents: Mapping[str, np.ndarray], visual_start, visual_len,
                       spec: VisualCacheSpec) -> dict[str, np.ndarray]:
    """Decode-graph cache feeds from a float prefill's outputs: ``presents`` maps
    ``present.{i}.key`` / ``.value`` to [B, KVH, T, D]; returns the text-only
    ``past_key_values.{i}.*`` and the packed ``visual_key_values.{i}.*`` of every layer."""
    layers = sorted({int(n[len(PRESENT_PREFIX):].split(".")[0]) for n in presents if n.startswith(PRESENT_PREFIX)})
    if not layers:
        raise UserInputError("no present.{i}.key / .value outputs to build the visual cache from")
    feeds = {}
    for i in layers:
        k_vis, k_txt = split_visual_rows(presents[f"{PRESENT_PREFIX}{i}.key"], visual_start, visual_len)
        v_vis, v_txt = split_visual_rows(presents[f"{PRESENT_PREFIX}{i}.value"], visual_start, visual_len)
        feeds[f"{PAST_PREFIX}{i}.key"], feeds[f"{PAST_PREFIX}{i}.value"] = k_txt, v_txt
        for field, value in quantize_visual_kv(k_vis, v_vis, spec).items():
            feeds[f"{VISUAL_PREFIX}{i}.{field}"] = value
    return feeds


def cache_bytes_per_token(layers: int, kv_heads: int, head_dim: int, visual_tokens: int, bits: int,
                          scheme: str = "calibquant") -> float:
    """Bytes of K+V per visual token: the b-bit codes plus the fp32 (alpha, scale) pairs amortized
    over the image's tokens (per token for KIVI's V)."""
    values = 2 * layers * kv_heads * head_dim
    k_params = 2 * layers * kv_heads * head_dim * 4 / visual_tokens
    v_params = {"channel": 2 * layers * kv_heads * head_dim * 4 / visual_tokens,
                "global": 2 * layers * kv_heads * 4 / visual_tokens,
                "token": 2 * layers * kv_heads * 4}[SCHEMES[scheme][1]]
    return values * bits / 8 + k_params + v_params
