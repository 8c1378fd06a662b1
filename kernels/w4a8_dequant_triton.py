"""INT4 -> FP8 dequantization for the W4A8 GEMM (DPQ): the device code the fused kernel inlines in
its K loop, the standalone dequantization kernel, and the two-pass GEMM built on it.

Why a module of its own: the fused GEMM (``w4a8_gemm_triton``) and the two-pass path
(dequantize once, then cuBLAS FP8 ``_scaled_mm``) must produce the same FP8 weight bit for bit, so
they share this code; the arithmetic and the three dequantization modes ("triton", "f32" and
"f16x2" inline PTX) are described in ``w4a8_gemm_triton``'s module docstring.
"""

from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl

from edgeq.kernels.w4a8_gemm_ref import FP8_DTYPE, GROUP_SIZE, SCALE_DTYPES

HALF = tl.constexpr(GROUP_SIZE // 2)  # each packed byte holds inputs j and j + 64 of its 128-wide group


@triton.jit
def _dequant(nibbles, scale, offset):
    """FP8 ``(u - z) * s`` of uint8 nibbles ``[R, C]``; scale ``[R]`` fp32, offset ``[R]`` = 2^23 + z.
    ``u | 0x4B000000`` read as fp32 is exactly 2^23 + u; the subtraction is exact and so is the
    product for scales of up to 11 significant bits; the cast rounds once (RNE, saturating)."""
    f = (nibbles.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
    return ((f - offset[:, None]) * scale[:, None]).to(tl.float8e4nv)


def _nibble_asm(regs: str, magic: str, convert) -> str:
    """Inline PTX that dequantizes 4 packed bytes ($2) into 4 low-plane ($0) and 4 high-plane ($1)
    e4m3 bytes: declares ``regs``, splits the bytes into their low (ql) and high (qh) nibbles, sets
    ``mg`` (the word PRMT takes the upper bytes from) to ``magic``, then for each of ql, qh emits
    ``convert(q)`` (the PTX that leaves the 4 results of nibble register q in h0, h1 as e4m3x2)."""
    head = (f"\n{{\n{regs}.reg .b16 h<2>;\nmov.b32 mg, {magic};\n"
            "and.b32 ql, $2, 0x0F0F0F0F;\nshr.u32 qh, $2, 4;\nand.b32 qh, qh, 0x0F0F0F0F;\n")
    return head + "".join(convert(q) + f"mov.b32 ${out}, {{h0, h1}};\n" for q, out in (("ql", 0), ("qh", 1))) + "}"


# One call converts 4 packed bytes (8 nibbles) into 4 low-plane and 4 high-plane e4m3 bytes, with
# the arithmetic of ``_dequant``: PRMT builds the fp32 words 2^23 + u (mantissa = the nibble, top
# byte 0x4B), then sub.rn (2^23 + z), mul.rn (s), and cvt.rn.satfinite.e4m3x2 packs two results.
# $0/$1: low/high outputs; $2: the 4 bytes; $3-$6: their scales; $7-$10: their offsets 2^23 + z.
_DEQUANT_ASM = tl.constexpr(_nibble_asm(".reg .b32 ql, qh, mg, t<4>;\n.reg .f32 f<4>;\n", "0x4B000000", lambda q: f"""\
prmt.b32 t0, {q}, mg, 0x7440;
prmt.b32 t1, {q}, mg, 0x7441;
prmt.b32 t2, {q}, mg, 0x7442;
prmt.b32 t3, {q}, mg, 0x7443;
mov.b32 f0, t0;
mov.b32 f1, t1;
mov.b32 f2, t2;
mov.b32 f3, t3;
sub.rn.f32 f0, f0, $7;
sub.rn.f32 f1, f1, $8;
sub.rn.f32 f2, f2, $9;
sub.rn.f32 f3, f3, $10;
mul.rn.f32 f0, f0, $3;
mul.rn.f32 f1, f1, $4;
mul.rn.f32 f2, f2, $5;
mul.rn.f32 f3, f3, $6;
cvt.rn.satfinite.e4m3x2.f32 h0, f1, f0;
cvt.rn.satfinite.e4m3x2.f32 h1, f3, f2;
"""))


# The same in packed half arithmetic, two weights an instruction: PRMT puts two nibbles in the
# mantissas of two fp16 1024s, sub.rn.f16x2 (1024 + z), mul.rn.f16x2 (s), one cvt per pair. Exact
# only for scales of at most 7 significant bits within [2^-14, 2^11] (then (u - z) * s has at most
# 11 and is an fp16), which ``quantize_dpq`` produces; ``w4a8_gemm`` checks before using it.
# $0/$1: low/high outputs; $2: the 4 bytes; $3-$4: scale pairs (fp16x2); $5-$6: (1024 + z) pairs.
_DEQUANT_ASM_F16X2 = tl.constexpr(_nibble_asm(".reg .b32 ql, qh, mg, p<2>;\n", "0x64646464", lambda q: f"""\
prmt.b32 p0, {q}, mg, 0x4140;
prmt.b32 p1, {q}, mg, 0x4342;
sub.rn.f16x2 p0, p0, $5;
sub.rn.f16x2 p1, p1, $6;
mul.rn.f16x2 p0, p0, $3;
mul.rn.f16x2 p1, p1, $4;
cvt.rn.satfinite.e4m3x2.f16x2 h0, p0;
cvt.rn.satfinite.e4m3x2.f16x2 h1, p1;
"""))

DEQ_TRITON, DEQ_F32, DEQ_F16X2 = 0, 1, 2  # the kernels' DEQ constexpr
_DEQ_MODES = {"triton": DEQ_TRITON, "f32": DEQ_F32, "f16x2": DEQ_F16X2}


@triton.jit
def _dequant_planes(packed, scale, offset, DEQ: tl.constexpr):
    """(low, high) FP8 tiles ``[R, C]`` of packed bytes ``[R, C]``: inputs j and 64 + j of each
    group; scale and offset (2^23 + z) ``[R]`` fp32. DEQ: DEQ_TRITON (plain ops), DEQ_F32 (inline
    PTX, fp32, same arithmetic, fewer instructions) or DEQ_F16X2 (inline PTX, packed halves)."""
    if DEQ == 2:
        s = tl.broadcast_to(scale.to(tl.float16)[:, None], packed.shape)
        c = tl.broadcast_to((offset - 8387584.0).to(tl.float16)[:, None], packed.shape)  # 1024 + z
        lo, hi = tl.inline_asm_elementwise(
            asm=_DEQUANT_ASM_F16X2, constraints="=r,=r,r,r,r,r,r", args=[packed, s, c],
            dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
        return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)
    elif DEQ == 1:
        s = tl.broadcast_to(scale[:, None], packed.shape)
        c = tl.broadcast_to(offset[:, None], packed.shape)
        lo, hi = tl.inline_asm_elementwise(
            asm=_DEQUANT_ASM, constraints="=r,=r,r,f,f,f,f,f,f,f,f", args=[packed, s, c],
            dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
        return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)
    else:
        return _dequant(packed & 0xF, scale, offset), _dequant(packed >> 4, scale, offset)


@triton.jit
def _group_params(s_ptr, z_ptr, rows, g, stride_sg, HAS_ZERO: tl.constexpr):
    """The raw scales and zero points (uint8; the scales again when symmetric) of group g."""
    s = tl.load(s_ptr + g * stride_sg + rows)
    if HAS_ZERO:
        return s, tl.load(z_ptr + g * stride_sg + rows)
    else:
        return s, s


@triton.jit
def _group_offset(z, HAS_ZERO: tl.constexpr, BLOCK: tl.constexpr):
    """2^23 + z for a row of zero points (or the symmetric 8)."""
    if HAS_ZERO:
        return z.to(tl.float32) + 8388608.0
    else:
        return tl.full((BLOCK,), 8388616.0, tl.float32)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, stride_wn, stride_sg, stride_on,
                    HAS_ZERO: tl.constexpr, DEQ: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n, g*128 + j] and out[n, g*128 + 64 + j] (FP8) for one [BLOCK_N, 128] block."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    rows = (offs_n % N).to(tl.int64)
    packed = tl.load(w_ptr + rows[:, None] * stride_wn + g * HALF + offs_h[None, :])
    s, z = _group_params(s_ptr, z_ptr, rows, g, stride_sg, HAS_ZERO)
    scale = s.to(tl.float32)
    offset = _group_offset(z, HAS_ZERO, BLOCK_N)
    out = out_ptr + offs_n[:, None].to(tl.int64) * stride_on + g * 128 + offs_h[None, :]
    mask = offs_n[:, None] < N
    w_lo, w_hi = _dequant_planes(packed, scale, offset, DEQ)
    tl.store(out, w_lo, mask=mask)
    tl.store(out + HALF, w_hi, mask=mask)


def _on_device(t: torch.Tensor) -> bool:
    """CUDA, or any device under the Triton interpreter (CPU debugging)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def check_weight(fn: str, packed, group_scales, zeros, group_size) -> tuple[int, int]:
    """(N, K) of a packed weight, after checking every tensor of it."""
    if group_size != GROUP_SIZE:
        raise ValueError(f"{fn}: group_size must be {GROUP_SIZE} (the kernel's K step and packing block), "
                         f"got {group_size}")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError(f"{fn}: packed must be a uint8 [N, K/2] tensor, got "
                        f"{getattr(packed, 'dtype', type(packed).__name__)} {tuple(getattr(packed, 'shape', ()))}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % GROUP_SIZE or n % 128:
        raise ValueError(f"{fn}: K and N must be multiples of 128, got K={k} (packed [N, K/2] = "
                         f"{tuple(packed.shape)}) and N={n}")
    if not isinstance(group_scales, torch.Tensor) or group_scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"{fn}: group_scales must be a {SCALE_DTYPES} tensor, got "
                        f"{getattr(group_scales, 'dtype', type(group_scales).__name__)}")
    want = (k // GROUP_SIZE, n)
    if tuple(group_scales.shape) != want:
        raise ValueError(f"{fn}: group_scales must be [K/G, N] = {list(want)}, got {tuple(group_scales.shape)}")
    if zeros is not None and (not isinstance(zeros, torch.Tensor) or zeros.dtype != torch.uint8
                              or tuple(zeros.shape) != want):
        raise ValueError(f"{fn}: zeros must be None or uint8 [K/G, N] = {list(want)}")
    for name, t in (("packed", packed), ("group_scales", group_scales), ("zeros", zeros)):
        if t is not None and not _on_device(t):
            raise ValueError(f"{fn}: {name} must be on a CUDA device, got {t.device}")
        if t is not None and t.device != packed.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, packed on {packed.device}")
    return n, k


def scale_tensor(v, what: str, device) -> torch.Tensor:
    """A per-tensor scale as a 1-element fp32 device tensor (no host sync for device tensors)."""
    if isinstance(v, torch.Tensor):
        if not v.is_floating_point() or v.numel() != 1:
            raise TypeError(f"{what} must be a number or a 1-element float tensor, got {v.dtype} {tuple(v.shape)}")
        return v.to(device=device, dtype=torch.float32).reshape(1)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{what} must be a number or a 1-element float tensor, got {type(v).__name__}")
    return torch.full((1,), float(v), dtype=torch.float32, device=device)


_F16X2_OK: dict = {}  # id(scale tensor) -> (its _version, whether f16x2 dequantization is exact)


def scales_fit_f16x2(scales: torch.Tensor) -> bool:
    """Whether every scale has at most 7 significant bits and lies in [2^-14, 2^11]: then the
    f16x2 dequantization is exact. Checked on the device once per tensor (one sync), cached by
    identity and version; inside CUDA graph capture an unchecked tensor counts as not fitting."""
    hit = _F16X2_OK.get(id(scales))
    if hit is not None and hit[0] == scales._version:
        return hit[1]
    if scales.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    s = scales.to(torch.float32)
    mant, _ = torch.frexp(s)
    ok = bool(((mant * 128 == torch.round(mant * 128)) & (s >= 2.0**-14) & (s <= 2.0**11)).all())
    if hit is None:
        weakref.finalize(scales, _F16X2_OK.pop, id(scales), None)
    _F16X2_OK[id(scales)] = (scales._version, ok)
    return ok


def dequant_mode(dequant: str, scales: torch.Tensor) -> int:
    if dequant == "auto":
        return DEQ_F16X2 if scales_fit_f16x2(scales) else DEQ_F32
    if dequant not in _DEQ_MODES:
        raise ValueError(f"dequant must be 'auto', 'f16x2', 'f32' or 'triton', got {dequant!r}")
    return _DEQ_MODES[dequant]


def w4a8_dequantize_fp8(packed: torch.Tensor, group_scales: torch.Tensor, zeros: torch.Tensor | None = None,
                        group_size: int = GROUP_SIZE, *, dequant: str = "auto") -> torch.Tensor:
    """The FP8 weight ``[N, K]`` the GEMM multiplies (same dequantization code), for checks and
    for the two-pass path. Bit-identical to ``w4a8_gemm_ref.dequantize_fp8``."""
    n, k = check_weight("w4a8_dequantize_fp8", packed, group_scales, zeros, group_size)
    out = torch.empty((n, k), dtype=FP8_DTYPE, device=packed.device)
    scales = group_scales.contiguous()
    zeros_arg = zeros.contiguous() if zeros is not None else scales
    block_n = 64
    _dequant_kernel[(triton.cdiv(n, block_n), k // GROUP_SIZE)](
        packed, scales, zeros_arg, out, n, packed.stride(0), scales.stride(0), out.stride(0),
        HAS_ZERO=zeros is not None, DEQ=dequant_mode(dequant, group_scales), BLOCK_N=block_n, num_warps=4)
    return out


def w4a8_gemm_two_pass(x_fp8: torch.Tensor, s_a, packed: torch.Tensor, group_scales: torch.Tensor, s8,
                       group_size: int = GROUP_SIZE, zeros: torch.Tensor | None = None, *,
                       fast_accum: bool = False, dequant: str = "auto") -> torch.Tensor:
    """The unfused alternative: ``w4a8_dequantize_fp8`` (reads the packed weight, writes the FP8
    weight: K / 2 + K bytes a row) then cuBLAS ``torch._scaled_mm`` on it. Same function as
    ``w4a8_gemm``; worth it only for large M, where that extra pass is small next to the multiply."""
    w8 = w4a8_dequantize_fp8(packed, group_scales, zeros, group_size, dequant=dequant)
    k = w8.shape[1]
    if x_fp8.dtype != FP8_DTYPE or x_fp8.shape[-1] != k:
        raise ValueError(f"w4a8_gemm_two_pass: x_fp8 must be {FP8_DTYPE} [..., {k}]")
    x2 = x_fp8.reshape(-1, k).contiguous()
    sa = scale_tensor(s_a, "s_a", x2.device)
    s8t = scale_tensor(s8, "s8", x2.device)
    y = torch._scaled_mm(x2, w8.t(), scale_a=sa, scale_b=s8t, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    return y.reshape(*x_fp8.shape[:-1], w8.shape[0])
