"""Calibration: run onnxruntime with intermediate tensors as extra outputs, feed observers.

One batch at a time: the outputs of a batch update the observers and are dropped before the next
batch runs, so memory is bounded by one batch's activations whatever the number of samples.
Results are cached on disk, keyed by the model's content hash, the data's fingerprint, the tensors
and the observer settings: compiling again with the same inputs skips the onnxruntime runs.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from edgeq import ir
from edgeq.calib.observers import ModalitySplitObserver, Observer, observer_from_state, observer_state
from edgeq.progress import progress


@dataclass
class CalibrationSet:
    """Model feeds, already batched; small (token ids), so they are held in memory."""

    batches: list[dict[str, np.ndarray]]
    fingerprint: str
    description: str
    samples: int
    tokens: int = 0


@dataclass
class CalibrationLog:
    runs: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    tensors_observed: int = 0
    fingerprint_seconds: float = 0.0  # spent keying the cache (graph fingerprints)
    ranges: dict[str, list[float]] = field(default_factory=dict)


def default_cache_dir() -> Path:
    return Path(os.environ.get("EDGEQ_CACHE_DIR", Path.home() / ".cache" / "edgeq")) / "calib"


class Calibrator:
    def __init__(self, data: CalibrationSet, cache_dir: Path | None = None, use_cache: bool = True):
        self.data = data
        self.cache_dir = cache_dir or default_cache_dir()
        self.use_cache = use_cache
        self.log = CalibrationLog()
        self._fingerprint_memo: dict = {}

    def observe(
        self,
        graph: gs.Graph,
        factories: dict[str, Callable[[], Observer]],
        settings_key: str,
        split_by: str | None = None,
    ) -> dict[str, Observer]:
        """Observers for each named tensor of ``graph``, after one pass over the data.

        ``split_by``: a [batch, seq] bool tensor of the graph marking visual tokens; each tensor
        then gets a ``ModalitySplitObserver`` (two observers built by its factory).
        """
        if not factories:
            return {}
        names = sorted(factories)
        start = time.perf_counter()
        key = self._cache_key(graph, names, settings_key + (f":split={split_by}" if split_by else ""))
        self.log.fingerprint_seconds += time.perf_counter() - start
        cached = self._load(key, names)
        if cached is not None:
            self.log.cache_hits += 1
            self._record(cached)
            return cached
        start = time.perf_counter()
        model = ir.to_model(graph)  # only when onnxruntime has to run
        if split_by:
            observers = {name: ModalitySplitObserver(factories[name](), factories[name]()) for name in names}
        else:
            observers = {name: factories[name]() for name in names}
        fetch = names + ([split_by] if split_by else [])
        add_outputs(model, graph, fetch)
        session = ir.make_session(model, optimize=True)
        del model  # onnxruntime holds its own copy of the weights; free ours before running
        for feeds in progress(self.data.batches, desc=f"calibrating {len(names)} tensors"):
            values = session.run(fetch, feeds)
            for name, value in zip(names, values):
                if split_by:
                    observers[name].update_split(value, values[-1])
                else:
                    observers[name].update(value)
            del values
        self.log.runs += 1
        self.log.seconds += time.perf_counter() - start
        self._save(key, observers)
        self._record(observers)
        return observers

    def fetch(self, graph: gs.Graph, names: list[str], max_batches: int | None = None):
        """Yield ``(feeds, {name: value})`` for the calibration batches (at most ``max_batches``),
        for methods whose statistics are not per-tensor observers (kvquant's attention samples).
        One onnxruntime session, counted in the log like ``observe``'s; nothing is cached."""
        model = ir.to_model(graph)
        add_outputs(model, graph, names)
        start = time.perf_counter()
        session = ir.make_session(model, optimize=True)
        del model
        for feeds in self.data.batches[:max_batches]:
            values = dict(zip(names, session.run(names, feeds)))
            yield feeds, values
        self.log.runs += 1
        self.log.tensors_observed += len(names)
        self.log.seconds += time.perf_counter() - start

    def _record(self, observers: dict[str, Observer]) -> None:
        self.log.tensors_observed += len(observers)
        for name, obs in observers.items():
            lo, hi = obs.range()
            self.log.ranges[name] = [float(lo), float(hi)]

    def _cache_key(self, graph: gs.Graph, names: list[str], settings_key: str) -> str:
        """The graph's fingerprint (taken on the graphsurgeon graph: no export, untouched weights
        hashed once per compile), the data's, the settings and the tensors."""
        h = hashlib.sha256()
        for part in (ir.graph_fingerprint(graph, self._fingerprint_memo), self.data.fingerprint, settings_key, *names):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:32]

    def _load(self, key: str, names: list[str]) -> dict[str, Observer] | None:
        path = self.cache_dir / f"{key}.npz"
        if not self.use_cache or not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                flat = {k: z[k] for k in z.files}
        except (OSError, ValueError):
            return None  # a damaged cache entry is recomputed, never trusted
        out = {}
        for i, name in enumerate(names):
            prefix = f"{i}/"
            state = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
            if not state:
                return None
            out[name] = observer_from_state(state)
        return out

    def _save(self, key: str, observers: dict[str, Observer]) -> None:
        if not self.use_cache:
            return
        flat = {}
        for i, name in enumerate(sorted(observers)):
            for k, v in observer_state(observers[name]).items():
                flat[f"{i}/{k}"] = v
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_dir / f".{key}.{os.getpid()}.npz"
            np.savez(tmp, **flat)
            tmp.replace(self.cache_dir / f"{key}.npz")
        except OSError:
            pass  # the cache is an optimization; an unwritable cache dir must not fail a compile


def add_outputs(model: onnx.ModelProto, graph: gs.Graph, names: list[str]) -> None:
    """Expose intermediate tensors as graph outputs (element type from graphsurgeon or float)."""
    existing = {o.name for o in model.graph.output}
    tensors = graph.tensors()
    for name in names:
        if name in existing:
            continue
        elem = _elem_type(getattr(tensors.get(name), "dtype", None))
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))


def _elem_type(dtype) -> int:
    if dtype is None:
        return onnx.TensorProto.FLOAT
    if isinstance(dtype, int):
        return dtype
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except TypeError:
        return onnx.TensorProto.FLOAT
