"""Correctness of the CalibQuant Triton decode attention on a CUDA GPU (skipped elsewhere).

Reference: ``calibquant_ref`` in float64 (post-scaled logits, calibration, softmax, post-scaled
p.V). The kernels differ from it in three roundings only:

1. the query planes ``q * sm_scale * scale_k * 2^-s`` are fp16 (2^-11 relative each), the codes
   are exact and the tensor cores accumulate in fp32: ``|logit - ref| <= 2^-10 * T`` with ``T`` the
   sum of the absolute terms ``sm_scale * (sum_c |q_c scale_c code_c| + |q . alpha|)``;
2. p is rounded to fp16 before the p.V dot (and the same rounded p is summed for the
   normalization), and the logit error above moves p by a relative ``|a| * dlogit``;
3. the output's rounding to fp16 / bf16.
So each output element is checked against ``2^-8 * (|alpha_v| + (2^b - 1) |scale_v|)`` (0.4% of
that channel's dequantized range) plus one rounding of the output dtype. A wrong bit position or
plane moves outputs by a whole quantization step (a third or all of the range): far outside.

Exact checks, no tolerance: one-hot queries with unit scales read every code of K back as a
logit (each logit is one fp16 product); a one-token cache with unit scales returns the V codes;
two runs give the same bits (the chunk reduction has a fixed order).
Shapes: bits 1 and 2; MHA (G = 1, the GQA1 path) and GQA (G = 4, 8); odd token counts (1, 7, 333,
1001, 4099) and chunked heads; head_dim 128 and 64. Triton is imported only once CUDA is known to
be there: the CPU suite never imports triton.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the Triton kernels need a GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from edgeq.kernels.calibquant_ref import (  # noqa: E402
    calibquant_attention_ref,
    calibquant_logits_ref,
    dequantize,
    pack_codes,
    quantize_kv,
    unpack_codes,
)
from edgeq.kernels.calibquant_triton import (  # noqa: E402
    UNPACK_MODES,
    calibquant_decode_attention,
    calibquant_qk,
    token_major,
)

pytestmark = pytest.mark.gpu

LOGIT_EPS = 2.0**-10
OUT_EPS = 2.0**-8
CALIBS = [None, (0.0, 3.0), (1.0, 2.0)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator("cuda").manual_seed(seed)


def _caches(bits, b, kvh, n, d, seed=0):
    """K with per-channel offsets and a few wide channels (what channel-wise ranges are for), V Gaussian."""
    g = _gen(seed)
    chan = torch.randn(d, device="cuda", generator=g)
    width = 1 + 3 * (torch.rand(d, device="cuda", generator=g) < 0.1)
    k = torch.randn(b, kvh, n, d, device="cuda", generator=g) * width + 2 * chan
    v = torch.randn(b, kvh, n, d, device="cuda", generator=g) + 0.5 * chan
    return quantize_kv(k.half(), bits), quantize_kv(v.half(), bits)


def _query(b, h, d, seed=1, dtype=torch.float16):
    return (torch.randn(b, h, d, device="cuda", generator=_gen(seed)) * 1.5).to(dtype)


def _abs_terms(q, kq, bits):
    """T of the module docstring: the sum of |terms| of each logit, [B, H, N]."""
    d = kq.alpha.shape[-1]
    h, kvh = q.shape[1], kq.alpha.shape[1]
    codes = unpack_codes(kq.packed, bits).double().repeat_interleave(h // kvh, dim=1)
    qs = (q.double() * kq.scale.double().repeat_interleave(h // kvh, dim=1)).abs()
    bias = (q.double() * kq.alpha.double().repeat_interleave(h // kvh, dim=1)).sum(-1, keepdim=True).abs()
    return (torch.einsum("bhd,bhnd->bhn", qs, codes) + bias) / math.sqrt(d)


def _out_tol(vq, bits, heads, ref, dtype):
    kvh = vq.alpha.shape[1]
    span = vq.alpha.double().abs() + (2**bits - 1) * vq.scale.double().abs()
    eps_out = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    return OUT_EPS * span.repeat_interleave(heads // kvh, dim=1) + eps_out * ref.abs() + 1e-6


def _run(bits, b, h, kvh, n, d, calib, unpack="auto", dtype=torch.float16, config=None, seed=0, vtm=False):
    kq, vq = _caches(bits, b, kvh, n, d, seed)
    q = _query(b, h, d, seed + 1, dtype)
    tau1, tau2 = calib or (0.0, 0.0)
    args = (q, kq.packed, kq.alpha, kq.scale, vq.packed, vq.alpha, vq.scale, bits)
    kargs = (q, kq.packed, kq.alpha, kq.scale, token_major(vq.packed) if vtm else vq.packed, vq.alpha, vq.scale, bits)
    out = calibquant_decode_attention(*kargs, tau1, tau2, calib is not None, unpack=unpack, config=config)
    ref = calibquant_attention_ref(*args, tau1=tau1, tau2=tau2, calibrate=calib is not None)
    return out, ref, kq, vq, q


def _assert_out(out, ref, vq, bits, dtype):
    assert out.dtype == dtype and out.shape == ref.shape and torch.isfinite(out).all()
    err = (out.double() - ref).abs()
    tol = _out_tol(vq, bits, ref.shape[1], ref, dtype)
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"error / tolerance reaches {worst:.3f} (max abs err {err.max().item():.3e})"


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("h,kvh", [(8, 8), (16, 4)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("n", [7, 333, 4099])
@pytest.mark.parametrize("calib", CALIBS, ids=["nocal", "cal03", "cal12"])
def test_matches_reference(bits, h, kvh, n, calib):
    """V natural for MHA, token-major for GQA (both layouts are also compared bit for bit below)."""
    out, ref, _, vq, _ = _run(bits, 2, h, kvh, n, 128, calib, vtm=kvh == 4)
    _assert_out(out, ref, vq, bits, torch.float16)


@pytest.mark.parametrize("unpack", sorted(UNPACK_MODES))
@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("h,kvh", [(4, 4), (8, 1)], ids=["mha", "gqa8"])
@pytest.mark.parametrize("vtm", [False, True], ids=["vnat", "vtok"])
def test_every_unpack_mode(unpack, bits, h, kvh, vtm):
    out, ref, _, vq, _ = _run(bits, 2, h, kvh, 1001, 128, (0.0, 3.0), unpack=unpack, vtm=vtm)
    _assert_out(out, ref, vq, bits, torch.float16)


@pytest.mark.parametrize("unpack", sorted(UNPACK_MODES))
@pytest.mark.parametrize("bits", [1, 2])
def test_logits_within_bound_and_chunk_minmax(unpack, bits):
    kq, _ = _caches(bits, 2, 4, 1001, 128, seed=3)
    q = _query(2, 8, 128, seed=4)
    lg, mm = calibquant_qk(q, kq.packed, kq.alpha, kq.scale, bits, unpack=unpack,
                           config={"qk_block": 64, "qk_per_sm": 1000})  # many chunks per head
    ref = calibquant_logits_ref(q, kq.packed, kq.alpha, kq.scale, bits)
    bound = LOGIT_EPS * _abs_terms(q, kq, bits) + 1e-6
    worst = ((lg.double() - ref).abs() / bound).max().item()
    assert worst <= 1.0, f"logit error / bound reaches {worst:.3f}"
    ncq = mm.shape[-1]
    assert ncq > 1
    assert torch.equal(mm[0].amin(-1), lg.amin(-1)) and torch.equal(mm[1].amax(-1), lg.amax(-1))


@pytest.mark.parametrize("unpack", sorted(UNPACK_MODES))
@pytest.mark.parametrize("bits", [1, 2])
def test_one_hot_queries_read_every_key_code(unpack, bits):
    """q_h = e_h (G = D query heads on one kv head), unit scales, zero alphas, sm_scale 1: logit[h, t]
    is code[t, h], a single exact product: pins every bit position of the K layout."""
    d, n = 64, 77
    codes = torch.randint(0, 2**bits, (1, 1, n, d), device="cuda", dtype=torch.uint8, generator=_gen(5))
    packed = pack_codes(codes, bits)
    ones, zeros = torch.ones(1, 1, d, device="cuda"), torch.zeros(1, 1, d, device="cuda")
    q = torch.eye(d, device="cuda", dtype=torch.float16)[None]  # [1, H = d, D]
    lg, _ = calibquant_qk(q, packed, zeros, ones, bits, sm_scale=1.0, unpack=unpack)
    assert torch.equal(lg[0], codes[0, 0].T.float())


@pytest.mark.parametrize("unpack", sorted(UNPACK_MODES))
@pytest.mark.parametrize("bits", [1, 2])
def test_one_token_returns_the_value_codes(unpack, bits):
    """N = 1: p = 1, so out = alpha_v + scale_v * code_v; with unit scales, fp32 q: the codes exactly."""
    d = 128
    kc = torch.randint(0, 2**bits, (3, 2, 1, d), device="cuda", dtype=torch.uint8, generator=_gen(6))
    vc = torch.randint(0, 2**bits, (3, 2, 1, d), device="cuda", dtype=torch.uint8, generator=_gen(7))
    ones, zeros = torch.ones(3, 2, d, device="cuda"), torch.zeros(3, 2, d, device="cuda")
    q = torch.randn(3, 4, d, device="cuda", generator=_gen(8))
    out = calibquant_decode_attention(q, pack_codes(kc, bits), zeros, ones, pack_codes(vc, bits), zeros, ones, bits,
                                      0.0, 3.0, True, unpack=unpack)
    assert out.dtype == torch.float32
    assert torch.equal(out, vc[:, :, 0].repeat_interleave(2, dim=1).float())


@pytest.mark.parametrize("bits", [1, 2])
def test_deterministic(bits):
    kq, vq = _caches(bits, 4, 8, 4099, 128, seed=9)
    q = _query(4, 8, 128, seed=10)
    args = (q, kq.packed, kq.alpha, kq.scale, vq.packed, vq.alpha, vq.scale, bits, 0.0, 3.0)
    cfg = {"pv_per_sm": 64, "qk_per_sm": 64}  # several chunks per head on both kernels
    assert torch.equal(calibquant_decode_attention(*args, config=cfg), calibquant_decode_attention(*args, config=cfg))


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("cfg", [{"qk_block": 64, "qk_warps": 4, "pv_block": 64, "pv_warps": 1},
                                 {"qk_block": 128, "qk_warps": 2, "pv_block": 128, "pv_warps": 2},
                                 {"qk_block": 256, "qk_warps": 4, "pv_block": 256, "pv_warps": 4, "pv_per_sm": 64}],
                         ids=["small", "mid", "large"])
def test_configs(bits, cfg):
    out, ref, _, vq, _ = _run(bits, 3, 8, 8, 1001, 128, (0.0, 3.0), config=cfg)
    _assert_out(out, ref, vq, bits, torch.float16)


@pytest.mark.parametrize("bits", [1, 2])
def test_head_dim_64_bf16_and_single_token(bits):
    out, ref, _, vq, _ = _run(bits, 2, 8, 2, 333, 64, (0.0, 3.0), dtype=torch.bfloat16)
    _assert_out(out, ref, vq, bits, torch.bfloat16)
    out, ref, _, vq, _ = _run(bits, 2, 4, 4, 1, 128, (0.0, 3.0))
    _assert_out(out, ref, vq, bits, torch.float16)


@pytest.mark.parametrize("bits", [1, 2])
def test_strided_cache_layouts(bits):
    """A cache stored [B, N, KVH, D*b/8] passes as a permuted view (same bits), and V stored
    token-major (unit stride on N, ``token_major``) gives the same values (a differently compiled
    kernel: the tensor cores may order the products of one instruction differently, so up to one
    fp16 rounding apart)."""
    b, kvh, n, d = 2, 4, 1001, 128
    kq, vq = _caches(bits, b, kvh, n, d, seed=11)
    q = _query(b, 8, d, seed=12)
    kp = kq.packed.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    vp = vq.packed.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert kp.stride(2) != kp.shape[3] and token_major(vq.packed).stride(2) == 1
    want = calibquant_decode_attention(q, kq.packed, kq.alpha, kq.scale, vq.packed, vq.alpha, vq.scale, bits, 0.0, 3.0)
    out = calibquant_decode_attention(q, kp, kq.alpha, kq.scale, vp, vq.alpha, vq.scale, bits, 0.0, 3.0)
    assert torch.equal(out, want)
    out = calibquant_decode_attention(q, kq.packed, kq.alpha, kq.scale, token_major(vq.packed), vq.alpha, vq.scale,
                                      bits, 0.0, 3.0)
    torch.testing.assert_close(out, want, rtol=2.0**-9, atol=1e-4)


def test_flat_logits_skip_calibration():
    """Every key identical: delta == gamma, calibration is skipped, p is uniform."""
    bits, d, n = 2, 128, 50
    k = torch.randn(1, 2, 1, d, device="cuda", generator=_gen(13)).expand(1, 2, n, d).contiguous()
    v = torch.randn(1, 2, n, d, device="cuda", generator=_gen(14))
    kq, vq = quantize_kv(k, bits), quantize_kv(v, bits)
    q = _query(1, 2, d, seed=15)
    out = calibquant_decode_attention(q, kq.packed, kq.alpha, kq.scale, vq.packed, vq.alpha, vq.scale, bits, 0.0, 3.0)
    want = dequantize(vq.packed, vq.alpha, vq.scale, bits).mean(dim=2)
    assert torch.allclose(out.double(), want, atol=2e-3, rtol=2e-3)


def test_matches_sdpa_on_the_dequantized_cache():
    """Without calibration the kernel is ordinary attention over the dequantized cache."""
    bits, b, h, n, d = 2, 2, 8, 1001, 128
    kq, vq = _caches(bits, b, h, n, d, seed=16)
    q = _query(b, h, d, seed=17)
    out = calibquant_decode_attention(q, kq.packed, kq.alpha, kq.scale, vq.packed, vq.alpha, vq.scale, bits,
                                      calibrate=False)
    k = dequantize(kq.packed, kq.alpha, kq.scale, bits).float()
    v = dequantize(vq.packed, vq.alpha, vq.scale, bits).float()
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.float()[:, :, None], k, v)[:, :, 0]
    assert torch.allclose(out.float(), sdpa, atol=2e-2, rtol=1e-2)


def test_bad_inputs():
    kq, vq = _caches(1, 2, 4, 10, 128)
    q = _query(2, 8, 128)
    good = (q, kq.packed, kq.alpha, kq.scale, vq.packed, vq.alpha, vq.scale, 1)
    with pytest.raises(ValueError, match="bits"):
        calibquant_decode_attention(*good[:7], 3)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        calibquant_decode_attention(_query(2, 6, 128), *good[1:])
    with pytest.raises(ValueError, match=r"D\*b/8"):
        calibquant_decode_attention(q, kq.packed[..., :8], *good[2:])
    with pytest.raises(TypeError, match="uint8"):
        calibquant_decode_attention(q, kq.packed.to(torch.int16), *good[2:])
    with pytest.raises(ValueError, match="KVH, D"):
        calibquant_decode_attention(q, kq.packed, kq.alpha[:, :2], *good[3:])
    with pytest.raises(ValueError, match="CUDA"):
        calibquant_decode_attention(q.cpu(), *good[1:])
    with pytest.raises(ValueError, match="unit stride"):
        calibquant_decode_attention(q, torch.cat([kq.packed, kq.packed], -1)[..., ::2], *good[2:])
    with pytest.raises(ValueError, match="unit stride"):  # K must have unit stride on head_dim
        calibquant_decode_attention(q, token_major(kq.packed), *good[2:])
    with pytest.raises(ValueError, match="token axis"):
        calibquant_decode_attention(*good[:4], torch.cat([vq.packed, vq.packed], -1)[..., ::2], *good[5:])
    with pytest.raises(ValueError, match="unpack"):
        calibquant_decode_attention(*good, unpack="fast")
    with pytest.raises(ValueError, match="config"):
        calibquant_decode_attention(*good, config={"block": 64})
