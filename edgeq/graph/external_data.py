"""External data of a model as edgeq's loader reads it (``edgeq.graph.ir.load_model``): every tensor's
location validated without reading it, optimum's external Constants turned into initializers, the
tensors every load needs read in, and a weight's bytes read from its file on demand."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx

from edgeq.errors import UserInputError
from edgeq.graph.loadcheck import FiniteScan
from edgeq.graph.modelcheck import tensor_bytes


def _check_external_data(model: onnx.ModelProto, base: Path) -> dict[str, list[tuple[onnx.TensorProto, int, int]]]:
    """Validate every tensor stored as external data without reading any of it: its location is
    named, a relative path without ``..`` (so a file inside ``base``; that file may be a symbolic
    link to a regular file elsewhere, as every file of a Hugging Face hub snapshot is one into
    ``../../blobs``) and a present regular file, and its bytes (``offset`` + ``length``, or the
    size its dims and data type need when ``length`` is absent) fit in that file. One ``stat`` per
    file, however many tensors share it. Returns location -> [(tensor, offset, length)], what
    ``_read_external_data`` reads."""
    import stat

    from onnx.external_data_helper import _get_all_tensors

    sizes: dict[str, int] = {}  # location -> file size in bytes
    extents: dict[str, list[tuple[onnx.TensorProto, int, int]]] = {}
    for tensor in _get_all_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        name = tensor.name
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if not location:
            raise UserInputError(f"initializer '{name}' is external but names no location")
        size = sizes.get(location)
        if size is None:
            if os.path.isabs(location) or ".." in Path(location.replace("\\", "/")).parts:
                raise UserInputError(f"external data of '{name}' points outside the model's folder: {location}")
            target = base / location
            try:
                st = target.stat()
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                raise UserInputError(f"missing external data file for '{name}': {target}")
            size = sizes[location] = st.st_size
        try:
            offset = int(info.get("offset") or 0)
            length = int(info["length"]) if info.get("length") else None
        except ValueError:
            raise UserInputError(f"external data of '{name}' in {location} has a non-integer offset or length: "
                                 f"offset={info.get('offset')!r} length={info.get('length')!r}") from None
        if offset < 0 or (length is not None and length < 0):
            raise UserInputError(f"external data of '{name}' in {location} has a negative offset or length: "
                                 f"offset={offset} length={length}")
        need = tensor_bytes(tensor)
        if length is None:
            length = need
        elif need is not None and length != need:
            raise UserInputError(f"external data of '{name}' in {location} is {length} bytes long, but its dims "
                                 f"{list(tensor.dims)} and data type need {need}")
        if length is None:  # a type whose size the dims do not give: at least the start must be in the file
            if offset > size:
                raise UserInputError(f"external data file {location} is truncated: tensor '{name}' starts at "
                                     f"byte {offset} but the file has {size} bytes")
        elif offset + length > size:
            raise UserInputError(f"external data file {location} is truncated: tensor '{name}' needs bytes "
                                 f"{offset}..{offset + length} but the file has {size}")
        extents.setdefault(location, []).append((tensor, offset, size - offset if length is None else length))
    return extents


def _external_constants_as_initializers(model: onnx.ModelProto) -> None:
    """Every top-level Constant node whose value is stored as external data becomes an initializer
    of the same name (its output's), the node dropped: what onnxruntime does at load, so the graph
    computes the same. optimum writes every weight of a model above 2 GB this way (Constant nodes,
    their values in ``model.onnx_data``); as initializers they are read (or, block-wise, streamed
    block by block) like any other weight instead of all at load."""
    nodes = model.graph.node
    keep = []
    moved = False
    for node in nodes:
        value = node.attribute[0] if node.op_type == "Constant" and node.domain in ("", "ai.onnx") \
            and len(node.attribute) == 1 and node.attribute[0].name == "value" and len(node.output) == 1 else None
        if value is None or value.t.data_location != onnx.TensorProto.EXTERNAL:
            keep.append(node)
            continue
        tensor = model.graph.initializer.add()
        tensor.CopyFrom(value.t)
        tensor.name = node.output[0]
        moved = True
    if moved:
        del nodes[:]
        nodes.extend(keep)


# external initializers up to this size are read in at load even without the weights: shape and
# axes tensors, which type inference and every graph rewrite read as values
SMALL_EXTERNAL_BYTES = 1 << 16


def _read_at_load(model: onnx.ModelProto, extents: dict[str, list[tuple[onnx.TensorProto, int, int]]]
                  ) -> dict[str, list[tuple[onnx.TensorProto, int, int]]]:
    """The external tensors every load reads in, whatever ``load_external`` says, taken out of
    ``extents``: every tensor that is not an initializer (a Constant node's value, any other
    attribute's tensor: optimum stores them outside the proto for models above 2 GB, and
    ``onnx.save_model(..., convert_attribute=True)`` does for any model), and the initializers up to
    ``SMALL_EXTERNAL_BYTES``. Read in, they travel with the graph to wherever it is written or handed
    to onnxruntime (a temporary folder), where a reference to the input's data file would point at
    nothing; the weights stay external until read (block-wise: block by block)."""
    initializers = {id(t) for t in model.graph.initializer}
    taken: dict[str, list[tuple[onnx.TensorProto, int, int]]] = {}
    for location, tensors in extents.items():
        now = [e for e in tensors if id(e[0]) not in initializers or e[2] <= SMALL_EXTERNAL_BYTES]
        if now:
            taken[location] = now
            tensors[:] = [e for e in tensors if id(e[0]) in initializers and e[2] > SMALL_EXTERNAL_BYTES]
    return taken


def _read_external_data(extents: dict[str, list[tuple[onnx.TensorProto, int, int]]], base: Path,
                        scan: FiniteScan | None = None) -> None:
    """Read the tensors ``_check_external_data`` validated into the model, each file opened once
    and read in offset order, each judged by ``scan`` (if any) before it goes into the proto. (onnx's
    own loader refuses a data file that is a symbolic link.)"""
    for location, tensors in extents.items():
        with open(base / location, "rb") as f:
            for tensor, offset, length in sorted(tensors, key=lambda item: item[1]):
                f.seek(offset)
                data = f.read(length)
                if len(data) != length:  # the file shrank since it was checked
                    raise UserInputError(f"external data file {location} is truncated: tensor '{tensor.name}' "
                                         f"needs bytes {offset}..{offset + length}")
                if scan is not None:
                    scan.read(tensor, data)
                tensor.raw_data = data
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]


def external_bytes(tensor: onnx.TensorProto, base_dir: str | os.PathLike) -> bytes:
    """The bytes of an initializer stored as external data, read from its file under ``base_dir``
    (a short read, a file truncated under us, is a one-line ``UserInputError``)."""
    info = {e.key: e.value for e in tensor.external_data}
    path = Path(base_dir) / info.get("location", "")
    offset = int(info.get("offset", 0))
    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    length = int(info["length"]) if "length" in info else int(np.prod(tensor.dims, dtype=np.int64)) * itemsize
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise UserInputError(f"external data file {path.name} is truncated: tensor '{tensor.name}' needs bytes "
                             f"{offset}..{offset + length} but the file has {path.stat().st_size}")
    return data


def weights_read_in(model: onnx.ModelProto, base_dir: str | os.PathLike) -> onnx.ModelProto:
    """A copy of ``model`` with its external initializers read in from ``base_dir``: what a check
    that reads weights needs. ``weights_pointed_back`` gives the checked graph without them again."""
    loaded = onnx.ModelProto()
    loaded.CopyFrom(model)
    for tensor in loaded.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            tensor.raw_data = external_bytes(tensor, base_dir)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    return loaded


def weights_pointed_back(loaded: onnx.ModelProto, like: onnx.ModelProto) -> onnx.ModelProto:
    """``loaded`` (from ``weights_read_in``, perhaps changed since) as a fresh message whose
    initializers external in ``like`` point at their file again. Fresh, so that dropping
    ``loaded`` frees its weights: protobuf keeps a cleared field's bytes until the whole message
    they were read into goes."""
    refs = {t.name: t.external_data for t in like.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    for tensor in loaded.graph.initializer:
        if tensor.name in refs:
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            tensor.external_data.extend(refs[tensor.name])
    fresh = onnx.ModelProto()
    fresh.CopyFrom(loaded)
    return fresh
