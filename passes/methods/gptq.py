"""GPTQ (Frantar et al.): quantize a linear's weight column by column, pushing each column's rounding
error onto the columns not yet quantized through the inverse Hessian of the layer input.

Why: round-to-nearest 4-bit weights cost SmolLM2 a third of its perplexity; GPTQ minimizes the
layer's output error ``||X W - X Q||`` over the calibration inputs instead of the weight error,
which is what keeps 4-bit weights usable. Everything here is numpy on one weight; the passes
(``gptq``, ``dpq``) collect ``H = 2 X^T X / n`` per linear input and write the integers.

Conventions: the weight is given as the MatMul reads it, ``[K, N]`` (inputs x outputs); GPTQ runs
over the K input columns of ``W^T`` ``[N, K]``. Scales are per output channel (``[N]``) or per
group of ``group_size`` consecutive inputs (``[ceil(K / group_size), N]``, the last group shorter
when K is not a multiple, as DequantizeLinear's ``block_size`` allows), so the result goes
straight into the graph.

What a column becomes is the job of a column quantizer (``IntColumns`` here: one integer grid;
``edgeq.passes.methods.dpq.DpqColumns``: INT4 through FP8, DPQ's two levels), so the error that is propagated is
always against what the graph will compute with. The visiting order:

- ``natural``: columns in stored order; group parameters fitted when the sweep reaches the group,
  on its already-updated columns (the usual GPTQ choice);
- ``act_order``: by decreasing Hessian diagonal; the columns of one group are then visited out of
  order, so group parameters are fitted up front on the original weight ("static groups");
- ``gar`` (DPQ's group-aware reordering): inside each group by decreasing diagonal, whole groups by
  their largest diagonal. Groups stay consecutive in the stored weight (no runtime permutation),
  each group is swept as one run, so its parameters are fitted on updated columns as in natural.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edgeq.quantize.quant import QuantSpec, scale_zero_point

ORDERS = ("natural", "act_order", "gar")


@dataclass(frozen=True)
class GptqResult:
    q: np.ndarray  # [K, N] integers (int64 values, cast by the caller to the storage type)
    scale: np.ndarray  # [N] or [groups, N], float32: the real-domain scale of each integer step
    zero_point: np.ndarray  # same shape as scale, the spec's storage type
    dequantized: np.ndarray  # [K, N] float32: what the graph computes with
    fp8_scale: float | None = None  # DPQ: the per-tensor power-of-two FP8 scale s8


class ColumnQuantizer(Protocol):
    """Fits grid parameters on rows of weights and quantizes one column with them."""

    spec: QuantSpec

    @property
    def s8(self) -> float | None:
        """A per-tensor FP8 level below the integers (DPQ), else None (read only: an attribute will do)."""

    def fit(self, w_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def quantize(self, col: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(integers, the real values the graph computes with) of one column [N]."""

    def real_scale(self, scale: np.ndarray) -> np.ndarray:
        """The fitted scales as the real-domain step DequantizeLinear multiplies by."""


class IntColumns:
    """One integer grid (``spec``): RTN range, MSE-searched shrunk range, or ``full_range``.

    ``full_range`` (symmetric signed types): the value of largest magnitude maps to qmin exactly
    (scale = v / qmin, negative when v > 0), so all 2^b levels are used, as onnxruntime's
    MatMulNBits quantizer does, instead of the restricted [-qmax, qmax]. ``positive``: the scale
    stays positive (Qualcomm's HTP computes garbage with negative ones), scale =
    max(-min / -qmin, max / qmax): qmin is reached when the channel's extreme is negative, and the
    grid is never coarser than the restricted one."""

    s8 = None

    def __init__(self, spec: QuantSpec, mse: bool = False, full_range: bool = False, positive: bool = False):
        self.spec, self.mse, self.full_range, self.positive = spec, mse, full_range, positive

    def real_scale(self, scale: np.ndarray) -> np.ndarray:
        return scale

    def fit(self, w_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        spec = self.spec
        lo, hi = w_rows.min(1), w_rows.max(1)
        if self.full_range and self.positive:
            ext = np.maximum(np.maximum(-lo, 0) / -spec.qmin, np.maximum(hi, 0) / spec.qmax)
            scale = np.where(ext == 0, 1.0, ext).astype(np.float32)
            zp = np.zeros_like(scale, dtype=spec.np_dtype)
        elif self.full_range:
            ext = np.where(-lo > hi, lo, hi)
            scale = np.where(ext == 0, 1.0, ext / spec.qmin).astype(np.float32)
            zp = np.zeros_like(scale, dtype=spec.np_dtype)
        else:
            scale, zp = scale_zero_point(lo, hi, spec)
        if not self.mse:
            return scale, zp
        best = np.full(w_rows.shape[0], np.inf)
        for shrink in np.linspace(1.0, 0.55, 19):
            if self.full_range:
                s, z = (scale * shrink).astype(np.float32), zp
            else:
                s, z = scale_zero_point(lo * shrink, hi * shrink, spec)
            deq = (np.clip(np.round(w_rows / s[:, None]) + z[:, None], spec.qmin, spec.qmax) - z[:, None]) * s[:, None]
            err = ((w_rows - deq) ** 2).sum(1)
            better = err < best
            best[better], scale[better], zp[better] = err[better], s[better], z[better]
        return scale, zp

    def quantize(self, col, scale, zp):
        q = np.clip(np.round(col / scale) + zp, self.spec.qmin, self.spec.qmax)
        return q, (q - zp) * scale


def inverse_hessian_factor(hessian: np.ndarray, perm: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """(upper Cholesky factor of the damped H^-1 in the visiting order ``perm``, dead-input mask in
    that order). Inputs never seen (zero diagonal) get a unit diagonal; their weights are zeroed by
    the caller. ``hessian`` is only read.

    One K x K float64 working array, and nothing else of that size: at a 1.5B model's down_proj
    (K = 8960) one is 0.6 GB, and the textbook chain (Cholesky, inverse, product, Cholesky) holds
    five or six at once. The factor comes from one Cholesky of the Hessian in the reversed order:
    with R the reversal and L L^T = R H R, U = R L^-1 R is upper triangular with a positive
    diagonal and U^T U = H^-1, so it is H^-1's upper Cholesky factor; the Cholesky and the
    triangular inverse run in place, in blocks (``_cholesky_in_place``, ``_invert_lower_in_place``)."""
    reverse = np.asarray(perm)[::-1]
    h = np.asarray(hessian, np.float64)[np.ix_(reverse, reverse)]  # (the working array, a copy of its own)
    k = len(h)
    diagonal = h.reshape(-1)[::k + 1]  # (a view: h is a new contiguous array)
    dead = diagonal == 0
    diagonal[dead] = 1.0
    diagonal += damp * float(np.mean(diagonal))
    _cholesky_in_place(h)
    _invert_lower_in_place(h)
    return h[::-1, ::-1], dead[::-1]


_PANEL = 256


def _cholesky_in_place(a: np.ndarray) -> None:
    """``a`` (symmetric positive definite, C-contiguous) overwritten with its lower Cholesky factor
    (zeros above the diagonal), right-looking in blocks of ``_PANEL``: temporaries of one panel.
    Raises ``np.linalg.LinAlgError`` where ``a`` is not positive definite, as numpy's does."""
    n = len(a)
    for j in range(0, n, _PANEL):
        e = min(j + _PANEL, n)
        l11 = np.linalg.cholesky(a[j:e, j:e])
        a[j:e, j:e] = l11
        a[j:e, e:] = 0.0
        if e == n:
            break
        a[e:, j:e] = np.linalg.solve(l11, a[e:, j:e].T).T  # L21 = A21 L11^-T
        l21 = a[e:, j:e]
        for r in range(e, n, _PANEL):  # the trailing lower triangle: A22 -= L21 L21^T
            re = min(r + _PANEL, n)
            a[r:re, e:re] -= l21[r - e:re - e] @ l21[:re - e].T


def _invert_lower_in_place(a: np.ndarray) -> None:
    """``a`` (lower triangular, invertible) overwritten with its inverse, by halves:
    [[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]], B's rows replaced a panel at a time."""
    n = len(a)
    if n <= _PANEL:
        inverse = np.linalg.inv(a)
        inverse[np.triu_indices(n, 1)] = 0.0
        a[:] = inverse
        return
    h = n // 2
    _invert_lower_in_place(a[:h, :h])
    _invert_lower_in_place(a[h:, h:])
    b, c = a[h:, :h], a[h:, h:]
    for r in range(0, n - h, _PANEL):  # B := B A^-1
        b[r:r + _PANEL] = b[r:r + _PANEL] @ a[:h, :h]
    for r in reversed(range(0, n - h, _PANEL)):  # B := -C^-1 B, bottom up: rows above are still unchanged
        re = min(r + _PANEL, n - h)
        b[r:re] = -(c[r:re, :re] @ b[:re])


def group_slices(k: int, group_size: int) -> list[np.ndarray]:
    """The input indices of each group (one group of all K when ``group_size`` is 0)."""
    if not group_size:
        return [np.arange(k)]
    return [np.arange(g0, min(g0 + group_size, k)) for g0 in range(0, k, group_size)]


def column_order(diag: np.ndarray, group_size: int, order: str) -> np.ndarray:
    """The permutation GPTQ visits the K columns in (see the module docstring)."""
    k = len(diag)
    if order == "act_order":
        return np.argsort(-diag, kind="stable")
    if order == "gar" and group_size:
        groups = group_slices(k, group_size)
        inner = [grp[np.argsort(-diag[grp], kind="stable")] for grp in groups]
        rank = np.argsort([-diag[grp].max() for grp in groups], kind="stable")
        return np.concatenate([inner[g] for g in rank])
    if order not in ORDERS:
        raise ValueError(f"unknown GPTQ order '{order}', expected one of {ORDERS}")
    return np.arange(k)


def _blocks(perm: np.ndarray, group_size: int, block_size: int, aligned: bool) -> list[tuple[int, int]]:
    """Lazy-update blocks over the permuted columns; ``aligned``: each block holds whole groups,
    so a group's parameters can be fitted on its columns when the sweep reaches its first one."""
    k = len(perm)
    if not aligned:
        return [(i, min(i + block_size, k)) for i in range(0, k, block_size)]
    starts = [i for i in range(1, k) if perm[i] // group_size != perm[i - 1] // group_size]
    bounds, begin = [], 0
    for s in starts + [k]:  # close a block at the first group end at or past block_size columns
        if s - begin >= block_size or s == k:
            bounds.append((begin, s))
            begin = s
    return bounds


def _sweep(w: np.ndarray, u: np.ndarray, blocks: list[tuple[int, int]], quantize_column) -> tuple[np.ndarray, np.ndarray]:
    """The GPTQ column sweep over the permuted weight ``w`` [N, K] (updated in place) with the upper
    Cholesky factor ``u`` of the permuted inverse Hessian, in lazy-update ``blocks``.
    ``quantize_column(j, w1, i)`` returns (integers, real values) of permuted column j, which is
    column i of the block's updated columns ``w1``. Returns both as [N, K] in the permuted order."""
    n, k = w.shape
    q_int = np.zeros((n, k), np.int64)
    deq = np.zeros((n, k), np.float64)
    for i1, i2 in blocks:
        w1, err1 = w[:, i1:i2].copy(), np.zeros((n, i2 - i1))
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            q, d = quantize_column(i1 + i, w1, i)
            q_int[:, i1 + i], deq[:, i1 + i] = q, d
            e = (w1[:, i] - d) / u1[i, i]
            w1[:, i:] -= np.outer(e, u1[i, i:])
            err1[:, i] = e
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    return q_int, deq


def gptq_quantize(w_kn: np.ndarray, hessian: np.ndarray, spec: QuantSpec, group_size: int = 0,
                  block_size: int = 128, damp: float = 0.01, act_order: bool = False,
                  mse: bool = False, full_range: bool = False, order: str | None = None,
                  columns: ColumnQuantizer | None = None,
                  subsets: list[tuple[np.ndarray, ColumnQuantizer]] | None = None) -> GptqResult:
    """GPTQ of one weight ``[K, N]`` against the input Hessian ``[K, K]`` (per output channel when
    ``group_size`` is 0, else per group of ``group_size`` inputs). ``order`` overrides
    ``act_order``; ``columns`` overrides the integer grid built from ``spec``/``mse``/``full_range``.

    ``subsets`` (mixed precision, ResQ): disjoint input index sets covering K, each with its own
    grid and per-output-channel scale (fitted up front); the result then has one scale row per
    subset (``[len(subsets), N]``) and ``q`` holds each row's integers on its subset's grid."""
    order = order or ("act_order" if act_order else "natural")
    if order not in ORDERS:
        raise ValueError(f"unknown GPTQ order '{order}', expected one of {ORDERS}")
    cq = columns or IntColumns(spec, mse, full_range)
    if subsets is not None:
        return _gptq_subsets(w_kn, hessian, subsets, block_size, damp, order)
    spec = cq.spec
    k, n = w_kn.shape
    w = np.array(w_kn.T, np.float64)  # [N, K]
    diag = np.diag(np.asarray(hessian, np.float64))
    perm = column_order(diag, group_size, order)
    inv_perm = np.argsort(perm)
    u, dead = inverse_hessian_factor(hessian, perm, damp)
    w = w[:, perm]
    w[:, dead] = 0.0
    groups = group_slices(k, group_size)
    scale = np.zeros((len(groups), n), np.float64)
    zp = np.zeros((len(groups), n), np.int64)
    dynamic = bool(group_size) and order != "act_order"
    if not dynamic:  # parameters fitted up front on the original weight
        for g, cols in enumerate(groups):
            scale[g], zp[g] = cq.fit(np.array(w_kn.T, np.float64)[:, cols])
    size = {g: len(cols) for g, cols in enumerate(groups)}

    def quantize_column(j: int, w1: np.ndarray, i: int):
        g = int(perm[j]) // group_size if group_size else 0
        if dynamic and (j == 0 or int(perm[j - 1]) // group_size != g):
            scale[g], zp[g] = cq.fit(w1[:, i:i + size[g]])  # the group's updated columns
        return cq.quantize(w1[:, i], scale[g], zp[g])

    q_int, deq = _sweep(w, u, _blocks(perm, group_size, block_size, dynamic), quantize_column)
    q_int, deq = q_int[:, inv_perm], deq[:, inv_perm]
    scale = cq.real_scale(scale)
    if not group_size:
        scale, zp = scale[0], zp[0]
    return GptqResult(q_int.T.copy(), scale.astype(np.float32), zp.astype(spec.np_dtype), deq.T.astype(np.float32),
                      cq.s8)


def _gptq_subsets(w_kn: np.ndarray, hessian: np.ndarray, subsets: list[tuple[np.ndarray, ColumnQuantizer]],
                  block_size: int, damp: float, order: str) -> GptqResult:
    """The GPTQ sweep with one grid per input subset (see ``gptq_quantize``)."""
    k, n = w_kn.shape
    group_of = np.full(k, -1)
    for g, (cols, _) in enumerate(subsets):
        group_of[np.asarray(cols)] = g
    if (group_of < 0).any():
        raise ValueError("subsets must cover every input")
    w = np.array(w_kn.T, np.float64)
    diag = np.diag(np.asarray(hessian, np.float64))
    perm = column_order(diag, 0, order)
    inv_perm = np.argsort(perm)
    u, dead = inverse_hessian_factor(hessian, perm, damp)
    scale = np.zeros((len(subsets), n), np.float64)
    zp = np.zeros((len(subsets), n), np.int64)
    for g, (cols, cq) in enumerate(subsets):
        scale[g], zp[g] = cq.fit(w[:, np.asarray(cols)])
    w = w[:, perm]
    w[:, dead] = 0.0

    def quantize_column(j: int, w1: np.ndarray, i: int):
        g = group_of[perm[j]]
        return subsets[g][1].quantize(w1[:, i], scale[g], zp[g])

    q_int, deq = _sweep(w, u, _blocks(perm, 0, block_size, False), quantize_column)
    q_int, deq = q_int[:, inv_perm], deq[:, inv_perm]
    return GptqResult(q_int.T.copy(), scale.astype(np.float32), zp, deq.T.astype(np.float32))
