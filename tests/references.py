"""Numpy references the tests hold edgeq's code against (not part of the library: nothing in
edgeq uses them)."""

from __future__ import annotations

import numpy as np

from edgeq.passes.methods.fp8 import round_fp8
from edgeq.quantize.quant import QuantSpec, dequantize, quantize


def fake_quant(x: np.ndarray, scale, zp, spec: QuantSpec) -> np.ndarray:
    """The numpy reference of a Q->DQ pair (per-tensor or already broadcast parameters)."""
    scale = np.asarray(scale, np.float32)
    zp = np.asarray(zp)
    return dequantize(quantize(x, scale, zp, spec), scale, zp)


def layer_error(x: np.ndarray, w_kn: np.ndarray, w_hat_kn: np.ndarray) -> float:
    """Mean squared output error of a linear over inputs ``x`` [tokens, K] ."""
    diff = np.asarray(x, np.float64) @ (np.asarray(w_kn, np.float64) - np.asarray(w_hat_kn, np.float64))
    return float(np.mean(diff ** 2))


def dpq_dequantize(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, s8: float, group_size: int) -> np.ndarray:
    """The real weight ``[K, N]`` of stored integers: ``s8 * fp8((q - z) * scale / s8)`` with the
    real-domain group ``scale`` [groups, N] (what the ONNX form DQ(INT4) -> Q/DQ(FP8, s8) computes)."""
    rows = np.arange(q.shape[0]) // group_size
    steps = (q.astype(np.float64) - zero_point.astype(np.float64)[rows]) * scale.astype(np.float64)[rows]
    return (s8 * round_fp8(steps.astype(np.float32) / s8)).astype(np.float32)
