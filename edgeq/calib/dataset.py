"""Build a ``CalibrationSet`` from what the user passes to ``--calib``.

A text file is cut into token windows with the model's tokenizer (the evaluation protocol's
windowing, on the validation split); an ``.npz`` holds input dicts validated against the model's
inputs. Either way the result is a list of batched feed dicts and a fingerprint for the cache.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from edgeq.calib.session import CalibrationSet
from edgeq.errors import UserInputError


def build_calibration_set(
    calib_path: str | Path,
    input_specs,
    tokenizer_dir: str | Path | None,
    windows: int,
    seq_len: int,
    batch_size: int = 1,
) -> CalibrationSet:
    """``input_specs``: the model's onnxruntime ``get_inputs()``."""
    from edgeq import textdata

    path = Path(calib_path)
    if not path.is_file():
        raise UserInputError(f"calibration file not found: {path}")
    if batch_size < 1:
        raise UserInputError("calibration batch size must be at least 1")
    if path.suffix == ".npz":
        samples = textdata.load_npz_samples(path, input_specs)
        if windows:
            samples = samples[:windows]
        batches = samples  # npz samples are already feed dicts with their own batch axis
        return CalibrationSet(batches, _fingerprint(path, "npz", len(samples)), f"{path.name}: {len(samples)} samples", len(samples))
    if tokenizer_dir is None:
        raise UserInputError("calibration text needs a tokenizer: pass --tokenizer DIR (a folder with tokenizer.json)")
    ids = textdata.token_windows(path, tokenizer_dir, seq_len=seq_len, windows=windows)
    batches = [textdata.feeds_for_windows(input_specs, ids[i:i + batch_size]) for i in range(0, len(ids), batch_size)]
    digest = hashlib.sha256(np.ascontiguousarray(ids).tobytes()).hexdigest()[:16]
    return CalibrationSet(
        batches,
        f"text:{digest}:{batch_size}",
        f"{path.name}: {len(ids)} windows of {seq_len} tokens",
        samples=len(ids),
        tokens=int(ids.size),
    )


def _fingerprint(path: Path, kind: str, count: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"{kind}:{h.hexdigest()[:16]}:{count}"
