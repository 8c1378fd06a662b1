"""CalibQuant's tau search: the grid minimum of independently computed errors, (0, 0) is the
uncalibrated op, and more bits mean less error; float attention matches a direct computation."""

import numpy as np
import pytest

from edgeq.kv_cache import VisualCacheSpec
from edgeq.passes.methods.kv_calibration import AttentionSample, float_attention, quantized_attention, search_clip, search_tau


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
        direct = np.mean([np.mean((quantized_attention(s, 1, t1, t2, True) - e) ** 2) / np.mean(e ** 2)
                          for s, e in zip(samples, exact)])  # relative error per sample
        assert err == pytest.approx(direct, rel=1e-12)
    assert choice.error == min(choice.errors.values())
    assert choice.errors[(0.0, 0.0)] == pytest.approx(choice.uncalibrated_error, rel=1e-9)  # g is the identity at (0, 0)
    assert choice.error <= choice.uncalibrated_error


def test_two_bits_beat_one_bit_and_errors_are_explicit():
    samples = [_sample(s) for s in range(3)]
    assert search_tau(samples, 2).uncalibrated_error < search_tau(samples, 1).uncalibrated_error
    with pytest.raises(ValueError, match="at least one"):
        search_tau([], 1)


def test_clip_search_is_coordinate_descent_over_the_grid():
    samples = [_sample(s) for s in range(3)]
    spec = VisualCacheSpec(bits=1)
    choice = search_clip(samples, spec, grid=(1.0, 0.5, 0.25))
    # K first with V unclipped, then V with the chosen K; every point is a recomputed error
    assert {"k=1,v=1", "k=0.5,v=1", "k=0.25,v=1"} <= set(choice.errors)
    k_best = min((1.0, 0.5, 0.25), key=lambda k: choice.errors[f"k={k:g},v=1"])
    assert choice.k_clip == k_best
    assert choice.error == min(v for k, v in choice.errors.items() if k.startswith(f"k={k_best:g},"))
    direct = np.mean([np.mean((quantized_attention(s, 1, calibrate=False, spec=VisualCacheSpec(1, k_clip=choice.k_clip, v_clip=choice.v_clip)) - e) ** 2)
                      / np.mean(e ** 2) for s, e in zip(samples, [float_attention(s) for s in samples])])
    assert choice.error == pytest.approx(direct, rel=1e-9)
    # 1-bit ranges with an outlier channel: clipping must beat the raw min/max range here
    assert choice.error < choice.unclipped_error


@pytest.mark.parametrize("scheme", ["global-v", "kivi"])
def test_other_schemes_run_their_op(scheme):
    s = _sample(0)
    exact = float_attention(s)
    errs = {b: np.mean((quantized_attention(s, b, calibrate=False, spec=VisualCacheSpec(scheme=scheme)) - exact) ** 2) for b in (1, 2, 4, 8)}
    assert errs[8] < errs[4] < errs[2] < errs[1]
