"""CPU checks of the DPQ W4A8 reference (``edgeq.kernels.w4a8_gemm_ref``); never imports triton.

- INT4 packing: round trip, the documented nibble layout (byte j of a 128-wide K block holds
  k0 + j low and k0 + 64 + j high) and input checks.
- Two-level quantization: s8 is the smallest power of two with max|W| / s8 <= 448 - 448/15; the
  dequantized weight never overflows FP8 (not even for weights built to hit the range's edges);
  its error is that of 4-bit RTN: per element at most half an INT4 step plus the two FP8
  roundings (of W / s8 and of the dequantized value, 2^-4 relative each for e4m3), and about
  10% relative RMS over Gaussian weights.
- The GEMM reference equals the float64 product of the dequantized operands, rounded once.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from edgeq.kernels.w4a8_gemm_ref import (  # noqa: E402
    DPQ_FP8_RANGE,
    FP8_DTYPE,
    FP8_MAX,
    activation_scale,
    dequantize,
    dequantize_fp8,
    dpq_fp8_scale,
    pack_int4,
    quantize_activation_fp8,
    quantize_dpq,
    unpack_int4,
    w4a8_abs_terms,
    w4a8_gemm_ref,
)

N, K = 96, 512


def _weight(seed: int, n: int = N, k: int = K, heavy: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if heavy:  # a few large outliers, as in real LLM weights
        idx = torch.randint(0, n * k, (20,), generator=g)
        w.view(-1)[idx] *= 50
    return w


def test_pack_round_trip_and_layout():
    g = torch.Generator().manual_seed(0)
    u = torch.randint(0, 16, (8, 256), generator=g, dtype=torch.uint8)
    packed = pack_int4(u)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 128)
    assert torch.equal(unpack_int4(packed), u)
    # byte j of block b: low nibble k = 128 b + j, high nibble k = 128 b + 64 + j
    for b in (0, 1):
        for j in (0, 5, 63):
            byte = int(packed[3, 64 * b + j])
            assert byte & 0xF == int(u[3, 128 * b + j]) and byte >> 4 == int(u[3, 128 * b + 64 + j])
    # every byte value survives unpack -> pack
    all_bytes = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(pack_int4(unpack_int4(all_bytes)), all_bytes)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 128"):
        pack_int4(torch.zeros(2, 100, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        pack_int4(torch.zeros(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.full((2, 128), 16, dtype=torch.uint8))


@pytest.mark.parametrize("amax", [1e-3, 0.0173, 1.0, 3.5, 418.0, 1000.0, 2.0**-5 * DPQ_FP8_RANGE])
def test_s8_is_the_smallest_power_of_two(amax):
    w = torch.tensor([[amax, -amax / 3]])
    s8 = dpq_fp8_scale(w)
    assert s8 > 0 and math.log2(s8) == round(math.log2(s8)), "s8 must be a power of two"
    assert amax / s8 <= DPQ_FP8_RANGE
    assert amax / (s8 / 2) > DPQ_FP8_RANGE
    assert dpq_fp8_scale(torch.zeros(2, 2)) == 1.0


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("heavy", [False, True], ids=["gauss", "outliers"])
def test_dequantized_fp8_never_overflows(symmetric, heavy):
    q = quantize_dpq(_weight(1, heavy=heavy), symmetric=symmetric)
    w8 = dequantize_fp8(q.packed, q.group_scales, q.zeros).to(torch.float32)
    assert torch.isfinite(w8).all()
    assert w8.abs().max() <= FP8_MAX


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_range_edges_do_not_overflow(symmetric):
    """Groups whose FP8 values reach +-R, one-sided groups and a group of zeros."""
    a = DPQ_FP8_RANGE / 256  # max|W| = R * 2^-8: s8 = 2^-8 and max|W8| = fp8(R) = 416
    w = torch.zeros(4, 256)
    w[0, :128] = torch.linspace(-a, a, 128)  # a group spanning the whole protective range
    w[1, :128] = torch.linspace(0.01, a, 128)  # positive only
    w[2, 128:] = -torch.linspace(0.01, a, 128)  # negative only
    w[3, 5] = -a  # a lone extreme in a group of zeros
    q = quantize_dpq(w, symmetric=symmetric)
    assert q.s8 == 2.0**-8
    w8 = dequantize_fp8(q.packed, q.group_scales, q.zeros).to(torch.float32)
    assert torch.isfinite(w8).all() and w8.abs().max() <= FP8_MAX
    assert w8.abs().max() >= 416.0
    assert (w8[0, 128:] == 0).all()  # the empty group stays zero


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_quantization_error_is_4_bit(symmetric):
    w = _weight(2)
    q = quantize_dpq(w, symmetric=symmetric)
    assert q.packed.shape == (N, K // 2) and q.group_scales.shape == (K // 128, N)
    assert q.group_scales.dtype == torch.float32
    mant, _ = torch.frexp(q.group_scales)
    assert torch.equal(mant * 128, torch.round(mant * 128)), "scales must have 7 significant bits"
    assert (q.zeros is None) == symmetric
    wq = dequantize(q)
    # per element: e4m3's rounding of W / s8 (2^-4 relative), half an INT4 step (in real units
    # s8 * s_g), e4m3's rounding of the dequantized value (2^-4), and e4m3's subnormal spacing
    step = q.group_scales.to(torch.float64).T.repeat_interleave(128, dim=1) * q.s8
    w64, wq64 = w.to(torch.float64), wq.to(torch.float64)
    bound = 2.0**-4 * w64.abs() + 0.5 * step * (1 + 2.0**-10) + 2.0**-4 * wq64.abs() + q.s8 * 2.0**-9
    worst = ((wq64 - w64).abs() / bound).max().item()
    assert worst <= 1.0, f"error / bound reaches {worst:.3f}"
    # overall: 4-bit RTN on Gaussian groups of 128 gives ~9-12% relative RMS error
    rel = ((wq - w).norm() / w.norm()).item()
    assert 0.02 < rel < 0.15, rel


def test_scale_dtypes_and_input_checks():
    w = _weight(3)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        q = quantize_dpq(w, scale_dtype=dt)
        assert q.group_scales.dtype == dt
        assert torch.isfinite(dequantize(q)).all()
    with pytest.raises(ValueError, match="group size"):
        quantize_dpq(w, group_size=64)
    with pytest.raises(ValueError, match="float"):
        quantize_dpq(torch.zeros(4, 128, dtype=torch.int32))
    q = quantize_dpq(w)
    with pytest.raises(ValueError, match=r"\[K/G, N\]"):
        dequantize_fp8(q.packed, q.group_scales.T.contiguous())


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_gemm_reference_is_the_exact_product(symmetric):
    q = quantize_dpq(_weight(4), symmetric=symmetric)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, K, generator=g)
    sa = activation_scale(x)
    x8 = quantize_activation_fp8(x, sa)
    assert x8.dtype == FP8_DTYPE and torch.isfinite(x8.to(torch.float32)).all()
    y = w4a8_gemm_ref(x8, sa, q.packed, q.group_scales, q.s8, zeros=q.zeros)
    exact = w4a8_gemm_ref(x8, sa, q.packed, q.group_scales, q.s8, zeros=q.zeros, out_dtype=torch.float64)
    assert y.dtype == torch.bfloat16 and y.shape == (7, N)
    assert torch.equal(y, exact.to(torch.bfloat16))
    w8 = dequantize_fp8(q.packed, q.group_scales, q.zeros).to(torch.float64)
    sa32 = float(torch.tensor(sa, dtype=torch.float32))
    assert torch.allclose(exact, (x8.to(torch.float64) @ w8.T) * sa32 * q.s8, rtol=0, atol=0)
    # W4A8 output vs the float layer: 4-bit weights and 8-bit activations, a few % relative
    ref_fp = x @ _weight(4).T
    rel = ((exact.to(torch.float32) - ref_fp).norm() / ref_fp.norm()).item()
    assert rel < 0.2, rel
    terms = w4a8_abs_terms(x8, sa, q.packed, q.group_scales, q.s8, zeros=q.zeros)
    assert (terms >= exact.abs() * (1 - 1e-12)).all()
