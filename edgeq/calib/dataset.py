"""Build a ``CalibrationSet`` from what the user passes to ``--calib``.

A text file is cut into token windows with the model's tokenizer (the evaluation protocol's
windowing, on the validation split); an ``.npz`` holds input dicts validated against the model's
inputs. Either way the result is a list of batched feed dicts and a fingerprint for the cache.
Beyond the input specs, the data must fit what ``InputLimits`` reads from the model: token ids
below the rows of its embedding table (a tokenizer of another model, an id of 100000), images of
the size its ``config.json`` declares.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from edgeq.calib.session import CalibrationSet
from edgeq.errors import UserInputError


@dataclass(frozen=True)
class InputLimits:
    """What calibration inputs must fit besides the input specs: ``vocab``, the rows of the
    embedding table ``input_ids`` indexes (``embedding``); ``image``, the (channels, height, width)
    of ``pixel_values`` a vision model's ``config.json`` declares (its graph takes any size but
    computes with one). None: not known."""

    vocab: int | None = None
    embedding: str = ""
    image: tuple[int | None, int, int] | None = None

    @classmethod
    def of(cls, model: onnx.ModelProto, model_path: str | os.PathLike) -> InputLimits:
        from edgeq.textdata import image_dims

        tables = {t.name: t for t in model.graph.initializer}
        ids = {"input_ids"}
        vocab, embedding = None, ""
        for node in model.graph.node:  # (topological: a Cast of the ids comes before its Gather)
            if node.op_type == "Cast" and node.input[0] in ids:
                ids.add(node.output[0])
            elif node.op_type == "Gather" and len(node.input) == 2 and node.input[1] in ids and node.input[0] in tables:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                rows = list(tables[node.input[0]].dims)
                if axis == 0 and len(rows) == 2 and (vocab is None or rows[0] < vocab):
                    vocab, embedding = rows[0], node.input[0]
        return cls(vocab, embedding, image_dims(Path(model_path).parent))

    def check(self, feeds: dict[str, np.ndarray], source: str) -> None:
        """A one-line ``UserInputError`` when one calibration batch does not fit."""
        ids = feeds.get("input_ids")
        if self.vocab is not None and ids is not None and ids.size and int(ids.max()) >= self.vocab:
            raise UserInputError(f"{source} token id {int(ids.max())}, but the model's vocabulary has {self.vocab} "
                                 f"tokens (rows of its embedding '{self.embedding}'): ids must be below {self.vocab}")
        pixels = feeds.get("pixel_values")
        if self.image is not None and pixels is not None and pixels.ndim == 4:
            got = tuple(pixels.shape[1:])
            if any(want is not None and want != have for want, have in zip(self.image, got)):
                want = "x".join("?" if d is None else str(d) for d in self.image)
                raise UserInputError(f"{source} images of {'x'.join(map(str, got))} (channels x height x width) in "
                                     f"'pixel_values', but the model takes {want} (image_size/num_channels in its "
                                     "config.json)")


def build_calibration_set(
    calib_path: str | Path,
    input_specs,
    tokenizer_dir: str | Path | None,
    windows: int,
    seq_len: int,
    batch_size: int = 1,
    limits: InputLimits | None = None,
) -> CalibrationSet:
    """``input_specs``: the model's onnxruntime ``get_inputs()``; ``limits``: what else the data
    must fit (``InputLimits.of(model, model_path)``)."""
    from edgeq import textdata

    limits = limits or InputLimits()

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
        for feeds in batches:
            limits.check(feeds, f"{path} holds")
        return CalibrationSet(batches, _fingerprint(path, "npz", len(samples)), f"{path.name}: {len(samples)} samples", len(samples))
    if tokenizer_dir is None:
        raise UserInputError("calibration text needs a tokenizer: pass --tokenizer DIR (a folder with tokenizer.json)")
    ids = textdata.token_windows(path, tokenizer_dir, seq_len=seq_len, windows=windows)
    limits.check({"input_ids": ids}, f"the tokenizer in {tokenizer_dir} gives")
    batches = [textdata.feeds_for_windows(input_specs, ids[i:i + batch_size]) for i in range(0, len(ids), batch_size)]
    digest = hashlib.sha256(np.ascontiguousarray(ids).tobytes()).hexdigest()[:16]
    return CalibrationSet(
        batches,
        f"text:{digest}:{batch_size}",
        f"{path.name}: {len(ids)} windows of {seq_len} tokens ({textdata.window_convention(tokenizer_dir)})",
        samples=len(ids),
        tokens=int(ids.size),
    )


def _fingerprint(path: Path, kind: str, count: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"{kind}:{h.hexdigest()[:16]}:{count}"
