"""Triton fast Hadamard transform: ``y = x @ H / sqrt(n)`` over the last axis, n = K * 2^m.

Why: the online Hadamard before down_proj (QuaRot, MQuant) runs on every token. A dense matmul
by H costs 2 n^2 flops per row (as much as down_proj itself); this kernel costs O(n (K + m)) and
is bound by reading x and writing y once.

How, for one row viewed as a ``[K, P]`` matrix X (P = 2^m): ``y = vec(H_K^T X H_P)``.

- ``H_K^T X``: a small matmul on tensor cores (``tl.dot``) with H_K^T as exact +-1 entries
  (fp16 / bf16 products are exact, fp32 accumulation). fp32 inputs are split into three bf16
  parts (hi + mid + lo holds all 24 mantissa bits), so three bf16 dots are exact too
  (``fp32_mode="split3"``; ``"tf32x3"`` is the slower alternative). Each program computes BKO
  of the K output rows of one input row; K is zero-padded to the block sizes.
- ``. H_P``: a Walsh-Hadamard transform in registers on fp32 values: m radix-2 butterfly stages
  in Stockham form (a stage pairs j with j + P/2 and writes the pair to 2j, 2j + 1; after m
  stages the order is natural again), written with reshape / permute / split / join.
- K == 1 (n a power of two): no matmul; a program transforms BR whole rows.

The normalization 1 / sqrt(n) is applied once, in fp32, before the cast to the output dtype.
H is the matrix of ``edgeq.runtime_ops.hadamard_matrix_for_fold(n)`` (kron(H_K, H_P), the
layout of the ``edgeq::OnlineHadamard`` op).

Limits: P <= 2^14 (a P-segment lives in registers); K > 1 needs P >= 16 (``tl.dot``'s minimum
size). Other sizes go through the torch path (``hadamard_ref``), which says so by returning
``used_triton=False`` from ``hadamard_transform(..., return_info=True)``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from edgeq.kernels.hadamard_ref import hadamard_ref
from edgeq.runtime_ops.hadamard import hadamard_factor_matrices, hadamard_factors

MAX_P = 1 << 14
DEFAULT_TILE = 8192  # fp32 elements of the output tile a program keeps in registers
DEFAULT_FP32_MODE = "split3"
# 4 warps beat 8 at every size of the H200 sweep (benchmarks/kernels/bench_hadamard.py --variants), by up to
# 1.6x (n = 11008, fp32); tile sizes 4096..16384 were within noise of each other.
DEFAULT_WARPS = 4


@triton.jit
def _fwht(x, M: tl.constexpr, P: tl.constexpr, LOG_P: tl.constexpr):
    """Unnormalized Walsh-Hadamard transform of each row of the fp32 tile x [M, P].

    Radix-2 Stockham stages: a stage pairs x[j] with x[j + P/2] and writes the pair to y[2j],
    y[2j + 1], i.e. consumes the top index bit and appends the output bit at the bottom, so the
    result is in natural order after LOG_P stages. (Fused radix-4 / radix-8 stages, one data
    permutation per 2 or 3 bits, measured no faster on an H200, so they were dropped.)"""
    for _ in tl.static_range(LOG_P):
        x = tl.permute(tl.reshape(x, (M, 2, P // 2)), (0, 2, 1))  # [M, P/2, 2]: (x[j], x[j+P/2])
        a, b = tl.split(x)
        x = tl.reshape(tl.join(a + b, a - b), (M, P))  # y[2j] = a + b, y[2j+1] = a - b
    return x


@triton.jit
def _hadamard_pow2_kernel(
    x_ptr, y_ptr, rows, stride_x, stride_y, scale,
    P: tl.constexpr, LOG_P: tl.constexpr, BR: tl.constexpr,
):
    """K == 1: BR rows of P elements per program."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_p = tl.arange(0, P)
    mask = offs_r[:, None] < rows
    x = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * stride_x + offs_p[None, :], mask=mask, other=0.0)
    y = _fwht(x.to(tl.float32), BR, P, LOG_P) * scale
    tl.store(y_ptr + offs_r[:, None].to(tl.int64) * stride_y + offs_p[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _hadamard_kron_kernel(
    x_ptr, y_ptr, at_ptr, stride_x, stride_y, scale,
    K: tl.constexpr, KPI: tl.constexpr, P: tl.constexpr, LOG_P: tl.constexpr,
    BKO: tl.constexpr, BKI: tl.constexpr, SPLIT3: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """K > 1: program (row, kb) computes y[row, k*P:(k+1)*P] for the BKO k of block kb.

    ``at`` is H_K^T zero-padded to [cdiv(K, BKO) * BKO, KPI] (KPI = cdiv(K, BKI) * BKI), so its
    loads need no mask. SPLIT3 (fp32 x): x = hi + mid + lo with three bf16 parts holds all 24
    mantissa bits, and +-1 times a bf16 is exact, so three bf16 dots give the fp32 product up to
    fp32 accumulation (tf32x3 is the alternative, PRECISION)."""
    row = tl.program_id(0).to(tl.int64)
    offs_o = tl.program_id(1) * BKO + tl.arange(0, BKO)
    offs_p = tl.arange(0, P)
    x_row = x_ptr + row * stride_x
    acc = tl.zeros((BKO, P), dtype=tl.float32)
    for k0 in range(0, K, BKI):
        offs_i = k0 + tl.arange(0, BKI)
        at = tl.load(at_ptr + offs_o[:, None] * KPI + offs_i[None, :])
        xb = tl.load(x_row + offs_i[:, None] * P + offs_p[None, :], mask=offs_i[:, None] < K, other=0.0)
        if SPLIT3:
            hi = xb.to(tl.bfloat16)
            r1 = xb - hi.to(tl.float32)
            mid = r1.to(tl.bfloat16)
            lo = (r1 - mid.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(at, hi, acc)
            acc = tl.dot(at, mid, acc)
            acc = tl.dot(at, lo, acc)
        else:
            acc = tl.dot(at, xb, acc, input_precision=PRECISION)
    y = _fwht(acc, BKO, P, LOG_P) * scale
    tl.store(
        y_ptr + row * stride_y + offs_o[:, None] * P + offs_p[None, :],
        y.to(y_ptr.dtype.element_ty), mask=offs_o[:, None] < K,
    )


def _pow2_at_least(v: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, (v - 1).bit_length()))


@functools.lru_cache(maxsize=64)
def _at_padded_cpu(n: int, rows: int, cols: int) -> torch.Tensor:
    """H_K^T (+-1, float32), zero-padded to [rows, cols]."""
    hk, _ = hadamard_factor_matrices(n)
    at = torch.zeros(rows, cols, dtype=torch.float32)
    at[: hk.shape[0], : hk.shape[0]] = torch.as_tensor(hk.T)
    return at


_AT_DEVICE: dict[tuple, torch.Tensor] = {}


def _at(n: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (n, rows, cols, dtype, device)
    if key not in _AT_DEVICE:
        _AT_DEVICE[key] = _at_padded_cpu(n, rows, cols).to(device=device, dtype=dtype).contiguous()
    return _AT_DEVICE[key]


def supported_by_kernel(n: int) -> bool:
    """Whether the Triton kernel handles size n (else ``hadamard_transform`` uses torch)."""
    f = hadamard_factors(n)
    if f is None:
        return False
    K, P = f
    return P <= MAX_P and (K == 1 or P >= 16)


def hadamard_transform(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    return_info: bool = False,
    *,
    fp32_mode: str = DEFAULT_FP32_MODE,
    tile: int = DEFAULT_TILE,
    num_warps: int | None = None,
):
    """``x @ H / sqrt(n)`` over the last axis, same shape and dtype as x (fp16, bf16 or fp32),
    fp32 accumulation. Raises ValueError when n has no Hadamard construction.

    Tuning knobs, exact either way: ``fp32_mode`` ("split3" or "tf32x3"), how fp32 inputs go
    through the K x K matmul; ``tile`` (a power of two), the fp32 elements of the output tile of
    one program; ``num_warps`` (default ``DEFAULT_WARPS``).
    """
    n = x.shape[-1]
    factors = hadamard_factors(n)
    if factors is None:
        raise ValueError(f"no Hadamard construction for n={n}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"hadamard_transform: unsupported dtype {x.dtype}")
    if fp32_mode not in ("split3", "tf32x3") or tile < 16 or tile & (tile - 1):
        raise ValueError(f"hadamard_transform: fp32_mode {fp32_mode!r} / tile {tile} not supported")
    K, P = factors
    on_device = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"  # interpreter: CPU debugging
    if not on_device or not supported_by_kernel(n):
        y = hadamard_ref(x).to(x.dtype)
        if out is not None:
            out.copy_(y)
            y = out
        return (y, {"used_triton": False, "K": K, "P": P}) if return_info else y
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y2 = torch.empty_like(x2) if out is None or not out.is_contiguous() else out.view(-1, n)
    scale = 1.0 / n**0.5
    log_p = P.bit_length() - 1
    info = {"used_triton": True, "K": K, "P": P, "tile": tile}
    if K == 1:
        br = max(1, min(64, tile // P))
        warps = num_warps or DEFAULT_WARPS
        if rows:
            _hadamard_pow2_kernel[(triton.cdiv(rows, br),)](
                x2, y2, rows, x2.stride(0), y2.stride(0), scale,
                P=P, LOG_P=log_p, BR=br, num_warps=warps,
            )
        info.update(BR=br, num_warps=warps)
    else:
        kpad = _pow2_at_least(K, 16)
        bko = max(16, min(kpad, 64, tile // P))
        bki = max(16, min(kpad, 64, tile // P))
        kpo, kpi = triton.cdiv(K, bko) * bko, triton.cdiv(K, bki) * bki
        warps = num_warps or DEFAULT_WARPS
        split3 = x.dtype == torch.float32 and fp32_mode == "split3"
        at_dtype = torch.bfloat16 if split3 else x.dtype
        precision = "tf32x3" if x.dtype == torch.float32 else "tf32"  # ignored for fp16 / bf16
        if rows:
            _hadamard_kron_kernel[(rows, kpo // bko)](
                x2, y2, _at(n, kpo, kpi, at_dtype, x.device), x2.stride(0), y2.stride(0), scale,
                K=K, KPI=kpi, P=P, LOG_P=log_p, BKO=bko, BKI=bki, SPLIT3=split3,
                PRECISION=precision, num_warps=warps,
            )
        info.update(BKO=bko, BKI=bki, num_warps=warps, fp32_mode=fp32_mode if x.dtype == torch.float32 else None)
    y = y2.view(x.shape)
    if out is not None:
        if y.data_ptr() != out.data_ptr():
            out.copy_(y)
        y = out
    return (y, info) if return_info else y
