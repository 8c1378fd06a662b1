"""Torch references for DPQ's W4A8 GEMM: ``Y = bf16((X8 @ W8^T) * s_a * s8)``, INT4 weights -> FP8.

DPQ (paper 003, ``docs/methods.md`` section 5) stores a linear's weight ``W`` ``[N, K]`` (the
nn.Linear layout: N outputs, K inputs) in two levels:

1. a per-tensor power-of-two FP8 scale ``s8 = 2^ceil(log2(max|W| / R))`` with
   ``R = 448 - 448/15`` (the e4m3fn maximum less one INT4 step, see below), and
   ``W8 = fp8_e4m3fn(W / s8)``, so ``|W8| <= R``;
2. INT4 groups of ``G = 128`` consecutive inputs (along K) fitted on ``W8`` by round-to-nearest:
   a group scale ``s_g`` (in the FP8 domain) and, asymmetric, a zero point ``z_g``.

At run time the kernel dequantizes ``w_fp8 = fp8_e4m3fn((u - z_g) * s_g)`` (u the stored nibble),
multiplies FP8 activations ``X8 = fp8(X / s_a)`` against it on FP8 tensor cores and scales the
sum by ``s_a * s8``. The real weight is ``s8 * w_fp8``.

Storage (what ``quantize_dpq`` returns and the Triton kernel reads):

- ``packed``: uint8 ``[N, K / 2]``, two nibbles a byte, K-major. Within each aligned 128-wide
  K block, byte ``j`` (0..63) holds input ``k0 + j`` in its low nibble and ``k0 + 64 + j`` in its
  high nibble. The kernel then unpacks a ``[BLOCK_N, 64]`` byte tile into two ``[BLOCK_N, 64]``
  FP8 tiles that multiply two contiguous 64-wide slices of X: no shuffles.
- Nibbles are unsigned ``u`` in [0, 15]. Symmetric: ``q = u - 8`` (offset binary), quantization
  uses ``q`` in [-7, 7] (``s_g = max|W8_g| / 7``); asymmetric (the paper's scheme): ``zeros``
  uint8 ``[K / G, N]`` with ``z_g`` in [0, 15], ``s_g = (max(W8_g, 0) - min(W8_g, 0)) / 15``.
- ``group_scales``: ``[K / G, N]`` (group-major: the N scales of one group are contiguous, so a
  kernel tile loads them coalesced). ``quantize_dpq`` rounds them to 7 significant bits
  (``SCALE_BITS``; a relative change of at most 2^-8, far below the INT4 step) so that the kernel
  can dequantize in packed fp16 arithmetic exactly, and stores them as fp32 by default (4 bytes a
  thread is cp.async's minimum, so the kernel's pipeline prefetches them); fp16 / bf16 storage
  hold the same values. Arbitrary scales are accepted too (the kernel then uses fp32 arithmetic).

Why no overflow (the protective range): symmetric, ``|q * s_g| <= 7 * s_g = max|W8_g| <= R``
(times ``1 + 2^-8`` for the rounding of ``s_g``); asymmetric, the zero point's rounding moves
the grid by at most ``s_g / 2 <= R / 15``, so ``|(u - z) * s_g| <= (R + R/15)(1 + 2^-8) = 447.8``.
FP8 rounding then lands on at most 448, the e4m3fn maximum (e4m3fn has no infinity; torch turns
an overflow into NaN, the GPU's ``satfinite`` conversion into 448). A hand-made symmetric nibble
0 (q = -8) is outside what ``quantize_dpq`` produces and could reach ``8/7 R = 478`` (saturates).

Exact emulation: ``u - z`` is a small integer (4 bits) and ``s_g`` has 7 significant bits, so
``(u - z) * s_g`` is exact in fp32 and in fp16 alike and the only rounding is the one to FP8,
round-to-nearest-even on both sides (torch here, ``cvt.rn.satfinite.e4m3x2`` in the kernel).
Arbitrary fp32 scales add one fp32 rounding of the product first, which both sides perform
identically (the kernel's fp32 paths; its fp16 path is only used for scales that fit). Every product of two
e4m3 values is exact in float64 and their sums are too (the terms span 2^-18 .. 2^30 for
K <= 4096, 48 bits < 53), so ``w4a8_gemm_ref``'s float64 accumulator is the exact sum; the kernel
differs from it only by its fp32 (tensor-core) accumulation and the final bf16 rounding.

Torch only (no triton): the CPU test suite imports this, and the GPU tests trust it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# The e4m3fn maximum reduced by one INT4 step (1/15 of the range), DPQ's protective range.
DPQ_FP8_RANGE = FP8_MAX - FP8_MAX / 15
GROUP_SIZE = 128
PACK_BLOCK = 128  # K block of the nibble pairing: byte j holds k0 + j (low) and k0 + 64 + j (high)
SYM_ZERO = 8  # symmetric nibbles are offset binary: q = u - 8
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE_BITS = 7  # significant bits of the fitted group scales (exact packed-fp16 dequantization)


@dataclass
class DPQWeight:
    """A DPQ-quantized weight of shape ``[N, K]``: see the module docstring for each field."""

    packed: torch.Tensor  # uint8 [N, K / 2]
    group_scales: torch.Tensor  # [K / G, N], fp16 / bf16 / fp32
    zeros: torch.Tensor | None  # uint8 [K / G, N] (asymmetric) or None (symmetric, zero point 8)
    s8: float  # per-tensor power-of-two FP8 scale
    group_size: int = GROUP_SIZE

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles ``[N, K]`` (values 0..15, K a multiple of 128) -> uint8 ``[N, K / 2]``."""
    if u.dim() != 2 or u.shape[1] % PACK_BLOCK:
        raise ValueError(f"pack_int4: need [N, K] with K a multiple of {PACK_BLOCK}, got {tuple(u.shape)}")
    if u.dtype != torch.uint8:
        raise TypeError(f"pack_int4: need uint8 nibbles, got {u.dtype}")
    if u.numel() and int(u.max()) > 15:
        raise ValueError("pack_int4: nibbles must be in [0, 15]")
    n, k = u.shape
    blocks = u.reshape(n, k // PACK_BLOCK, 2, PACK_BLOCK // 2)
    return (blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K / 2]`` -> uint8 nibbles ``[N, K]``, the inverse of ``pack_int4``."""
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] % (PACK_BLOCK // 2):
        raise ValueError(f"unpack_int4: need uint8 [N, K/2] with K a multiple of {PACK_BLOCK}, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    n, half = packed.shape
    blocks = packed.reshape(n, half // (PACK_BLOCK // 2), 1, PACK_BLOCK // 2)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=2).reshape(n, half * 2)


def dpq_fp8_scale(w: torch.Tensor) -> float:
    """``s8 = 2^ceil(log2(max|W| / R))``: the smallest power of two with ``max|W| / s8 <= R``."""
    amax = float(w.abs().max()) if w.numel() else 0.0
    if not math.isfinite(amax):
        raise ValueError("dpq_fp8_scale: the weight has inf or NaN")
    if amax == 0.0:
        return 1.0
    s8 = 2.0 ** math.ceil(math.log2(amax / DPQ_FP8_RANGE))
    while amax / s8 > DPQ_FP8_RANGE:  # log2's rounding at exact powers of two
        s8 *= 2.0
    while amax / (s8 / 2) <= DPQ_FP8_RANGE:
        s8 /= 2.0
    return s8


def fit_groups(w8: torch.Tensor, group_size: int = GROUP_SIZE, symmetric: bool = True,
               scale_dtype: torch.dtype = torch.float32):
    """RTN INT4 fit of FP8-domain values ``w8`` ``[N, K]``: (nibbles uint8 ``[N, K]``, group scales
    ``[K / G, N]`` in ``scale_dtype``, zeros uint8 ``[K / G, N]`` or None). Scales are rounded to
    ``SCALE_BITS`` significant bits (exact in fp32, fp16 and bf16 storage), and the fit uses the
    rounded scale, so dequantization sees exactly the grid the fit chose."""
    n, k = w8.shape
    if k % group_size:
        raise ValueError(f"fit_groups: K={k} is not a multiple of the group size {group_size}")
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"fit_groups: scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}")
    g = w8.to(torch.float64).reshape(n, k // group_size, group_size)
    if symmetric:
        s = g.abs().amax(dim=-1) / 7
    else:
        lo = g.amin(dim=-1).clamp(max=0.0)
        hi = g.amax(dim=-1).clamp(min=0.0)
        s = (hi - lo) / 15
    s = round_significant(torch.where(s > 0, s, torch.ones_like(s)), SCALE_BITS).to(scale_dtype)
    s64 = s.to(torch.float64)
    if symmetric:
        q = torch.round(g / s64[..., None]).clamp(-8, 7)
        u = q + SYM_ZERO
        zeros = None
    else:
        z = torch.round(-lo / s64).clamp(0, 15)
        u = (torch.round(g / s64[..., None]) + z[..., None]).clamp(0, 15)
        zeros = z.to(torch.uint8).T.contiguous()
    nibbles = u.to(torch.uint8).reshape(n, k)
    return nibbles, s.T.contiguous(), zeros


def round_significant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded (to nearest, ties to even) to ``bits`` significant bits, same dtype."""
    mant, exp = torch.frexp(x)
    return torch.ldexp(torch.round(mant * 2.0**bits) / 2.0**bits, exp.to(x.dtype)).to(x.dtype)


def quantize_dpq(w: torch.Tensor, group_size: int = GROUP_SIZE, symmetric: bool = True,
                 scale_dtype: torch.dtype = torch.float32) -> DPQWeight:
    """RTN DPQ of a float weight ``[N, K]`` (K a multiple of 128): s8, ``W8 = fp8(W / s8)``,
    INT4 groups fitted on W8 (no GPTQ error compensation: that is the calibration pass's job)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_dpq: need a float [N, K] weight, got {w.dtype} {tuple(w.shape)}")
    if group_size != GROUP_SIZE:
        raise ValueError(f"quantize_dpq: only group size {GROUP_SIZE} is supported (the kernel's K step)")
    s8 = dpq_fp8_scale(w)
    w8 = (w.to(torch.float64) / s8).to(torch.float32).to(FP8_DTYPE)  # |W / s8| <= R < 448: no overflow
    nibbles, scales, zeros = fit_groups(w8.to(torch.float32), group_size, symmetric, scale_dtype)
    return DPQWeight(pack_int4(nibbles), scales, zeros, s8, group_size)


def dequantize_fp8(packed: torch.Tensor, group_scales: torch.Tensor, zeros: torch.Tensor | None = None,
                   group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The FP8 weight ``[N, K]`` the kernel multiplies: ``fp8_e4m3fn((u - z) * s_g)``, with the
    product rounded to fp32 first (a no-op for scales of up to 11 significant bits), as the kernel's
    fp32 paths compute it (its fp16 path only runs where the product is exact)."""
    u = unpack_int4(packed).to(torch.float64)
    n, k = u.shape
    _check_group_tensors(group_scales, zeros, n, k, group_size)
    s = group_scales.to(torch.float64).T.repeat_interleave(group_size, dim=1)
    z = SYM_ZERO if zeros is None else zeros.to(torch.float64).T.repeat_interleave(group_size, dim=1)
    return ((u - z) * s).to(torch.float32).to(FP8_DTYPE)


def dequantize(q: DPQWeight) -> torch.Tensor:
    """The real (float32) weight ``s8 * w_fp8`` ``[N, K]`` that the quantized layer applies."""
    return dequantize_fp8(q.packed, q.group_scales, q.zeros, q.group_size).to(torch.float32) * q.s8


def activation_scale(x: torch.Tensor) -> float:
    """A static per-tensor FP8 activation scale ``max|x| / 448`` (DPQ calibrates it offline)."""
    amax = float(x.abs().max()) if x.numel() else 0.0
    return amax / FP8_MAX if amax > 0 else 1.0


def quantize_activation_fp8(x: torch.Tensor, s_a: float) -> torch.Tensor:
    """``fp8_e4m3fn(x / s_a)``, saturated to +-448 (a static scale may see larger inputs)."""
    return (x.to(torch.float32) / float(s_a)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def w4a8_gemm_ref(x_fp8: torch.Tensor, s_a, packed: torch.Tensor, group_scales: torch.Tensor, s8,
                  group_size: int = GROUP_SIZE, zeros: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(X8 @ W8^T) * s_a * s8`` for FP8 activations ``x_fp8`` ``[..., K]``: the exact float64 sum
    (see the module docstring), scaled by the fp32 values of s_a and s8 (what the kernel reads),
    rounded once to ``out_dtype`` (bf16, like the kernel; float64 returns the unrounded value)."""
    if x_fp8.dtype != FP8_DTYPE:
        raise TypeError(f"w4a8_gemm_ref: x must be {FP8_DTYPE}, got {x_fp8.dtype}")
    w8 = dequantize_fp8(packed, group_scales, zeros, group_size).to(device=x_fp8.device, dtype=torch.float64)
    if x_fp8.shape[-1] != w8.shape[1]:
        raise ValueError(f"w4a8_gemm_ref: x has K={x_fp8.shape[-1]}, the weight K={w8.shape[1]}")
    acc = x_fp8.to(torch.float64) @ w8.T
    y = acc * _fp32(s_a) * _fp32(s8)
    return y.to(out_dtype)


def w4a8_abs_terms(x_fp8: torch.Tensor, s_a, packed: torch.Tensor, group_scales: torch.Tensor, s8,
                   group_size: int = GROUP_SIZE, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """``(|X8| @ |W8|^T) * s_a * s8`` in float64: the scale of any accumulation error (a sum
    rounded step by step errs by at most a small multiple of this times the unit roundoff)."""
    w8 = dequantize_fp8(packed, group_scales, zeros, group_size).to(device=x_fp8.device, dtype=torch.float64)
    return (x_fp8.to(torch.float64).abs() @ w8.abs().T) * _fp32(s_a) * _fp32(s8)


def _fp32(v) -> float:
    """A scale as the kernel sees it: rounded to fp32."""
    t = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
    if t.numel() != 1:
        raise ValueError(f"per-tensor scale must have one element, got {t.numel()}")
    return float(t.detach().reshape(()).to(torch.float32).cpu())


def _check_group_tensors(scales: torch.Tensor, zeros: torch.Tensor | None, n: int, k: int, group_size: int) -> None:
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    want = (k // group_size, n)
    if tuple(scales.shape) != want:
        raise ValueError(f"group_scales must be [K/G, N] = {list(want)}, got {tuple(scales.shape)}")
    if scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"group_scales must be one of {SCALE_DTYPES}, got {scales.dtype}")
    if zeros is not None:
        if tuple(zeros.shape) != want or zeros.dtype != torch.uint8:
            raise ValueError(f"zeros must be uint8 [K/G, N] = {list(want)}, got {zeros.dtype} {tuple(zeros.shape)}")
