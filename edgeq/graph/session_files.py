"""The temporary files an onnxruntime session is built from (``edgeq.graph.ir.make_session`` and
``graph_session``): a graph's large constants written to an external data file straight from their
arrays, and a full disk while writing them reported as the environment's problem."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from edgeq.errors import UserInputError


@contextlib.contextmanager
def temporary_files(where: str):
    """A full disk (or a file size limit) while writing temporary files is the environment's
    problem, not a bug: one line and exit 2 (``UserInputError``)."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise UserInputError(f"cannot write temporary files in {Path(where).parent}: {exc.strerror or exc}") from None
        raise


@contextlib.contextmanager
def constants_as_external_data(graph: gs.Graph, data_path: Path, min_bytes: int = 1024):
    """While open, the graph's large numpy constants read as references into ``data_path``, where
    their bytes are written from the arrays' own buffers; their arrays are put back on exit."""
    from onnx_graphsurgeon.ir.tensor import LazyValues

    swapped = []
    try:
        with open(data_path, "wb") as f:
            offset = 0
            for tensor in graph.tensors().values():
                if not isinstance(tensor, gs.Constant):
                    continue
                values = tensor._values  # noqa: SLF001 (a lazy proto's bytes are written, not loaded)
                if isinstance(values, LazyValues):
                    proto = values.tensor
                    if proto.data_location == onnx.TensorProto.EXTERNAL or len(proto.raw_data) < min_bytes:
                        continue
                    data_type, dims, data = proto.data_type, list(proto.dims), memoryview(proto.raw_data)
                elif isinstance(values, np.ndarray):
                    if values.nbytes < min_bytes or tensor.export_dtype != tensor.dtype or values.dtype == object:
                        continue
                    array = np.ascontiguousarray(values)
                    data_type, dims = onnx.helper.np_dtype_to_tensor_dtype(values.dtype), list(values.shape)
                    # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
                    data = memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
                else:
                    continue
                pad = -offset % 64
                f.write(b"\0" * pad)
                offset += pad
                f.write(data)
                ref = onnx.TensorProto()
                ref.name, ref.data_type = tensor.name, data_type
                ref.dims.extend(dims)
                ref.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", data_path.name), ("offset", str(offset)), ("length", str(data.nbytes))):
                    ref.external_data.add(key=key, value=value)
                offset += data.nbytes
                del data
                swapped.append((tensor, values))
                tensor._values = LazyValues(ref)  # noqa: SLF001
        yield
    finally:
        for tensor, values in swapped:
            tensor._values = values  # noqa: SLF001
