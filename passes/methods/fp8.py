"""FP8 e4m3fn arithmetic in numpy (round to nearest even, saturating), and power-of-two scales.

Why here: DPQ's weights pass through FP8 between their INT4 storage and the matmul, and its
activations are FP8 with static scales; the compensation (``edgeq.passes.methods.dpq``), the numpy references and
the graph's QuantizeLinear(float8e4m3fn, saturate=1) must round identically. ``ml_dtypes`` (a
dependency of onnx itself) does the rounding; it does not saturate, so values are clipped to
+-448 first, which is what QuantizeLinear's ``saturate=1`` and the GPU's ``satfinite`` do.
"""

from __future__ import annotations

import math

import numpy as np

FP8_MAX = 448.0  # the largest finite float8 e4m3fn
# DPQ's protective range: the e4m3fn maximum less one INT4 step (1/15 of the range), so an
# INT4 value dequantized into the FP8 domain cannot overflow (docs/methods.md section 5).
DPQ_FP8_RANGE = FP8_MAX - FP8_MAX / 15


def round_fp8(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to the nearest float8 e4m3fn value (ties to even), saturated to +-448, as float64."""
    import ml_dtypes

    clipped = np.clip(np.asarray(x, np.float32), -FP8_MAX, FP8_MAX)
    return clipped.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def power_of_two_scale(amax: float, limit: float = DPQ_FP8_RANGE) -> float:
    """The smallest power of two ``s`` with ``amax / s <= limit`` (1.0 for an all-zero tensor)."""
    if not math.isfinite(amax):
        raise ValueError("power_of_two_scale: the tensor has inf or NaN")
    if amax <= 0.0:
        return 1.0
    s = 2.0 ** math.ceil(math.log2(amax / limit))
    while amax / s > limit:  # log2 rounding at exact powers of two
        s *= 2.0
    while amax / (s / 2) <= limit:
        s /= 2.0
    return s


def round_significant(x: np.ndarray, bits: int) -> np.ndarray:
    """``x`` rounded (ties to even) to ``bits`` significant bits: DPQ's group scales keep 7 so that
    ``(q - z) * s_g`` is exact in fp16 and fp32 (the Triton kernel's dequantization)."""
    mant, exp = np.frexp(np.asarray(x, np.float64))
    return np.ldexp(np.round(mant * 2.0 ** bits) / 2.0 ** bits, exp)
