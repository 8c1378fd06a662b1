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


def subcommands(doc: str | None) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction, argparse.ArgumentParser]:
    """(parser, its subparsers, the ``quantize`` subparser) with ``settings`` and ``quantize``'s
    four arguments; an adapter adds its own options or subcommands before parsing."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("settings")
    quantize = sub.add_parser("quantize")
    for flag in ("--setting", "--model", "--calib-ids", "--out"):
        quantize.add_argument(flag, required=True)
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
