"""GPTQ (Frantar et al.): quantize a linear's weight column by column, pushing each column's rounding
error onto the columns not yet quantized through the inverse Hessian of the layer input.

Why: round-to-nearest 4-bit weights cost SmolLM2 a third of its perplexity; GPTQ minimizes the
layer's output error ``||X W - X Q||`` over the calibration inputs instead of the weight error,
which is what keeps 4-bit weights usable. Everything here is numpy on one weight; the pass
(``edgeq.passes.gptq``) collects ``H = 2 X^T X / n`` per linear input and writes the integers.

Conventions: the weight is given as the MatMul reads it, ``[K, N]`` (inputs x outputs); GPTQ runs
over the K input columns of ``W^T`` ``[N, K]``. Scales are per output channel (``[N]``) or per
group of ``group_size`` consecutive inputs (``[K / group_size, N]``), the layouts
``DequantizeLinear`` reads (axis 1, or axis 0 with ``block_size``; the last group is shorter when
K is not a multiple, as ``block_size`` allows), so the result goes straight into the graph. Group parameters are fitted when the sweep reaches the group, on the already-updated
columns (the usual GPTQ choice); with ``act_order`` they are fitted up front on the original
weight ("static groups"), since the columns of one group are then visited out of order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeq.quant import QuantSpec, scale_zero_point


@dataclass(frozen=True)
class GptqResult:
    q: np.ndarray  # [K, N] integers (int64 values, cast by the caller to the storage type)
    scale: np.ndarray  # [N] or [K / group_size, N], float32
    zero_point: np.ndarray  # same shape as scale, the spec's storage type
    dequantized: np.ndarray  # [K, N] float32: what the graph computes with


def _fit(w_rows: np.ndarray, spec: QuantSpec, mse: bool, full_range: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point per row of ``w_rows`` [N, m] (RTN range, or the MSE-best shrunk range).

    ``full_range`` (symmetric signed types): the value of largest magnitude maps to qmin exactly
    (scale = v / qmin, negative when v > 0), so all 2^b levels are used, as onnxruntime's
    MatMulNBits quantizer does, instead of the restricted [-qmax, qmax]."""
    lo, hi = w_rows.min(1), w_rows.max(1)
    if full_range:
        ext = np.where(-lo > hi, lo, hi)
        scale = np.where(ext == 0, 1.0, ext / spec.qmin).astype(np.float32)
        return scale, np.zeros_like(scale, dtype=spec.np_dtype)
    scale, zp = scale_zero_point(lo, hi, spec)
    if not mse:
        return scale, zp
    best = np.full(w_rows.shape[0], np.inf)
    for shrink in np.linspace(1.0, 0.55, 19):
        s, z = scale_zero_point(lo * shrink, hi * shrink, spec)
        deq = (np.clip(np.round(w_rows / s[:, None]) + z[:, None], spec.qmin, spec.qmax) - z[:, None]) * s[:, None]
        err = ((w_rows - deq) ** 2).sum(1)
        better = err < best
        best[better], scale[better], zp[better] = err[better], s[better], z[better]
    return scale, zp


def _quantize_column(w: np.ndarray, scale: np.ndarray, zp: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray]:
    q = np.clip(np.round(w / scale) + zp, spec.qmin, spec.qmax)
    return q, (q - zp) * scale


def inverse_hessian_factor(h: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """(upper Cholesky factor of H^-1 after damping, dead-input mask). Inputs never seen (zero
    diagonal) get a unit diagonal; their weights are zeroed by the caller."""
    h = np.array(h, np.float64, copy=True)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += damp * float(np.mean(np.diag(h)))
    lower = np.linalg.cholesky(h)
    inv_lower = np.linalg.solve(lower, np.eye(len(h)))
    h_inv = inv_lower.T @ inv_lower
    return np.linalg.cholesky(h_inv).T, dead


def gptq_quantize(w_kn: np.ndarray, hessian: np.ndarray, spec: QuantSpec, group_size: int = 0,
                  block_size: int = 128, damp: float = 0.01, act_order: bool = False,
                  mse: bool = False, full_range: bool = False) -> GptqResult:
    """GPTQ of one weight ``[K, N]`` against the input Hessian ``[K, K]`` (per output channel when
    ``group_size`` is 0, else per group of ``group_size`` inputs)."""
    k, n = w_kn.shape
    w = np.array(w_kn.T, np.float64)  # [N, K]
    u, dead = inverse_hessian_factor(hessian, damp)
    w[:, dead] = 0.0
    perm = np.argsort(-np.diag(hessian), kind="stable") if act_order else np.arange(k)
    inv_perm = np.argsort(perm)
    if act_order:
        h = np.asarray(hessian, np.float64)[np.ix_(perm, perm)]
        h = np.where(np.eye(k, dtype=bool) & (np.diag(h) == 0)[:, None], 1.0, h)
        u, _ = inverse_hessian_factor(h, damp)
    groups = -(-k // group_size) if group_size else 1  # the last group may be shorter (K = 576, g = 128)
    scale = np.zeros((groups, n), np.float64)
    zp = np.zeros((groups, n), np.int64)
    if not group_size or act_order:  # parameters fitted up front on the original weight
        for g in range(groups):
            cols = slice(g * group_size, min((g + 1) * group_size, k)) if group_size else slice(None)
            s, z = _fit(w[:, cols], spec, mse, full_range)
            scale[g], zp[g] = s, z
    fitted = np.zeros(groups, bool) if group_size and not act_order else np.ones(groups, bool)
    w = w[:, perm]
    q_int = np.zeros((n, k), np.int64)
    deq = np.zeros((n, k), np.float64)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1, err1 = w[:, i1:i2].copy(), np.zeros((n, i2 - i1))
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // group_size if group_size else 0
            if not fitted[g]:  # in order: the group's columns are this one and the next ones
                stop = min(i + group_size, i2 - i1)
                rest = np.concatenate([w1[:, i:stop], w[:, i1 + stop:min(i1 + i + group_size, k)]], axis=1)
                scale[g], zp[g] = _fit(rest, spec, mse, full_range)
                fitted[g] = True
            q, d = _quantize_column(w1[:, i], scale[g], zp[g], spec)
            q_int[:, i1 + i], deq[:, i1 + i] = q, d
            e = (w1[:, i] - d) / u1[i, i]
            w1[:, i:] -= np.outer(e, u1[i, i:])
            err1[:, i] = e
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    q_int, deq = q_int[:, inv_perm], deq[:, inv_perm]
    if not group_size:
        scale, zp = scale[0], zp[0]
    return GptqResult(q_int.T.copy(), scale.astype(np.float32), zp.astype(spec.np_dtype), deq.T.astype(np.float32))


def layer_error(x: np.ndarray, w_kn: np.ndarray, w_hat_kn: np.ndarray) -> float:
    """Mean squared output error of a linear over inputs ``x`` [tokens, K] (tests, ablations)."""
    diff = np.asarray(x, np.float64) @ (np.asarray(w_kn, np.float64) - np.asarray(w_hat_kn, np.float64))
    return float(np.mean(diff ** 2))
