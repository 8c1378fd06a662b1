"""Streaming observers: equal to the batch statistics, bounded state, round trip via state()."""

import numpy as np
import pytest

from edgeq.calib.observers import (HistogramObserver, MinMaxObserver, PerChannelAbsMaxObserver,
                                   observer_from_state, observer_state)


def _batches(seed=0, n=5):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, 16, 8)).astype(np.float32) * (i + 1) for i in range(n)]


def test_minmax_equals_global():
    obs = MinMaxObserver()
    data = _batches()
    for x in data:
        obs.update(x)
    allx = np.concatenate([x.ravel() for x in data])
    assert obs.range() == (pytest.approx(allx.min()), pytest.approx(allx.max()))


def test_per_channel_absmax():
    obs = PerChannelAbsMaxObserver()
    data = _batches()
    for x in data:
        obs.update(x)
    expect = np.max(np.abs(np.concatenate(data, axis=1)), axis=(0, 1))
    np.testing.assert_allclose(obs.absmax, expect)


def test_histogram_grows_range_and_keeps_counts():
    obs = HistogramObserver(bins=256, method="minmax")
    data = _batches()
    for x in data:  # each batch wider than the last: forces rebinning
        obs.update(x)
    assert obs.hist.sum() == sum(x.size for x in data)
    assert obs.top >= max(np.abs(x).max() for x in data)
    assert obs.hist.shape == (256,)


def test_histogram_percentile_clips_outlier():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(100_000).astype(np.float32)
    x[0] = 1000.0
    obs = HistogramObserver(method="percentile", percentile=99.9)
    obs.update(x)
    lo, hi = obs.range()
    assert 2.0 < hi < 10.0  # the single outlier is clipped away


def test_mse_clip_below_absmax_for_heavy_tail():
    rng = np.random.default_rng(0)
    x = rng.standard_t(df=2, size=200_000).astype(np.float32)
    obs = HistogramObserver(method="mse", bits=8)
    obs.update(x)
    clip = obs.clip()
    assert clip < np.abs(x).max() * 0.9


@pytest.mark.parametrize("make", [MinMaxObserver, PerChannelAbsMaxObserver, lambda: HistogramObserver(method="mse")])
def test_state_round_trip(make):
    obs = make()
    for x in _batches():
        obs.update(x)
    restored = observer_from_state(observer_state(obs))
    assert restored.range() == pytest.approx(obs.range())


def test_modality_split_observer_splits_tokens_and_round_trips():
    from edgeq.calib.observers import ModalitySplitObserver, observer_from_state, observer_state

    obs = ModalitySplitObserver(MinMaxObserver(), HistogramObserver(bins=64, method="minmax"))
    x = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3) - 10
    mask = np.zeros((2, 5), bool)
    mask[0, :2] = mask[1, 4] = True
    obs.update_split(x, mask)
    vis, txt = x[mask], x[~mask]
    assert obs.visual.range() == (vis.min(), vis.max())
    assert obs.text.range() == (txt.min(), txt.max())
    assert obs.tokens.tolist() == [3, 7]
    back = observer_from_state(observer_state(obs))
    assert isinstance(back.text, HistogramObserver) and back.visual.range() == obs.visual.range()
    assert back.range() == (x.min(), x.max())
    with pytest.raises(ValueError, match="does not match"):
        obs.update_split(x, mask[:, :4])
    with pytest.raises(TypeError, match="update_split"):
        obs.update(x)
