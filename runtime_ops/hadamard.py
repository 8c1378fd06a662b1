"""Hadamard matrices of order n = K * 2^m, built by construction in float64, and rotation helpers.

Why here: rotation passes (QuaRot-style residual rotation, the online Hadamard before down_proj,
RMS) need the exact matrix a runtime op computes, so the construction lives next to the op.
Nothing is stored as a table of +-1 entries: every matrix is built and its orthogonality is
cheap to check (``H @ H.T == n * I``).

Constructions of the base order K (the small, non power-of-two factor):

- Sylvester doubling for the 2^m factor (natural / Walsh ordering, first row all ones);
- Paley I, order q + 1, for a prime power q = 3 (mod 4) (K = 12, 20, 28 via q = 27, 60, 108, 140);
- Paley II, order 2 (q + 1), for a prime power q = 1 (mod 4) (K = 28 via q = 13, 36, 52 via
  q = 25 in GF(5^2));
- Goethals-Seidel arrays for K = 156 = 4 * 39 and K = 172 = 4 * 43, which no Paley construction
  reaches: four circulant +-1 matrices whose periodic autocorrelations sum to zero. The defining
  sets below are unions of orbits of a multiplier subgroup of Z_t (t = 39: the units {1, 5, 8, 25};
  t = 43: the seventh powers), found by a meet-in-the-middle search over orbit unions; the build
  checks the result, so a wrong set fails loudly instead of giving a non-orthogonal rotation.

K = 40 is reached as 20 * 2. Every base matrix is normalized (first row and first column all
+1), so the first row of every H here is all ones: the property MQuant's RMS analysis (Eq. 8)
relies on. H of order n is ``kron(H_K, H_{2^m})``, the layout the OnlineHadamard op computes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, cast

import numpy as np

# The K the method spec names; every one of them is constructible here (tests check each).
SPEC_BASE_ORDERS = (1, 12, 20, 28, 36, 40, 52, 60, 108, 140, 156, 172)

# Goethals-Seidel defining sets: t -> the positions of -1 in the first rows of A, B, C, D
# (circulants of order t). Row sums 1, 1, 1, 13 (t = 43) and 1, 3, 5, 11 (t = 39): squares
# summing to 4t, as the construction requires.
_GS_SETS: dict[int, tuple[tuple[int, ...], ...]] = {
    39: (
        (0, 1, 2, 4, 5, 6, 8, 9, 10, 11, 13, 16, 20, 22, 25, 26, 30, 32, 33),
        (1, 2, 3, 5, 6, 8, 9, 10, 11, 13, 15, 16, 24, 25, 26, 30, 33, 36),
        (0, 1, 2, 3, 5, 8, 10, 11, 15, 16, 23, 24, 25, 28, 29, 36, 37),
        (3, 4, 6, 9, 13, 15, 20, 22, 24, 26, 30, 32, 33, 36),
    ),
    43: (
        (1, 4, 6, 7, 10, 11, 16, 18, 21, 23, 24, 26, 28, 29, 30, 31, 34, 35, 38, 40, 41),
        (2, 6, 7, 8, 10, 18, 22, 23, 24, 26, 27, 28, 29, 30, 31, 32, 34, 38, 39, 40, 42),
        (1, 3, 4, 5, 6, 10, 11, 12, 16, 19, 20, 21, 23, 24, 31, 33, 35, 37, 38, 40, 41),
        (0, 3, 5, 7, 12, 18, 19, 20, 26, 28, 29, 30, 33, 34, 37),
    ),
}


# ----------------------------------------------------------------------------- finite fields
def prime_power(q: int) -> tuple[int, int] | None:
    """(p, k) with q = p^k for a prime p, or None."""
    if q < 2:
        return None
    p = next(d for d in range(2, q + 1) if q % d == 0)
    k, r = 0, q
    while r % p == 0:
        r //= p
        k += 1
    return (p, k) if r == 1 else None


def _poly_mulmod(a: list[int], b: list[int], f: list[int], p: int) -> list[int]:
    """a * b mod (f, p); polynomials as coefficient lists, lowest degree first, f monic."""
    k = len(f) - 1
    prod = [0] * (len(a) + len(b) - 1)
    for i, ai in enumerate(a):
        for j, bj in enumerate(b):
            prod[i + j] = (prod[i + j] + ai * bj) % p
    for d in range(len(prod) - 1, k - 1, -1):
        c = prod[d]
        if c:
            for i in range(k + 1):
                prod[d - k + i] = (prod[d - k + i] - c * f[i]) % p
    return (prod + [0] * k)[:k]


def _poly_divides(g: list[int], f: list[int], p: int) -> bool:
    """Whether monic g divides f over GF(p)."""
    r = list(f)
    dg = len(g) - 1
    for d in range(len(r) - 1, dg - 1, -1):
        c = r[d]
        if c:
            for i in range(dg + 1):
                r[d - dg + i] = (r[d - dg + i] - c * g[i]) % p
    return not any(r[:dg])


def _digits(x: int, p: int, k: int) -> list[int]:
    return [(x // p**i) % p for i in range(k)]


def _irreducible(p: int, k: int) -> list[int]:
    """The first monic irreducible polynomial of degree k over GF(p) (lowest degree first)."""
    for code in range(p**k):
        f = _digits(code, p, k) + [1]
        if f[0] == 0:
            continue
        factors = (
            _digits(c, p, d) + [1] for d in range(1, k // 2 + 1) for c in range(p**d)
        )
        if not any(_poly_divides(g, f, p) for g in factors):
            return f
    raise AssertionError(f"no irreducible polynomial of degree {k} over GF({p})")


def _quadratic_character_table(q: int) -> tuple[np.ndarray, np.ndarray]:
    """(chi, digits): chi[a] the quadratic character of element a of GF(q), and the base-p digits
    of every element (elements are integers whose base-p digits are polynomial coefficients)."""
    p, k = cast("tuple[int, int]", prime_power(q))  # q a prime power here
    elems = np.arange(q)
    digits = np.stack([(elems // p**i) % p for i in range(k)], axis=1)
    if k == 1:
        squares = {(x * x) % p for x in range(1, p)}
    else:
        f = _irreducible(p, k)
        weights = p ** np.arange(k)
        squares = set()
        for x in range(1, q):
            d = _digits(x, p, k)
            squares.add(int(np.dot(_poly_mulmod(d, d, f, p), weights)))
    chi = np.array([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=np.int64)
    return chi, digits


def _jacobsthal(q: int) -> np.ndarray:
    """Q[a, b] = chi(a - b) over GF(q): the core of both Paley constructions."""
    p, k = cast("tuple[int, int]", prime_power(q))  # q a prime power here
    chi, digits = _quadratic_character_table(q)
    diff = (digits[:, None, :] - digits[None, :, :]) % p
    index = diff @ (p ** np.arange(k))
    return chi[index].astype(np.float64)


# ----------------------------------------------------------------------------- constructions
def _paley1(q: int) -> np.ndarray:
    """Order q + 1 for q = 3 (mod 4): H = I + S, S = [[0, 1^T], [-1, Q]] skew."""
    Q = _jacobsthal(q)
    S = np.zeros((q + 1, q + 1))
    S[0, 1:] = 1.0
    S[1:, 0] = -1.0
    S[1:, 1:] = Q
    return np.eye(q + 1) + S


def _paley2(q: int) -> np.ndarray:
    """Order 2 (q + 1) for q = 1 (mod 4), from the symmetric conference matrix C of order q + 1."""
    Q = _jacobsthal(q)
    C = np.zeros((q + 1, q + 1))
    C[0, 1:] = 1.0
    C[1:, 0] = 1.0
    C[1:, 1:] = Q
    return np.kron(C, np.array([[1.0, 1.0], [1.0, -1.0]])) + np.kron(
        np.eye(q + 1), np.array([[1.0, -1.0], [-1.0, -1.0]])
    )


def _circulant(first_row: np.ndarray) -> np.ndarray:
    t = len(first_row)
    return np.stack([np.roll(first_row, i) for i in range(t)])


def _goethals_seidel(t: int) -> np.ndarray:
    """Order 4t from four circulants A, B, C, D with A A^T + B B^T + C C^T + D D^T = 4t I."""
    A, B, C, D = (
        _circulant(np.where(np.isin(np.arange(t), s), -1.0, 1.0)) for s in _GS_SETS[t]
    )
    R = np.fliplr(np.eye(t))
    return np.block(
        [
            [A, B @ R, C @ R, D @ R],
            [-B @ R, A, D.T @ R, -C.T @ R],
            [-C @ R, -D.T @ R, A, B.T @ R],
            [-D @ R, C.T @ R, -B.T @ R, A],
        ]
    )


def _normalize(H: np.ndarray) -> np.ndarray:
    """Flip column and row signs so the first row and the first column are all +1."""
    H = H * np.sign(H[0])[None, :]
    return H * np.sign(H[:, 0])[:, None]


def _base_construction(K: int) -> str | None:
    """Name of the construction that builds a base order K, or None if there is none here."""
    if K == 1:
        return "trivial"
    if K % 4 == 0 and K // 4 in _GS_SETS:
        return "goethals-seidel"
    pk = prime_power(K - 1)
    if pk is not None and (K - 1) % 4 == 3:
        return "paley1"
    if K % 2 == 0:
        pk = prime_power(K // 2 - 1)
        if pk is not None and (K // 2 - 1) % 4 == 1:
            return "paley2"
    return None


@lru_cache(maxsize=64)
def _base_matrix(K: int) -> np.ndarray:
    kind = _base_construction(K)
    if kind == "trivial":
        H = np.ones((1, 1))
    elif kind == "goethals-seidel":
        H = _goethals_seidel(K // 4)
    elif kind == "paley1":
        H = _paley1(K - 1)
    elif kind == "paley2":
        H = _paley2(K // 2 - 1)
    else:
        raise ValueError(f"no Hadamard construction for base order {K}")
    H = _normalize(H)
    if not np.array_equal(H @ H.T, K * np.eye(K)):
        raise AssertionError(f"{kind} construction of order {K} is not Hadamard")
    H.setflags(write=False)
    return H


def _sylvester(P: int) -> np.ndarray:
    H = np.ones((1, 1))
    while H.shape[0] < P:
        H = np.block([[H, H], [H, -H]])
    return H


# ----------------------------------------------------------------------------- public API
def hadamard_factors(n: int) -> tuple[int, int] | None:
    """(K, P) with n = K * P, P = 2^m and K the smallest base order built here, or None.

    Smallest K first because the online op's cost grows with K (a K x K matmul per element
    group) while the 2^m part runs as a fast Walsh-Hadamard transform.
    """
    if not isinstance(n, (int, np.integer)) or n < 1:
        return None
    n = int(n)
    m = (n & -n).bit_length() - 1  # largest m with 2^m | n
    for j in range(m, -1, -1):
        K = n >> j
        if _base_construction(K) is not None:
            return K, 1 << j
    return None


def is_hadamard_size(n: int) -> bool:
    """Whether ``hadamard_matrix(n)`` has a construction here."""
    return hadamard_factors(n) is not None


def hadamard_factor_matrices(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(H_K, H_P), both +-1 float64 and normalized to a first row of ones, with
    ``hadamard_matrix(n) == kron(H_K, H_P)``. Raises ValueError when n has no construction."""
    factors = hadamard_factors(n)
    if factors is None:
        raise ValueError(
            f"no Hadamard matrix of order {n} is constructible here: n must be K * 2^m with K = 1 "
            f"or a base order from Paley I/II (prime powers) or Goethals-Seidel (156, 172); "
            f"use random_orthogonal({n}, seed) instead"
        )
    K, P = factors
    return _base_matrix(K).copy(), _sylvester(P)


def hadamard_matrix(n: int) -> np.ndarray:
    """Hadamard matrix of order n (entries +-1, H @ H.T == n I), float64, = kron(H_K, H_{2^m})."""
    hk, hp = hadamard_factor_matrices(n)
    return np.kron(hk, hp)


def normalized_hadamard_matrix(n: int) -> np.ndarray:
    """``hadamard_matrix(n) / sqrt(n)``: orthogonal, first row all 1/sqrt(n)."""
    return hadamard_matrix(n) / np.sqrt(n)


def normalized_hadamard_factors(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(H_K / sqrt(K), H_P / sqrt(P)): the two constants of the OnlineHadamard op."""
    hk, hp = hadamard_factor_matrices(n)
    return hk / np.sqrt(hk.shape[0]), hp / np.sqrt(hp.shape[0])


def random_orthogonal(n: int, seed: int) -> np.ndarray:
    """Haar-random orthogonal matrix of order n (float64): QR of a seeded Gaussian, with the signs
    of R's diagonal moved into Q so the result does not depend on the QR routine's sign choice."""
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    return q * signs[None, :]


class Rotation(NamedTuple):
    """An orthogonal float64 matrix and whether it is a (sign-randomized) Hadamard matrix."""

    matrix: np.ndarray
    is_hadamard: bool


def randomized_hadamard(n: int, seed: int) -> Rotation:
    """``diag(s) @ H / sqrt(n)`` with seeded random signs s, or, when no Hadamard matrix of order
    n exists here, ``random_orthogonal(n, seed)``; ``is_hadamard`` says which one was built (a pass
    reports the fallback)."""
    if not is_hadamard_size(n):
        return Rotation(random_orthogonal(n, seed), False)
    signs = np.random.default_rng(seed).choice(np.array([-1.0, 1.0]), size=n)
    return Rotation(signs[:, None] * normalized_hadamard_matrix(n), True)
