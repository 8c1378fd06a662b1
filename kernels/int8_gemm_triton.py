"""Triton INT8 GEMM for MUXQ's Concat form: ``Y = fp16((A @ B) * s_a * s_w (+ bias))``.

Why: MUXQ (``edgeq.passes.muxq``, form "concat") turns a linear with outlier input channels into
one uniform INT8 GEMM: A = Concat([Body, Aux], axis=-1) int8 ``[M, K + k]`` against the stacked
int8 weight B ``[K + k, N]``. k is the number of outlier channels, so K + k is rarely a multiple
of a tile (4096 + 37), and torch's own integer GEMM (``torch._int_mm``) refuses M <= 16 and K not
a multiple of 8, and returns raw int32 that needs a second pass to dequantize. This kernel takes
any M, N, K, sums exactly in int32 on the tensor cores, and dequantizes in its epilogue.

How: one program computes a ``[BLOCK_M, BLOCK_N]`` tile of Y.

- Main loop: ``tl.dot`` of int8 ``[BLOCK_M, BLOCK_K]`` x ``[BLOCK_K, BLOCK_N]`` tiles into an int32
  accumulator (exact: |A @ B| <= K * 2^14 < 2^31 for K <= 131071). Full K blocks load unmasked
  (so the loop pipelines cleanly); a ragged tail (K % BLOCK_K != 0, known at compile time through
  the ``EVEN_K*`` heuristics) is one extra masked step with zeros past K.
- Rows past M and columns past N are read wrapped (``% M``, ``% N``) so every load is in bounds
  without a mask; their results are dropped by the masked store.
- Epilogue in float32: ``acc * s_a * s_w[n] (+ bias[n])``, one rounding to fp16. s_a is per tensor
  (or per token: M values), s_w per tensor or per output channel; scales are read from device
  tensors, so a call never synchronizes with the host.
- Split entry (``int8_gemm_split``): Body ``[M, K]`` and Aux ``[M, k]`` are read through two
  pointers, one K loop each into the same accumulator, so the concatenation is never written.
- Tiles are grouped along M (``GROUP_M``) so programs running together share B tiles in L2.

Layout of B: any strides. int8 tensor-core instructions on Hopper (wgmma) take B K-major, so the
fastest B is a weight stored ``[N, K + k]`` (the nn.Linear layout) and passed as its transpose
view ``w.T`` (``to_k_major``); a row-major ``[K + k, N]`` B is correct too (Triton transposes it
on chip) but was 3.7x to 5.8x slower at M = 4096 and 4x to 6x at M = 512 on an H200
(``benchmarks/kernels/bench_int8_gemm.py`` times both; ``benchmarks/results/int8-gemm-h200.json``).

Autotuning: ``CONFIGS`` holds prefill tiles (BLOCK_M >= 64: wgmma needs M tiles of 64 and 4 or 8
warps) and decode tiles (BLOCK_M 16 or 32, narrow N so that N / BLOCK_N programs fill the
H100/H200's 132 SMs while streaming the weight). The key buckets M to the next power of two, so
a model with varying sequence lengths tunes once per bucket; ``config=`` pins one config instead.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
import triton.testing

from edgeq.kernels.int8_gemm_ref import MAX_EXACT_INT32_K
from edgeq.kernels.triton_tiles import tile_ids


def _config(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group}, num_warps=warps, num_stages=stages
    )


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Shared memory per stage is
# (BLOCK_M + BLOCK_N) * BLOCK_K bytes: the largest, 128x256x128 at 3 stages, takes 144 KiB of the
# 227 KiB a Hopper SM offers.
CONFIGS = [
    # prefill (M >= 64): wgmma-sized tiles
    _config(128, 256, 128, 8, 3),
    _config(256, 128, 128, 8, 3),
    _config(128, 128, 128, 8, 4),
    _config(128, 128, 64, 4, 4),
    _config(64, 128, 128, 4, 4),
    _config(64, 64, 128, 4, 4),
    # decode (M <= 32): the weight streams once; N = 4096 gives 64 to 128 programs, each keeping
    # 36 to 120 KiB of B in flight (what an SM needs to draw its share of HBM bandwidth)
    _config(16, 64, 256, 4, 4),
    _config(16, 32, 256, 4, 5),
    _config(32, 64, 256, 4, 4),
    _config(16, 32, 512, 4, 4),
    _config(16, 64, 512, 4, 3),
]


def _prune_configs(configs, named_args, **kwargs):
    """Skip tiles that cannot win, to halve tuning time: big M tiles for M <= 64 (mostly padding)
    and 16/32-row tiles for M >= 512 (they re-read B M / 16 times)."""
    m = named_args["M_BUCKET"]
    if m <= 64:
        return [c for c in configs if c.kwargs["BLOCK_M"] <= 64]
    if m >= 512:
        return [c for c in configs if c.kwargs["BLOCK_M"] >= 64]
    return configs


def _tuning_bench(kernel_call, quantiles):
    """Shorter than Triton's default (25 ms warm-up, 100 ms runs): enough to rank tiles, and
    tuning time is paid once per (M bucket, N, K, layout, dtypes). Caveat: these eager timings
    include the host's launch cost (~40 us), which at M <= 512 exceeds the kernel, so close tiles
    rank by noise (H200: M = 512, k = 64 got a tile 1.5x slower than k = 0 and 256 did); a CUDA-graph
    timer would fix that (not yet tried on a GPU)."""
    return triton.testing.do_bench(kernel_call, warmup=10, rep=40, quantiles=quantiles)


@triton.jit
def _mac(acc, a_rows, stride_ak, b_cols, stride_bk, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """acc += A[:, :K] @ B[:K, :] for one K segment; a_rows is [BLOCK_M, 1] row pointers, b_cols
    [1, BLOCK_N] column pointers. Full blocks unmasked, then one masked tail unless EVEN_K."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_rows + offs_k[None, :] * stride_ak
    b_ptrs = b_cols + offs_k[:, None] * stride_bk
    for _ in range(0, K // BLOCK_K):
        acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if not EVEN_K:
        rem = K % BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < rem, other=0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < rem, other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    return acc


@triton.jit
def _int8_gemm_kernel(
    a_ptr, x_ptr, b_ptr, bx_ptr, c_ptr, sa_ptr, sw_ptr, bias_ptr,
    M, N, K1, K2, M_BUCKET,
    stride_am, stride_ak, stride_xm, stride_xk, stride_bk, stride_bn, stride_cm, stride_cn,
    HAS_AUX: tl.constexpr, OUT_INT32: tl.constexpr, PER_TOKEN: tl.constexpr,
    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K1: tl.constexpr, EVEN_K2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[M, N] = A[M, K1] @ B[:K1] (+ X[M, K2] @ BX[:K2] when HAS_AUX), int32 accumulation, then
    either the raw int32 (OUT_INT32) or the dequantized fp16. M_BUCKET only keys the autotuner."""
    pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)  # wrapped: in-bounds loads, the store drops these rows
    cols = (offs_n % N).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    acc = _mac(acc, a_ptr + rows[:, None] * stride_am, stride_ak, b_ptr + cols[None, :] * stride_bn, stride_bk,
               K1, BLOCK_K, EVEN_K1)
    if HAS_AUX:
        acc = _mac(acc, x_ptr + rows[:, None] * stride_xm, stride_xk, bx_ptr + cols[None, :] * stride_bn, stride_bk,
                   K2, BLOCK_K, EVEN_K2)

    mask_m = offs_m < M
    mask_n = offs_n < N
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    mask = mask_m[:, None] & mask_n[None, :]
    if OUT_INT32:
        tl.store(c_ptrs, acc, mask=mask)
    else:
        y = acc.to(tl.float32)
        if PER_TOKEN:
            y = y * tl.load(sa_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
        else:
            y = y * tl.load(sa_ptr)
        if PER_CHANNEL:
            y = y * tl.load(sw_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        else:
            y = y * tl.load(sw_ptr)
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptrs, y.to(tl.float16), mask=mask)


_EVEN_K = {
    "EVEN_K1": lambda args: args["K1"] % args["BLOCK_K"] == 0,
    "EVEN_K2": lambda args: args["K2"] % args["BLOCK_K"] == 0,
}
_kernel = triton.heuristics(_EVEN_K)(_int8_gemm_kernel)
_kernel_tuned = triton.autotune(
    configs=CONFIGS,
    key=["M_BUCKET", "N", "K1", "K2", "stride_ak", "stride_bk", "stride_bn"],
    prune_configs_by={"early_config_prune": _prune_configs},
    do_bench=_tuning_bench,
)(_kernel)

_CONFIG_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}


def config_dict(config: triton.Config) -> dict:
    """A ``triton.Config`` as the plain dict ``config=`` accepts (and JSON can hold)."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def last_tuned_config() -> dict | None:
    """The config the autotuner used for the most recent tuned launch (None before any)."""
    best = getattr(_kernel_tuned, "best_config", None)
    return config_dict(best) if best is not None else None


def to_k_major(b: torch.Tensor) -> torch.Tensor:
    """The same ``[K, N]`` matrix stored K-major (the transpose view of a contiguous ``[N, K]``
    copy): the B layout int8 wgmma reads directly. Convert a weight once, at load time."""
    return b.T.contiguous().T


def int8_gemm(a, b, scale_a, scale_b, bias=None, *, config: dict | None = None) -> torch.Tensor:
    """fp16 ``(a @ b) * scale_a * scale_b (+ bias)`` with exact int32 accumulation.

    a: int8 ``[..., K]`` (MUXQ: Concat([Body, Aux])), b: int8 ``[K, N]``, any strides (``w.T`` of
    an ``[N, K]`` weight is the fast layout). scale_a: a number or a float tensor of 1 element (per
    tensor) or M elements (per token, M = rows of a). scale_b: a number or a float tensor of 1
    (per tensor) or N elements (per output channel). bias: None or an fp16 / bf16 / fp32 tensor
    of N elements. Returns fp16 ``[..., N]`` on a's device. ``config`` pins one tile config
    (keys of ``CONFIGS``' entries, see ``config_dict``) instead of autotuning.
    Raises TypeError for wrong dtypes and ValueError for wrong shapes or devices.
    """
    _check_operands("int8_gemm", a, None, b)
    return _run(a, None, b, scale_a, scale_b, bias, out_int32=False, config=config)


def int8_gemm_split(body, aux, b, scale_a, scale_b, bias=None, *, config: dict | None = None) -> torch.Tensor:
    """``int8_gemm(Concat([body, aux], -1), b, ...)`` without writing the concatenation.

    body: int8 ``[..., K]``, aux: int8 ``[..., k]`` with the same leading shape, b: the stacked
    int8 weight ``[K + k, N]`` (rows K.. multiply aux). Same scales, bias and result as
    ``int8_gemm``: the kernel runs one K loop over body and one over aux into one int32 sum."""
    _check_operands("int8_gemm_split", body, aux, b)
    return _run(body, aux, b, scale_a, scale_b, bias, out_int32=False, config=config)


def int8_matmul_int32(a, b, *, config: dict | None = None) -> torch.Tensor:
    """The raw int32 accumulator ``a @ b`` (int8 ``[..., K]`` x ``[K, N]``), no epilogue: the
    exactness check of the main loop, and what ``torch._int_mm`` returns."""
    _check_operands("int8_matmul_int32", a, None, b)
    return _run(a, None, b, None, None, None, out_int32=True, config=config)


def _on_device(t: torch.Tensor) -> bool:
    """CUDA, or any device under the Triton interpreter (CPU debugging)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _check_operands(fn: str, a, aux, b) -> None:
    named = [("a" if aux is None else "body", a), ("b", b)] + ([("aux", aux)] if aux is not None else [])
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int8:
            raise TypeError(f"{fn}: {name} must be int8 (quantize it first), got {t.dtype}")
        if not _on_device(t):
            raise ValueError(f"{fn}: {name} must be on a CUDA device, got {t.device}")
        if t.device != a.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, a is on {a.device}")
    if a.dim() < 1 or b.dim() != 2:
        raise ValueError(f"{fn}: need a [..., K] and b [K, N], got a {tuple(a.shape)} and b {tuple(b.shape)}")
    k = a.shape[-1]
    if aux is not None:
        if aux.dim() != a.dim() or aux.shape[:-1] != a.shape[:-1]:
            raise ValueError(f"{fn}: aux {tuple(aux.shape)} must share body's leading shape {tuple(a.shape[:-1])}")
        k += aux.shape[-1]
    if b.shape[0] != k:
        what = "K" if aux is None else "K + k (body + aux)"
        raise ValueError(f"{fn}: b has {b.shape[0]} rows but {what} = {k}: b must be [K, N] (pass w.T for [N, K])")
    if k > MAX_EXACT_INT32_K:
        raise ValueError(f"{fn}: K={k} could overflow the int32 accumulator (max {MAX_EXACT_INT32_K})")


def _scale_vector(scale, length: int, what: str, per: str, device) -> tuple[torch.Tensor, bool]:
    """(fp32 contiguous 1-D tensor on device, whether it has one value per row / column)."""
    if isinstance(scale, torch.Tensor):
        if not scale.is_floating_point():
            raise TypeError(f"{what} must be a float tensor, got {scale.dtype}")
        if scale.is_cuda and scale.device != device:
            raise ValueError(f"{what} is on {scale.device}, the operands on {device}")
        if scale.numel() not in (1, length):
            raise ValueError(f"{what} must have 1 element or {length} ({per}), got shape {tuple(scale.shape)}")
        vec = scale.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
        return vec, vec.numel() > 1
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{what} must be a number or a float tensor, got {type(scale).__name__}")
    return torch.full((1,), float(scale), dtype=torch.float32, device=device), False


def _bias_vector(bias, n: int, device) -> torch.Tensor | None:
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or bias.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"bias must be an fp16, bf16 or fp32 tensor, got {getattr(bias, 'dtype', type(bias).__name__)}")
    if bias.numel() != n:
        raise ValueError(f"bias must have N={n} elements, got shape {tuple(bias.shape)}")
    return bias.to(device).reshape(-1).contiguous()


def _check_config(config: dict) -> dict:
    missing = {"BLOCK_M", "BLOCK_N", "BLOCK_K"} - config.keys()
    unknown = config.keys() - _CONFIG_KEYS
    if missing or unknown:
        raise ValueError(f"config needs BLOCK_M, BLOCK_N, BLOCK_K (and may set GROUP_M, num_warps, num_stages); "
                         f"missing {sorted(missing)}, unknown {sorted(unknown)}")
    return {"GROUP_M": 8, "num_warps": 4, "num_stages": 3, **config}


def _run(a, aux, b, scale_a, scale_b, bias, *, out_int32: bool, config: dict | None) -> torch.Tensor:
    """Flattens the leading dims, builds the epilogue operands and launches the kernel."""
    n = b.shape[1]
    a2 = a.reshape(-1, a.shape[-1])
    x2 = aux.reshape(-1, aux.shape[-1]) if aux is not None else a2  # dummy when there is no aux
    rows = a2.shape[0]
    out = torch.empty((rows, n), dtype=torch.int32 if out_int32 else torch.float16, device=a.device)
    if out_int32:
        sa = sw = torch.empty(1, dtype=torch.float32, device=a.device)  # never read
        per_token = per_channel = False
    else:
        sa, per_token = _scale_vector(scale_a, rows, "scale_a", "per token: rows of a", a.device)
        sw, per_channel = _scale_vector(scale_b, n, "scale_b", "per output channel: N", a.device)
    bias_vec = _bias_vector(bias, n, a.device)
    if rows and n:
        _launch(a2, x2, b, out, sa, sw, bias_vec, has_aux=aux is not None, out_int32=out_int32,
                per_token=per_token, per_channel=per_channel, config=config)
    return out.reshape(*a.shape[:-1], n)


def _launch(a2, x2, b, out, sa, sw, bias, *, has_aux, out_int32, per_token, per_channel, config) -> None:
    rows, k1 = a2.shape
    k2 = x2.shape[1] if has_aux else 0
    n = b.shape[1]
    bx = b[k1:] if has_aux else b  # aux weight rows as their own base pointer (host-side offset)
    args = (
        a2, x2, b, bx, out, sa, sw, bias if bias is not None else sw,
        rows, n, k1, k2, triton.next_power_of_2(rows),
        a2.stride(0), a2.stride(1), x2.stride(0), x2.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1),
    )
    flags = dict(HAS_AUX=has_aux, OUT_INT32=out_int32, PER_TOKEN=per_token, PER_CHANNEL=per_channel,
                 HAS_BIAS=bias is not None)
    if config is None:
        grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _kernel_tuned[grid](*args, **flags)
    else:
        meta = _check_config(config)
        grid = (triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        _kernel[grid](*args, **flags, **meta)
