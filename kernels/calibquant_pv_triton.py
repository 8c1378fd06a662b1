"""CalibQuant's Algorithm 2 in Triton: p.V over packed codes with the token axis split across SMs
(``_pv_kernel``, applying the logit calibration's slope), and the fixed-order reduction with the
post-scale (``_reduce_kernel``); launched by ``calibquant_triton.calibquant_pv``."""

from __future__ import annotations

import triton
import triton.language as tl

from edgeq.kernels.calibquant_unpack_triton import PLANE_SCALE, _program_chunk, _unpack_planes

LOG2E = tl.constexpr(1.4426950408889634)


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
        v0, v1, v2, v3, v4, v5, v6, v7 = _unpack_planes(packed, 1, UNPACK)
        o0 = tl.dot(v0, pt, o0)
        o1 = tl.dot(v1, pt, o1)
        o2 = tl.dot(v2, pt, o2)
        o3 = tl.dot(v3, pt, o3)
        o4 = tl.dot(v4, pt, o4)
        o5 = tl.dot(v5, pt, o5)
        o6 = tl.dot(v6, pt, o6)
        o7 = tl.dot(v7, pt, o7)
    else:
        v0, v1, v2, v3 = _unpack_planes(packed, 2, UNPACK)
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
    b, kh, chunk, t_start, t_end, t_full, offs_g, gm, offs_j, jm, offs_t = _program_chunk(
        N, G, KVH, DP, CHUNK, G_PAD, DPC, BLOCK_T)
    H = KVH * G
    D = DP * (8 // BITS)
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
