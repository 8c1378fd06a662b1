"""CalibQuant's calibration (paper 001, section 4.2): choose the logit-calibration pair (tau1, tau2)
by grid search over {0, 1, 2, 3}^2, and the range-clipping factors of the low-bit visual cache,
minimizing the attention-output error of the quantized cache against float attention on
calibration samples.

Why a search on attention outputs: the calibration ``g`` pulls the extreme pre-softmax logits that
low-bit keys exaggerate back towards the float distribution, and clipping trades saturation of the
extreme channels for resolution everywhere else; how much of either helps depends on the model, so
the paper fixes tau from a small grid (the released code hard-codes (0, 3)) and the released code
hard-codes 1-bit clip factors (K 0.5, V 0.3). Here both are measured, per sample, on what the
decode step consumes (the attention output), with exactly the numbers ``edgeq::VisualKVAttention``
(or the KIVI comparator) computes, through their numpy references. The error of one sample is
relative (squared error over the float output's mean square), so layers with large values do not
decide for all. ``kvquant`` feeds these searches the post-RoPE queries, keys and values of
calibration prompts.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from edgeq.kv_cache import VisualCacheSpec, quantize_visual_kv

TAU_GRID = (0.0, 1.0, 2.0, 3.0)
CLIP_GRID = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1)


@dataclass(frozen=True)
class AttentionSample:
    """One layer's decode-time attention inputs: queries [B, H, S, D]; visual and text keys and
    values [B, KVH, N, D] (float, before quantization); an optional additive mask
    (broadcastable to [B, H, S, Nv + Nt])."""

    q: np.ndarray
    k_visual: np.ndarray
    v_visual: np.ndarray
    k_text: np.ndarray
    v_text: np.ndarray
    mask: np.ndarray | None = None


@dataclass(frozen=True)
class TauChoice:
    tau1: float
    tau2: float
    error: float  # mean relative attention-output error at the chosen pair
    uncalibrated_error: float  # the same without calibration
    errors: dict[tuple[float, float], float] = field(default_factory=dict)  # every grid point


@dataclass(frozen=True)
class ClipChoice:
    k_clip: float
    v_clip: float
    error: float  # mean relative attention-output error at the chosen factors (no logit calibration)
    unclipped_error: float
    errors: dict[str, float] = field(default_factory=dict)  # "k=0.5,v=1.0" -> error, every point tried


def float_attention(sample: AttentionSample) -> np.ndarray:
    """Exact attention of the sample in float64 (visual tokens first, then text; GQA by head)."""
    q = np.asarray(sample.q, np.float64)
    rep = q.shape[1] // sample.k_visual.shape[1]
    k = np.repeat(np.concatenate([sample.k_visual, sample.k_text], axis=-2).astype(np.float64), rep, axis=1)
    v = np.repeat(np.concatenate([sample.v_visual, sample.v_text], axis=-2).astype(np.float64), rep, axis=1)
    logits = np.einsum("bhsd,bhnd->bhsn", q, k) / math.sqrt(q.shape[-1])
    if sample.mask is not None:
        logits = logits + np.asarray(sample.mask, np.float64)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhsn,bhnd->bhsd", p, v)


def _attend(sample: AttentionSample, cache: dict, spec: VisualCacheSpec, tau1: float, tau2: float,
            calibrate: bool) -> np.ndarray:
    from edgeq.runtime_ops import visual_kv_attention as vk

    reference = vk.visual_kv_attention_kivi_reference if spec.scheme == "kivi" else vk.visual_kv_attention_reference
    (y,) = reference(sample.q, cache["key_codes"], cache["key_alpha"], cache["key_scale"], cache["value_codes"],
                     cache["value_alpha"], cache["value_scale"], sample.k_text, sample.v_text, sample.mask,
                     bits=spec.bits, tau1=tau1, tau2=tau2, calibrate=int(calibrate))
    return y.astype(np.float64)


def quantized_attention(sample: AttentionSample, bits: int, tau1: float = 0.0, tau2: float = 0.0,
                        calibrate: bool = True, spec: VisualCacheSpec | None = None) -> np.ndarray:
    """The op's output with the sample's visual K/V quantized by ``spec`` (default: CalibQuant's
    channel-wise K and V at ``bits``, no clipping)."""
    spec = replace(spec or VisualCacheSpec(), bits=bits)
    return _attend(sample, quantize_visual_kv(sample.k_visual, sample.v_visual, spec), spec, tau1, tau2, calibrate)


def relative_error(y: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean((y - exact) ** 2) / max(float(np.mean(exact ** 2)), 1e-30))


class _Errors:
    """Mean relative error over the samples for a spec and (tau1, tau2); quantized caches are
    computed once per spec."""

    def __init__(self, samples: list[AttentionSample]):
        if not samples:
            raise ValueError("calibration needs at least one attention sample")
        self.samples = samples
        self.exact = [float_attention(s) for s in samples]
        self._caches: dict[VisualCacheSpec, list[dict]] = {}

    def __call__(self, spec: VisualCacheSpec, tau1: float = 0.0, tau2: float = 0.0, calibrate: bool = False) -> float:
        if spec not in self._caches:
            self._caches = {spec: [quantize_visual_kv(s.k_visual, s.v_visual, spec) for s in self.samples]}
        errs = [relative_error(_attend(s, c, spec, tau1, tau2, calibrate), e)
                for s, c, e in zip(self.samples, self._caches[spec], self.exact)]
        return float(np.mean(errs))


def search_tau(samples: list[AttentionSample], bits: int, grid: tuple[float, ...] = TAU_GRID,
               spec: VisualCacheSpec | None = None) -> TauChoice:
    """The (tau1, tau2) of ``grid`` x ``grid`` with the least mean relative attention-output error
    over ``samples`` (ties: the first in grid order, so (0, 0), i.e. no calibration, wins ties)."""
    spec = replace(spec or VisualCacheSpec(), bits=bits)
    error = _Errors(samples)
    errors = {(t1, t2): error(spec, t1, t2, True) for t1, t2 in itertools.product(grid, grid)}
    best = min(errors, key=errors.__getitem__)
    return TauChoice(best[0], best[1], errors[best], error(spec), errors)


def search_clip(samples: list[AttentionSample], spec: VisualCacheSpec, grid: tuple[float, ...] = CLIP_GRID) -> ClipChoice:
    """Range-clipping factors for K and V by coordinate descent over ``grid`` (K with V unclipped,
    then V with the chosen K), without logit calibration; 1.0 (no clipping) wins ties."""
    error = _Errors(samples)
    errors: dict[str, float] = {}

    def at(k: float, v: float) -> float:
        key = f"k={k:g},v={v:g}"
        if key not in errors:
            errors[key] = error(replace(spec, k_clip=k, v_clip=v))
        return errors[key]

    grid = tuple(sorted(set(grid) | {1.0}, reverse=True))
    k_best = min(grid, key=lambda k: at(k, 1.0))
    v_best = min(grid, key=lambda v: at(k_best, v))
    return ClipChoice(k_best, v_best, at(k_best, v_best), at(1.0, 1.0), errors)
