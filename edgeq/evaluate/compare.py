"""Compare two models on the same inputs: per output (and optionally per layer) error statistics.

Model A is the reference, B the model under test (typically A after quantization). For each
compared tensor, over all samples: ``max_abs`` = max |B - A|, ``mean_abs`` = mean |B - A| and
``sqnr_db`` = 10 log10(sum A^2 / sum (B - A)^2) (``inf`` when B equals A exactly).

Per-layer mode (``per_layer=True``) adds intermediate tensors of A that B also produces under the
same name (quantization passes keep the names of the float tensors they wrap): the outputs of
MatMul / Gemm / normalization nodes and the activation input of each MatMul / Gemm (which, in an
exported graph with decomposed RMSNorm / LayerNorm, is the norm's output). They are made extra
graph outputs of both models (no type needed: onnxruntime infers it), reported in A's node
order and capped at ``max_layers`` (evenly spaced when more exist); tensors that turn out not to
be float at run time are left out of the report. Samples run one at a time and
the statistics are streamed in float64 chunks, so memory is one sample's selected activations.

Sessions run with graph optimizations off by default, so each graph is compared as written
(onnxruntime's CPU QDQ fusions would otherwise replace the float simulation by integer kernels).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx

from edgeq.errors import UserInputError
from edgeq.graph.ir import check_model_file, load_model, model_folder
from edgeq.runtime.ort_session import open_session, session_options
from edgeq.runtime.progress import progress
from edgeq.quantize.sqnr import sqnr_from_energies
from edgeq.textdata import ort_dtype

LAYER_OPS = frozenset(
    {
        "MatMul",
        "Gemm",
        "LayerNormalization",
        "RMSNormalization",
        "SimplifiedLayerNormalization",
        "SkipLayerNormalization",
        "SkipSimplifiedLayerNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "BatchNormalization",
    }
)
_MATMUL_OPS = frozenset({"MatMul", "Gemm"})
_CHUNK = 1 << 20  # elements per float64 chunk when streaming statistics


class ErrorStats:
    """Streaming |B - A| and SQNR statistics of one tensor over many samples."""

    def __init__(self) -> None:
        self.count = 0
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.sum_ref2 = 0.0
        self.sum_err2 = 0.0
        self.shape: list[int] | None = None
        self.problem: str | None = None

    def update(self, ref: np.ndarray, test: np.ndarray) -> None:
        if self.problem is not None:
            return
        if ref.shape != test.shape:
            self.problem = f"shape mismatch: A {list(ref.shape)} vs B {list(test.shape)}"
            return
        if self.shape is None:
            self.shape = list(ref.shape)
        a = np.ascontiguousarray(ref).reshape(-1)
        b = np.ascontiguousarray(test).reshape(-1)
        for i in range(0, a.size, _CHUNK):
            ra = a[i : i + _CHUNK].astype(np.float64)
            err = b[i : i + _CHUNK].astype(np.float64)
            err -= ra
            self.sum_ref2 += float(np.dot(ra, ra))
            self.sum_err2 += float(np.dot(err, err))
            np.abs(err, out=err)
            self.sum_abs += float(err.sum())
            m = float(err.max()) if err.size else 0.0
            if m > self.max_abs or math.isnan(m):
                self.max_abs = m
        self.count += a.size

    def result(self) -> dict:
        out: dict[str, Any] = {"shape": self.shape}
        if self.problem is not None:
            out["problem"] = self.problem
            return out
        out["max_abs"] = self.max_abs
        out["mean_abs"] = self.sum_abs / self.count if self.count else 0.0
        out["sqnr_db"] = sqnr_from_energies(self.sum_ref2, self.sum_err2)
        return out


# ---------------------------------------------------------------------------------------------
# Layer selection
# ---------------------------------------------------------------------------------------------


def _node_outputs(graph: onnx.GraphProto) -> set[str]:
    return {out for node in graph.node for out in node.output if out}


def select_layers(
    model_a: onnx.ModelProto,
    model_b: onnx.ModelProto,
    max_layers: int | None = 256,
    layer_ops: Iterable[str] = LAYER_OPS,
) -> tuple[list[tuple[str, str]], int]:
    """(tensor name, description) of the layer tensors to compare, in A's order, and how many
    candidates there were before the ``max_layers`` cap."""
    ops = set(layer_ops)
    graph = model_a.graph
    producer_index: dict[str, int] = {}
    producer_op: dict[str, str] = {}
    for i, node in enumerate(graph.node):
        for out in node.output:
            if out:
                producer_index[out] = i
                producer_op[out] = node.op_type
    in_b = _node_outputs(model_b.graph)
    outputs_a = {o.name for o in graph.output}

    found: dict[str, str] = {}
    for node in graph.node:
        if node.op_type not in ops:
            continue
        if node.op_type in _MATMUL_OPS and node.input and node.input[0] in producer_index:
            src = node.input[0]
            if producer_op[src] not in ("Constant", "DequantizeLinear"):
                found.setdefault(src, f"{producer_op[src]} -> {node.op_type} input")
        if node.output and node.output[0]:
            found.setdefault(node.output[0], node.op_type)
    names = [
        n
        for n in sorted(found, key=producer_index.__getitem__)
        if n in in_b and n not in outputs_a
    ]
    total = len(names)
    if max_layers is not None and total > max_layers:
        if max_layers < 1:
            raise UserInputError(f"max_layers must be >= 1, got {max_layers}")
        keep = np.unique(np.linspace(0, total - 1, max_layers).round().astype(int))
        names = [names[i] for i in keep]
    return [(n, found[n]) for n in names], total


def _session_with_outputs(path: Path, model: onnx.ModelProto, extra: Sequence[str], threads, optimize, exact_qdq=False) -> Any:
    """Session of ``model`` (loaded from ``path`` without external data) with ``extra`` tensors as
    untyped graph outputs; ``model`` is extended in place (it is compare's own copy)."""
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in extra if n not in have)
    opts = session_options(threads, optimize, exact_qdq)
    opts.add_session_config_entry(
        "session.model_external_initializers_file_folder_path", str(model_folder(path))
    )
    try:
        data = model.SerializeToString()
    except ValueError as exc:  # protobuf's 2 GB limit with inlined weights
        raise UserInputError(f"{path} is too large to add layer outputs: {exc}") from None
    return open_session(data, options=opts)


# ---------------------------------------------------------------------------------------------
# Compare
# ---------------------------------------------------------------------------------------------


def _feeds_for(session: Any, feeds: Mapping[str, np.ndarray], label: str) -> dict[str, np.ndarray]:
    out = {}
    for spec in session.get_inputs():
        if spec.name not in feeds:
            raise UserInputError(f"{label} needs input '{spec.name}' that the data does not give")
        arr = np.asarray(feeds[spec.name])
        want = ort_dtype(spec.type, spec.name)
        if arr.dtype != want:
            if np.issubdtype(arr.dtype, np.integer) and np.issubdtype(want, np.integer):
                arr = arr.astype(want)
            else:
                raise UserInputError(f"{label} input '{spec.name}' is {spec.type}, the data gives {arr.dtype}")
        out[spec.name] = arr
    return out


def _match_outputs(names_a: list[str], names_b: list[str]) -> list[tuple[str, str]]:
    if all(n in names_b for n in names_a):
        return [(n, n) for n in names_a]
    if len(names_a) == len(names_b):
        return list(zip(names_a, names_b))
    raise UserInputError(
        f"the models' outputs do not match: A has {names_a}, B has {names_b}"
    )


def _run(session: Any, names: list[str], feeds: dict, label: str) -> list[np.ndarray]:
    try:
        return session.run(names, feeds)
    except Exception as exc:  # onnxruntime's own error types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserInputError(f"{label} failed to run on the inputs: {first}") from None


def compare(
    model_a: str | os.PathLike,
    model_b: str | os.PathLike,
    feeds_list: Sequence[Mapping[str, np.ndarray]] | Callable[[Any], Sequence[Mapping[str, np.ndarray]]],
    per_layer: bool = False,
    max_layers: int | None = 256,
    threads: int | None = None,
    optimize: bool = False,
    exact_qdq: bool = False,
) -> dict:
    """Run A (reference) and B on every feed dict; statistics per output and, with
    ``per_layer``, per shared intermediate tensor (see the module docstring).

    Returns ``{"samples", "outputs": [...], "layers": [...], "layers_available", "seconds"}``
    where each entry has ``name``, ``shape``, ``max_abs``, ``mean_abs``, ``sqnr_db`` (or
    ``problem`` when A and B disagree on its shape); layer entries also name the producing ``op``.

    ``feeds_list`` may also be a callable taking A's ``session.get_inputs()`` and returning the
    samples, so inputs can be built for the model without loading it twice.
    """
    path_a, path_b = Path(model_a), Path(model_b)
    layers: list[tuple[str, str]] = []
    available = 0
    if per_layer:
        proto_a = load_model(path_a, load_external=False)
        proto_b = load_model(path_b, load_external=False)
        layers, available = select_layers(proto_a, proto_b, max_layers=max_layers)
        layer_names = [n for n, _ in layers]
        sess_a = _session_with_outputs(path_a, proto_a, layer_names, threads, optimize, exact_qdq)
        sess_b = _session_with_outputs(path_b, proto_b, layer_names, threads, optimize, exact_qdq)
        del proto_a, proto_b
    else:
        check_model_file(path_a)
        check_model_file(path_b)
        sess_a = open_session(path_a, options=session_options(threads, optimize, exact_qdq))
        sess_b = open_session(path_b, options=session_options(threads, optimize, exact_qdq))

    if callable(feeds_list):
        feeds_list = feeds_list(sess_a.get_inputs())
    feeds_list = list(feeds_list)
    if not feeds_list:
        raise UserInputError("compare needs at least one input sample")
    layer_set = {n for n, _ in layers}
    outs_a = [o.name for o in sess_a.get_outputs() if o.name not in layer_set]
    outs_b = [o.name for o in sess_b.get_outputs() if o.name not in layer_set]
    pairs = _match_outputs(outs_a, outs_b) + [(n, n) for n, _ in layers]
    fetch_a = [a for a, _ in pairs]
    fetch_b = [b for _, b in pairs]
    stats = [ErrorStats() for _ in pairs]
    non_float: set[int] = set()

    start = time.perf_counter()
    for feeds in progress(feeds_list, total=len(feeds_list), desc="compare"):
        ra = _run(sess_a, fetch_a, _feeds_for(sess_a, feeds, "model A"), "model A")
        rb = _run(sess_b, fetch_b, _feeds_for(sess_b, feeds, "model B"), "model B")
        for i, (x, y) in enumerate(zip(ra, rb)):
            is_layer = i >= len(pairs) - len(layers)
            if is_layer and not (np.issubdtype(x.dtype, np.floating) and np.issubdtype(y.dtype, np.floating)):
                non_float.add(i)
                continue
            stats[i].update(x, y)
        del ra, rb
    seconds = time.perf_counter() - start

    outputs = []
    for (a, b), st in zip(pairs[: len(pairs) - len(layers)], stats):
        entry = {"name": a}
        if b != a:
            entry["name_b"] = b
        entry.update(st.result())
        outputs.append(entry)
    layer_rows = []
    first_layer = len(pairs) - len(layers)
    for j, (name, op) in enumerate(layers):
        if first_layer + j in non_float:
            continue
        entry = {"name": name, "op": op}
        entry.update(stats[first_layer + j].result())
        layer_rows.append(entry)
    result = {"samples": len(feeds_list), "outputs": outputs, "seconds": seconds}
    if per_layer:
        result["layers"] = layer_rows
        result["layers_available"] = available
    return result
