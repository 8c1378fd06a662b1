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

Files: this module is the host side (checks, chunk planning, launches, the entry points); the
kernels are in ``calibquant_qk_triton`` (1), ``calibquant_pv_triton`` (2, 3) and the device code
they share (each program's batch, kv head, token chunk and lanes; the register unpacking) in
``calibquant_unpack_triton``.

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

from edgeq.kernels.calibquant_ref import BITS
from edgeq.kernels.calibquant_pv_triton import _pv_kernel, _reduce_kernel
from edgeq.kernels.calibquant_qk_triton import _qk_kernel
from edgeq.kernels.calibquant_unpack_triton import UNPACK_MODES

__all__ = ["calibquant_decode_attention", "calibquant_qk", "calibquant_pv", "token_major", "DEFAULT_CONFIG",
           "DEFAULT_UNPACK", "UNPACK_MODES", "plan"]


# qk_*: Algorithm 1's kernel; pv_*: Algorithm 2's. *_block: tokens a step; *_warps: warps a program
# (more warps than 16-row MMA tiles would repeat the same tile: the 1-bit PV dot has one);
# *_per_sm: programs per SM the token chunking aims for. Defaults: the fastest of
# ``benchmarks/kernels/bench_calibquant.py --sweep`` at B=64, H=32, N=8192, D=128 on an H100.
DEFAULT_UNPACK = "asm-sub"
DEFAULT_CONFIG = {1: {"qk_block": 256, "qk_warps": 2, "qk_stages": 3, "qk_per_sm": 8,
                      "pv_block": 256, "pv_warps": 1, "pv_stages": 3, "pv_per_sm": 16},
                  2: {"qk_block": 256, "qk_warps": 4, "qk_stages": 3, "qk_per_sm": 64,
                      "pv_block": 128, "pv_warps": 1, "pv_stages": 3, "pv_per_sm": 16}}


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
