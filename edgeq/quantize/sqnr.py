"""Signal-to-quantization-noise ratio in dB: the one SQNR of edgeq, 10 log10(sum ref^2 / sum (out -
ref)^2). Beside ``edgeq.quantize.quant``, below everything that reports it: the pass manager's numerics
check (``edgeq.passmanager.pipeline``), model comparison (``edgeq.evaluate.compare``, from streamed energies)
and the tests."""

from __future__ import annotations

import math

import numpy as np


def sqnr_db(ref: np.ndarray, out: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``out`` against ``ref`` in dB (inf when equal)."""
    ref = np.asarray(ref, np.float64)
    err = ref - np.asarray(out, np.float64)
    return sqnr_from_energies(float(np.sum(ref * ref)), float(np.sum(err * err)))


def sqnr_from_energies(sum_ref2: float, sum_err2: float) -> float:
    """10 log10(signal energy / error energy); inf for no error, -inf for error on a zero signal."""
    if math.isnan(sum_ref2) or math.isnan(sum_err2):
        return math.nan
    if sum_err2 == 0.0:
        return math.inf
    if sum_ref2 == 0.0:
        return -math.inf
    return 10.0 * math.log10(sum_ref2 / sum_err2)
