"""Quantization math: scales, zero points, round trips and the ranges each dtype uses."""

import numpy as np
import pytest

from edgeq.errors import UserInputError
from edgeq.quantize.quant import QuantSpec, dequantize_weight, quantize_weight, scale_zero_point
from references import fake_quant


def test_symmetric_int8_scale_and_zero_point():
    scale, zp = scale_zero_point(np.array(-2.0), np.array(1.0), QuantSpec("int8"))
    assert scale == pytest.approx(2.0 / 127)
    assert zp == 0


def test_symmetric_uint8_uses_midpoint():
    _, zp = scale_zero_point(np.array(-1.0), np.array(1.0), QuantSpec("uint8"))
    assert zp == 128


def test_asymmetric_covers_range_and_zero():
    spec = QuantSpec("uint8", symmetric=False)
    scale, zp = scale_zero_point(np.array(0.5), np.array(3.0), spec)
    # zero must be representable, so the range is widened to [0, 3]
    assert scale == pytest.approx(3.0 / 255)
    assert zp == 0
    x = np.linspace(0, 3, 50, dtype=np.float32)
    assert np.max(np.abs(fake_quant(x, scale, zp, spec) - x)) <= scale / 2 + 1e-7


def test_fake_quant_saturates_outside_range():
    spec = QuantSpec("int8")
    scale, zp = scale_zero_point(np.array(-1.0), np.array(1.0), spec)
    y = fake_quant(np.array([5.0, -5.0], np.float32), scale, zp, spec)
    np.testing.assert_allclose(y, [127 * scale, -128 * scale], rtol=1e-6)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_per_channel_weight_round_trip_error_bounded(dtype):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32) * np.linspace(0.1, 10, 32, dtype=np.float32)
    spec = QuantSpec(dtype, axis=1)
    q, scale, zp = quantize_weight(w, spec)
    assert scale.shape == (32,)
    err = np.abs(dequantize_weight(q, scale, zp, spec) - w)
    assert np.all(err <= scale[None, :] / 2 + 1e-6)


def test_block_weight_parameters_layout():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((256, 8)).astype(np.float32)
    spec = QuantSpec("int4", axis=0, block_size=128)
    q, scale, zp = quantize_weight(w, spec)
    assert scale.shape == (2, 8) and zp.shape == (2, 8)
    assert q.min() >= -7 and q.max() <= 7
    w2 = dequantize_weight(q, scale, zp, spec)
    np.testing.assert_allclose(w2[:128, 0], np.clip(np.round(w[:128, 0] / scale[0, 0]), -7, 7) * scale[0, 0], rtol=1e-6)


def test_unknown_dtype_rejected():
    with pytest.raises(UserInputError):
        QuantSpec("int3")
