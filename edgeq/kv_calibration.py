"""CalibQuant's logit-calibration search (paper 001, section 4.2): choose (tau1, tau2) once for a
model by grid search over {0, 1, 2, 3}^2, minimizing the attention-output error of the quantized
visual KV cache against float attention on calibration samples.

Why a search on attention outputs: the calibration ``g`` pulls the extreme pre-softmax logits that
low-bit keys exaggerate back towards the float distribution; how far depends on the model, so the
paper fixes the pair from a small grid, and the released code hard-codes (0, 3). Here the error is
measured, per sample, on what the decode step consumes (the attention output), with exactly the
numbers ``edgeq::VisualKVAttention`` computes (its numpy reference). The ``kvquant`` pass of the
CalibQuant issue feeds it the post-RoPE queries, keys and values of calibration prompts.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from edgeq.runtime_ops.visual_kv_attention import pack_codes, quantize_channelwise, visual_kv_attention_reference

TAU_GRID = (0.0, 1.0, 2.0, 3.0)


@dataclass(frozen=True)
class AttentionSample:
    """One layer's decode-time attention inputs: queries [B, H, S, D]; visual and text keys and
    values [B, KVH, N, D] (float, before quantization); an optional additive mask."""

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
    error: float  # mean squared attention-output error at the chosen pair
    uncalibrated_error: float  # the same without calibration
    errors: dict[tuple[float, float], float] = field(default_factory=dict)  # every grid point


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


def quantized_attention(sample: AttentionSample, bits: int, tau1: float, tau2: float, calibrate: bool) -> np.ndarray:
    """``edgeq::VisualKVAttention``'s output with the sample's visual K/V quantized channel-wise."""
    kc, ka, ks = quantize_channelwise(sample.k_visual, bits)
    vc, va, vs = quantize_channelwise(sample.v_visual, bits)
    (y,) = visual_kv_attention_reference(sample.q, pack_codes(kc, bits), ka, ks, pack_codes(vc, bits), va, vs,
                                         sample.k_text, sample.v_text, sample.mask, bits=bits, tau1=tau1,
                                         tau2=tau2, calibrate=int(calibrate))
    return y.astype(np.float64)


def search_tau(samples: list[AttentionSample], bits: int, grid: tuple[float, ...] = TAU_GRID) -> TauChoice:
    """The (tau1, tau2) of ``grid`` x ``grid`` with the least mean squared attention-output error
    over ``samples`` (ties: the first in grid order, so (0, 0), i.e. no calibration, wins ties)."""
    if not samples:
        raise ValueError("search_tau needs at least one calibration sample")
    exact = [float_attention(s) for s in samples]

    def error(tau1: float, tau2: float, calibrate: bool = True) -> float:
        sq = [np.mean((quantized_attention(s, bits, tau1, tau2, calibrate) - e) ** 2) for s, e in zip(samples, exact)]
        return float(np.mean(sq))

    errors = {(t1, t2): error(t1, t2) for t1, t2 in itertools.product(grid, grid)}
    best = min(errors, key=errors.get)
    return TauChoice(best[0], best[1], errors[best], error(0.0, 0.0, calibrate=False), errors)
