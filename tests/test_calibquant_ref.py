"""CPU checks of the CalibQuant reference (``edgeq.kernels.calibquant_ref``); never imports triton.

- Packing: round trip, and the documented MSB-first bit order (appendix A.1) on hand-made bytes.
- Channel-wise quantization: alpha / scale per (batch, head, channel), error at most half a step,
  constant channels (zero range) dequantize exactly.
- Post-scaling (Eq. 6) equals dequantize-then-attend in float64, with and without calibration,
  GQA and not: the identity the Triton kernels rely on.
- Calibration (Eq. 7) maps each row's [gamma, delta] onto [gamma - tau1, delta - tau2], linearly.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from edgeq.kernels.calibquant_ref import (  # noqa: E402
    calibquant_attention_ref,
    calibquant_logits_ref,
    calibrate_logits,
    dequant_attention_ref,
    dequantize,
    pack_codes,
    quantize_channelwise,
    quantize_kv,
    shifts,
    unpack_codes,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("bits", [1, 2])
def test_pack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (2, 3, 5, 32), generator=_gen(bits), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, 32 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(pack_codes(unpack_codes(every_byte, bits), bits), every_byte)


def test_bit_order_is_msb_first():
    assert shifts(1) == [7, 6, 5, 4, 3, 2, 1, 0] and shifts(2) == [6, 4, 2, 0]
    # 1 bit: channel 8j + i is bit 7 - i of byte j
    c1 = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    assert pack_codes(c1, 1).tolist() == [[0x81, 0x40]]
    assert unpack_codes(torch.tensor([0xB1], dtype=torch.uint8), 1).tolist() == [1, 0, 1, 1, 0, 0, 0, 1]
    # 2 bits: channel 4j + i is bits (7 - 2i, 6 - 2i) of byte j
    c2 = torch.tensor([3, 0, 1, 2, 0, 0, 0, 3], dtype=torch.uint8)
    assert pack_codes(c2, 2).tolist() == [0b11000110, 0b00000011]
    assert unpack_codes(torch.tensor([0x1B], dtype=torch.uint8), 2).tolist() == [0, 1, 2, 3]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="bits"):
        pack_codes(torch.zeros(8, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="multiple"):
        pack_codes(torch.zeros(6, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        pack_codes(torch.full((4,), 4, dtype=torch.uint8), 2)
    with pytest.raises(TypeError, match="uint8"):
        pack_codes(torch.zeros(8, dtype=torch.int32), 1)


@pytest.mark.parametrize("bits", [1, 2])
def test_channelwise_quantization(bits):
    x = torch.randn(2, 3, 37, 16, generator=_gen(3)) * torch.linspace(0.1, 4, 16) + torch.linspace(-2, 2, 16)
    x[1, 2, :, 5] = 0.75  # a constant channel
    codes, alpha, scale = quantize_channelwise(x, bits)
    assert codes.shape == x.shape and alpha.shape == scale.shape == (2, 3, 16)
    assert torch.equal(alpha, x.amin(dim=-2)) and int(codes.max()) <= 2**bits - 1
    assert torch.allclose(scale * (2**bits - 1), x.amax(dim=-2) - alpha)
    assert scale[1, 2, 5] == 0 and (codes[1, 2, :, 5] == 0).all()
    q = quantize_kv(x, bits)
    xd = q.dequantize()
    assert (xd[1, 2, :, 5] == 0.75).all()
    err = (xd - x.double()).abs()
    assert (err <= scale.double().unsqueeze(-2) / 2 * (1 + 1e-6) + 1e-6).all()
    # the extremes of each channel are reproduced (the codebook holds alpha and beta)
    assert torch.allclose(xd.amin(dim=-2), x.amin(dim=-2).double()) and torch.allclose(
        xd.amax(dim=-2), x.amax(dim=-2).double(), atol=1e-5)


def _caches(bits, b=2, kvh=2, n=29, d=32, seed=0):
    g = _gen(seed)
    k = torch.randn(b, kvh, n, d, generator=g) * 2 + torch.randn(1, 1, 1, d, generator=g)
    v = torch.randn(b, kvh, n, d, generator=g)
    return quantize_kv(k, bits), quantize_kv(v, bits)


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("heads,kvh", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("calib", [None, (0.0, 3.0), (1.0, 2.0), (3.0, 0.0)], ids=str)
def test_post_scaling_equals_dequantize_then_attend(bits, heads, kvh, calib):
    kq, vq = _caches(bits, kvh=kvh, seed=bits)
    q = torch.randn(2, heads, 32, generator=_gen(7))
    tau1, tau2 = calib or (0.0, 0.0)
    args = (q, kq.packed, kq.alpha, kq.scale, vq.packed, vq.alpha, vq.scale, bits)
    post = calibquant_attention_ref(*args, tau1=tau1, tau2=tau2, calibrate=calib is not None)
    deq = dequant_attention_ref(*args, tau1=tau1, tau2=tau2, calibrate=calib is not None)
    assert post.shape == (2, heads, 32) and post.dtype == torch.float64
    assert torch.allclose(post, deq, rtol=1e-12, atol=1e-12)


def test_logits_match_dequantized_keys_and_gqa_mapping():
    kq, _ = _caches(2, kvh=2, seed=4)
    q = torch.randn(2, 6, 32, generator=_gen(5))
    logits = calibquant_logits_ref(q, kq.packed, kq.alpha, kq.scale, 2)
    k = dequantize(kq.packed, kq.alpha, kq.scale, 2)
    for h in range(6):  # query head h reads kv head h // 3
        want = torch.einsum("bd,bnd->bn", q[:, h].double(), k[:, h // 3]) / 32**0.5
        assert torch.allclose(logits[:, h], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tau1,tau2", [(0.0, 3.0), (1.0, 2.0), (2.5, 0.5), (0.0, 0.0)])
def test_calibration_maps_the_range(tau1, tau2):
    x = torch.randn(3, 4, 50, generator=_gen(8), dtype=torch.float64) * 3
    y = calibrate_logits(x, tau1, tau2)
    gamma, delta = x.amin(-1), x.amax(-1)
    assert torch.allclose(y.amin(-1), gamma - tau1) and torch.allclose(y.amax(-1), delta - tau2)
    a = (delta - gamma + tau1 - tau2) / (delta - gamma)  # linear, with that slope
    assert torch.allclose(y, a.unsqueeze(-1) * (x - gamma.unsqueeze(-1)) + (gamma - tau1).unsqueeze(-1))
    flat = torch.full((2, 7), 1.5, dtype=torch.float64)
    assert torch.equal(calibrate_logits(flat, tau1, tau2), flat)


def test_calibration_changes_attention_like_a_temperature():
    """softmax(g(x)) = softmax(a x): tau2 > tau1 flattens the distribution (a < 1)."""
    kq, vq = _caches(1, seed=9)
    q = torch.randn(2, 2, 32, generator=_gen(10)) * 3
    args = (q, kq.packed, kq.alpha, kq.scale, vq.packed, vq.alpha, vq.scale, 1)
    logits = calibquant_logits_ref(q, kq.packed, kq.alpha, kq.scale, 1)
    gamma, delta = logits.amin(-1, keepdim=True), logits.amax(-1, keepdim=True)
    a = (delta - gamma - 3.0) / (delta - gamma)
    p = torch.softmax(a * logits, dim=-1)
    v = dequantize(vq.packed, vq.alpha, vq.scale, 1)
    want = torch.einsum("bhn,bhnd->bhd", p, v)
    assert torch.allclose(calibquant_attention_ref(*args, tau1=0.0, tau2=3.0), want, atol=1e-12)


def test_bad_shapes():
    kq, vq = _caches(1)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        calibquant_attention_ref(torch.randn(2, 3, 32), kq.packed, kq.alpha, kq.scale, vq.packed, vq.alpha,
                                 vq.scale, 1)
    with pytest.raises(ValueError, match=r"\[B, H, D=32\]"):
        calibquant_logits_ref(torch.randn(2, 2, 16), kq.packed, kq.alpha, kq.scale, 1)
    with pytest.raises(ValueError, match="bits"):
        quantize_kv(torch.randn(1, 1, 4, 8), 3)
