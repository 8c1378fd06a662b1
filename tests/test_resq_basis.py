"""ResQ's basis on a hand-built covariance: orthogonal, the last ``rank`` columns span exactly the
top-``rank`` eigenvectors (the high-precision tail), eigenvalues ascending, rotations seeded."""

from __future__ import annotations

import numpy as np
import pytest

from edgeq.passes.methods.resq import subspace_basis


def _covariance(d=24, seed=0):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    vals = np.linspace(1.0, 2.0, d)
    vals[[3, 11, 17]] = [50.0, 80.0, 65.0]  # three dominant directions, not at the end
    return q @ np.diag(vals) @ q.T, q, vals


def test_high_subspace_is_the_top_eigenvectors():
    cov, q, vals = _covariance()
    basis = subspace_basis(cov, rank=3, seed=5, damp=0.0)
    u = basis.u
    np.testing.assert_allclose(u.T @ u, np.eye(24), atol=1e-12)
    top = q[:, [3, 11, 17]]
    np.testing.assert_allclose(u[:, -3:] @ u[:, -3:].T, top @ top.T, atol=1e-10)  # same subspace
    assert np.all(np.diff(basis.eigenvalues) >= 0)
    np.testing.assert_allclose(basis.eigenvalues[-3:], [50.0, 65.0, 80.0], rtol=1e-10)
    assert basis.high_energy_fraction == pytest.approx(195.0 / vals.sum())
    # the projected covariance is block diagonal: no energy crosses between the subspaces
    proj = u.T @ cov @ u
    np.testing.assert_allclose(proj[:-3, -3:], 0.0, atol=1e-9)


def test_rotation_inside_subspaces_is_seeded_and_damping_keeps_order():
    cov, _, _ = _covariance()
    a = subspace_basis(cov, 4, seed=1).u
    np.testing.assert_array_equal(a, subspace_basis(cov, 4, seed=1).u)
    assert not np.allclose(a, subspace_basis(cov, 4, seed=2).u)
    plain = subspace_basis(cov, 4, damp=0.0).eigenvalues
    damped = subspace_basis(cov, 4, damp=0.01).eigenvalues
    np.testing.assert_allclose(damped - plain, 0.01 * np.mean(np.diag(cov)), rtol=1e-9)


@pytest.mark.parametrize("rank", [0, 24, -1])
def test_bad_rank(rank):
    cov, _, _ = _covariance()
    with pytest.raises(ValueError, match="rank"):
        subspace_basis(cov, rank)
