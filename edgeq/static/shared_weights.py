"""Several graphs saved over one external weights file, each weight written once.

The prefill and decode graphs of a static pair hold the same weights (same names, same bytes: the
specialization never folds a weight). NPU SDKs share one copy between the two (QNN "weight
sharing" context binaries); on disk we do the same: every initializer of ``size_threshold`` bytes
or more goes into ``weights.data`` once, and each graph's initializer points at its (offset,
length) there. Tensors are keyed by their bytes (sha256), so a weight both graphs hold is written
once, and a constant the specialization folded differently per graph (a mask or position table
of the graph's own width) is written once per distinct content.

Offsets are aligned to 4096 bytes so onnxruntime can memory-map the file (two sessions in one
process then read the same pages).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import onnx
from onnx import numpy_helper

from edgeq.graph.ir import external_bytes

WEIGHTS_FILE = "weights.data"
_ALIGN = 4096


def _payload(tensor: onnx.TensorProto, source_dir: Path | None = None) -> bytes:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        if source_dir is None:
            raise ValueError(f"initializer {tensor.name} is external already: load the weights first")
        return external_bytes(tensor, source_dir)
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.to_array(tensor).tobytes()


def _point_at(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    tensor.ClearField("raw_data")
    for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def save_sharing_weights(models: dict[str, onnx.ModelProto], folder: Path, size_threshold: int = 1024,
                         source_dir: Path | None = None) -> dict:
    """Save ``models`` (file name -> model) into ``folder`` with their large initializers in one
    ``weights.data``; the protos are changed in place (their weights now point at the file).
    ``source_dir``: where initializers still stored as external data are read from, one tensor
    at a time (a block-wise compile's weights file), else every initializer must be in memory.
    Returns {"file", "bytes", "tensors", "shared", "shared_bytes"}: what the file holds, how many of
    its tensors more than one graph references and their bytes."""
    folder = Path(folder)
    written: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length)
    users: dict[str, int] = {}
    with open(folder / WEIGHTS_FILE, "wb") as data:
        for model in models.values():
            for tensor in model.graph.initializer:
                payload = _payload(tensor, source_dir)
                if len(payload) < size_threshold:
                    if tensor.data_location == onnx.TensorProto.EXTERNAL:  # (small: kept in the graph)
                        del tensor.external_data[:]
                        tensor.data_location = onnx.TensorProto.DEFAULT
                        tensor.raw_data = payload
                    continue
                digest = hashlib.sha256(payload).hexdigest()
                if digest in written:
                    offset, length = written[digest]
                else:
                    offset = -data.tell() % _ALIGN + data.tell()
                    data.seek(offset)
                    data.write(payload)
                    length = len(payload)
                    written[digest] = (offset, length)
                users[digest] = users.get(digest, 0) + 1
                _point_at(tensor, WEIGHTS_FILE, offset, length)
                del payload
        data.flush()
        os.fsync(data.fileno())
    for name, model in models.items():
        onnx.save_model(model, str(folder / name))
    shared = [d for d, n in users.items() if n > 1]
    return {"file": WEIGHTS_FILE, "bytes": (folder / WEIGHTS_FILE).stat().st_size, "tensors": len(written),
            "shared": len(shared), "shared_bytes": sum(written[d][1] for d in shared)}
