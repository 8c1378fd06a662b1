"""Correctness of the Triton INT8 GEMM (MUXQ Concat form) on a CUDA GPU (skipped elsewhere).

- The int32 accumulator is compared for equality with the exact reference (float64 sums of int8
  products are exact), over the full int8 range, at every shape: M in {1, 16, 37, 512} (decode to
  prefill, ragged), K in {64, 4096 + 37, 4096 + 128} (K + k with k outlier channels, ragged and
  aligned), N in {64, 4096}.
- The fp16 output with unit scales and values in {-1, 0, 1} is exact (|A @ B| stays far below
  2048, where fp16 still holds every integer), so it must equal the reference bit for bit.
- With real scales (per tensor / per output channel / per token) and bias, the kernel scales the
  exact sum in float32 and the reference in float64: both then round once to fp16, so they differ
  by at most one fp16 step, 2^-10 of the value (plus 2^-24 for subnormals), plus the float32
  epilogue's error (2^-20 of the terms), which shows only where a bias cancels the product.
- The split entry (Body and Aux through two pointers) and a K-major B give bit-identical results:
  the int32 sum is exact and the epilogue the same.
Triton is imported only once CUDA is known to be there: the CPU suite never imports triton.
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the Triton kernel needs a GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from edgeq.kernels.int8_gemm_ref import (  # noqa: E402
    MAX_EXACT_INT32_K,
    int8_gemm_ref,
    int8_matmul_int32_ref,
    muxq_concat,
    muxq_stack_weight,
)
from triton.runtime.errors import OutOfResources  # noqa: E402

from edgeq.kernels.int8_gemm_triton import (  # noqa: E402
    CONFIGS,
    config_dict,
    int8_gemm,
    int8_gemm_split,
    int8_matmul_int32,
    last_tuned_config,
    to_k_major,
)

pytestmark = pytest.mark.gpu

M_SIZES = [1, 16, 37, 512]
K_SIZES = [64, 4096 + 37, 4096 + 128]
N_SIZES = [64, 4096]
SHAPES = [(m, k, n) for m in M_SIZES for k in K_SIZES for n in N_SIZES]
SCALE_A = 0.013
SCALE_W = 7.3e-4


def _int8(shape, seed: int, lo: int = -128, hi: int = 128) -> torch.Tensor:
    g = torch.Generator("cuda").manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g, device="cuda", dtype=torch.int8)


@functools.lru_cache(maxsize=8)
def _operands(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _int8((m, k), seed=m * 7919 + k), _int8((k, n), seed=k * 31 + n)


def _weight_scale(n: int, per_channel: bool):
    if not per_channel:
        return SCALE_W
    g = torch.Generator("cuda").manual_seed(n)
    return 2e-4 + 1e-3 * torch.rand(n, generator=g, device="cuda")


def _assert_matches_reference(y, a, b, scale_a, scale_w, bias=None) -> None:
    """y within one fp16 step of the float64 reference, plus the float32 epilogue's own error.

    That error is a few float32 roundings of the terms, under 2^-20 of |acc * s_a * s_w| + |bias|:
    invisible at fp16 precision except where the bias cancels the product and the result is far
    smaller than its terms (seen on an H200: a handful of outputs near zero in 2M)."""
    ref = int8_gemm_ref(a, b, scale_a, scale_w, bias)
    assert y.dtype == torch.float16 and y.shape == ref.shape
    assert torch.isfinite(ref).all(), "test scales overflow fp16"
    terms = int8_gemm_ref(a, b, scale_a, scale_w).float().abs()
    if bias is not None:
        terms = terms + bias.float().abs().reshape(-1)
    diff = (y.float() - ref.float()).abs()
    tol = ref.float().abs() * 2.0**-10 + terms * 2.0**-20 + 2.0**-24
    bad = diff > tol
    assert not bad.any(), (f"{int(bad.sum())} outputs off by more than one fp16 step, "
                           f"worst diff / tol {(diff / tol).max().item():.2f}")


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int32_accumulation_is_exact(m, k, n):
    a, b = _operands(m, k, n)
    acc = int8_matmul_int32(a, b)
    assert acc.dtype == torch.int32 and acc.shape == (m, n)
    assert torch.equal(acc, int8_matmul_int32_ref(a, b))


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_unit_scales_give_exact_fp16(m, k, n):
    a = _int8((m, k), seed=1, lo=-1, hi=2)
    b = _int8((k, n), seed=2, lo=-1, hi=2)
    y = int8_gemm(a, b, 1.0, 1.0)
    ref = int8_gemm_ref(a, b, 1.0, 1.0)
    assert int8_matmul_int32_ref(a, b).abs().max().item() < 2048  # fp16 holds these integers exactly
    assert torch.equal(y, ref)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias_fp32"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["w_per_tensor", "w_per_channel"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matches_reference(m, k, n, per_channel, bias):
    a, b = _operands(m, k, n)
    sw = _weight_scale(n, per_channel)
    bias_t = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(5)) if bias else None
    y = int8_gemm(a, b, SCALE_A, sw, bias_t)
    _assert_matches_reference(y, a, b, SCALE_A, sw, bias_t)


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (37, 4096 + 37, 4096)])
def test_half_bias_and_tensor_scales(m, k, n, bias_dtype):
    """Scales given as device tensors (0-d and [N]) and a half-precision bias."""
    a, b = _operands(m, k, n)
    sa = torch.tensor(SCALE_A, device="cuda")
    sw = _weight_scale(n, per_channel=True).reshape(1, n)
    bias_t = torch.randn(n, device="cuda").to(bias_dtype)
    y = int8_gemm(a, b, sa, sw, bias_t)
    _assert_matches_reference(y, a, b, sa, sw, bias_t)


@pytest.mark.parametrize("m,k,n", [(16, 4096 + 37, 4096), (512, 4096 + 128, 64)])
def test_per_token_activation_scale(m, k, n):
    a, b = _operands(m, k, n)
    sa = 1e-3 + 0.02 * torch.rand(m, device="cuda")
    sw = _weight_scale(n, per_channel=True)
    _assert_matches_reference(int8_gemm(a, b, sa, sw), a, b, sa, sw)


@pytest.mark.parametrize("outliers", [1, 37, 128, 256])
@pytest.mark.parametrize("m", [1, 16, 37, 512])
def test_split_entry_equals_concat(m, outliers):
    """Body and Aux through two pointers == the materialized Concat, bit for bit."""
    n = 4096
    body, aux = _int8((m, 4096), seed=m), _int8((m, outliers), seed=m + outliers)
    b = muxq_stack_weight(_int8((4096, n), seed=3), _int8((outliers, n), seed=4))
    a = muxq_concat(body, aux)
    sw = _weight_scale(n, per_channel=True)
    y_split = int8_gemm_split(body, aux, b, SCALE_A, sw)
    assert torch.equal(y_split, int8_gemm(a, b, SCALE_A, sw))
    _assert_matches_reference(y_split, a, b, SCALE_A, sw)


@pytest.mark.parametrize("m,k,n", [(16, 4096 + 37, 4096), (512, 4096 + 128, 4096), (37, 64, 64)])
def test_k_major_weight_layout(m, k, n):
    """B as the transpose view of an [N, K] weight (the fast layout) gives the same result."""
    a, b = _operands(m, k, n)
    b_kmajor = to_k_major(b)
    assert b_kmajor.stride() == (1, k) and torch.equal(b_kmajor, b)
    assert torch.equal(int8_matmul_int32(a, b_kmajor), int8_matmul_int32_ref(a, b))
    sw = _weight_scale(n, per_channel=True)
    assert torch.equal(int8_gemm(a, b_kmajor, SCALE_A, sw), int8_gemm(a, b, SCALE_A, sw))


def test_leading_dims_strided_and_empty():
    a = _int8((2, 3, 4096 + 37), seed=11)
    b = _int8((4096 + 37, 256), seed=12)
    y = int8_gemm(a, b, SCALE_A, SCALE_W)
    assert y.shape == (2, 3, 256)
    _assert_matches_reference(y, a, b, SCALE_A, SCALE_W)
    wide = _int8((37, 2 * 4200), seed=13)[:, ::2]  # non-unit K stride
    b2 = _int8((4200, 128), seed=14)
    assert torch.equal(int8_matmul_int32(wide, b2), int8_matmul_int32_ref(wide, b2))
    assert int8_gemm(a[:, :0], b, SCALE_A, SCALE_W).shape == (2, 0, 256)


@pytest.mark.parametrize("cfg", [config_dict(c) for c in CONFIGS],
                         ids=lambda c: "m{BLOCK_M}n{BLOCK_N}k{BLOCK_K}w{num_warps}s{num_stages}".format(**c))
def test_every_config_is_exact(cfg):
    """Autotuning picks one config per shape, so each config is checked here on ragged M, N, K
    (row-major and K-major B)."""
    m, k, n = 300, 4096 + 37, 320
    a, b = _int8((m, k), seed=21), _int8((k, n), seed=22)
    ref = int8_matmul_int32_ref(a, b)
    try:
        acc = int8_matmul_int32(a, b, config=cfg)
    except OutOfResources as e:
        pytest.skip(f"config does not fit this GPU: {e}")
    assert torch.equal(acc, ref)
    assert torch.equal(int8_matmul_int32(a, b.T.contiguous().T, config=cfg), ref)
    sw = _weight_scale(n, per_channel=True)
    bias_t = torch.randn(n, device="cuda")
    y = int8_gemm(a, b, SCALE_A, sw, bias_t, config=cfg)
    _assert_matches_reference(y, a, b, SCALE_A, sw, bias_t)
    y_split = int8_gemm_split(a[:, :4096], a[:, 4096:], b, SCALE_A, sw, bias_t, config=cfg)
    assert torch.equal(y_split, y)


def test_autotuner_reports_its_choice():
    a, b = _operands(16, 4096 + 37, 4096)
    int8_gemm(a, b, SCALE_A, SCALE_W)
    cfg = last_tuned_config()
    assert cfg is not None and cfg.keys() >= {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}


def test_bad_inputs():
    a, b = _operands(16, 64, 64)
    with pytest.raises(TypeError, match="int8"):
        int8_gemm(a.half(), b, 1.0, 1.0)
    with pytest.raises(TypeError, match="int8"):
        int8_gemm(a, b.int(), 1.0, 1.0)
    with pytest.raises(TypeError, match="torch.Tensor"):
        int8_gemm(a.cpu().numpy(), b, 1.0, 1.0)
    with pytest.raises(ValueError, match="rows"):
        int8_gemm(a[:, :63], b, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"b \[K, N\]"):
        int8_gemm(a, b[None], 1.0, 1.0)
    with pytest.raises(ValueError, match="CUDA"):
        int8_gemm(a.cpu(), b.cpu(), 1.0, 1.0)
    with pytest.raises(ValueError, match="scale_b"):
        int8_gemm(a, b, 1.0, torch.ones(63, device="cuda"))
    with pytest.raises(ValueError, match="scale_a"):
        int8_gemm(a, b, torch.ones(15, device="cuda"), 1.0)
    with pytest.raises(TypeError, match="scale_a"):
        int8_gemm(a, b, torch.ones(1, dtype=torch.int32, device="cuda"), 1.0)
    with pytest.raises(TypeError, match="scale_b"):
        int8_gemm(a, b, 1.0, "1.0")
    with pytest.raises(ValueError, match="bias"):
        int8_gemm(a, b, 1.0, 1.0, torch.ones(63, device="cuda"))
    with pytest.raises(TypeError, match="bias"):
        int8_gemm(a, b, 1.0, 1.0, torch.ones(64, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="leading shape"):
        int8_gemm_split(a, _int8((15, 8), seed=0), _int8((72, 64), seed=0), 1.0, 1.0)
    with pytest.raises(ValueError, match="body \\+ aux"):
        int8_gemm_split(a, _int8((16, 8), seed=0), b, 1.0, 1.0)
    with pytest.raises(ValueError, match="config"):
        int8_gemm(a, b, 1.0, 1.0, config={"BLOCK_M": 16})
    big = MAX_EXACT_INT32_K + 1
    with pytest.raises(ValueError, match="overflow"):
        int8_matmul_int32(_int8((1, big), seed=0), _int8((big, 1), seed=0))
