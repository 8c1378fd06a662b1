"""What every peer adapter shares: the contract of benchmarks/peers.py.

An adapter runs in its peer's own venv (``.venvs/<peer>/bin/python adapters/<peer>.py``), so this
module imports only the standard library and numpy. Subcommands: ``settings`` (a JSON list),
``quantize --setting S --model FP32_ONNX --calib-ids CALIB.npy --out DIR`` (the last stdout line a
JSON object ``{"version", "notes"}``) and, for runtimes that are not onnxruntime, ``evaluate``. On
failure: one line on stderr, exit 1 (``PEERS_DEBUG=1`` prints the traceback too). Imported before an
adapter drops its own folder from ``sys.path`` (adapters named after their package do).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

import numpy as np


def fail(msg: str) -> NoReturn:
    """One line on stderr, exit 1 (``PEERS_DEBUG=1``: the traceback first)."""
    if os.environ.get("PEERS_DEBUG"):
        import traceback
        traceback.print_exc()
    print(" ".join(str(msg).split()), file=sys.stderr)
    sys.exit(1)


def model_inputs(ids: np.ndarray) -> dict[str, np.ndarray]:
    """One window -> the model's three int64 inputs, batch 1 (mask all ones, positions arange)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
    n = ids.shape[1]
    return {"input_ids": ids, "attention_mask": np.ones((1, n), dtype=np.int64),
            "position_ids": np.arange(n, dtype=np.int64).reshape(1, n)}


def subcommands(doc: str | None, calib_ids_required: bool = True
                ) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction, argparse.ArgumentParser]:
    """(parser, its subparsers, the ``quantize`` subparser) with ``settings`` and ``quantize``'s
    four arguments; an adapter adds its own options or subcommands before parsing.
    ``calib_ids_required=False``: for an adapter that also takes recorded feeds (``--calib-feeds``,
    ``load_feeds``) instead of token ids; it then checks that one of the two was given."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("settings")
    quantize = sub.add_parser("quantize")
    for flag in ("--setting", "--model", "--calib-ids", "--out"):
        quantize.add_argument(flag, required=calib_ids_required or flag != "--calib-ids")
    return parser, sub, quantize


def quantize_inputs(args: argparse.Namespace, by_name: dict) -> tuple[dict, np.ndarray, Path]:
    """``quantize``'s checked inputs: (the setting's spec, calibration ids [windows, tokens], the
    output folder, created)."""
    if args.setting not in by_name:
        fail(f"unknown setting {args.setting!r}; known: {', '.join(by_name)}")
    calib = np.load(args.calib_ids)
    if calib.ndim != 2:
        fail(f"calibration ids must be [windows, tokens], got shape {calib.shape}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return by_name[args.setting], calib, out


class RecordedFeeds:
    """Calibration feeds recorded from a graph's own runs (an ``.npz`` whose arrays are named
    ``<feed>/<input name>``, e.g. ``000/input_ids``, one feed per run), read one feed at a time.

    An array smaller than its input's static shape is zero-padded at the end of each axis to that
    shape: a static graph's KV-cache inputs are stored only up to their filled slots (the rest of
    the cache is zeros when the host runs the graph), which keeps the file to a fraction of the
    cache's size. ``input_shapes``: input name -> static shape (inputs not named are fed as stored).
    Iterable any number of times (``len`` is the number of feeds)."""

    def __init__(self, path, input_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        self.path = str(path)
        self.input_shapes = dict(input_shapes or {})
        with np.load(self.path) as npz:
            names = list(npz.files)
        feeds: dict[str, list[str]] = {}
        for name in names:
            feed, sep, _ = name.partition("/")
            if not sep:
                raise ValueError(f"{self.path}: array {name!r} is not named <feed>/<input>")
            feeds.setdefault(feed, []).append(name)
        self.keys = [feeds[k] for k in sorted(feeds)]

    def __len__(self) -> int:
        return len(self.keys)

    def _pad(self, name: str, arr: np.ndarray) -> np.ndarray:
        shape = self.input_shapes.get(name)
        if shape is None or tuple(arr.shape) == tuple(shape):
            return arr
        if len(shape) != arr.ndim or any(a > s for a, s in zip(arr.shape, shape)):
            raise ValueError(f"{self.path}: {name} has shape {arr.shape}, the graph's input is {tuple(shape)}")
        return np.pad(arr, [(0, s - a) for a, s in zip(arr.shape, shape)])

    def __iter__(self):
        with np.load(self.path) as npz:
            for names in self.keys:
                yield {n.partition("/")[2]: self._pad(n.partition("/")[2], npz[n]) for n in names}
