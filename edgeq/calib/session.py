"""Calibration: run onnxruntime with intermediate tensors as extra outputs, feed observers.

One batch at a time: the outputs of a batch update the observers and are dropped before the next
batch runs, so memory is bounded by one batch's activations whatever the number of samples.
Results are cached on disk, keyed by the model's content hash, the data's fingerprint, the tensors
and the observer settings: compiling again with the same inputs skips the onnxruntime runs.

Block-wise compiles (``edgeq.blockwise``) give the calibrator a ``StreamCarry``: the graph is then
one decoder block between the model's prologue and epilogue, the block's stream input is fed with
the hidden states the previous block produced (instead of the embedding), and the block's output is
kept for the next block. Each calibration request of a compile (pass, then call within the pass)
has its own carried states, so every block sees what the in-memory path's whole-model run shows it:
the upstream blocks as they were before that pass.
"""

from __future__ import annotations

import copy

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast
from collections.abc import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.calib.observers import ModalitySplitObserver, Observer, observer_from_state, observer_state
from edgeq.graph.fingerprint import graph_fingerprint
from edgeq.files.npzfile import NumpyFileError, read_npz
from edgeq.runtime.progress import progress
from edgeq.graph.protowalk import prune_to_outputs


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


def default_cache_dir() -> Path | None:
    """``$EDGEQ_CACHE_DIR/calib`` (``edgeq.textdata.cache_root``, the one reading of the variable);
    None when the variable is set empty: caching off (not a ``calib`` folder in the current one)."""
    from edgeq.textdata import cache_root

    root = cache_root()
    return None if root is None else root / "calib"


@dataclass
class StreamCarry:
    """Hidden states carried from one block to the next through a block-wise compile.

    ``cut``: the block graph's stream input, fed with the carried states (None for the first
    block, whose input is the real embedding); ``capture``: the block's output. Per calibration
    request ``(pass position, call within the pass)`` there is one array per calibration batch,
    kept on disk under ``spill_dir`` (one batch in memory at a time: 64 windows of a 3B model's
    hidden states are 400 MB per request): ``states`` are this block's inputs, ``captured`` its
    outputs, which ``advance`` makes the next block's inputs.
    """

    cut: str | None
    capture: str
    spill_dir: Path
    states: dict[tuple[int, int], int] = field(default_factory=dict)  # request -> batches on disk
    captured: dict[tuple[int, int], int] = field(default_factory=dict)
    stage: int = 0
    calls: int = 0
    generation: int = 0

    def next_request(self) -> tuple[int, int]:
        key = (self.stage, self.calls)
        self.calls += 1
        if self.cut is not None and key not in self.states:
            raise RuntimeError(f"block-wise calibration: request {key} has no carried states (a pass calibrates "
                               "a different number of times per block)")
        self.captured[key] = 0
        return key

    def _path(self, generation: int, key: tuple[int, int], batch: int) -> Path:
        return self.spill_dir / f"g{generation}" / f"{key[0]}-{key[1]}-{batch}.npy"

    def state(self, key: tuple[int, int], batch: int) -> np.ndarray:
        return np.load(self._path(self.generation, key, batch))

    def keep(self, key: tuple[int, int], value: np.ndarray) -> None:
        path = self._path(self.generation + 1, key, self.captured[key])
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, value)
        self.captured[key] += 1

    def advance(self, cut: str, capture: str) -> None:
        """Start the next block: its input is what this block produced."""
        import shutil

        shutil.rmtree(self.spill_dir / f"g{self.generation}", ignore_errors=True)
        self.generation += 1
        self.states, self.captured = self.captured, {}
        self.cut, self.capture, self.stage, self.calls = cut, capture, 0, 0


class Calibrator:
    def __init__(self, data: CalibrationSet, cache_dir: Path | None = None, use_cache: bool = True):
        self.data = data
        self.cache_dir = cache_dir or default_cache_dir()
        self.use_cache = use_cache and self.cache_dir is not None
        self.log = CalibrationLog()
        self._fingerprint_memo: dict = {}
        # block-wise calibration's hidden-state carry; only set on a view made by ``streaming``
        self.carry: StreamCarry | None = None

    def streaming(self, carry: StreamCarry) -> Calibrator:
        """A view of this calibrator for a block-wise compile: the same data, cache, log and
        fingerprints, observing one block at a time through ``carry``. Why a view, not a switch:
        the compile plan holds this calibrator frozen, and a mode set on it from outside would
        change what every later user of the plan observes."""
        view = copy.copy(self)
        view.carry = carry
        return view

    def begin_pass(self, position: int) -> None:
        """The pipeline names the pass about to run (block-wise calibration keys its states by it)."""
        if self.carry is not None:
            self.carry.stage, self.carry.calls = position, 0

    def end_pass(self, position: int, graph: gs.Graph, calibrates: bool, modified: bool) -> None:
        """Block-wise: a calibrating pass that did not calibrate in this block (nothing to do here,
        e.g. no Eq. 9 layer) still owes the next block its input; the graph is unchanged, so the
        block's output is computed from it now."""
        carry = self.carry
        if carry is None or not calibrates or (position, 0) in carry.captured:
            return
        if modified:
            raise RuntimeError(f"block-wise calibration: pass #{position} changed a block without calibrating on it")
        carry.stage, carry.calls = position, 0
        for _ in self._runs(graph, []):
            pass

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
        carry = self.carry
        if carry is not None and split_by:
            # passes that split by modality (msq, aifs) do not declare per_block, so never run block-wise
            raise RuntimeError("block-wise calibration cannot split by modality (a pass without per_block ran block-wise)")
        # a block-wise compile needs every run (its output feeds the next block): no cache
        key = cached = None
        if carry is None:
            start = time.perf_counter()
            # (the observer kind per tensor: a site observed with less state must not answer for more)
            kinds = ",".join(str(getattr(factories[name], "kind", "")) for name in names)
            key = self._cache_key(graph, names, settings_key + (f":split={split_by}" if split_by else "") + f":{kinds}")
            self.log.fingerprint_seconds += time.perf_counter() - start
            cached = self._load(key, names)
        if cached is not None:
            self.log.cache_hits += 1
            self._record(cached)
            return cached
        start = time.perf_counter()
        observers: dict[str, Observer]
        if split_by:
            observers = {name: ModalitySplitObserver(factories[name](), factories[name]()) for name in names}
        else:
            observers = {name: factories[name]() for name in names}
        fetch = names + ([split_by] if split_by else [])
        for _, values in self._runs(graph, fetch, f"calibrating {len(names)} tensors"):
            for name, value in zip(names, values):
                if split_by:
                    cast(ModalitySplitObserver, observers[name]).update_split(value, values[-1])
                else:
                    observers[name].update(value)
            del values
        self.log.runs += 1
        self.log.seconds += time.perf_counter() - start
        if key is not None:
            self._save(key, observers)
        self._record(observers)
        return observers

    def _runs(self, graph: gs.Graph, fetch: list[str], desc: str | None = None):
        """One onnxruntime session over ``graph`` fetching ``fetch``: yields (feeds, values) per
        calibration batch. Block-wise, the block's stream input is fed the carried states and its
        output is kept for the next block (``StreamCarry``)."""
        carry = self.carry
        request: tuple[int, int] | None = None  # (set whenever carry is)
        if carry is not None:
            request = carry.next_request()
            fetch = fetch + [carry.capture]
        cut = carry.cut if carry is not None else None

        def prepare(model: onnx.ModelProto) -> None:
            if cut is not None:
                feed_from_input(model, cut)
            add_outputs(model, graph, fetch)

        # only what the fetches need, the weights handed to onnxruntime through a file (its copy is the only one)
        session = ir.graph_session(ir.pruned_copy(graph, fetch), prepare, optimize=True)
        accepted = {i.name for i in session.get_inputs()}
        # (block-wise: one progress line per block instead of a bar per calibration)
        batches = self.data.batches if carry is not None or desc is None else progress(self.data.batches, desc=desc)
        for b, feeds in enumerate(batches):
            if carry is not None:
                feeds = {k: v for k, v in feeds.items() if k in accepted}
                if carry.cut is not None:
                    feeds[carry.cut] = carry.state(cast("tuple[int, int]", request), b)
            values = session.run(fetch, feeds)
            if carry is not None:
                carry.keep(cast("tuple[int, int]", request), values.pop())
            yield feeds, values

    def fetch(self, graph: gs.Graph, names: list[str], max_batches: int | None = None):
        """Yield ``(feeds, {name: value})`` for the calibration batches (at most ``max_batches``),
        for methods whose statistics are not per-tensor observers (kvquant's attention samples).
        One onnxruntime session, counted in the log like ``observe``'s; nothing is cached."""
        if self.carry is not None:
            # fetch() serves kvquant, which does not declare per_block, so never runs block-wise
            raise RuntimeError("block-wise calibration carries states through observe() only (a pass without per_block "
                               "ran block-wise)")
        model = ir.to_model(graph)
        add_outputs(model, graph, names)
        start = time.perf_counter()
        session = ir.make_session(model, optimize=True, consume=True)
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
        for part in (graph_fingerprint(graph, self._fingerprint_memo), self.data.fingerprint, settings_key, *names):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:32]

    def _load(self, key: str, names: list[str]) -> dict[str, Observer] | None:
        if not self.use_cache:
            return None
        assert self.cache_dir is not None  # (use_cache is only set with a cache dir)
        path = self.cache_dir / f"{key}.npz"
        if not path.is_file():
            return None
        # a damaged entry (truncated, not a zip, a member or key missing) is a miss: recomputed
        # and overwritten by ``_save``, never trusted and never an error
        try:
            flat = read_npz(path)
            out = {}
            for i, name in enumerate(names):
                prefix = f"{i}/"
                state = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
                if not state:
                    return None
                out[name] = observer_from_state(state)
        except (NumpyFileError, KeyError, TypeError, ValueError):
            return None
        return out

    def _save(self, key: str, observers: dict[str, Observer]) -> None:
        if not self.use_cache:
            return
        assert self.cache_dir is not None  # (use_cache is only set with a cache dir)
        flat = {}
        for i, name in enumerate(sorted(observers)):
            for k, v in observer_state(observers[name]).items():
                flat[f"{i}/{k}"] = v
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_dir / f".{key}.{os.getpid()}.npz"
            np.savez(tmp, **flat)  # type: ignore[arg-type]  # (numpy stub: **kwds could bind allow_pickle: bool)
            tmp.replace(self.cache_dir / f"{key}.npz")
        except OSError:
            pass  # the cache is an optimization; an unwritable cache dir must not fail a compile


def add_outputs(model: onnx.ModelProto, graph: gs.Graph, names: list[str]) -> None:
    """Make ``names`` the graph's outputs (element type from graphsurgeon or float). The model's
    own outputs that are not among them (the logits) are dropped, so onnxruntime prunes what only
    they need: calibration never computes the vocabulary head unless it observes it."""
    wanted = set(names)
    kept = [o for o in model.graph.output if o.name in wanted]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    existing = {o.name for o in kept}
    tensors = graph.tensors()
    for name in names:
        if name in existing:
            continue
        elem = _elem_type(getattr(tensors.get(name), "dtype", None))
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
    prune_to_outputs(model)


def feed_from_input(model: onnx.ModelProto, name: str) -> None:
    """Make tensor ``name`` a graph input: its producer is removed, so onnxruntime takes it from the
    feeds (a block's stream input, fed with the previous block's output)."""
    graph = model.graph
    producers = [n for n in graph.node if name in n.output]
    for node in producers:
        graph.node.remove(node)
    graph.input.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))


def _elem_type(dtype) -> int:
    if dtype is None:
        return onnx.TensorProto.FLOAT
    if isinstance(dtype, int):
        return dtype
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except TypeError:
        return onnx.TensorProto.FLOAT
