"""CalibQuant's tau search: the grid minimum of independently computed errors, (0, 0) is the
uncalibrated op, and more bits mean less error; float attention matches a direct computation."""

import numpy as np
import pytest

from edgeq.kv_calibration import AttentionSample, float_attention, quantized_attention, search_tau


def _sample(seed: int, heads: int = 4, kv_heads: int = 2, nv: int = 24, nt: int = 5, d: int = 16) -> AttentionSample:
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    k_vis = f(1, kv_heads, nv, d)
    k_vis[..., 3] *= 6.0  # an outlier key channel, as in real caches
    return AttentionSample(f(1, heads, 1, d) * 2, k_vis, f(1, kv_heads, nv, d), f(1, kv_heads, nt, d), f(1, kv_heads, nt, d))


def test_float_attention_is_softmax_attention():
    s = _sample(0, heads=2, kv_heads=2)
    k = np.concatenate([s.k_visual, s.k_text], axis=-2)[0, 1].astype(np.float64)
    v = np.concatenate([s.v_visual, s.v_text], axis=-2)[0, 1].astype(np.float64)
    logits = k @ s.q[0, 1, 0].astype(np.float64) / 4.0
    p = np.exp(logits - logits.max())
    np.testing.assert_allclose(float_attention(s)[0, 1, 0], (p / p.sum()) @ v, rtol=1e-12)


def test_search_picks_the_grid_minimum():
    samples = [_sample(s) for s in range(3)]
    exact = [float_attention(s) for s in samples]
    choice = search_tau(samples, bits=1, grid=(0.0, 1.0, 3.0))
    assert len(choice.errors) == 9
    for (t1, t2), err in choice.errors.items():
        direct = np.mean([np.mean((quantized_attention(s, 1, t1, t2, True) - e) ** 2) for s, e in zip(samples, exact)])
        assert err == pytest.approx(direct, rel=1e-12)
    assert choice.error == min(choice.errors.values())
    assert choice.errors[(0.0, 0.0)] == pytest.approx(choice.uncalibrated_error, rel=1e-9)  # g is the identity at (0, 0)
    assert choice.error <= choice.uncalibrated_error


def test_two_bits_beat_one_bit_and_errors_are_explicit():
    samples = [_sample(s) for s in range(3)]
    assert search_tau(samples, 2).uncalibrated_error < search_tau(samples, 1).uncalibrated_error
    with pytest.raises(ValueError, match="at least one"):
        search_tau([], 1)
