"""Hadamard constructions (edgeq.runtime_ops.hadamard): exact orthogonality for every base order
the spec names, the factorization rule, the fallback, and the torch reference of the kernels."""

from __future__ import annotations

import numpy as np
import pytest

from edgeq.runtime_ops import hadamard as hd
from edgeq.runtime_ops import (
    SPEC_BASE_ORDERS,
    hadamard_factor_matrices,
    hadamard_factors,
    hadamard_matrix,
    hadamard_matrix_for_fold,
    is_hadamard_size,
    normalized_hadamard_factors,
    normalized_hadamard_matrix,
    random_orthogonal,
    randomized_hadamard,
)


@pytest.mark.parametrize("m", [0, 1, 3])
@pytest.mark.parametrize("K", SPEC_BASE_ORDERS)
def test_every_spec_order_is_hadamard(K, m):
    n = K * 2**m
    H = hadamard_matrix(n)
    assert H.shape == (n, n) and H.dtype == np.float64
    assert set(np.unique(H)) <= {-1.0, 1.0}
    np.testing.assert_array_equal(H @ H.T, n * np.eye(n))
    assert np.all(H[0] == 1) and np.all(H[:, 0] == 1)  # normalized: the DC row RMS relies on
    k, p = hadamard_factors(n)
    assert k * p == n and k <= K


def test_construction_kinds():
    """28 and 52 need GF(3^3) and GF(5^2); 156 and 172 the Goethals-Seidel sets."""
    kinds = {K: hd._base_construction(K) for K in SPEC_BASE_ORDERS}
    assert kinds[28] == "paley1" and hd.prime_power(27) == (3, 3)
    assert kinds[52] == "paley2" and hd.prime_power(25) == (5, 2)
    assert kinds[36] == "paley2" and kinds[12] == "paley1"
    assert kinds[156] == kinds[172] == "goethals-seidel"


@pytest.mark.parametrize("q", [7, 11, 13, 9, 25, 27, 49, 81, 125])
def test_jacobsthal_over_prime_power_fields(q):
    """Q Q^T = q I - J, Q J = 0, and Q is symmetric iff q = 1 mod 4 (GF(p^k) arithmetic)."""
    Q = hd._jacobsthal(q)
    np.testing.assert_array_equal(Q @ Q.T, q * np.eye(q) - np.ones((q, q)))
    np.testing.assert_array_equal(Q.sum(axis=1), np.zeros(q))
    np.testing.assert_array_equal(Q, Q.T if q % 4 == 1 else -Q.T)


def test_larger_paley_orders():
    for n in (44, 84, 100, 124, 164, 252):  # Paley I / II beyond the spec's list
        np.testing.assert_array_equal(hadamard_matrix(n) @ hadamard_matrix(n).T, n * np.eye(n))


def test_model_sizes():
    assert hadamard_factors(576) == (36, 16)  # SmolLM2 hidden
    assert hadamard_factors(1536) == (12, 128)  # SmolLM2 intermediate
    assert hadamard_factors(64) == (1, 64)  # tiny models' hidden
    assert hadamard_factors(128) == (1, 128) and hadamard_factors(256) == (1, 256)
    assert hadamard_factors(11008) == (172, 64)
    assert hadamard_factors(14336) == (28, 512)
    assert hadamard_factors(40) == (20, 2)  # smallest K wins
    assert hadamard_factors(4096) == (1, 4096)


@pytest.mark.parametrize("n", [0, -4, 3, 6, 116, 2 * 116, 1.5, "64"])
def test_unsupported_sizes(n):
    assert hadamard_factors(n) is None and not is_hadamard_size(n)
    with pytest.raises(ValueError, match="random_orthogonal"):
        hadamard_matrix(n)


def test_kron_layout_and_normalization():
    for n in (64, 576, 1536):
        hk, hp = hadamard_factor_matrices(n)
        np.testing.assert_array_equal(hadamard_matrix(n), np.kron(hk, hp))
        nk, np_ = normalized_hadamard_factors(n)
        np.testing.assert_allclose(np.kron(nk, np_), normalized_hadamard_matrix(n), atol=1e-15)
        H = normalized_hadamard_matrix(n)
        np.testing.assert_allclose(H @ H.T, np.eye(n), atol=1e-12)
        np.testing.assert_array_equal(hadamard_matrix_for_fold(n), H)


def test_hadamard_times_equals_the_dense_product():
    """``hadamard_times`` (the folds of rotate, rms and massive-split) is ``H @ w`` / ``H^T @ w``
    for the dense H, without building it, for power-of-two, Paley and Kronecker sizes."""
    from edgeq.runtime_ops import hadamard_times

    rng = np.random.default_rng(0)
    for n in (64, 576, 1536, 4864):
        w = rng.standard_normal((n, 7)).astype(np.float32)
        H = hadamard_matrix_for_fold(n)
        np.testing.assert_allclose(hadamard_times(w), H @ w, rtol=0, atol=1e-12)
        np.testing.assert_allclose(hadamard_times(w, transpose=True), H.T @ w, rtol=0, atol=1e-12)
    with pytest.raises(ValueError):
        hadamard_times(np.ones((7, 2)))


def test_wrong_goethals_seidel_set_fails_loudly(monkeypatch):
    """The build verifies itself: one wrong position in a defining set must raise."""
    bad = dict(hd._GS_SETS)
    bad[43] = (bad[43][0][:-1],) + bad[43][1:]
    monkeypatch.setattr(hd, "_GS_SETS", bad)
    hd._base_matrix.cache_clear()
    try:
        with pytest.raises(AssertionError, match="not Hadamard"):
            hd._base_matrix(172)
    finally:
        hd._base_matrix.cache_clear()


def test_base_matrices_are_read_only_copies():
    hk, _ = hadamard_factor_matrices(576)
    hk[0, 0] = -7.0  # caller's copy; the cache must not change
    assert hadamard_matrix(576)[0, 0] == 1.0


def test_random_orthogonal():
    Q = random_orthogonal(96, seed=3)
    np.testing.assert_allclose(Q @ Q.T, np.eye(96), atol=1e-12)
    np.testing.assert_array_equal(Q, random_orthogonal(96, seed=3))
    assert not np.allclose(Q, random_orthogonal(96, seed=4))


@pytest.mark.parametrize("n", [64, 576, 1536])
def test_randomized_hadamard(n):
    rot = randomized_hadamard(n, seed=0)
    assert rot.is_hadamard
    Q, flag = rot  # a plain tuple as well
    assert flag and Q.dtype == np.float64
    np.testing.assert_allclose(np.abs(Q) * np.sqrt(n), np.ones((n, n)), atol=1e-12)
    np.testing.assert_allclose(Q @ Q.T, np.eye(n), atol=1e-12)
    signs = Q[:, 0] * np.sqrt(n)
    np.testing.assert_allclose(Q, signs[:, None] * normalized_hadamard_matrix(n), atol=1e-15)
    assert 0 < (signs > 0).sum() < n  # really random signs
    np.testing.assert_array_equal(Q, randomized_hadamard(n, seed=0).matrix)
    assert not np.array_equal(Q, randomized_hadamard(n, seed=1).matrix)


def test_randomized_hadamard_falls_back():
    rot = randomized_hadamard(116, seed=0)
    assert not rot.is_hadamard
    np.testing.assert_allclose(rot.matrix @ rot.matrix.T, np.eye(116), atol=1e-12)
    np.testing.assert_array_equal(rot.matrix, random_orthogonal(116, 0))


def test_torch_reference_matches_fold_matrix():
    torch = pytest.importorskip("torch")
    from edgeq.kernels.hadamard_ref import dense_hadamard, hadamard_ref

    for n in (64, 576, 1536):
        x = torch.randn(3, 2, n, dtype=torch.float64)
        H = torch.as_tensor(hadamard_matrix_for_fold(n))
        torch.testing.assert_close(hadamard_ref(x), x @ H, rtol=0, atol=1e-12)
        torch.testing.assert_close(dense_hadamard(n, dtype=torch.float64), H, rtol=0, atol=1e-15)
