"""Correctness of the Triton W4A8 GEMM (DPQ) on a CUDA GPU (skipped elsewhere).

Reference: ``w4a8_gemm_ref`` with ``out_dtype=float64`` is the exact value of
``(X8 @ W8^T) * s_a * s8`` (float64 holds every sum of e4m3 products exactly, see its module
docstring). The kernel differs from it in two ways only:

1. the rounding of its fp32 result to bf16: at most half a bf16 ulp, <= 2^-8 of the value;
2. its accumulation. The products of two e4m3 values are exact; their sums are not, and on
   Hopper the FP8 wgmma accumulator keeps fewer bits than fp32 (DeepSeek-V3 measured ~14).
   The error of any such sum is a multiple of the sum of |terms| (``w4a8_abs_terms``):
   - default (``fast_accum=False``): every 64-deep dot starts from zero in the tensor core and is
     then added to the fp32 sum on the CUDA cores. Measured on an H200: at most 3.3e-5 (2^-14.9)
     of the |terms|, largest for short K; the test allows 2^-12;
   - ``fast_accum=True``: all K / 32 steps chain in the wgmma accumulator; the test allows 2^-9.
   So the check is ``|y - exact| <= 2^-8 |exact| + eps * terms``. For the default that is within
   one or two bf16 ulps of the bf16 reference except where the sum cancels far below its terms
   (H200: 0 to 0.2% of outputs, each near zero); 96.7% of outputs equal the bf16 reference
   exactly at K = 4096, against 95% for ``torch._scaled_mm`` on the same FP8 operands.

Exact checks, no tolerance: the dequantization kernel equals the reference's FP8 weight bit for
bit (same fp32 arithmetic, one RNE rounding to e4m3); one-hot activations (each output a single
product) give the bf16 reference exactly, which pins every nibble's position in the layout; the
split-K reduction sums in a fixed order, so two runs are bit-identical.

Shapes: M in {1, 16, 256, 4096} (decode, split-K, mid, prefill) with K = N = 4096 and with
K = 384, N = 640 (N not a multiple of the 256-wide tiles, K of 3 groups: fewer groups than splits).
Triton is imported only once CUDA is known to be there: the CPU suite never imports triton.
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the Triton kernel needs a GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from edgeq.kernels.w4a8_gemm_ref import (  # noqa: E402
    DPQ_FP8_RANGE,
    FP8_DTYPE,
    FP8_MAX,
    activation_scale,
    dequantize_fp8,
    pack_int4,
    quantize_activation_fp8,
    round_significant,
    quantize_dpq,
    unpack_int4,
    w4a8_abs_terms,
    w4a8_gemm_ref,
)
from triton.runtime.errors import OutOfResources  # noqa: E402

from edgeq.kernels import w4a8_gemm_triton as W  # noqa: E402
from edgeq.kernels.w4a8_dequant_triton import (  # noqa: E402
    scales_fit_f16x2,
    w4a8_dequantize_fp8,
    w4a8_gemm_two_pass,
)
from edgeq.kernels.w4a8_gemm_triton import (  # noqa: E402
    CONFIGS,
    config_dict,
    last_tuned_config,
    w4a8_gemm,
)

pytestmark = pytest.mark.gpu

M_SIZES = [1, 16, 256, 4096]
KN = [(4096, 4096), (384, 640)]
PRECISE_EPS = 2.0**-12
FAST_EPS = 2.0**-9
DECODE_CFG = {"BLOCK_N": 64, "BLOCK_M": 16, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4}
LARGE_CFG = {"BLOCK_N": 128, "BLOCK_M": 128, "SPLIT_K": 1, "num_warps": 8, "num_stages": 4}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator("cuda").manual_seed(seed)


@functools.lru_cache(maxsize=8)
def _layer(n: int, k: int, symmetric: bool = True, scale_dtype: torch.dtype = torch.float16, heavy: bool = False):
    w = torch.randn(n, k, device="cuda", generator=_gen(n * 31 + k)) * 0.02
    if heavy:
        idx = torch.randint(0, n * k, (64,), device="cuda", generator=_gen(7))
        w.view(-1)[idx] *= 60.0
    return quantize_dpq(w, symmetric=symmetric, scale_dtype=scale_dtype)


@functools.lru_cache(maxsize=8)
def _acts(m: int, k: int, seed: int = 0):
    x = torch.randn(m, k, device="cuda", generator=_gen(m * 7919 + k + seed))
    sa = activation_scale(x)
    return quantize_activation_fp8(x, sa), sa


def _gemm(x8, sa, q, path="fused", **kw):
    """The fused kernel unless told otherwise (``path="auto"`` would take two passes at large M)."""
    return w4a8_gemm(x8, sa, q.packed, q.group_scales, q.s8, zeros=q.zeros, path=path, **kw)


def _assert_close(y, x8, sa, q, eps: float) -> None:
    """|y - exact| <= 2^-8 |exact| + eps * sum|terms| (see the module docstring)."""
    exact = w4a8_gemm_ref(x8, sa, q.packed, q.group_scales, q.s8, zeros=q.zeros, out_dtype=torch.float64)
    terms = w4a8_abs_terms(x8, sa, q.packed, q.group_scales, q.s8, zeros=q.zeros)
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    assert torch.isfinite(y).all(), "non-finite outputs (unwritten or overflowed)"
    diff = (y.double() - exact).abs()
    tol = exact.abs() * 2.0**-8 + terms * eps + 1e-30
    ratio = (diff / tol).max().item()
    acc_err = ((diff - exact.abs() * 2.0**-8).clamp(min=0) / terms.clamp(min=1e-30)).max().item()
    ref_bf16 = exact.to(torch.bfloat16).double()
    ulp = torch.where(ref_bf16 != 0, ref_bf16.abs() * 2.0**-7, torch.full_like(ref_bf16, 2.0**-133))
    far = int(((y.double() - ref_bf16).abs() > 2 * ulp).sum())
    assert ratio <= 1.0, (f"worst diff / tol {ratio:.2f}; accumulation error up to {acc_err:.2e} of sum|terms| "
                          f"(eps {eps:.1e}); {far} of {y.numel()} outputs more than 2 bf16 ulps off")


@pytest.mark.parametrize("dequant", ["f16x2", "f32", "triton"])
@pytest.mark.parametrize("k,n", KN, ids=lambda v: str(v))
@pytest.mark.parametrize("m", M_SIZES)
def test_matches_reference(m, k, n, dequant):
    q = _layer(n, k)
    x8, sa = _acts(m, k)
    _assert_close(_gemm(x8, sa, q, dequant=dequant), x8, sa, q, PRECISE_EPS)


@pytest.mark.parametrize("m", M_SIZES)
def test_fast_accum_matches_reference(m):
    q = _layer(4096, 4096)
    x8, sa = _acts(m, 4096)
    _assert_close(_gemm(x8, sa, q, fast_accum=True), x8, sa, q, FAST_EPS)


@pytest.mark.parametrize("cfg", [DECODE_CFG, LARGE_CFG], ids=["decode", "large"])
@pytest.mark.parametrize("m", [16, 300])
def test_asymmetric_zero_points(m, cfg):
    q = _layer(640, 1024, symmetric=False)
    assert q.zeros is not None and q.zeros.dtype == torch.uint8
    x8, sa = _acts(m, 1024)
    _assert_close(_gemm(x8, sa, q, config=cfg), x8, sa, q, PRECISE_EPS)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_scale_dtypes(scale_dtype):
    q = _layer(640, 1024, scale_dtype=scale_dtype)
    assert q.group_scales.dtype == scale_dtype
    x8, sa = _acts(37, 1024)
    _assert_close(_gemm(x8, sa, q, config=DECODE_CFG), x8, sa, q, PRECISE_EPS)


@pytest.mark.parametrize("dequant", ["f16x2", "f32", "triton"])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_dequant_kernel_is_bit_exact(symmetric, scale_dtype, dequant):
    q = _layer(640, 1024, symmetric=symmetric, scale_dtype=scale_dtype, heavy=True)
    assert scales_fit_f16x2(q.group_scales)
    w8 = w4a8_dequantize_fp8(q.packed, q.group_scales, q.zeros, dequant=dequant)
    ref = dequantize_fp8(q.packed, q.group_scales, q.zeros)
    assert w8.dtype == FP8_DTYPE and w8.shape == (640, 1024)
    assert torch.equal(w8.view(torch.uint8), ref.view(torch.uint8))


def test_dequant_of_every_nibble_and_scale_is_bit_exact():
    """Every nibble (both planes) against every zero point and fp32 scales of all magnitudes the
    fit produces (up to 15 * 2^4.5 < 448; down to e4m3 subnormals): arbitrary fp32 scales (the
    product itself rounds; "auto" must pick the fp32 path) and the same rounded to 7 bits (f16x2)."""
    n, k = 256, 256
    u = (torch.arange(n * k, device="cuda") % 16).to(torch.uint8).reshape(n, k)
    u = u[:, torch.randperm(k, device="cuda", generator=_gen(11))]
    scales = (2.0 ** torch.empty(k // 128, n, device="cuda").uniform_(-12, 4.5, generator=_gen(12))).float()
    zeros = (torch.arange(2 * n, device="cuda") % 16).to(torch.uint8).reshape(k // 128, n)
    packed = pack_int4(u)
    scales7 = round_significant(scales, 7)
    assert not scales_fit_f16x2(scales) and scales_fit_f16x2(scales7)
    for sc, modes in ((scales, ("auto", "f32", "triton")), (scales7, ("auto", "f16x2", "f32", "triton"))):
        for z in (None, zeros):
            ref = dequantize_fp8(packed, sc, z)
            for mode in modes:
                w8 = w4a8_dequantize_fp8(packed, sc, z, dequant=mode)
                assert torch.equal(w8.view(torch.uint8), ref.view(torch.uint8)), f"{mode} zeros={z is not None}"


def test_f16x2_check_is_cached_and_follows_in_place_changes():
    q = quantize_dpq(torch.randn(128, 256, device="cuda") * 0.02)
    sc = q.group_scales.clone()
    assert scales_fit_f16x2(sc) and scales_fit_f16x2(sc)
    sc[0, 0] = 0.1  # 0.1 has more than 7 significant bits; the version counter moves
    assert not scales_fit_f16x2(sc)
    x8, sa = _acts(16, 256)
    y = w4a8_gemm(x8, sa, q.packed, sc, q.s8, path="fused")  # auto -> f32 path, still exact
    ref = w4a8_gemm_ref(x8, sa, q.packed, sc, q.s8, out_dtype=torch.float64)
    assert ((y.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-3 * ref.abs().max()).all()


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_no_fp8_overflow(symmetric):
    """Outlier-heavy weights and groups that reach the protective range's edge: the FP8 weight
    (reference and kernel) stays finite and within +-448, and so does the GEMM."""
    a = DPQ_FP8_RANGE / 256  # max|W| = R * 2^-8: s8 = 2^-8 and max|W8| = fp8(R) = 416
    w = torch.randn(256, 512, device="cuda", generator=_gen(3)) * 0.02
    w[0, :128] = torch.linspace(-a, a, 128, device="cuda")  # a group spanning the whole protective range
    w[1, 128:256] = torch.linspace(0.01, a, 128, device="cuda")  # one-sided group
    w[2, 256:384] = -torch.linspace(0.01, a, 128, device="cuda")
    q = quantize_dpq(w, symmetric=symmetric)
    for w8 in (dequantize_fp8(q.packed, q.group_scales, q.zeros),
               w4a8_dequantize_fp8(q.packed, q.group_scales, q.zeros)):
        w8f = w8.to(torch.float32)
        assert torch.isfinite(w8f).all() and w8f.abs().max() <= FP8_MAX
    x8, sa = _acts(16, 512)
    _assert_close(_gemm(x8, sa, q), x8, sa, q, PRECISE_EPS)


def test_one_hot_activations_give_each_weight_exactly():
    """X = I: Y[m, n] = W8[n, m] * s_a * s8, one product per output, so the kernel must equal the
    bf16 reference bit for bit, which checks the position of every nibble."""
    k = n = 256
    q = _layer(n, k)
    x8 = torch.eye(k, device="cuda").to(FP8_DTYPE)
    for cfg in (DECODE_CFG, LARGE_CFG, None):
        y = _gemm(x8, 0.5, q, config=cfg)
        ref = w4a8_gemm_ref(x8, 0.5, q.packed, q.group_scales, q.s8, zeros=q.zeros)
        assert torch.equal(y, ref), f"config {cfg}"


def test_packing_round_trip_on_gpu():
    u = torch.randint(0, 16, (128, 512), device="cuda", dtype=torch.uint8, generator=_gen(1))
    packed = pack_int4(u)
    assert packed.shape == (128, 256) and torch.equal(unpack_int4(packed), u)
    q = _layer(640, 1024)
    assert torch.equal(pack_int4(unpack_int4(q.packed)), q.packed)


@pytest.mark.parametrize("cfg", [config_dict(c) for c in CONFIGS],
                         ids=lambda c: "n{BLOCK_N}m{BLOCK_M}s{SPLIT_K}w{num_warps}st{num_stages}".format(**c))
def test_every_config(cfg):
    """Autotuning picks one config per shape, so each is checked on ragged M, N not a multiple of
    256 and K of 5 groups (splits of 1 or 0 groups)."""
    q = _layer(384, 640)
    x8, sa = _acts(300, 640)
    try:
        y = _gemm(x8, sa, q, config=cfg)
    except OutOfResources as e:
        pytest.skip(f"config does not fit this GPU: {e}")
    _assert_close(y, x8, sa, q, PRECISE_EPS)


def test_split_k_is_deterministic_and_resets_counters():
    q = _layer(4096, 4096)
    x8, sa = _acts(16, 4096)
    cfg = {**DECODE_CFG, "SPLIT_K": 8}
    y1 = _gemm(x8, sa, q, config=cfg)
    y2 = _gemm(x8, sa, q, config=cfg)
    torch.cuda.synchronize()
    assert torch.equal(y1, y2)
    for cnt in W._COUNTERS.values():
        assert int(cnt.abs().sum()) == 0


def test_out_leading_dims_and_device_scales():
    q = _layer(640, 1024)
    x8, sa = _acts(48, 1024)
    out = torch.full((2, 24, 640), float("nan"), dtype=torch.bfloat16, device="cuda")
    sa_t = torch.tensor(sa, device="cuda")
    s8_t = torch.tensor([q.s8], device="cuda", dtype=torch.float64)
    y = w4a8_gemm(x8.reshape(2, 24, 1024), sa_t, q.packed, q.group_scales, s8_t, out=out)
    assert y.shape == (2, 24, 640) and y.data_ptr() == out.data_ptr()
    _assert_close(y.reshape(48, 640), x8, sa, q, PRECISE_EPS)
    assert w4a8_gemm(x8[:0], sa, q.packed, q.group_scales, q.s8).shape == (0, 640)


def test_two_pass_matches_reference():
    q = _layer(4096, 4096)
    x8, sa = _acts(256, 4096)
    _assert_close(w4a8_gemm_two_pass(x8, sa, q.packed, q.group_scales, q.s8), x8, sa, q, PRECISE_EPS)


@pytest.mark.parametrize("m", [16, W.TWO_PASS_MIN_M, 4096])
def test_auto_path(m):
    """path="auto": the fused kernel below TWO_PASS_MIN_M rows, the two passes from there."""
    q = _layer(640, 1024, symmetric=False)
    x8, sa = _acts(m, 1024)
    y = _gemm(x8, sa, q, path="auto")
    if m >= W.TWO_PASS_MIN_M:
        assert torch.equal(y, w4a8_gemm_two_pass(x8, sa, q.packed, q.group_scales, q.s8, zeros=q.zeros))
    else:
        assert torch.equal(y, _gemm(x8, sa, q))
    _assert_close(y, x8, sa, q, PRECISE_EPS)


def test_autotuner_reports_its_choice():
    q = _layer(4096, 4096)
    x8, sa = _acts(16, 4096)
    _gemm(x8, sa, q)
    cfg = last_tuned_config()
    assert cfg is not None and cfg.keys() >= {"BLOCK_N", "BLOCK_M", "SPLIT_K", "num_warps", "num_stages"}


def test_bad_inputs():
    q = _layer(640, 1024)
    x8, sa = _acts(16, 1024)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        w4a8_gemm(x8.to(torch.bfloat16), sa, q.packed, q.group_scales, q.s8)
    with pytest.raises(ValueError, match=r"\[\.\.\., K=1024\]"):
        w4a8_gemm(x8[:, :512], sa, q.packed, q.group_scales, q.s8)
    with pytest.raises(ValueError, match="multiples of 128"):
        w4a8_gemm(x8[:, :960], sa, q.packed[:, :480], q.group_scales, q.s8)
    with pytest.raises(ValueError, match="multiples of 128"):
        w4a8_gemm(x8, sa, q.packed[:600], q.group_scales[:, :600], q.s8)
    with pytest.raises(ValueError, match="group_size"):
        w4a8_gemm(x8, sa, q.packed, q.group_scales, q.s8, group_size=64)
    with pytest.raises(ValueError, match=r"\[K/G, N\]"):
        w4a8_gemm(x8, sa, q.packed, q.group_scales.T.contiguous(), q.s8)
    with pytest.raises(TypeError, match="group_scales"):
        w4a8_gemm(x8, sa, q.packed, q.group_scales.to(torch.int32), q.s8)
    with pytest.raises(ValueError, match="zeros"):
        w4a8_gemm(x8, sa, q.packed, q.group_scales, q.s8, zeros=torch.zeros(8, 640, device="cuda"))
    with pytest.raises(TypeError, match="packed"):
        w4a8_gemm(x8, sa, q.packed.to(torch.int8), q.group_scales, q.s8)
    with pytest.raises(ValueError, match="CUDA"):
        w4a8_gemm(x8.cpu(), sa, q.packed.cpu(), q.group_scales.cpu(), q.s8)
    with pytest.raises(TypeError, match="s_a"):
        w4a8_gemm(x8, torch.ones(2, device="cuda"), q.packed, q.group_scales, q.s8)
    with pytest.raises(ValueError, match="config"):
        w4a8_gemm(x8, sa, q.packed, q.group_scales, q.s8, config={"BLOCK_N": 64})
    with pytest.raises(ValueError, match="path"):
        w4a8_gemm(x8, sa, q.packed, q.group_scales, q.s8, path="cublas")
