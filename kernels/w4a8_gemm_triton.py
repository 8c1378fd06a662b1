"""Triton W4A8 GEMM for DPQ: ``Y = bf16((X8 @ W8^T) * s_a * s8)``, INT4 weights dequantized to FP8.

Why: DPQ (``edgeq.kernels.w4a8_gemm_ref``, paper 003) stores weights as INT4 with FP8-domain group
scales and a per-tensor power-of-two scale s8, and multiplies in FP8. A bf16 decode GEMM (M <= 16)
is bound by reading the weight: 4 bits a weight is a quarter of bf16's bytes. Prefill (large M) is bound by
the multiply: FP8 tensor cores run at twice bf16's rate. torch has no such GEMM: ``_scaled_mm``
needs the FP8 weight (twice the bytes) and cuBLAS has no INT4 input.

How: one program computes the tile ``Y[m0:m0+BLOCK_M, n0:n0+BLOCK_N]`` as its transpose,
``acc[BLOCK_N, BLOCK_M] = W8 tile @ X8 tile^T`` ("swap AB"):

- The weight is the MMA's M side. Hopper's wgmma needs M tiles of 64 but takes N tiles of 16, so
  swapping lets M = 1..16 decode use a 16-wide activation tile on the wgmma path instead of
  padding M to 64; and the dequantized weight, computed in registers, is the A operand, which
  wgmma reads from registers (B, the activations, comes from shared memory).
- K loop, one 128-wide group per step (``G = 128``, the packing block): cp.async-pipelined loads
  of the packed bytes ``[BLOCK_N, 64]`` (byte j = inputs j and 64 + j, see the reference's
  layout), the group's ``BLOCK_N`` scales (contiguous: scales are stored ``[K/G, N]``) and the two
  64-wide activation slices ``X[:, k0:k0+64]``, ``X[:, k0+64:k0+128]``; dequantize both nibble
  planes in registers; two ``tl.dot`` of K = 64 on FP8 tensor cores (QGMMA in the SASS).
- Dequantization, bit-exact with the reference (``fp8_e4m3fn((u - z) * s_g)``, one RNE rounding):
  ``dequant="f16x2"`` (inline PTX, packed halves, ~3 instructions a weight: PRMT places two
  nibbles in the mantissas of two fp16 1024s, ``sub.rn.f16x2`` 1024 + z, ``mul.rn.f16x2`` s_g,
  ``cvt.rn.satfinite.e4m3x2.f16x2``) is exact for scales of at most 7 significant bits, which
  ``quantize_dpq`` produces; ``"f32"`` (inline PTX, fp32: 2^23 + u by PRMT, sub, mul, cvt; ~4 a
  weight) and ``"triton"`` (the same in plain Triton ops) take any scales. ``"auto"`` checks the
  scales once per tensor. For the decode tile (BLOCK_N = 64, 4 warps) the K step compiles to
  272 / 367 / 502 SASS instructions for the three, and on an H200 at M = 16 the GEMM takes
  8.4 / 10.1 / 11.3 us: the dequantization's instruction count, not HBM, bounds decode.
- Scales stored in fp32 (the reference's default) are prefetched by Triton's cp.async pipeline
  with the tiles; fp16 / bf16 scales (2 bytes a thread, under cp.async's 4) are loaded in each
  step and waited for: same results, 12-15% slower decode.
- Accumulation: fp32. Hopper's FP8 wgmma adds into its accumulator with reduced precision
  (DeepSeek-V3 measured ~14 bits); ``fast_accum=False`` (the default, like ``torch._scaled_mm``)
  sets ``max_num_imprecise_acc = 64`` so that each 64-deep dot lands in a fresh accumulator that
  is added to the fp32 sum on the CUDA cores (96.7% of outputs equal the bf16 rounding of the
  exact result at K = 4096, against 95% for ``_scaled_mm``); ``fast_accum=True`` chains the wgmma
  accumulator (77%, like ``_scaled_mm(use_fast_accum=True)``; faster only at large M).
- Epilogue: ``acc * (s_a * s8)`` in fp32 (s8 is a power of two: exact), one rounding to bf16,
  stored transposed into ``Y [M, N]``. s_a and s8 are read from device tensors (no host sync).
- Split-K (decode and mid M): N / BLOCK_N tiles are too few for the 132 SMs, so SPLIT_K programs
  share a tile, each over a contiguous range of groups. Each writes its fp32 partial to a
  workspace, then bumps the tile's counter (barrier, then one acq_rel atomic); the program that
  arrives last sums the SPLIT_K partials in a fixed order (deterministic result), stores Y and
  resets the counter to 0 for the next launch. One launch, no memset. The counters are one
  buffer per device: do not run two split-K calls at the same time on different streams.
- Rows past M and columns past N are read wrapped (``% M``, ``% N``) and dropped at the store.

Constraints (checked by the wrapper, ``ValueError``): K and N multiples of 128, group size 128,
any M >= 0; x float8_e4m3fn ``[..., K]``, packed uint8 ``[N, K/2]``, scales ``[K/G, N]`` fp32 /
fp16 / bf16, zeros (asymmetric) uint8 ``[K/G, N]``. Symmetric weights use zero point 8
(offset-binary nibbles, ``zeros=None``). The first call per device must run outside CUDA graph
capture (it allocates the split-K counters and checks the scales).

Autotuning: ``DECODE_CONFIGS`` (M <= 32: 16/32-row activation tiles, split-K 2 to 8 so 128 to 512
programs share the dequantization), ``MID_CONFIGS`` (M 64..512: 64/128 tiles, split-K 1 or 2) and
``LARGE_CONFIGS`` (M >= 1024: 128x128 to 256x128 wgmma tiles). The key buckets M to a power of
two (at least 16); tuning times CUDA-graph replays (no host launch cost). ``config=`` pins one.
Host cost: a call spends ~0.1 ms in Python and Triton's launcher, more than the decode kernel:
capture decode steps in a CUDA graph (the benchmark's main timings replay graphs).

Large M: the fused kernel re-dequantizes each weight tile once per BLOCK_M rows of X, so from a
few hundred rows the unfused ``w4a8_gemm_two_pass`` wins: ``w4a8_dequantize_fp8`` (``w4a8_dequant_triton``'s
dequantization, written to an FP8 ``[N, K]``) then cuBLAS ``torch._scaled_mm``. ``w4a8_gemm``'s
default ``path="auto"`` takes the fused kernel below ``TWO_PASS_MIN_M`` rows and the two passes
from there (H200, K = N = 4096: fused 8.4 us vs two-pass 13.8 us at M = 16; 17.1 vs 15.8 us at
M = 128; 236 vs 124 us at M = 4096, where ``_scaled_mm`` alone takes 120 us).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
import triton.testing

from edgeq.kernels.triton_tiles import tile_ids
from edgeq.kernels.w4a8_dequant_triton import (
    HALF,
    _dequant_planes,
    _group_offset,
    _group_params,
    check_weight,
    dequant_mode,
    scale_tensor,
    w4a8_gemm_two_pass,
)
from edgeq.kernels.w4a8_gemm_ref import FP8_DTYPE, GROUP_SIZE

COUNTER_SLOTS = 1 << 16  # split-K tile counters per device (tiles of one split-K launch)
__all__ = ["w4a8_gemm", "config_dict", "last_tuned_config", "tuning_timings", "candidate_configs", "m_bucket",
           "CONFIGS", "TWO_PASS_MIN_M"]
TWO_PASS_MIN_M = 128  # path="auto": rows of X from which the two-pass path is taken


def _config(bn: int, bm: int, split_k: int, warps: int, stages: int, group: int = 8) -> triton.Config:
    return triton.Config({"BLOCK_N": bn, "BLOCK_M": bm, "SPLIT_K": split_k, "GROUP_M": group},
                         num_warps=warps, num_stages=stages)


# (BLOCK_N weight rows, BLOCK_M activation rows, SPLIT_K, num_warps, num_stages). Shared memory a
# stage: BLOCK_N * 64 packed bytes + 2 * BLOCK_M * 64 FP8 activations (+ scales).
DECODE_CONFIGS = [  # M <= 32; for N = 4096: 64 or 32 tiles, times SPLIT_K programs
    _config(64, 16, 4, 4, 4),
    _config(64, 16, 2, 4, 6),
    _config(64, 16, 8, 4, 4),
    _config(64, 16, 8, 4, 2),
    _config(128, 16, 4, 4, 4),
    _config(128, 16, 4, 8, 4),
    _config(128, 16, 8, 8, 3),
    _config(64, 32, 4, 4, 4),
]
MID_CONFIGS = [  # 64 <= M <= 512
    _config(64, 64, 2, 4, 4),
    _config(128, 64, 1, 4, 4),
    _config(64, 128, 1, 4, 4),
    _config(128, 128, 1, 8, 4),
    _config(128, 64, 2, 4, 4),
]
LARGE_CONFIGS = [  # M >= 1024
    _config(128, 256, 1, 8, 3),
    _config(128, 128, 1, 8, 4),
    _config(256, 128, 1, 8, 3),
    _config(128, 128, 1, 4, 4),
    _config(64, 256, 1, 4, 3),
]
CONFIGS = DECODE_CONFIGS + MID_CONFIGS + LARGE_CONFIGS
_CONFIG_KEYS = {"BLOCK_N", "BLOCK_M", "SPLIT_K", "GROUP_M", "num_warps", "num_stages"}


def m_bucket(m: int) -> int:
    """The autotuning key of M: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(max(m, 1)))


def candidate_configs(bucket: int, k: int) -> list:
    """The configs tuned for an M bucket (and K: no more splits than groups)."""
    pool = DECODE_CONFIGS if bucket <= 32 else MID_CONFIGS if bucket <= 512 else LARGE_CONFIGS
    groups = max(k // GROUP_SIZE, 1)
    kept = [c for c in pool if c.kwargs["SPLIT_K"] <= groups]
    return kept or [c for c in pool if c.kwargs["SPLIT_K"] == min(x.kwargs["SPLIT_K"] for x in pool)] or pool


def _prune_configs(configs, named_args, **kwargs):
    keep = [config_dict(c) for c in candidate_configs(named_args["M_BUCKET"], named_args["K"])]
    return [c for c in configs if config_dict(c) in keep]


def _tuning_bench(kernel_call, quantiles):
    """CUDA-graph replays: at decode sizes the host's launch cost (tens of us) would otherwise
    swamp the 5-10 us kernels and rank the tiles by noise."""
    return triton.testing.do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)


@triton.jit
def _mma(w, x, acc, FAST_ACC: tl.constexpr):
    """acc += w [BN, 64] @ x [BM, 64]^T, FP8 operands, fp32 accumulator."""
    if FAST_ACC:
        return tl.dot(w, tl.trans(x), acc)
    else:
        return tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=64)


@triton.jit
def _store_tile(y_ptr, y, offs_m, offs_n, M, N, stride_ym):
    """Y[m, n] = y[n, m] (bf16), rows past M and columns past N dropped."""
    ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    tl.store(ptrs, y.to(tl.bfloat16), mask=mask)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _w4a8_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, sa_ptr, s8_ptr, ws_ptr, cnt_ptr,
    M, N, K, M_BUCKET,
    stride_xm, stride_wn, stride_sg, stride_ym,
    HAS_ZERO: tl.constexpr, FAST_ACC: tl.constexpr, DEQ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Y[M, N] = bf16((X8 @ dequant(W)^T) * s_a * s8). M_BUCKET only keys the autotuner."""
    pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    rows_x = (offs_m % M).to(tl.int64)  # wrapped: in-bounds loads, the store drops these
    rows_w = (offs_n % N).to(tl.int64)

    num_groups = K // 128
    g0 = (pid_k * num_groups) // SPLIT_K  # balanced: splits differ by at most one group
    g1 = ((pid_k + 1) * num_groups) // SPLIT_K
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + (g0 * HALF + offs_h)[None, :]
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + (g0 * 128 + offs_h)[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(g0, g1):
        packed = tl.load(w_ptrs)
        x_lo = tl.load(x_ptrs)
        x_hi = tl.load(x_ptrs + HALF)
        gs, gz = _group_params(s_ptr, z_ptr, rows_w, g, stride_sg, HAS_ZERO)
        w_lo, w_hi = _dequant_planes(packed, gs.to(tl.float32), _group_offset(gz, HAS_ZERO, BLOCK_N), DEQ)
        acc = _mma(w_lo, x_lo, acc, FAST_ACC)
        acc = _mma(w_hi, x_hi, acc, FAST_ACC)
        w_ptrs += HALF
        x_ptrs += 128

    out_scale = tl.load(sa_ptr) * tl.load(s8_ptr)
    if SPLIT_K == 1:
        _store_tile(y_ptr, acc * out_scale, offs_m, offs_n, M, N, stride_ym)
    else:
        _split_k_reduce(acc, out_scale, ws_ptr, cnt_ptr, y_ptr, pid_m, pid_n, pid_k, offs_m, offs_n,
                        M, N, stride_ym, BLOCK_N, BLOCK_M, SPLIT_K)


@triton.jit
def _split_k_reduce(acc, out_scale, ws_ptr, cnt_ptr, y_ptr, pid_m, pid_n, pid_k, offs_m, offs_n,
                    M, N, stride_ym, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """Write this split's partial; the last of the SPLIT_K programs of the tile sums all of them
    in order 0..SPLIT_K-1, stores Y and resets the tile's counter."""
    tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
    local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tile_ws = ws_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
    tl.store(tile_ws + pid_k * (BLOCK_N * BLOCK_M) + local, acc)
    tl.debug_barrier()  # every thread's partial is written before the release below
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.load(tile_ws + local, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(tile_ws + s * (BLOCK_N * BLOCK_M) + local, cache_modifier=".cg")
        _store_tile(y_ptr, total * out_scale, offs_m, offs_n, M, N, stride_ym)
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


_kernel = _w4a8_kernel
_kernel_tuned = triton.autotune(
    configs=CONFIGS,
    key=["M_BUCKET", "N", "K", "HAS_ZERO", "FAST_ACC", "DEQ"],
    prune_configs_by={"early_config_prune": _prune_configs},
    do_bench=_tuning_bench,
)(_w4a8_kernel)


# ----------------------------------------------------------------------------------------------
# Python side


def config_dict(config: triton.Config) -> dict:
    """A ``triton.Config`` as the plain dict ``config=`` accepts (and JSON can hold)."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def last_tuned_config() -> dict | None:
    """The config the autotuner used for the most recent tuned launch (None before any)."""
    best = getattr(_kernel_tuned, "best_config", None)
    return config_dict(best) if best is not None else None


def tuning_timings() -> dict:
    """{config as a string: [ms, ...]} of the most recent autotuning run (empty before any)."""
    timings = getattr(_kernel_tuned, "configs_timings", None) or {}
    return {str(config_dict(c)): (list(v) if isinstance(v, (list, tuple)) else v) for c, v in timings.items()}


_COUNTERS: dict = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The per-device split-K tile counters (zeros; every launch leaves them at zero)."""
    key = (device.type, device.index)
    cnt = _COUNTERS.get(key)
    if cnt is None or cnt.numel() < tiles:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("w4a8_gemm: call it once outside CUDA graph capture first "
                               "(it allocates its split-K counters on the first call)")
        cnt = torch.zeros(max(COUNTER_SLOTS, tiles), dtype=torch.int32, device=device)
        _COUNTERS[key] = cnt
    return cnt


@functools.lru_cache(maxsize=64)
def _candidate_metas(bucket: int, k: int) -> list[dict]:
    """``config_dict`` of each candidate config of an M bucket (cached: it runs on every call)."""
    return [config_dict(c) for c in candidate_configs(bucket, k)]


def _check_config(config: dict) -> dict:
    missing = {"BLOCK_N", "BLOCK_M"} - config.keys()
    unknown = config.keys() - _CONFIG_KEYS
    if missing or unknown:
        raise ValueError(f"config needs BLOCK_N, BLOCK_M (and may set SPLIT_K, GROUP_M, num_warps, num_stages); "
                         f"missing {sorted(missing)}, unknown {sorted(unknown)}")
    return {"SPLIT_K": 1, "GROUP_M": 8, "num_warps": 4, "num_stages": 3, **config}


def _workspace_elems(configs: list[dict], m: int, n: int) -> int:
    """fp32 elements of split-K workspace the largest of ``configs`` needs at this M, N."""
    need = 0
    for c in configs:
        if c["SPLIT_K"] > 1:
            tiles = triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"])
            need = max(need, c["SPLIT_K"] * tiles * c["BLOCK_N"] * c["BLOCK_M"])
    return need


def w4a8_gemm(x_fp8: torch.Tensor, s_a, packed: torch.Tensor, group_scales: torch.Tensor, s8,
              group_size: int = GROUP_SIZE, zeros: torch.Tensor | None = None, *, fast_accum: bool = False,
              dequant: str = "auto", config: dict | None = None, out: torch.Tensor | None = None,
              path: str = "auto") -> torch.Tensor:
    """bf16 ``(x_fp8 @ W8^T) * s_a * s8`` with ``W8 = fp8((u - z) * s_g)`` dequantized in registers.

    x_fp8: float8_e4m3fn ``[..., K]`` (quantized with the static per-tensor scale s_a). packed:
    uint8 ``[N, K/2]`` (layout: ``w4a8_gemm_ref.pack_int4``), group_scales ``[K/128, N]`` (fp32, the
    fast storage, or fp16 / bf16), zeros None (symmetric, zero point 8) or uint8 ``[K/128, N]``.
    s_a, s8: numbers or 1-element float tensors. K and N multiples of 128, group_size 128. Returns bf16
    ``[..., N]`` (written into ``out`` if given, a contiguous bf16 ``[M, N]`` / ``[..., N]``).
    ``fast_accum``: chain Hopper's reduced-precision FP8 accumulator (see the module docstring).
    ``dequant``: "f16x2" (packed-half inline PTX; needs scales of at most 7 significant bits in
    [2^-14, 2^11], as ``quantize_dpq`` makes them), "f32" (inline PTX, any scales), "triton" (plain
    Triton ops, any scales) or "auto" (f16x2 when the scales allow it, checked once per scale
    tensor, else f32). All give the same bits where they apply.
    ``path``: "fused" (this kernel), "two_pass" (``w4a8_gemm_two_pass``) or "auto" (fused below
    ``TWO_PASS_MIN_M`` rows; a ``config`` forces the fused kernel).
    ``config`` pins one tile config (keys of ``config_dict``) instead of autotuning.
    Raises TypeError for wrong dtypes and ValueError for wrong shapes or devices."""
    n, k = check_weight("w4a8_gemm", packed, group_scales, zeros, group_size)
    if not isinstance(x_fp8, torch.Tensor) or x_fp8.dtype != FP8_DTYPE:
        raise TypeError(f"w4a8_gemm: x_fp8 must be a {FP8_DTYPE} tensor, got {getattr(x_fp8, 'dtype', type(x_fp8))}")
    if x_fp8.dim() < 1 or x_fp8.shape[-1] != k:
        raise ValueError(f"w4a8_gemm: x_fp8 must be [..., K={k}] to match packed [N, K/2], got {tuple(x_fp8.shape)}")
    if x_fp8.device != packed.device:
        raise ValueError(f"w4a8_gemm: x_fp8 is on {x_fp8.device}, packed on {packed.device}")
    x2 = x_fp8.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is not None and (out.dtype != torch.bfloat16 or out.numel() != m * n or not out.is_contiguous()):
        raise ValueError(f"w4a8_gemm: out must be a contiguous bf16 tensor of {m} x {n} elements")
    if path not in ("auto", "fused", "two_pass"):
        raise ValueError(f"w4a8_gemm: path must be 'auto', 'fused' or 'two_pass', got {path!r}")
    sa = scale_tensor(s_a, "s_a", x2.device)
    s8t = scale_tensor(s8, "s8", x2.device)
    deq = dequant_mode(dequant, group_scales)
    two_pass = path == "two_pass" or (path == "auto" and m >= TWO_PASS_MIN_M and config is None)
    if m and two_pass:
        y = w4a8_gemm_two_pass(x2, sa, packed, group_scales, s8t, zeros=zeros, fast_accum=fast_accum,
                               dequant=dequant)
        if out is not None:
            y = out.view(m, n).copy_(y)
    else:
        y = out.view(m, n) if out is not None else torch.empty((m, n), dtype=torch.bfloat16, device=x2.device)
        if m:
            _launch(x2, packed, group_scales.contiguous(), zeros, y, sa, s8t, fast_accum, deq, config)
    return y.reshape(*x_fp8.shape[:-1], n)


def _launch(x2, packed, scales, zeros, y, sa, s8t, fast_accum, deq: int, config):
    m, k = x2.shape
    n = packed.shape[0]
    bucket = m_bucket(m)
    metas = _candidate_metas(bucket, k) if config is None else [_check_config(config)]
    ws = torch.empty(max(_workspace_elems(metas, m, n), 1), dtype=torch.float32, device=x2.device)
    tiles = max(triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]) for c in metas)
    cnt = _counters(x2.device, tiles)
    zeros_arg = zeros.contiguous() if zeros is not None else scales  # never read when symmetric
    args = (x2, packed, scales, zeros_arg, y, sa, s8t, ws, cnt,
            m, n, k, bucket, x2.stride(0), packed.stride(0), scales.stride(0), y.stride(0))
    flags = dict(HAS_ZERO=zeros is not None, FAST_ACC=bool(fast_accum), DEQ=deq)
    if config is None:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),  # noqa: E731
                             meta["SPLIT_K"])
        return _kernel_tuned[grid](*args, **flags)
    meta = metas[0]
    grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])
    return _kernel[grid](*args, **flags, **meta)
