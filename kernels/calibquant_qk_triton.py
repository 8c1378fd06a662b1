"""CalibQuant's Algorithm 1 in Triton: q.K over packed codes with the query tile kept on chip
(``_qk_kernel``, launched by ``calibquant_triton.calibquant_qk``): fp32 logits and per-chunk
min / max for the calibration."""

from __future__ import annotations

import triton
import triton.language as tl

from edgeq.kernels.calibquant_unpack_triton import PLANE_SCALE, _program_chunk, _unpack_planes


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
        k0, k1, k2, k3, k4, k5, k6, k7 = _unpack_planes(packed, 1, UNPACK)
        acc = tl.dot(k0, q0, acc)
        acc = tl.dot(k1, q1, acc)
        acc = tl.dot(k2, q2, acc)
        acc = tl.dot(k3, q3, acc)
        acc = tl.dot(k4, q4, acc)
        acc = tl.dot(k5, q5, acc)
        acc = tl.dot(k6, q6, acc)
        acc = tl.dot(k7, q7, acc)
    else:
        k0, k1, k2, k3 = _unpack_planes(packed, 2, UNPACK)
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
    b, kh, chunk, t_start, t_end, t_full, offs_g, gm, offs_j, jm, offs_t = _program_chunk(
        N, G, KVH, DP, CHUNK, G_PAD, DPC, BLOCK_T)
    H = KVH * G
    D = DP * (8 // BITS)
    qb = q_ptr + b.to(tl.int64) * stride_qb + (kh * G).to(tl.int64) * stride_qh
    kvb = tl.program_id(0).to(tl.int64) * D  # (b, kh)'s row: alpha / scale are contiguous [B, KVH, D]
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
