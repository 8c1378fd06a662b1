"""ResQ's projections (paper 002, section 4.2): a PCA basis whose high-variance subspace is kept at
high precision, with a random rotation inside each subspace.

Why: Theorem 4.2 bounds the mixed-precision quantization error by a term that shrinks as the
energy ``||X P_h||`` of the high-precision subspace grows, which PCA maximizes: the eigenvectors
of the activation covariance with the largest eigenvalues. Inside each subspace a random
orthogonal rotation spreads outliers (activations become near-Gaussian), so one scale per
subspace fits. ``U = P blockdiag(R_low, R_high)`` with P's columns in increasing eigenvalue order,
so the LAST ``rank`` channels of ``x U`` are the high-precision ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeq.runtime_ops.hadamard import random_orthogonal


@dataclass(frozen=True)
class SubspaceBasis:
    u: np.ndarray  # [d, d] orthogonal, float64: activations are projected as x @ u
    eigenvalues: np.ndarray  # [d] ascending (after damping)
    rank: int  # the last ``rank`` columns of u span the high-variance subspace

    @property
    def high_energy_fraction(self) -> float:
        """Share of the activation variance the high-precision subspace holds."""
        return float(self.eigenvalues[-self.rank:].sum() / self.eigenvalues.sum())


def subspace_basis(cov: np.ndarray, rank: int, seed: int = 0, damp: float = 0.01) -> SubspaceBasis:
    """``U = P blockdiag(R_low, R_high)`` from a covariance ``cov`` [d, d] (float64, symmetric PSD):
    eigendecomposition after ``damp`` x mean(diag) is added to the diagonal, eigenvectors ascending,
    R seeded Haar-random orthogonal (``seed`` for the low block, ``seed + 1`` for the high one)."""
    cov = np.asarray(cov, np.float64)
    d = cov.shape[0]
    if cov.shape != (d, d):
        raise ValueError(f"covariance must be square, got {cov.shape}")
    if not 0 < rank < d:
        raise ValueError(f"rank must be in [1, {d - 1}], got {rank}")
    sym = (cov + cov.T) / 2 + damp * float(np.mean(np.diag(cov))) * np.eye(d)
    vals, vecs = np.linalg.eigh(sym)  # ascending
    rot = np.zeros((d, d))
    rot[: d - rank, : d - rank] = random_orthogonal(d - rank, seed)
    rot[d - rank:, d - rank:] = random_orthogonal(rank, seed + 1)
    return SubspaceBasis(vecs @ rot, vals, rank)


def linf_basis(absmax: np.ndarray, rank: int, seed: int = 0) -> SubspaceBasis:
    """ResQ's Table 4 baseline (QUIK-style outlier channels + QuaRot-style rotation): the
    ``rank`` channels with the largest calibrated |x| max form the high-precision group, a
    seeded random rotation inside each group. ``eigenvalues`` holds the sorted absmax."""
    absmax = np.asarray(absmax, np.float64).reshape(-1)
    d = absmax.shape[0]
    if not 0 < rank < d:
        raise ValueError(f"rank must be in [1, {d - 1}], got {rank}")
    order = np.argsort(absmax, kind="stable")  # ascending: the last ``rank`` are the outliers
    perm = np.eye(d)[:, order]
    rot = np.zeros((d, d))
    rot[: d - rank, : d - rank] = random_orthogonal(d - rank, seed)
    rot[d - rank:, d - rank:] = random_orthogonal(rank, seed + 1)
    return SubspaceBasis(perm @ rot, absmax[order] ** 2, rank)
