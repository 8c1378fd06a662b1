"""Torch references for the Hadamard transform ``y = x @ H / sqrt(n)`` over the last axis.

Torch only (no triton), so the CPU test suite can check them and the GPU tests can trust them.
H is exactly the matrix ``edgeq.runtime_ops.hadamard_matrix_for_fold(n)`` returns, i.e. what the
``edgeq::OnlineHadamard`` op computes, so a kernel, the ONNX op and a folded weight agree.
"""

from __future__ import annotations

import torch

from edgeq.runtime_ops.hadamard import hadamard_factor_matrices, hadamard_factors


def hadamard_factors_torch(n: int, device=None, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(H_K, H_P) as +-1 tensors (unnormalized), ``H = kron(H_K, H_P)``."""
    hk, hp = hadamard_factor_matrices(n)
    return (torch.as_tensor(hk, dtype=dtype, device=device), torch.as_tensor(hp, dtype=dtype, device=device))


def dense_hadamard(n: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The dense normalized H (n x n): the baseline a fast transform must beat."""
    hk, hp = hadamard_factors_torch(n, device=device)
    return (torch.kron(hk, hp) / n**0.5).to(dtype)


def hadamard_ref(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_normalized`` in float64 through the Kronecker factors (exact to fp64 rounding),
    returned in float64; O(n (K + P)) work per row, so usable at every size."""
    n = x.shape[-1]
    if hadamard_factors(n) is None:
        raise ValueError(f"no Hadamard construction for n={n}")
    hk, hp = hadamard_factors_torch(n, device=x.device)
    K, P = hk.shape[0], hp.shape[0]
    xr = x.to(torch.float64).reshape(*x.shape[:-1], K, P)
    y = hk.T @ (xr @ hp)
    return y.reshape(x.shape) / n**0.5
