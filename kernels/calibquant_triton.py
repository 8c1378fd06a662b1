"""Triton decode attention over a CalibQuant 1/2-bit visual KV cache (paper 001, Algorithms 1-2).

Why: at decode, attention reads the whole KV cache once per generated token, so its time is the
cache's bytes over HBM bandwidth; fp16 SDPA at B=64, H=32, N=8192, D=128 moves 8.6 GB (2.78 ms on
an H100). The packed 1-bit cache is 16x smaller (8x at 2 bits), but only if the codes are consumed
packed: dequantizing to fp16 first would move the fp16 bytes again. These kernels unpack in
registers and apply the channel-wise alpha / scale after the products (post-scaling, Eq. 6).

Math (``calibquant_ref`` is the spec): ``logit_t = (q' * scale_k) . code_t + q' . alpha_k`` with
``q' = q * sm_scale``; calibration ``g`` (Eq. 7) is affine with slope ``a = (delta - gamma + tau1 -
tau2) / (delta - gamma)``, so ``softmax(g(x)) = softmax(a x)``: only the per-head slope is needed,
but it needs the head's min / max over all tokens before any exponential. Hence three launches:

1. ``_qk_kernel`` (Algorithm 1): one program per (batch, kv head, token chunk). The query tile of
   the GQA group (G heads, padded to a power of two; 1 for MHA) is loaded once, multiplied by
   sm_scale and scale_k and kept on chip for the whole chunk; each step loads a ``[BLOCK_T,
   D*b/8]`` tile of packed bytes (cp.async-pipelined), unpacks it into ``8/b`` fp16 bit planes and
   runs one tensor-core dot per plane (mma.sync, A = the plane from registers). Writes fp32 logits
   ``[B, H, N]`` and each chunk's min / max.
2. ``_pv_kernel`` (Algorithm 2): the token axis is split into chunks so that about ``pv_per_sm``
   programs per SM exist whatever B * KVH is (several waves: a short last wave). Each program
   reduces the chunk min / max to the head's [gamma, delta], forms ``p = exp2(a log2(e) (x - x*))``
   (x* = delta, or gamma when a < 0: one reference point for every chunk, so partials add without
   rescaling), rounds p to fp16 and accumulates ``plane^T @ p^T`` per plane on tensor cores
   (A = the unpacked plane ``[D*b/8, BLOCK_T]``) plus ``sum(p)`` into an fp32 workspace.
   The dot reduces over tokens, so V is read fastest stored token-major (``token_major``: unit
   stride on N; each thread's fragment is then 4 consecutive tokens of one byte column, one
   32-bit shared-memory load instead of four byte loads and three PRMTs).
3. ``_reduce_kernel``: sums the chunks in a fixed order (deterministic) and applies the post-scale
   ``out = scale_v * (sum p.code) / sum p + alpha_v``, cast to q's dtype.

Unpacking (the bit order of ``calibquant_ref``: element i of a byte at shift ``s_i = 8 - b(i+1)``),
inline PTX, 4 bytes a call, one PRMT per two bytes and one AND per plane and fp16 pair:
``unpack="asm-sub"`` (default): PRMT puts two bytes in the low bytes of two zero halves, the AND
keeps ``byte & mask_i``, read as the fp16 subnormal ``code * 2^(s_i - 24)``; the tensor cores take
fp16 subnormals exactly (checked bit for bit by the GPU tests), and ``2^(24 - s_i)`` is applied in
fp32 after the dot. ``unpack="asm"``: the same with the fp16 1024 (``0x64XX & (0xFF00 | mask)`` =
``1024 + code 2^s_i``) and a ``sub.f16x2`` of 1024 (one more instruction a pair, exact; folding the
1024 into a bias instead would lose ~10 bits to cancellation in the fp32 accumulator);
``2^-s_i`` goes into the query plane (exact). "triton" / "triton-sub": the same arithmetic in plain
Triton (the interpreter's path). The ANDs run on the integer pipe (half rate): with the packed
bytes' HBM traffic they set the floor.

Precision: the query planes (``q * sm_scale * scale_k * 2^-s``) and p are rounded to fp16
(2^-11 relative), codes are exact, accumulation is fp32; outputs are within 2^-8 of each
channel's range of the float64 reference (``tests/test_kernels_gpu_calibquant.py``; measured
2e-4 at B=64, N=8192).

Speed (H100, CUDA graphs, ``benchmarks/results/calibquant-h100.json``): B=64, H=32, N=8192, D=128
with calibration: 1 bit 0.284 ms, 2 bits 0.439 ms, fp16 SDPA 2.775 ms (9.8x and 6.3x); that is
about 80% (1 bit) and 90% (2 bits) of the 3.0 TB/s copy bandwidth on the bytes moved: the packed
codes plus the fp32 logits that QK writes and PV reads back (the cost of calibrating over all
tokens: 20% of the 1-bit traffic).

Constraints (``ValueError`` / ``TypeError``): q ``[B, H, D]`` fp16 / bf16 / fp32; packed uint8
``[B, KVH, N, D*b/8]``, K with unit stride on the last axis, V on the last or on the token axis
(other strides free, so a cache laid out ``[B, N, KVH, .]`` works through a permuted view);
alpha / scale ``[B, KVH, D]`` float; H a multiple of KVH; D a multiple of 8/b; N >= 1. Host cost
is three launches and four allocations (tens of us): capture decode steps in CUDA graphs (the
benchmark times graph replays).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from edgeq.kernels.calibquant_ref import BITS

__all__ = ["calibquant_decode_attention", "calibquant_qk", "calibquant_pv", "token_major", "DEFAULT_CONFIG",
           "DEFAULT_UNPACK", "UNPACK_MODES", "plan"]

LOG2E = tl.constexpr(1.4426950408889634)
# unpack modes (the kernels' UNPACK constexpr): the 1024 form in plain Triton / inline PTX, the
# subnormal form in inline PTX / plain Triton. PLANE_SCALE: what the subnormal planes are scaled by.
UNPACK_MODES = {"triton": 0, "asm": 1, "asm-sub": 2, "triton-sub": 3}
PLANE_SCALE = tl.constexpr(16777216.0)  # 2^24

# qk_*: Algorithm 1's kernel; pv_*: Algorithm 2's. *_block: tokens a step; *_warps: warps a program
# (more warps than 16-row MMA tiles would repeat the same tile: the 1-bit PV dot has one);
# *_per_sm: programs per SM the token chunking aims for. Defaults: the fastest of
# ``bench_calibquant.py --sweep`` at B=64, H=32, N=8192, D=128 on an H100.
DEFAULT_UNPACK = "asm-sub"
DEFAULT_CONFIG = {1: {"qk_block": 256, "qk_warps": 2, "qk_stages": 3, "qk_per_sm": 8,
                      "pv_block": 256, "pv_warps": 1, "pv_stages": 3, "pv_per_sm": 16},
                  2: {"qk_block": 256, "qk_warps": 4, "qk_stages": 3, "qk_per_sm": 64,
                      "pv_block": 128, "pv_warps": 1, "pv_stages": 3, "pv_per_sm": 16}}


def _asm_unpack(bits: int, subnormal: bool) -> str:
    """PTX: $0.. the planes (2 regs each: fp16 pairs of bytes 0-1, 2-3), last operand the 4 bytes.
    1024 form: ``0x64XX & (0xFF00 | mask)`` = 1024 + v, minus 1024; subnormal form: ``0x00XX & mask``
    is the fp16 subnormal ``v * 2^-24`` (no subtraction; the 2^24 is applied in fp32 later)."""
    per = 8 // bits
    body = [".reg .b32 t0, t1, mg, off;", f"mov.b32 mg, {'0x00000000' if subnormal else '0x64646464'};",
            "mov.b32 off, 0x64006400;",
            f"prmt.b32 t0, ${2 * per}, mg, 0x4140;", f"prmt.b32 t1, ${2 * per}, mg, 0x4342;"]
    for i in range(per):
        m = ((2**bits - 1) << (8 - bits * (i + 1))) | (0 if subnormal else 0xFF00)
        mask = f"0x{m:04X}{m:04X}"
        for r, t in ((2 * i, "t0"), (2 * i + 1, "t1")):
            body.append(f"and.b32 ${r}, {t}, {mask};")
            if not subnormal:
                body.append(f"sub.rn.f16x2 ${r}, ${r}, off;")
    return "{\n" + "\n".join(body) + "\n}"


_ASM_B1 = tl.constexpr(_asm_unpack(1, False))
_ASM_B2 = tl.constexpr(_asm_unpack(2, False))
_ASM_B1_SUB = tl.constexpr(_asm_unpack(1, True))
_ASM_B2_SUB = tl.constexpr(_asm_unpack(2, True))


@triton.jit
def _plane(x, MASK: tl.constexpr, UNPACK: tl.constexpr):
    """One plane of int32 bytes in plain Triton: the asm modes' arithmetic (exact either way)."""
    if UNPACK == 3:
        return (x & MASK).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        return ((x & MASK) | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _unpack_b1(packed, UNPACK: tl.constexpr):
    """The 8 planes (fp16 ``bit_i * 2^(7-i)``, times 2^-24 in the subnormal modes) of 1-bit bytes."""
    if UNPACK == 1:
        return tl.inline_asm_elementwise(asm=_ASM_B1, constraints="=r," * 16 + "r", args=[packed],
                                         dtype=(tl.float16,) * 8, is_pure=True, pack=4)
    elif UNPACK == 2:
        return tl.inline_asm_elementwise(asm=_ASM_B1_SUB, constraints="=r," * 16 + "r", args=[packed],
                                         dtype=(tl.float16,) * 8, is_pure=True, pack=4)
    else:
        x = packed.to(tl.int32)
        return (_plane(x, 0x80, UNPACK), _plane(x, 0x40, UNPACK), _plane(x, 0x20, UNPACK),
                _plane(x, 0x10, UNPACK), _plane(x, 0x08, UNPACK), _plane(x, 0x04, UNPACK),
                _plane(x, 0x02, UNPACK), _plane(x, 0x01, UNPACK))


@triton.jit
def _unpack_b2(packed, UNPACK: tl.constexpr):
    """The 4 planes (fp16 ``code_i * 2^(6-2i)``, times 2^-24 in the subnormal modes) of 2-bit bytes."""
    if UNPACK == 1:
        return tl.inline_asm_elementwise(asm=_ASM_B2, constraints="=r," * 8 + "r", args=[packed],
                                         dtype=(tl.float16,) * 4, is_pure=True, pack=4)
    elif UNPACK == 2:
        return tl.inline_asm_elementwise(asm=_ASM_B2_SUB, constraints="=r," * 8 + "r", args=[packed],
                                         dtype=(tl.float16,) * 4, is_pure=True, pack=4)
    else:
        x = packed.to(tl.int32)
        return _plane(x, 0xC0, UNPACK), _plane(x, 0x30, UNPACK), _plane(x, 0x0C, UNPACK), _plane(x, 0x03, UNPACK)


@triton.jit
def _q_plane(q_ptr, ks_ptr, ka_ptr, offs_g, offs_j, G, DP, stride_qh, sm_scale,
             I: tl.constexpr, BITS: tl.constexpr):
    """Query plane i, transposed and ready for the dot: fp16 ``[DPC, G_PAD]`` of
    ``q' * scale_k * 2^-s_i`` over channels ``PER*j + i``, and its share of ``q' . alpha_k``."""
    PER: tl.constexpr = 8 // BITS
    SHIFT: tl.constexpr = 8 - BITS * (I + 1)
    c = offs_j * PER + I
    jm = offs_j < DP
    qm = (offs_g[:, None] < G) & jm[None, :]
    qv = tl.load(q_ptr + offs_g[:, None] * stride_qh + c[None, :], mask=qm, other=0.0).to(tl.float32) * sm_scale
    ks = tl.load(ks_ptr + c, mask=jm, other=0.0).to(tl.float32) * (1.0 / (1 << SHIFT))
    ka = tl.load(ka_ptr + c, mask=jm, other=0.0).to(tl.float32)
    return tl.trans((qv * ks[None, :]).to(tl.float16)), tl.sum(qv * ka[None, :], axis=1)


@triton.jit
def _qk_dots(packed, q0, q1, q2, q3, q4, q5, q6, q7, BITS: tl.constexpr, UNPACK: tl.constexpr,
             BLOCK_T: tl.constexpr, G_PAD: tl.constexpr):
    """``[BLOCK_T, G_PAD]`` sums of plane_i @ q_i over the planes of one packed K tile."""
    acc = tl.zeros((BLOCK_T, G_PAD), dtype=tl.float32)
    if BITS == 1:
        k0, k1, k2, k3, k4, k5, k6, k7 = _unpack_b1(packed, UNPACK)
        acc = tl.dot(k0, q0, acc)
        acc = tl.dot(k1, q1, acc)
        acc = tl.dot(k2, q2, acc)
        acc = tl.dot(k3, q3, acc)
        acc = tl.dot(k4, q4, acc)
        acc = tl.dot(k5, q5, acc)
        acc = tl.dot(k6, q6, acc)
        acc = tl.dot(k7, q7, acc)
    else:
        k0, k1, k2, k3 = _unpack_b2(packed, UNPACK)
        acc = tl.dot(k0, q0, acc)
        acc = tl.dot(k1, q1, acc)
        acc = tl.dot(k2, q2, acc)
        acc = tl.dot(k3, q3, acc)
    if UNPACK >= 2:
        acc = acc * PLANE_SCALE
    return acc


@triton.jit
def _qk_kernel(q_ptr, ks_ptr, ka_ptr, kp_ptr, lg_ptr, mm_ptr,
               N, G, KVH, DP, CHUNK, NCQ, sm_scale,
               stride_qb, stride_qh, stride_pb, stride_ph, stride_pn,
               BITS: tl.constexpr, DPC: tl.constexpr, G_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
               UNPACK: tl.constexpr, GQA1: tl.constexpr):
    """Logits ``[B, H, N]`` (fp32) of one (batch, kv head, token chunk), and the chunk's min / max.
    Full token blocks run in the loop; the last, partial block of the chunk, if any, once more
    after it with token masks (the loop's own mask is always true: see the load)."""
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    b = pid // KVH
    kh = pid % KVH
    H = KVH * G
    D = DP * (8 // BITS)
    offs_g = tl.arange(0, G_PAD)
    offs_j = tl.arange(0, DPC)
    offs_t = tl.arange(0, BLOCK_T)
    gm = offs_g < G
    jm = offs_j < DP
    qb = q_ptr + b.to(tl.int64) * stride_qb + (kh * G).to(tl.int64) * stride_qh
    kvb = pid.to(tl.int64) * D  # alpha / scale are contiguous [B, KVH, D]
    ks = ks_ptr + kvb
    ka = ka_ptr + kvb
    # the query planes stay on chip for the whole chunk (Algorithm 1)
    q0, c0 = _q_plane(qb, ks, ka, offs_g, offs_j, G, DP, stride_qh, sm_scale, 0, BITS)
    q1, c1 = _q_plane(qb, ks, ka, offs_g, offs_j, G, DP, stride_qh, sm_scale, 1, BITS)
    q2, c2 = _q_plane(qb, ks, ka, offs_g, offs_j, G, DP, stride_qh, sm_scale, 2, BITS)
    q3, c3 = _q_plane(qb, ks, ka, offs_g, offs_j, G, DP, stride_qh, sm_scale, 3, BITS)
    bias = c0 + c1 + c2 + c3
    if BITS == 1:
        q4, c4 = _q_plane(qb, ks, ka, offs_g, offs_j, G, DP, stride_qh, sm_scale, 4, BITS)
        q5, c5 = _q_plane(qb, ks, ka, offs_g, offs_j, G, DP, stride_qh, sm_scale, 5, BITS)
        q6, c6 = _q_plane(qb, ks, ka, offs_g, offs_j, G, DP, stride_qh, sm_scale, 6, BITS)
        q7, c7 = _q_plane(qb, ks, ka, offs_g, offs_j, G, DP, stride_qh, sm_scale, 7, BITS)
        bias += c4 + c5 + c6 + c7
    else:  # unused placeholders
        q4 = q0
        q5 = q0
        q6 = q0
        q7 = q0

    t_start = chunk * CHUNK
    t_end = tl.minimum(t_start + CHUNK, N)
    n_full = (t_end - t_start) // BLOCK_T
    kb = kp_ptr + b.to(tl.int64) * stride_pb + kh.to(tl.int64) * stride_ph + offs_j[None, :]
    lb = lg_ptr + (b * H + kh * G).to(tl.int64) * N
    # running min / max kept elementwise (one reduction after the loop, not one a step)
    if GQA1:  # one query head per kv head
        bias1 = tl.sum(bias, axis=0)
        lptrs = lb + offs_t
        mn = tl.full((BLOCK_T,), float("inf"), tl.float32)
        mx = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    else:
        lptrs = lb + offs_g[None, :].to(tl.int64) * N + offs_t[:, None]
        mn = tl.full((BLOCK_T, G_PAD), float("inf"), tl.float32)
        mx = tl.full((BLOCK_T, G_PAD), float("-inf"), tl.float32)
    t_full = t_start + n_full * BLOCK_T
    for t0 in range(t_start, t_full, BLOCK_T):
        # the (always true) token mask keeps Triton's cp.async pipelining of this load
        packed = tl.load(kb + (t0 + offs_t)[:, None].to(tl.int64) * stride_pn,
                         mask=(t0 + offs_t < t_end)[:, None] & jm[None, :], other=0)
        acc = _qk_dots(packed, q0, q1, q2, q3, q4, q5, q6, q7, BITS, UNPACK, BLOCK_T, G_PAD)
        if GQA1:
            lg1 = tl.sum(acc, axis=1) + bias1
            tl.store(lptrs + t0, lg1)
            mn = tl.minimum(mn, lg1)
            mx = tl.maximum(mx, lg1)
        else:
            lg = acc + bias[None, :]
            tl.store(lptrs + t0, lg, mask=gm[None, :])
            mn = tl.minimum(mn, tl.where(gm[None, :], lg, float("inf")))
            mx = tl.maximum(mx, tl.where(gm[None, :], lg, float("-inf")))
    if t_full < t_end:  # the partial last block
        tm = t_full + offs_t < t_end
        packed = tl.load(kb + (t_full + offs_t)[:, None].to(tl.int64) * stride_pn,
                         mask=tm[:, None] & jm[None, :], other=0)
        acc = _qk_dots(packed, q0, q1, q2, q3, q4, q5, q6, q7, BITS, UNPACK, BLOCK_T, G_PAD)
        if GQA1:
            lg1 = tl.sum(acc, axis=1) + bias1
            tl.store(lptrs + t_full, lg1, mask=tm)
            mn = tl.minimum(mn, tl.where(tm, lg1, float("inf")))
            mx = tl.maximum(mx, tl.where(tm, lg1, float("-inf")))
        else:
            lg = acc + bias[None, :]
            m2 = tm[:, None] & gm[None, :]
            tl.store(lptrs + t_full, lg, mask=m2)
            mn = tl.minimum(mn, tl.where(m2, lg, float("inf")))
            mx = tl.maximum(mx, tl.where(m2, lg, float("-inf")))
    hi = tl.num_programs(0) * G * NCQ
    if GQA1:
        row0 = (b * H + kh * G) * NCQ + chunk
        tl.store(mm_ptr + row0, tl.min(mn, axis=0))
        tl.store(mm_ptr + hi + row0, tl.max(mx, axis=0))
    else:
        row = (b * H + kh * G + offs_g) * NCQ + chunk
        tl.store(mm_ptr + row, tl.min(mn, axis=0), mask=gm)
        tl.store(mm_ptr + hi + row, tl.max(mx, axis=0), mask=gm)


@triton.jit
def _store_plane(wo_ptr, o, offs_j, offs_g, jm, gm, I: tl.constexpr, BITS: tl.constexpr, UNPACK: tl.constexpr):
    """Partial ``sum p . code`` of plane i (channels ``PER*j + i``): undo the plane's 2^s_i."""
    PER: tl.constexpr = 8 // BITS
    SHIFT: tl.constexpr = 8 - BITS * (I + 1)
    if UNPACK >= 2:
        o = o * (PLANE_SCALE / (1 << SHIFT))
    else:
        o = o * (1.0 / (1 << SHIFT))
    tl.store(wo_ptr + (offs_j * PER + I)[:, None], o, mask=jm[:, None] & gm[None, :])


@triton.jit
def _pv_dots(packed, pt, o0, o1, o2, o3, o4, o5, o6, o7, BITS: tl.constexpr, UNPACK: tl.constexpr):
    """Accumulate plane_i^T @ p^T into o_i over the planes of one packed V tile ``[DPC, BLOCK_T]``."""
    if BITS == 1:
        v0, v1, v2, v3, v4, v5, v6, v7 = _unpack_b1(packed, UNPACK)
        o0 = tl.dot(v0, pt, o0)
        o1 = tl.dot(v1, pt, o1)
        o2 = tl.dot(v2, pt, o2)
        o3 = tl.dot(v3, pt, o3)
        o4 = tl.dot(v4, pt, o4)
        o5 = tl.dot(v5, pt, o5)
        o6 = tl.dot(v6, pt, o6)
        o7 = tl.dot(v7, pt, o7)
    else:
        v0, v1, v2, v3 = _unpack_b2(packed, UNPACK)
        o0 = tl.dot(v0, pt, o0)
        o1 = tl.dot(v1, pt, o1)
        o2 = tl.dot(v2, pt, o2)
        o3 = tl.dot(v3, pt, o3)
    return o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def _pv_probs(lptrs, ref, c2, offs_g, gm, tm, GQA1: tl.constexpr, MASKED: tl.constexpr):
    """fp16 ``p^T [BLOCK_T, G_PAD]`` of one token block and its per-row sums (of the fp16 values)."""
    if GQA1:  # one logit row: load and exponentiate it once, not G_PAD times
        if MASKED:
            x = tl.load(lptrs, mask=tm, other=0.0)
            p = tl.where(tm, tl.exp2((x - ref) * c2), 0.0).to(tl.float16)
        else:
            p = tl.exp2((tl.load(lptrs) - ref) * c2).to(tl.float16)
        s = tl.where(offs_g == 0, tl.sum(p.to(tl.float32), axis=0), 0.0)
        return tl.where((offs_g == 0)[None, :], p[:, None], 0.0).to(tl.float16), s
    else:
        m2 = gm[:, None] & tm[None, :]
        x = tl.load(lptrs, mask=m2, other=0.0)
        p = tl.where(m2, tl.exp2((x - ref[:, None]) * c2[:, None]), 0.0).to(tl.float16)
        return tl.trans(p), tl.sum(p.to(tl.float32), axis=1)


@triton.jit
def _pv_kernel(lg_ptr, mm_ptr, vp_ptr, wo_ptr, ws_ptr,
               N, G, KVH, DP, CHUNK, NCQ, NCP, tau1, tau2,
               stride_pb, stride_ph, stride_pn, stride_pj,
               BITS: tl.constexpr, DPC: tl.constexpr, G_PAD: tl.constexpr, NCQ_PAD: tl.constexpr,
               BLOCK_T: tl.constexpr, UNPACK: tl.constexpr, CALIB: tl.constexpr, GQA1: tl.constexpr):
    """Unnormalized ``sum_t p_t code_v[t]`` and ``sum_t p_t`` of one (batch, kv head, token chunk).
    V may be stored token-major (``stride_pn == 1``): each thread's A fragment then holds
    consecutive tokens of one byte column, which is what the p.V dot reduces over."""
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    b = pid // KVH
    kh = pid % KVH
    H = KVH * G
    D = DP * (8 // BITS)
    offs_g = tl.arange(0, G_PAD)
    offs_j = tl.arange(0, DPC)
    offs_t = tl.arange(0, BLOCK_T)
    gm = offs_g < G
    jm = offs_j < DP
    row = b * H + kh * G + offs_g
    # [gamma, delta] of each query head from the QK chunks; the calibration slope a
    offs_c = tl.arange(0, NCQ_PAD)
    cm = gm[:, None] & (offs_c < NCQ)[None, :]
    mm = mm_ptr + row[:, None] * NCQ + offs_c[None, :]
    gamma = tl.min(tl.load(mm, mask=cm, other=float("inf")), axis=1)
    delta = tl.max(tl.load(mm + tl.num_programs(0) * G * NCQ, mask=cm, other=float("-inf")), axis=1)
    width = delta - gamma
    flat = width <= 0  # also the padding rows (inf - inf would be nan)
    if CALIB:
        a = tl.where(flat, 1.0, (width + tau1 - tau2) / tl.where(flat, 1.0, width))
    else:
        a = tl.full((G_PAD,), 1.0, tl.float32)
    ref = tl.where(gm, tl.where(a >= 0, delta, gamma), 0.0)
    c2 = tl.where(gm, a * LOG2E, 0.0)

    t_start = chunk * CHUNK
    t_end = tl.minimum(t_start + CHUNK, N)
    n_full = (t_end - t_start) // BLOCK_T
    vb = vp_ptr + b.to(tl.int64) * stride_pb + kh.to(tl.int64) * stride_ph + offs_j[:, None].to(tl.int64) * stride_pj
    lb = lg_ptr + (b * H + kh * G).to(tl.int64) * N + t_start
    if GQA1:
        lptrs = lb + offs_t
        ref = tl.sum(ref, axis=0)
        c2 = tl.sum(c2, axis=0)
    else:
        lptrs = lb + offs_g[:, None].to(tl.int64) * N + offs_t[None, :]
    s = tl.zeros((G_PAD,), dtype=tl.float32)
    o0 = tl.zeros((DPC, G_PAD), dtype=tl.float32)
    o1 = tl.zeros((DPC, G_PAD), dtype=tl.float32)
    o2 = tl.zeros((DPC, G_PAD), dtype=tl.float32)
    o3 = tl.zeros((DPC, G_PAD), dtype=tl.float32)
    o4 = tl.zeros((DPC, G_PAD), dtype=tl.float32)
    o5 = tl.zeros((DPC, G_PAD), dtype=tl.float32)
    o6 = tl.zeros((DPC, G_PAD), dtype=tl.float32)
    o7 = tl.zeros((DPC, G_PAD), dtype=tl.float32)
    tm_all = offs_t < BLOCK_T
    t_full = t_start + n_full * BLOCK_T
    for t0 in range(t_start, t_full, BLOCK_T):
        pt, ps = _pv_probs(lptrs + (t0 - t_start), ref, c2, offs_g, gm, tm_all, GQA1, False)
        s += ps
        # the (always true) token mask keeps Triton's cp.async pipelining of this load
        packed = tl.load(vb + (t0 + offs_t)[None, :].to(tl.int64) * stride_pn,
                         mask=jm[:, None] & (t0 + offs_t < t_end)[None, :], other=0)
        o0, o1, o2, o3, o4, o5, o6, o7 = _pv_dots(packed, pt, o0, o1, o2, o3, o4, o5, o6, o7, BITS, UNPACK)
    if t_full < t_end:  # the partial last block
        tm = t_full + offs_t < t_end
        pt, ps = _pv_probs(lptrs + (t_full - t_start), ref, c2, offs_g, gm, tm, GQA1, True)
        s += ps
        packed = tl.load(vb + (t_full + offs_t)[None, :].to(tl.int64) * stride_pn,
                         mask=jm[:, None] & tm[None, :], other=0)
        o0, o1, o2, o3, o4, o5, o6, o7 = _pv_dots(packed, pt, o0, o1, o2, o3, o4, o5, o6, o7, BITS, UNPACK)
    part = (row * NCP + chunk).to(tl.int64)
    wo = wo_ptr + part[None, :] * D
    _store_plane(wo, o0, offs_j, offs_g, jm, gm, 0, BITS, UNPACK)
    _store_plane(wo, o1, offs_j, offs_g, jm, gm, 1, BITS, UNPACK)
    _store_plane(wo, o2, offs_j, offs_g, jm, gm, 2, BITS, UNPACK)
    _store_plane(wo, o3, offs_j, offs_g, jm, gm, 3, BITS, UNPACK)
    if BITS == 1:
        _store_plane(wo, o4, offs_j, offs_g, jm, gm, 4, BITS, UNPACK)
        _store_plane(wo, o5, offs_j, offs_g, jm, gm, 5, BITS, UNPACK)
        _store_plane(wo, o6, offs_j, offs_g, jm, gm, 6, BITS, UNPACK)
        _store_plane(wo, o7, offs_j, offs_g, jm, gm, 7, BITS, UNPACK)
    tl.store(ws_ptr + part, s, mask=gm)


@triton.jit
def _reduce_kernel(wo_ptr, ws_ptr, va_ptr, vs_ptr, out_ptr, G, KVH, NCP, D, stride_ob, stride_oh,
                   NCP_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """``out[b, h] = scale_v * (sum_chunks o) / (sum_chunks s) + alpha_v``, chunks summed in order."""
    pid = tl.program_id(0)  # b * H + h
    H = KVH * G
    b = pid // H
    h = pid % H
    offs_c = tl.arange(0, NCP_PAD)
    offs_d = tl.arange(0, D_PAD)
    cm = offs_c < NCP
    dm = offs_d < D
    o = tl.load(wo_ptr + (pid * NCP + offs_c)[:, None].to(tl.int64) * D + offs_d[None, :],
                mask=cm[:, None] & dm[None, :], other=0.0)
    s = tl.sum(tl.load(ws_ptr + pid * NCP + offs_c, mask=cm, other=0.0), axis=0)
    kv = (b * KVH + h // G).to(tl.int64) * D
    va = tl.load(va_ptr + kv + offs_d, mask=dm, other=0.0).to(tl.float32)
    vs = tl.load(vs_ptr + kv + offs_d, mask=dm, other=0.0).to(tl.float32)
    out = vs * (tl.sum(o, axis=0) / s) + va
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=dm)


# ----------------------------------------------------------------------------------------------
# Python side


def _on_device(t: torch.Tensor) -> bool:
    """CUDA, or any device under the Triton interpreter (CPU debugging)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _unpack_mode(unpack: str, device: torch.device) -> int:
    if unpack != "auto" and unpack not in UNPACK_MODES:
        raise ValueError(f"unpack must be 'auto' or one of {sorted(UNPACK_MODES)}, got {unpack!r}")
    if unpack == "auto":
        on_gpu = device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
        return UNPACK_MODES[DEFAULT_UNPACK if on_gpu else "triton"]
    return UNPACK_MODES[unpack]


def _config(config: dict | None, bits: int) -> dict:
    cfg = dict(DEFAULT_CONFIG[bits])
    if config:
        unknown = config.keys() - cfg.keys()
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)} (known: {sorted(cfg)})")
        cfg.update(config)
    return cfg


def token_major(packed: torch.Tensor) -> torch.Tensor:
    """The same ``[B, KVH, N, D*b/8]`` codes stored token-major (unit stride on N): the layout in
    which ``calibquant_pv`` reads V fastest (its dot reduces over tokens). A view with new strides."""
    return packed.transpose(2, 3).contiguous().transpose(2, 3)


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(n: int, heads: int, block: int, per_sm: int, sms: int) -> tuple[int, int]:
    """(tokens a chunk, chunks a head): split each head's N tokens only as far as needed for
    ``per_sm * sms`` programs over ``heads`` (batch x kv heads), in multiples of ``block``."""
    want = max(1, -(-per_sm * sms // max(heads, 1)))
    chunks = max(1, min(want, triton.cdiv(n, block)))
    chunk = triton.cdiv(triton.cdiv(n, chunks), block) * block
    return chunk, triton.cdiv(n, chunk)


def _check_cache(fn, name, packed, alpha, scale, bits, b, d, device, token_major_ok=False):
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 4:
        raise TypeError(f"{fn}: {name}_packed must be a uint8 [B, KVH, N, D*b/8] tensor, got "
                        f"{getattr(packed, 'dtype', type(packed).__name__)} {tuple(getattr(packed, 'shape', ()))}")
    kvh, n, dp = packed.shape[1], packed.shape[2], packed.shape[3]
    if packed.shape[0] != b or dp * 8 != d * bits:
        raise ValueError(f"{fn}: {name}_packed must be [B={b}, KVH, N, D*b/8={d * bits // 8}], "
                         f"got {tuple(packed.shape)}")
    if n < 1:
        raise ValueError(f"{fn}: the cache holds no tokens")
    if packed.stride(3) != 1 and not (token_major_ok and packed.stride(2) == 1):
        raise ValueError(f"{fn}: {name}_packed needs unit stride on its last axis"
                         + (" or on its token axis" if token_major_ok else ""))
    for what, t in (("alpha", alpha), ("scale", scale)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{fn}: {name}_{what} must be a float tensor")
        if tuple(t.shape) != (b, kvh, d):
            raise ValueError(f"{fn}: {name}_{what} must be [B, KVH, D] = {[b, kvh, d]}, got {tuple(t.shape)}")
    for t in (packed, alpha, scale):
        if not _on_device(t) or t.device != device:
            raise ValueError(f"{fn}: every tensor must be on q's CUDA device {device}, got {t.device}")
    return kvh, n, dp


def _check_q(fn, q, bits):
    if bits not in BITS:
        raise ValueError(f"{fn}: bits must be one of {BITS}, got {bits}")
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or q.dim() != 3:
        raise TypeError(f"{fn}: q must be a float16 / bfloat16 / float32 [B, H, D] tensor")
    if not _on_device(q):
        raise ValueError(f"{fn}: q must be on a CUDA device, got {q.device}")
    if q.shape[-1] % (8 // bits):
        raise ValueError(f"{fn}: head_dim {q.shape[-1]} is not a multiple of {8 // bits}")


def _pad(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(n))


def calibquant_qk(q, k_packed, k_alpha, k_scale, bits: int, *, sm_scale=None, unpack: str = "auto",
                  config: dict | None = None):
    """Algorithm 1: fp32 logits ``[B, H, N]`` (post-scaled, times sm_scale, not calibrated) and
    the per-chunk min / max ``[2, B, H, NCQ]``."""
    _check_q("calibquant_qk", q, bits)
    b, h, d = q.shape
    kvh, n, dp = _check_cache("calibquant_qk", "k", k_packed, k_alpha, k_scale, bits, b, d, q.device)
    if h % kvh:
        raise ValueError(f"calibquant_qk: query heads {h} are not a multiple of kv heads {kvh}")
    cfg = _config(config, bits)
    g = h // kvh
    sm = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    chunk, ncq = plan(n, b * kvh, cfg["qk_block"], cfg["qk_per_sm"], _sms(q.device))
    q = q if q.stride(-1) == 1 else q.contiguous()
    logits = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    minmax = torch.empty((2, b, h, ncq), dtype=torch.float32, device=q.device)
    _qk_kernel[(b * kvh, ncq)](
        q, k_scale.contiguous(), k_alpha.contiguous(), k_packed, logits, minmax,
        n, g, kvh, dp, chunk, ncq, sm,
        q.stride(0), q.stride(1), k_packed.stride(0), k_packed.stride(1), k_packed.stride(2),
        BITS=bits, DPC=_pad(dp, 16), G_PAD=_pad(g), BLOCK_T=cfg["qk_block"], UNPACK=_unpack_mode(unpack, q.device),
        GQA1=g == 1,
        num_warps=cfg["qk_warps"], num_stages=cfg["qk_stages"])
    return logits, minmax


def calibquant_pv(logits, minmax, v_packed, v_alpha, v_scale, bits: int, tau1: float = 0.0, tau2: float = 0.0,
                  calibrate: bool = True, *, out_dtype: torch.dtype = torch.float16, unpack: str = "auto",
                  config: dict | None = None):
    """Algorithm 2 and the reduction: ``out [B, H, D]`` (``out_dtype``) from ``calibquant_qk``'s output."""
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 or logits.dim() != 3:
        raise TypeError("calibquant_pv: logits must be calibquant_qk's float32 [B, H, N]")
    b, h, n = logits.shape
    if minmax.dim() != 4 or tuple(minmax.shape[:3]) != (2, b, h):
        raise ValueError(f"calibquant_pv: minmax must be [2, B, H, NCQ], got {tuple(minmax.shape)}")
    if bits not in BITS:
        raise ValueError(f"calibquant_pv: bits must be one of {BITS}, got {bits}")
    d = v_alpha.shape[-1] if isinstance(v_alpha, torch.Tensor) else 0
    kvh, nv, dp = _check_cache("calibquant_pv", "v", v_packed, v_alpha, v_scale, bits, b, d, logits.device,
                               token_major_ok=True)
    if nv != n or h % kvh:
        raise ValueError(f"calibquant_pv: V holds {nv} tokens and {kvh} kv heads; logits have {n} tokens, {h} heads")
    cfg = _config(config, bits)
    g = h // kvh
    ncq = minmax.shape[3]
    chunk, ncp = plan(n, b * kvh, cfg["pv_block"], cfg["pv_per_sm"], _sms(logits.device))
    ws_o = torch.empty((b, h, ncp, d), dtype=torch.float32, device=logits.device)
    ws_s = torch.empty((b, h, ncp), dtype=torch.float32, device=logits.device)
    _pv_kernel[(b * kvh, ncp)](
        logits, minmax, v_packed, ws_o, ws_s,
        n, g, kvh, dp, chunk, ncq, ncp, float(tau1), float(tau2),
        v_packed.stride(0), v_packed.stride(1), v_packed.stride(2), v_packed.stride(3),
        BITS=bits, DPC=_pad(dp, 16), G_PAD=_pad(g), NCQ_PAD=_pad(ncq, 2), BLOCK_T=cfg["pv_block"],
        UNPACK=_unpack_mode(unpack, logits.device), CALIB=bool(calibrate), GQA1=g == 1,
        num_warps=cfg["pv_warps"], num_stages=cfg["pv_stages"])
    out = torch.empty((b, h, d), dtype=out_dtype, device=logits.device)
    _reduce_kernel[(b * h,)](ws_o, ws_s, v_alpha.contiguous(), v_scale.contiguous(), out, g, kvh, ncp, d,
                             out.stride(0), out.stride(1), NCP_PAD=_pad(ncp, 2), D_PAD=_pad(d, 16), num_warps=4)
    return out


def calibquant_decode_attention(q, k_packed, k_alpha, k_scale, v_packed, v_alpha, v_scale, bits: int,
                                tau1: float = 0.0, tau2: float = 0.0, calibrate: bool = True, *,
                                sm_scale=None, unpack: str = "auto", config: dict | None = None) -> torch.Tensor:
    """CalibQuant decode attention: ``out [B, H, D]`` in q's dtype (fp16 / bf16; fp32 q gives fp32).

    q ``[B, H, D]`` (one decode query per head); ``*_packed`` uint8 ``[B, KVH, N, D*b/8]``
    (``calibquant_ref.pack_codes`` layout, MSB first); ``*_alpha`` / ``*_scale`` ``[B, KVH, D]``;
    bits 1 or 2; GQA: query head h reads kv head ``h // (H / KVH)``. ``calibrate`` applies Eq. 7
    with (tau1, tau2) per query head over all N tokens. ``unpack``: a key of ``UNPACK_MODES`` or
    "auto" (``DEFAULT_UNPACK`` on CUDA, "triton" under the interpreter). ``config``: keys of
    ``DEFAULT_CONFIG[bits]``. V is read fastest stored token-major (``token_major``)."""
    logits, minmax = calibquant_qk(q, k_packed, k_alpha, k_scale, bits, sm_scale=sm_scale, unpack=unpack,
                                   config=config)
    return calibquant_pv(logits, minmax, v_packed, v_alpha, v_scale, bits, tau1, tau2, calibrate,
                         out_dtype=q.dtype, unpack=unpack, config=config)
