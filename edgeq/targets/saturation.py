"""onnxruntime's uint8 x int8 integer kernels on x86 without VNNI, in numpy: where they saturate,
and the weight grid that cannot saturate.

What MLAS (onnxruntime's CPU math library) does, read from its dispatch code
(``onnxruntime/core/mlas/lib/platform.cpp``) and checked on an AVX2 machine
(``tests/test_saturation.py``):

- ``MatMulIntegerToFloat`` / ``QGemm`` / ``MatMulInteger`` with a uint8 activation and an int8
  weight take ``GemmU8S8Kernel``. On AVX2 (``MlasGemmU8S8KernelAvx2``) and on AVX-512 without
  VNNI (``...Avx512Core``) it multiplies with VPMADDUBSW: the two products of an adjacent pair
  of the K axis, (2j, 2j + 1), are summed into a *saturating int16*; VPMADDWD by ones then adds
  int16 pairs into int32 exactly. AVX-VNNI, AVX-512 VNNI (VPDPBUSD) and AMX accumulate the
  products in int32 and do not saturate; neither do ARM64's kernels.
- The codes are the raw integers (zero points are corrected afterwards from row and column
  sums), so a "symmetric" uint8 activation (zero point 128) sits around 128 and a full-range
  int8 weight pushes ``u0 q0 + u1 q1`` past 32767.
- int8 activations are turned into uint8 (code + 128) by onnxruntime on x86 and take the same
  kernel; uint8 weights take the U8U8 kernel (int16 widening + VPMADDWD: exact, about 2x slower
  on AVX2); 4-bit weights widened to int8 cannot reach the limit.

Saturation-free by construction: with activation codes anywhere in [0, 255], ``|u0 q0 + u1 q1|``
is at most ``255 (|q0| + |q1|)`` for same-sign pairs and ``255 max(|q0|, |q1|)`` otherwise. So
weight codes with ``|q0| + |q1| <= 128`` for every same-sign adjacent pair along K never saturate
(255 x 128 = 32640; 129 would overflow). The pair-bounded grid takes the per-channel scale
``max(largest same-sign pair sum / 128, max |w| / 127)``: between the 8-bit grid (a pair whose
large weight sits next to a small one) and the 7-bit grid of onnxruntime's ``reduce_range`` /
NNCF's ``overflow_fix`` (a pair of two maxima), always at least as fine as the 7-bit one. Rounding
can leave a pair at 129 or 130; ``fix_pairs`` takes one step off the element whose rounding went
up the most.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the pair-bounded grid is quantization math (edgeq.quantize.quant); the kernel model is here
from edgeq.quantize.quant import (PAIR_LIMIT, adjacent_pairs, column_blocks, fix_pairs, is_saturation_free, pair_bounded_scale, pair_magnitudes,
                         quantize_pair_bounded, worst_pair)

INT16_MIN, INT16_MAX = -32768, 32767
__all__ = ["PAIR_LIMIT", "fix_pairs", "is_saturation_free", "pair_bounded_scale", "pair_magnitudes", "quantize_pair_bounded",
           "simulate_linear", "vpmaddubsw_matmul", "worst_pair", "SaturationStats"]


def vpmaddubsw_matmul(a_u8: np.ndarray, b_s8: np.ndarray, entries_per_chunk: int = 4096) -> tuple[np.ndarray, int, int]:
    """``a [M, K] uint8 @ b [K, N] int8`` the way MLAS's AVX2 / AVX-512 (no VNNI) kernel computes
    it: adjacent-K pair sums clamped to int16, then int32 accumulation.

    The exact product comes from one float64 matmul (exact at these magnitudes); only the (pair,
    column) entries that can leave int16 at all (same-sign weight pairs with |q0| + |q1| > 128)
    are then evaluated per row and their clamping added. Returns (int64 result [M, N], pair sums
    that saturated, pair sums in all)."""
    a = np.asarray(a_u8, np.int64)
    b = np.asarray(b_s8, np.int64)
    if a.shape[1] % 2:
        a = np.concatenate([a, np.zeros((a.shape[0], 1), np.int64)], axis=1)
    b0, b1 = adjacent_pairs(b)
    out = np.rint(a.astype(np.float64) @ np.concatenate([b, np.zeros((a.shape[1] - b.shape[0], b.shape[1]), np.int64)])
                  .astype(np.float64)).astype(np.int64)
    risky_j, risky_n = np.nonzero(((b0 >= 0) == (b1 >= 0)) & (np.abs(b0) + np.abs(b1) > PAIR_LIMIT))
    saturated = 0
    correction = np.zeros((b.shape[1], a.shape[0]), np.int64)  # [N, M]
    for e in range(0, risky_j.size, entries_per_chunk):
        j, n = risky_j[e:e + entries_per_chunk], risky_n[e:e + entries_per_chunk]
        sums = a[:, 2 * j] * b0[j, n] + a[:, 2 * j + 1] * b1[j, n]  # [M, E]
        clipped = np.clip(sums, INT16_MIN, INT16_MAX) - sums
        saturated += int(np.count_nonzero(clipped))
        np.add.at(correction, n, clipped.T)
    return out + correction.T, saturated, a.shape[0] * b0.shape[0] * b0.shape[1]


@dataclass(frozen=True)
class SaturationStats:
    """What the VPMADDUBSW model predicts for one linear on given activation codes."""

    pair_rate: float  # fraction of int16 pair sums clamped
    output_rate: float  # fraction of outputs that differ from the exact integer product
    rel_error: float  # ||kernel - exact|| / ||exact|| over the zero-point-corrected products

    def to_dict(self) -> dict:
        return {"pair_rate": self.pair_rate, "output_rate": self.output_rate, "rel_error": self.rel_error}


def simulate_linear(a_codes: np.ndarray, a_zero_point: int, q_kn: np.ndarray, w_zero_point: np.ndarray | int = 0) -> SaturationStats:
    """Run the model on one linear: activation codes [M, K] (uint8, or int8 which onnxruntime
    shifts to uint8 by +128 on x86), weight codes [K, N] int8. Taken in column blocks
    (``edgeq.quantize.quant.column_blocks``): a vocabulary head's codes widened to int64 at once would be
    gigabytes."""
    a = np.asarray(a_codes)
    zp = int(a_zero_point)
    if a.dtype == np.int8:
        a, zp = a.astype(np.int64) + 128, zp + 128
    a = a.astype(np.int64)
    a_rows = a.sum(axis=1, keepdims=True)
    wz = np.broadcast_to(np.asarray(w_zero_point, np.int64), (q_kn.shape[1],))
    saturated = total = changed = outputs = 0
    diff_sq = ref_sq = 0.0
    for cols in column_blocks(q_kn):
        q = np.asarray(q_kn[:, cols], np.int64)
        kernel, block_saturated, block_total = vpmaddubsw_matmul(a, q)
        exact = a @ q
        # zero-point-corrected products (what the kernel hands to the float scale)
        correction = zp * q.sum(axis=0)[None] + a_rows * wz[None, cols] - zp * wz[None, cols] * q.shape[0]
        ref = (exact - correction).astype(np.float64)
        diff = (kernel - exact).astype(np.float64)
        saturated, total = saturated + block_saturated, total + block_total
        changed, outputs = changed + int(np.count_nonzero(diff)), outputs + diff.size
        diff_sq += float(np.sum(diff * diff))
        ref_sq += float(np.sum(ref * ref))
    denom = float(np.sqrt(ref_sq))
    return SaturationStats(
        pair_rate=saturated / max(total, 1),
        output_rate=changed / max(outputs, 1),
        rel_error=float(np.sqrt(diff_sq)) / denom if denom else 0.0,
    )
