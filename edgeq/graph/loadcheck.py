"""What ``compile`` checks of a model beyond its structure (``edgeq.graph.modelcheck``), before any work:
its weights are finite, and onnxruntime can build a session on it. Both are one-line
``UserInputError``s (exit 2) naming the model; ``edgeq check`` reports the first as the
``finite-initializer`` rule (``edgeq.targets.check``, exit 3).

Finite weights (``nonfinite_tensors``, ``FiniteScan``): every float initializer (float32, float16,
float64, bfloat16) the graph reads, subgraphs included, and every ``Constant`` node's float value
may hold no NaN, and no inf either unless it is a single value or an additive mask (every value 0
or -inf): exporters write ``-inf`` constants for attention masking (``edgeq export tiny llama``
has two), and a mask folded into an initializer keeps them. A weight with NaN or inf makes every
value computed from it NaN or inf; the quantizer refuses such a tensor (``edgeq.quantize.quant``), but a
tensor the recipe leaves in float (the embedding table under ``w8a8``) would be written as it is.
Vectorized numpy over the raw little-endian bytes, in slices (no full-size temporary): bytes read
from an external data file are judged as they are read (``edgeq.graph.ir.load_model_and_locations``
with ``finite=True``), those of a model read without its weights (block-wise compile) are
streamed from their files in 16 MiB reads, so the block-wise memory bound holds.

onnxruntime (``check_onnxruntime``): a model can pass every structural check and still be one
onnxruntime refuses at session creation (an ``LRN`` of ``size=0``, an ``LpNormalization`` of
``p=3``, an attribute its operator does not have); compile would then fail inside its first
pass, an internal error (exit 1). One CPU session is built on the model file (or on its graph
with the small external tensors read in, ``_session_source``) with graph optimizations and weight
prepacking off: onnxruntime then maps the external data files into memory without touching their
pages (measured: 0.1 to 0.3 s and about 30 MB, onnxruntime's own, for a 780 MB model whose
block-wise compile peaks at 2.2 GB either way), so the block-wise route gets it too, before it
reads any block. Only a model with its weights inside the ``.onnx`` file costs onnxruntime's copy
of them while the session is built (the in-memory route holds several copies later anyway).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import cast
from pathlib import Path
from collections.abc import Iterable, Iterator

import numpy as np
import onnx

from edgeq.errors import UserInputError
from edgeq.graph.modelcheck import tensor_bytes
from edgeq.graph.protowalk import proto_nodes

# element type -> the numpy type of its little-endian bytes (bfloat16: its bits, widened to float32)
_FLOAT_TYPES: dict[int, np.dtype] = {
    onnx.TensorProto.FLOAT: np.dtype("<f4"), onnx.TensorProto.FLOAT16: np.dtype("<f2"),
    onnx.TensorProto.DOUBLE: np.dtype("<f8"), onnx.TensorProto.BFLOAT16: np.dtype("<u2")}
_SLICE_ELEMENTS = 1 << 22  # values judged at a time (16 MiB of float32)
_READ_BYTES = 1 << 24  # bytes read at a time from an external data file
_INLINE_BYTES = 1 << 16  # external tensors up to this size are read in for onnxruntime's session


@dataclass(frozen=True)
class NonFinite:
    """A float tensor holding NaN or inf where a weight may not."""

    subject: str  # "initializer 'x'" or "Constant node 'n'"
    name: str  # the tensor's name (the node's output for a Constant)
    nan: int
    inf: int
    size: int
    first: list[int]  # index of the first NaN or inf

    def describe(self) -> str:
        counts = " and ".join(f"{n} {what}" for n, what in ((self.nan, "NaN"), (self.inf, "inf")) if n)
        return f"{self.subject} holds {counts} among its {self.size} values (first at index {self.first})"


def is_float(data_type: int) -> bool:
    return data_type in _FLOAT_TYPES


def _as_float(values: np.ndarray) -> np.ndarray:
    """A slice of values as numpy floats (bfloat16 bits widened to float32)."""
    if values.dtype == np.uint16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values


def judge(slices: Iterable[np.ndarray], subject: str, name: str, dims, rescan=None) -> NonFinite | None:
    """The verdict on a tensor given as consecutive 1-D slices of its values (``_FLOAT_TYPES``
    dtypes). ``rescan()``: the slices again, for the mask test, only asked when there is inf and
    no NaN (else ``slices`` must be a list)."""
    nan = inf = seen = 0
    first = None
    for values in slices:
        values = _as_float(values)
        ok = np.isfinite(values)
        if not ok.all():
            bad = np.flatnonzero(~ok)
            if first is None:
                first = seen + int(bad[0])
            n = int(np.count_nonzero(np.isnan(values[bad])))
            nan += n
            inf += bad.size - n
        seen += values.size
    if first is None:
        return None
    if not nan and (seen <= 1 or _is_mask(rescan() if rescan is not None else slices)):
        return None
    index = [int(i) for i in np.unravel_index(first, tuple(dims))] if len(dims) else []
    return NonFinite(subject, name, nan, inf, seen, index)


def _is_mask(slices: Iterable[np.ndarray]) -> bool:
    """Every value is 0 or -inf: an additive attention mask."""
    return all(bool(np.all((v == 0) | (v == -np.inf))) for v in map(_as_float, slices))


def _slices(flat: np.ndarray) -> list[np.ndarray]:
    return [flat[i:i + _SLICE_ELEMENTS] for i in range(0, flat.size, _SLICE_ELEMENTS)] or [flat]


def judge_bytes(data, tensor: onnx.TensorProto, subject: str, name: str) -> NonFinite | None:
    """``judge`` on a tensor's raw bytes (no copy: numpy views of ``data``)."""
    flat = np.frombuffer(data, _FLOAT_TYPES[tensor.data_type])
    return judge(_slices(flat), subject, name, tensor.dims)


def _judge_in_memory(tensor: onnx.TensorProto, subject: str, name: str) -> NonFinite | None:
    if tensor.HasField("raw_data"):
        return judge_bytes(tensor.raw_data, tensor, subject, name)  # (protobuf hands out one copy)
    values = onnx.numpy_helper.to_array(tensor).reshape(-1)  # values in the typed fields: small tensors
    if tensor.data_type == onnx.TensorProto.BFLOAT16:
        values = values.astype(np.float32)
    return judge(_slices(values), subject, name, tensor.dims)


def _file_slices(path: Path, offset: int, length: int, dtype: np.dtype) -> Iterator[np.ndarray]:
    """A tensor's values streamed from its external data file, ``_READ_BYTES`` at a time into one buffer."""
    step = _READ_BYTES - _READ_BYTES % dtype.itemsize
    buffer = memoryview(bytearray(min(step, length)))
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            n = min(step, left)
            got = 0
            while got < n:
                k = f.readinto(buffer[got:n])
                if not k:  # the file shrank since edgeq.graph.ir checked it
                    raise UserInputError(f"external data file {path.name} is truncated: it ends inside bytes "
                                         f"{offset}..{offset + length}")
                got += k
            yield np.frombuffer(buffer[:n], dtype)  # (judged before the next read overwrites it)
            left -= n


def _judge_external(tensor: onnx.TensorProto, base_dir: Path, subject: str, name: str) -> NonFinite | None:
    info = {e.key: e.value for e in tensor.external_data}
    path = base_dir / info.get("location", "")
    offset = int(info.get("offset") or 0)
    length = int(info["length"]) if info.get("length") else cast(int, tensor_bytes(tensor))  # a float type: known
    dtype = _FLOAT_TYPES[tensor.data_type]
    return judge(_file_slices(path, offset, length, dtype), subject, name, tensor.dims,
                 rescan=lambda: _file_slices(path, offset, length, dtype))


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every If / Loop / Scan body in it, depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def _reads(model: onnx.ModelProto) -> set[str]:
    """Names some node reads (subgraph bodies included) or some graph outputs."""
    names = {x for node in proto_nodes(model.graph.node) for x in node.input}
    names.update(vi.name for g in _graphs(model.graph) for vi in g.output)
    return names


def weight_tensors(model: onnx.ModelProto) -> Iterator[tuple[onnx.TensorProto, str, str]]:
    """(tensor, subject, name) of every float initializer the graph reads and every float value of
    a Constant node whose output is read, subgraphs included. A Constant's ``value_float(s)``
    becomes a tensor of its own."""
    reads = _reads(model)
    for g in _graphs(model.graph):
        for t in g.initializer:
            if t.name in reads and is_float(t.data_type):
                yield t, f"initializer '{t.name}'", t.name
    for node in proto_nodes(model.graph.node):
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or not node.output \
                or node.output[0] not in reads:
            continue
        label = f"Constant node '{node.name or node.output[0]}'"
        for attr in node.attribute:
            if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR and is_float(attr.t.data_type):
                yield attr.t, label, node.output[0]
            elif attr.name in ("value_float", "value_floats"):
                values = np.asarray(onnx.helper.get_attribute_value(attr), np.float32)
                yield onnx.numpy_helper.from_array(values, node.output[0]), label, node.output[0]


def nonfinite_tensors(model: onnx.ModelProto, base_dir: str | os.PathLike | None = None) -> Iterator[NonFinite]:
    """Every weight (``weight_tensors``) holding NaN or inf where it may not (see the module
    docstring). A tensor still stored as external data is streamed from its file under
    ``base_dir``, or skipped without one."""
    for tensor, subject, name in weight_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            if base_dir is None:
                continue
            found = _judge_external(tensor, Path(base_dir), subject, name)
        else:
            found = _judge_in_memory(tensor, subject, name)
        if found is not None:
            yield found


def refusal(found: NonFinite, path: str | os.PathLike) -> UserInputError:
    return UserInputError(f"{path}: {found.describe()}: every value computed from it would be NaN or inf; "
                          "fix or re-export the model")


class FiniteScan:
    """The finite-weights check of a model as ``edgeq.graph.ir`` reads it: ``read(tensor, data)`` judges
    an external tensor's bytes as they come off the file (before they are copied into the
    proto), ``finish(model, base_dir)`` every weight not judged so far (in memory, or streamed
    from its file when the weights were not read). Raises at the first bad weight."""

    def __init__(self, model: onnx.ModelProto, path: str | os.PathLike):
        self.path = path
        self.initializers = {t.name for t, subject, _ in weight_tensors(model) if subject.startswith("initializer")}
        self.done: set[str] = set()

    def read(self, tensor: onnx.TensorProto, data: bytes) -> None:
        if not is_float(tensor.data_type) or tensor.name not in self.initializers or tensor.name in self.done:
            return
        self.done.add(tensor.name)
        found = judge_bytes(data, tensor, f"initializer '{tensor.name}'", tensor.name)
        if found is not None:
            raise refusal(found, self.path)

    def finish(self, model: onnx.ModelProto, base_dir: str | os.PathLike) -> None:
        for tensor, subject, name in weight_tensors(model):
            if subject.startswith("initializer") and name in self.done:
                continue
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                found = _judge_external(tensor, Path(base_dir), subject, name)
            else:
                found = _judge_in_memory(tensor, subject, name)
            if found is not None:
                raise refusal(found, self.path)


# -- onnxruntime -----------------------------------------------------------------------------------

# domains whose nodes onnxruntime runs only with onnxruntime-extensions' library registered
_EXTENSION_DOMAINS = frozenset({"edgeq.ort", "ai.onnx.contrib", "com.microsoft.extensions"})


def check_onnxruntime(model: onnx.ModelProto, path: str | os.PathLike, external: bool = False) -> None:
    """Build (and drop) one onnxruntime CPU session on the model at ``path`` (``model``: that file
    as read, best without its weights: ``load_external=False``): graph optimizations and
    prepacking off, one thread, log level fatal only. onnxruntime-extensions' library (the edgeq
    kernels) is registered when the model has nodes of its domains without a function body in the
    model and it is installed. The session is built on the file itself, or on a copy of ``model``
    (``_session_source``) when it needs more than the file gives onnxruntime; ``external`` (the
    file has external data) always takes the copy: the loader read its attribute and small tensors
    in (``edgeq.graph.ir``), which onnxruntime cannot read from a file for some operators
    (a ConstantOfShape's value). A refusal is
    ``UserInputError("MODEL: onnxruntime cannot load this model: <its first line>")``."""
    import onnxruntime as ort

    so = ort.SessionOptions()  # (edgeq.graph.ir.session_options' settings; ir imports this module)
    so.log_severity_level = 4  # fatal only: the refusal is edgeq's one line, not onnxruntime's own
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.disable_prepacking", "1")  # weights mapped, never touched
    nodes = list(proto_nodes(model.graph.node))
    bodies = {(f.domain, f.name) for f in model.functions}
    if any(n.domain in _EXTENSION_DOMAINS and (n.domain, n.op_type) not in bodies for n in nodes):
        # (not for edgeq.ort nodes with their function bodies, which onnxruntime runs without
        # the library: importing onnxruntime-extensions costs seconds, it imports transformers)
        from edgeq.runtime_ops.ort_kernels import has_ort_kernels, ort_kernel_session_options

        if has_ort_kernels():
            ort_kernel_session_options(so)
    folder = Path(path).parent.resolve()  # (edgeq.graph.ir.model_folder)
    source = _session_source(model, path, folder, any(n.domain == "edgeq" for n in nodes), external)
    if isinstance(source, bytes):  # the external data locations resolve against the model's folder
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    try:
        session = ort.InferenceSession(source, sess_options=so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 (onnxruntime raises its own pybind types: Fail, InvalidGraph, ...)
        text = str(exc).strip()
        first = text.splitlines()[0].strip() if text else type(exc).__name__
        raise UserInputError(f"{path}: onnxruntime cannot load this model: {first}") from None
    del session


def _session_source(model: onnx.ModelProto, path, folder: Path, has_edgeq_ops: bool, external: bool = False) -> str | bytes:
    """What the session is built on: the file at ``path``, or a copy of ``model`` serialized with
    (a) the function body of every edgeq op it uses that the model lacks (compile adds them:
    ``edgeq.graph.ir.to_model``), and (b) its small external tensors (up to ``_INLINE_BYTES``) read in:
    onnxruntime's type inference refuses to read a constant input (a ReduceMean's ``axes``) from
    external data ("Cannot parse data from external tensors"), where compile reads them. The large
    ones stay external (mapped by onnxruntime). ``model`` itself is not changed; the copy costs
    its in-memory part (the graph; the weights too only for a model with its weights inside the
    ``.onnx`` file and edgeq ops without their bodies)."""
    from onnx.external_data_helper import _get_all_tensors

    def small_external(tensor: onnx.TensorProto) -> bool:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            return False
        size = tensor_bytes(tensor)
        return size is not None and size <= _INLINE_BYTES

    missing = False
    if has_edgeq_ops:
        from edgeq.runtime_ops.schema import DOMAIN, used_ops

        missing = not used_ops(model) <= {f.name for f in model.functions if f.domain == DOMAIN}
    if not missing and not external and not any(small_external(t) for t in _get_all_tensors(model)):
        return str(path)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    if missing:
        from edgeq.runtime_ops.schema import ensure_functions

        try:
            ensure_functions(copy)
        except (KeyError, ValueError) as exc:
            raise UserInputError(f"{path}: onnxruntime cannot load this model: {exc}") from None
    for tensor in _get_all_tensors(copy):
        if small_external(tensor):
            info = {e.key: e.value for e in tensor.external_data}
            with open(folder / info["location"], "rb") as f:  # (edgeq.graph.ir checked the extent)
                f.seek(int(info.get("offset") or 0))
                tensor.raw_data = f.read(tensor_bytes(tensor))
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    return copy.SerializeToString()
