"""Streaming observers: each sees one batch at a time and keeps a fixed-size state.

Memory never grows with the number of calibration samples. Every observer can be saved to and
restored from a dict of arrays (``state`` / ``from_state``) so calibration results are cached on
disk. ``range()`` gives the (lo, hi) an activation scale should cover.
"""

from __future__ import annotations

import abc
from typing import cast

import numpy as np

from edgeq.errors import UserInputError


class Observer(abc.ABC):
    kind = ""

    @abc.abstractmethod
    def update(self, x: np.ndarray) -> None:
        """Fold one batch into the state."""

    @abc.abstractmethod
    def state(self) -> dict[str, np.ndarray]:
        """The whole state as arrays (for the on-disk cache)."""

    @classmethod
    @abc.abstractmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> Observer:
        """Inverse of ``state``."""

    @abc.abstractmethod
    def range(self) -> tuple[float, float]:
        """The (lo, hi) an activation scale should cover."""


class MinMaxObserver(Observer):
    kind = "minmax"

    def __init__(self):
        self.lo = np.inf
        self.hi = -np.inf

    def update(self, x):
        if x.size:
            self.lo = min(self.lo, float(np.min(x)))
            self.hi = max(self.hi, float(np.max(x)))

    def state(self):
        return {"lo": np.array(self.lo), "hi": np.array(self.hi)}

    @classmethod
    def from_state(cls, state):
        obs = cls()
        obs.lo, obs.hi = float(state["lo"]), float(state["hi"])
        return obs

    def range(self):
        return self.lo, self.hi


class PerChannelAbsMaxObserver(Observer):
    """Absolute maximum of each channel along ``axis`` (the last axis: hidden features)."""

    kind = "channel_absmax"

    def __init__(self, axis: int = -1):
        self.axis = axis
        self.absmax: np.ndarray | None = None

    def update(self, x):
        reduce = tuple(a for a in range(x.ndim) if a != self.axis % x.ndim)
        m = np.max(np.abs(x), axis=reduce).astype(np.float64)
        self.absmax = m if self.absmax is None else np.maximum(self.absmax, m)

    def state(self):
        return {"absmax": self.absmax, "axis": np.array(self.axis)}

    @classmethod
    def from_state(cls, state):
        obs = cls(int(state["axis"]))
        obs.absmax = np.asarray(state["absmax"])
        return obs

    def range(self):
        m = float(self.absmax.max())
        return -m, m


class ChannelMinMaxObserver(Observer):
    """Minimum and maximum of each channel of the last axis: ranges of any channel subset
    (ResQ's low and high subspaces, each with its own static scale) come from one run."""

    kind = "channel_minmax"

    def __init__(self):
        self.lo: np.ndarray | None = None
        self.hi: np.ndarray | None = None

    def update(self, x):
        flat = np.asarray(x).reshape(-1, x.shape[-1])
        lo, hi = flat.min(0).astype(np.float64), flat.max(0).astype(np.float64)
        self.lo = lo if self.lo is None else np.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else np.maximum(self.hi, hi)

    def subset_range(self, channels: np.ndarray) -> tuple[float, float]:
        # (after the first update)
        return float(cast(np.ndarray, self.lo)[channels].min()), float(cast(np.ndarray, self.hi)[channels].max())

    def state(self):
        return {"lo": self.lo, "hi": self.hi}

    @classmethod
    def from_state(cls, state):
        obs = cls()
        obs.lo, obs.hi = np.asarray(state["lo"], np.float64), np.asarray(state["hi"], np.float64)
        return obs

    def range(self):
        return float(self.lo.min()), float(self.hi.max())


class HistogramObserver(Observer):
    """Histogram of |x| over [0, R] with R doubled (bins merged in pairs) when data exceed it.

    Also tracks the exact min and max. ``range()`` clips by the chosen ``method``: 'minmax' (no
    clipping), 'percentile' (of |x|), or 'mse' (the clip minimizing expected quantization error
    for ``bits``: rounding noise step^2/12 inside the clip, squared distance outside).
    The clip is symmetric in |x|; an asymmetric range keeps the min/max ratio of the data.
    """

    kind = "histogram"

    def __init__(self, bins: int = 2048, method: str = "mse", percentile: float = 99.99, bits: int = 8):
        if bins & (bins - 1):
            raise ValueError("bins must be a power of two")
        if method not in ("minmax", "percentile", "mse"):
            raise UserInputError(f"unknown calibration method '{method}' (minmax, percentile, mse)")
        self.bins, self.method, self.percentile, self.bits = bins, method, percentile, bits
        self.hist = np.zeros(bins, np.float64)
        self.top = 0.0  # R: upper edge of the last bin
        self.lo, self.hi = np.inf, -np.inf

    def update(self, x):
        if not x.size:
            return
        self.lo = min(self.lo, float(np.min(x)))
        self.hi = max(self.hi, float(np.max(x)))
        a = np.abs(x).ravel()
        amax = float(a.max())
        if self.top == 0.0:
            self.top = amax if amax > 0 else 1.0
        while amax > self.top:  # grow by merging adjacent bins: R doubles each time
            self.hist = np.concatenate([self.hist.reshape(-1, 2).sum(1), np.zeros(self.bins // 2)])
            self.top *= 2.0
        counts, _ = np.histogram(a, bins=self.bins, range=(0.0, self.top))
        self.hist += counts

    def state(self):
        return {
            "hist": self.hist, "top": np.array(self.top), "lo": np.array(self.lo), "hi": np.array(self.hi),
            "cfg": np.array([self.bins, self.percentile, self.bits], np.float64), "method": np.array(self.method),
        }

    @classmethod
    def from_state(cls, state):
        bins, pct, bits = state["cfg"]
        obs = cls(int(bins), str(state["method"]), float(pct), int(bits))
        obs.hist = np.asarray(state["hist"], np.float64)
        obs.top, obs.lo, obs.hi = float(state["top"]), float(state["lo"]), float(state["hi"])
        return obs

    def clip(self) -> float:
        absmax = max(-self.lo, self.hi, 0.0)
        total = self.hist.sum()
        if self.method == "minmax" or total == 0 or absmax == 0:
            return absmax
        edges = np.linspace(0.0, self.top, self.bins + 1)
        centers = 0.5 * (edges[:-1] + edges[1:])
        if self.method == "percentile":
            cdf = np.cumsum(self.hist) / total
            idx = int(np.searchsorted(cdf, self.percentile / 100.0))
            return float(min(edges[min(idx + 1, self.bins)], absmax))
        levels = 2 ** (self.bits - 1) - 1
        candidates = absmax * np.linspace(0.05, 1.0, 96)
        errors = []
        for c in candidates:
            step = c / levels
            inside = centers <= c
            err = np.where(inside, step * step / 12.0, (centers - c) ** 2 + step * step / 12.0)
            errors.append(float((self.hist * err).sum()))
        return float(candidates[int(np.argmin(errors))])

    def range(self):
        c = self.clip()
        absmax = max(-self.lo, self.hi, 0.0)
        ratio = c / absmax if absmax > 0 else 1.0
        return self.lo * ratio, self.hi * ratio


class ChannelStatsObserver(Observer):
    """Per-channel |x| max, mean and standard deviation over every token (last axis = channels),
    in float64 sums: what outlier-channel rules (|x| threshold, std z-score) need."""

    kind = "channel_stats"

    def __init__(self):
        self.absmax = self.total = self.total_sq = None
        self.count = 0

    def update(self, x):
        flat = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        m, s, sq = np.abs(flat).max(0), flat.sum(0), (flat * flat).sum(0)
        if self.absmax is None:
            self.absmax, self.total, self.total_sq = m, s, sq
        else:
            self.absmax = np.maximum(self.absmax, m)
            self.total += s
            self.total_sq += sq
        self.count += flat.shape[0]

    @property
    def mean(self) -> np.ndarray:
        return self.total / max(self.count, 1)

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(np.maximum(self.total_sq / max(self.count, 1) - self.mean ** 2, 0.0))

    def state(self):
        return {"absmax": self.absmax, "total": self.total, "total_sq": self.total_sq, "count": np.array(self.count)}

    @classmethod
    def from_state(cls, state):
        obs = cls()
        obs.absmax, obs.total, obs.total_sq = (np.asarray(state[k]) for k in ("absmax", "total", "total_sq"))
        obs.count = int(state["count"])
        return obs

    def range(self):
        m = float(self.absmax.max())
        return -m, m


class HessianObserver(Observer):
    """``X^T X`` of a linear input over every token (last axis = K), in float64, and the token
    count: GPTQ's Hessian is ``2 X^T X / n``. Memory is K^2, whatever the number of tokens.

    It also keeps ``X_0^T X_0`` of the first token of every sequence (inputs [batch, seq, K]):
    that token is the attention sink, one token in hundreds of the calibration set, so plain GPTQ
    treats its direction as unimportant and pushes rounding error into it, and every later
    query attends to the damaged key and value (measured on SmolLM2: attention projections
    alone go from 32.8 (RTN) to 35.8 perplexity with plain GPTQ, 30.0 with the sink weighted).
    ``hessian_with_sink(weight)`` counts each first token ``weight`` times."""

    kind = "hessian"
    track_first = True

    def __init__(self):
        self.xtx: np.ndarray | None = None
        self.first_xtx: np.ndarray | None = None
        self.count = 0
        self.first_count = 0

    def update(self, x):
        x = np.asarray(x)
        flat = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
        xtx = flat.T @ flat
        if self.xtx is None:
            self.xtx = xtx
        else:  # (in place: at K = 8960 a sum would hold a third K x K for the moment)
            self.xtx += xtx
        del xtx
        self.count += flat.shape[0]
        if self.track_first and x.ndim >= 3:
            first = np.asarray(x[:, 0], np.float64).reshape(-1, x.shape[-1])
            ftx = first.T @ first
            if self.first_xtx is None:
                self.first_xtx = ftx
            else:
                self.first_xtx += ftx
            self.first_count += first.shape[0]

    @property
    def hessian(self) -> np.ndarray:
        return 2.0 * cast(np.ndarray, self.xtx) / max(self.count, 1)  # (after the first update)

    def hessian_with_sink(self, weight: float, consume: bool = False) -> np.ndarray:
        """The Hessian with each sequence's first token counted ``weight`` times (1: plain).
        ``consume``: the observer's last use; the Hessian is made in its own accumulator, which it
        then gives up (no K x K copy)."""
        sink = weight != 1.0 and self.first_xtx is not None
        if not consume:
            return (2.0 * (cast(np.ndarray, self.xtx) + (weight - 1.0) * cast(np.ndarray, self.first_xtx))
                    / max(self.count, 1) if sink else self.hessian)
        h, self.xtx = cast(np.ndarray, self.xtx), None
        if sink:  # (sink: first_xtx is set)
            h += (weight - 1.0) * cast(np.ndarray, self.first_xtx)
        self.first_xtx = None
        h *= 2.0 / max(self.count, 1)
        return h

    def state(self):
        first = self.first_xtx if self.first_xtx is not None else np.zeros((0, 0))
        return {"xtx": self.xtx, "count": np.array(self.count), "first_xtx": first,
                "first_count": np.array(self.first_count)}

    @classmethod
    def from_state(cls, state):
        obs = cls()
        obs.xtx, obs.count = np.asarray(state["xtx"], np.float64), int(state["count"])
        first = np.asarray(state["first_xtx"], np.float64)
        obs.first_xtx = first if first.size else None
        obs.first_count = int(state["first_count"])
        return obs

    def range(self):
        m = float(np.sqrt(np.max(np.diag(self.xtx)))) if self.xtx is not None else 0.0
        return -m, m


class PlainHessianObserver(HessianObserver):
    """``HessianObserver`` without the first-token term, for inputs of linears whose Hessian does
    not weight the attention sink: half the memory (a down_proj input's K^2 float64 is 0.5 GB at
    K = 8192), the same ``hessian``."""

    kind = "hessian_plain"
    track_first = False


class ModalitySplitObserver(Observer):
    """Two observers of one tensor: one fed the visual tokens, one the text tokens (MQuant's MSQ
    calibrates a static scale per modality). ``update_split(x, is_visual)`` takes the tensor
    [B, S, ...] and a [B, S] mask; ``range()`` is the union, for callers that want one scale."""

    kind = "modality_split"

    def __init__(self, visual: Observer, text: Observer):
        self.visual, self.text = visual, text
        self.tokens = np.zeros(2, np.int64)  # visual, text tokens seen

    def update(self, x):
        raise TypeError("ModalitySplitObserver needs the token mask: call update_split(x, is_visual)")

    def update_split(self, x: np.ndarray, is_visual: np.ndarray) -> None:
        is_visual = np.asarray(is_visual, bool)
        if x.shape[:2] != is_visual.shape:
            raise ValueError(f"token mask {is_visual.shape} does not match tensor {x.shape}")
        for obs, rows, slot in ((self.visual, x[is_visual], 0), (self.text, x[~is_visual], 1)):
            if rows.size:
                obs.update(rows)
                self.tokens[slot] += rows.shape[0]

    def state(self):
        out = {"tokens": self.tokens}
        for part, obs in (("visual", self.visual), ("text", self.text)):
            out.update({f"{part}.{k}": v for k, v in observer_state(obs).items()})
        return out

    @classmethod
    def from_state(cls, state):
        parts = [observer_from_state({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(f"{p}.")})
                 for p in ("visual", "text")]
        obs = cls(*parts)
        obs.tokens = np.asarray(state["tokens"], np.int64)
        return obs

    def range(self):
        ranges = [o.range() for o, n in zip((self.visual, self.text), self.tokens) if n]
        if not ranges:
            return np.inf, -np.inf
        return min(r[0] for r in ranges), max(r[1] for r in ranges)


OBSERVERS = {cls.kind: cls for cls in (MinMaxObserver, PerChannelAbsMaxObserver, HistogramObserver, ChannelStatsObserver,
                                       HessianObserver, PlainHessianObserver, ModalitySplitObserver, ChannelMinMaxObserver)}


def observer_from_state(state: dict[str, np.ndarray]) -> Observer:
    return OBSERVERS[str(state["kind"])].from_state(state)


def observer_state(obs: Observer) -> dict[str, np.ndarray]:
    return {"kind": np.array(obs.kind), **obs.state()}
