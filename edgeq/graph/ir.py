"""IR helpers: onnx-graphsurgeon is the graph API; this module adds what it lacks.

- ``load_model``: validated load (missing file, not ONNX, truncated protobuf, missing or escaping
  external data, and a graph ``edgeq.graph.modelcheck`` finds invalid: a cycle, an unknown operator or
  domain, initializer bytes that do not fit its dims, text that is not UTF-8, all become
  one-line ``UserInputError``s), external data read in; the one loader every command uses. With
  ``finite=True`` (compile) also a weight holding NaN or inf (``edgeq.graph.loadcheck``), judged as its
  bytes are read; ``check_finite`` is that check on a model already read (with or without weights).
- ``to_graph`` / ``to_model``: graphsurgeon round trip that keeps opset imports, IR version,
  producer and metadata of the original model (graphsurgeon drops metadata_props).
- ``save_model``: always writes weights as external data next to the model, so models over 2 GB
  save; never mutates the caller's proto.
- ``GraphIndex``: name -> tensor, producer and consumer lookups in O(1) after one O(N) build.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError

from edgeq.errors import UserInputError
from edgeq.graph.loadcheck import FiniteScan
from edgeq.graph.external_data import (SMALL_EXTERNAL_BYTES, _check_external_data, _external_constants_as_initializers,  # noqa: F401
                                       _read_at_load, _read_external_data, external_bytes, weights_pointed_back,
                                       weights_read_in)
from edgeq.graph.modelcheck import check_structure, check_types
from edgeq.graph.session_files import constants_as_external_data, temporary_files
from edgeq.files.output_dir import honour_umask

EXTERNAL_DATA_SUFFIX = ".data"
# Opsets of the default domain the passes are written for. Older graphs lack per-channel QDQ
# (opset 13) and newer ones may use ops our pattern matchers do not know.
MIN_OPSET = 13
MAX_OPSET = onnx.defs.onnx_opset_version()


def external_data_locations(model: onnx.ModelProto) -> Iterator[tuple[str, str]]:
    """Yield (tensor name, location) of every initializer stored as external data."""
    from onnx.external_data_helper import _get_all_tensors

    for tensor in _get_all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in tensor.external_data}
            yield tensor.name, info.get("location", "")


def load_model(path: str | os.PathLike, load_external: bool = True, finite: bool = False) -> onnx.ModelProto:
    """Load an ONNX model, turning every way the file can be bad into a ``UserInputError``."""
    return load_model_and_locations(path, load_external, finite)[0]


def load_model_and_locations(path: str | os.PathLike, load_external: bool = True,
                             finite: bool = False) -> tuple[onnx.ModelProto, set[str]]:
    """``load_model`` plus the external data file names it validated (inside the model's folder,
    present), so that hashing the input (``manifest.json``) needs no second read of the model.

    ``finite``: also refuse a float weight holding NaN or inf (``edgeq.graph.loadcheck``): external
    bytes judged as they are read (no copy), the rest in memory; without ``load_external`` the
    external weights are streamed from their files (a bounded buffer) instead."""
    path = Path(path)
    if not path.exists():
        raise UserInputError(f"model file not found: {path}")
    if not path.is_file():
        raise UserInputError(f"model path is not a file: {path}")
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise UserInputError(f"{path} is not a valid ONNX model (truncated or not protobuf): {exc}") from None
    if not model.graph.node and not model.graph.output:
        raise UserInputError(f"{path} is not an ONNX model (no graph found)")
    check_ir_version(model, path)
    check_structure(model, path, types=False)
    _external_constants_as_initializers(model)
    base = model_folder(path)
    extents = _check_external_data(model, base)
    try:  # (before the type check: onnx's inference cannot read a Constant's value from a file)
        _read_external_data(_read_at_load(model, extents), base)
    except OSError as exc:
        raise UserInputError(f"cannot read external data of {path}: {exc.strerror or exc}") from None
    check_types(model, path)
    scan = FiniteScan(model, path) if finite else None
    try:
        if load_external:
            _read_external_data(extents, base, scan)
        if scan is not None:
            scan.finish(model, base)
    except OSError as exc:
        raise UserInputError(f"cannot read external data of {path}: {exc.strerror or exc}") from None
    return model, set(extents)


def check_finite(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """The ``finite=True`` check of ``load_model`` on a model already read from ``path``: weights in
    memory judged there, those still external streamed from their files in the model's folder
    (a bounded buffer: the block-wise compile's memory bound holds)."""
    try:
        FiniteScan(model, path).finish(model, model_folder(path))
    except OSError as exc:
        raise UserInputError(f"cannot read external data of {path}: {exc.strerror or exc}") from None


def check_model_file(path: str | os.PathLike) -> Path:
    """Every check of ``load_model`` (the file, its structure, its external data present and
    fitting), no weights read: for commands that hand the file itself to onnxruntime (``eval``,
    ``generate``). Returns ``path``."""
    load_model_and_locations(path, load_external=False)
    return Path(path)


def model_folder(path: str | os.PathLike) -> Path:
    """The folder a model's external data and side files (tokenizer, config) are read from: the
    folder of ``path`` as named, not of the file it links to (a Hugging Face hub snapshot's
    ``model.onnx`` links into ``../../blobs``, its siblings stay in the snapshot)."""
    return Path(path).parent.resolve()


def check_ir_version(model: onnx.ModelProto, path: str | os.PathLike = "the model") -> None:
    """Refuse an IR version newer than the installed onnx (and onnxruntime, which refuses to load
    it) knows: ``compile`` would otherwise fail deep inside a pass."""
    if model.ir_version > onnx.IR_VERSION:
        raise UserInputError(f"{path}: IR version {model.ir_version} is not supported (onnx {onnx.__version__} "
                             f"reads IR versions up to {onnx.IR_VERSION})")


def check_opset(model: onnx.ModelProto, lo: int = MIN_OPSET, hi: int = MAX_OPSET) -> int:
    """Return the default-domain opset, or raise if the passes cannot handle it."""
    version = default_opset(model)
    if version is None or not lo <= version <= hi:
        raise UserInputError(f"opset {version} is not supported (edgeq handles opset {lo} to {hi})")
    return version


def default_opset(model: onnx.ModelProto) -> int | None:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return None


def to_graph(model: onnx.ModelProto) -> gs.Graph:
    """Import into graphsurgeon, remembering what export would otherwise drop."""
    graph = gs.import_onnx(model)
    graph._edgeq_model_attrs = _model_attrs(model)  # noqa: SLF001 (kept with the graph on purpose)
    return graph


def _kept_model_attrs(graph: gs.Graph) -> dict | None:
    """What ``to_graph`` remembered, or None for a graph built otherwise. Read from the instance
    dict: graphsurgeon's ``Graph.__getattr__`` logs an "[E] Function ... was not registered" line
    for every missing attribute before raising."""
    return vars(graph).get("_edgeq_model_attrs")


def _model_attrs(model: onnx.ModelProto) -> dict:
    return {
        "ir_version": model.ir_version,
        "producer_name": model.producer_name,
        "producer_version": model.producer_version,
        "doc_string": model.doc_string,
        "model_version": model.model_version,
        "metadata": [(p.key, p.value) for p in model.metadata_props],
        "opsets": {imp.domain: imp.version for imp in model.opset_import},
    }


def to_model(graph: gs.Graph) -> onnx.ModelProto:
    """Export from graphsurgeon with the original model's metadata and opset imports restored.

    Domains used by the graph but not imported by the original (e.g. ``edgeq``) are added by
    graphsurgeon; the default domain keeps ``graph.opset`` (passes may raise it).
    """
    attrs = _kept_model_attrs(graph)
    model = gs.export_onnx(graph, do_type_check=False)
    if attrs is not None:
        _restore_model_attrs(model, graph, attrs)
    if any(node.domain == "edgeq" for node in model.graph.node):
        from edgeq.runtime_ops import ensure_functions

        ensure_functions(model)  # every edgeq op travels with its ONNX function body
    return model


def pruned_copy(graph: gs.Graph, outputs: list[str]) -> gs.Graph:
    """A copy of ``graph`` (nodes and tensors copied, weights shared) cut down to what computes
    ``outputs``, with the model attributes ``to_model`` restores: exporting it serializes only the
    weights those outputs need (a calibration run does not write out a 1 GB vocabulary head to
    prune it afterwards). Element types of the outputs are left to the caller."""
    part = graph.copy()
    attrs = _kept_model_attrs(graph)
    if attrs is not None:
        part._edgeq_model_attrs = attrs  # noqa: SLF001 (kept with the graph on purpose)
    tensors = part.tensors()
    part.outputs = [tensors[name] for name in outputs]
    part.cleanup(remove_unused_graph_inputs=False)
    return part


def _restore_model_attrs(model: onnx.ModelProto, graph: gs.Graph, attrs: dict) -> None:
    opsets = dict(attrs["opsets"])
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            opsets[""] = max(imp.version, graph.opset)
        else:
            opsets[imp.domain] = max(opsets.get(imp.domain, 0), imp.version)
    opsets.pop("ai.onnx", None)
    del model.opset_import[:]
    model.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in sorted(opsets.items()))
    # onnx stamps its newest IR version; runtimes (onnxruntime) may not read it yet, so keep the
    # original's unless the opsets now in use need a newer one.
    model.ir_version = max(attrs["ir_version"], onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True))
    model.producer_name = attrs["producer_name"] or "edgeq"
    model.producer_version = attrs["producer_version"]
    model.doc_string = attrs["doc_string"]
    model.model_version = attrs["model_version"]
    del model.metadata_props[:]
    for key, value in attrs["metadata"]:
        model.metadata_props.add(key=key, value=value)


def graph_metadata(graph: gs.Graph) -> dict[str, str]:
    """The model metadata carried with an imported graph (what ``to_model`` writes back)."""
    attrs = _kept_model_attrs(graph)
    return dict(attrs["metadata"]) if attrs else {}


def set_graph_metadata(graph: gs.Graph, key: str, value: str) -> None:
    """Record a fact about the graph in its model metadata (e.g. that a rotation was applied),
    so that passes stay idempotent across save/load."""
    attrs = _kept_model_attrs(graph)
    if attrs is None:
        attrs = graph._edgeq_model_attrs = {"metadata": [], "opsets": {}, "ir_version": 8, "producer_name": "edgeq",
                                            "producer_version": "", "doc_string": "", "model_version": 0}
    attrs["metadata"] = [(k, v) for k, v in attrs["metadata"] if k != key] + [(key, value)]


def drop_graph_metadata(graph: gs.Graph, key: str) -> None:
    """Remove a fact that no longer holds for the graph (e.g. inputs a specialization removed)."""
    attrs = _kept_model_attrs(graph)
    if attrs is not None:
        attrs["metadata"] = [(k, v) for k, v in attrs["metadata"] if k != key]


def nodes_with_graphs(graph: gs.Graph) -> Iterator[tuple[gs.Graph, gs.Node]]:
    """(graph holding it, node) for every node, depth first into If / Loop / Scan bodies: the one
    walker lowering passes use to reach nodes inside subgraphs."""
    for node in graph.nodes:
        yield graph, node
        for value in node.attrs.values():
            for sub in value if isinstance(value, list) else [value]:
                if isinstance(sub, gs.Graph):
                    yield from nodes_with_graphs(sub)


def subgraph_reads(graph: gs.Graph) -> set[str]:
    """Names read inside If / Loop / Scan bodies (outer-scope tensors among them)."""
    return {t.name for g, node in nodes_with_graphs(graph) if g is not graph for t in node.inputs}


@dataclass(frozen=True)
class Boundary:
    """Tensors a retyping rewrite (int8 lowering) must leave alone: the graph's inputs and outputs
    (its interface with the caller) and the names read inside If / Loop / Scan bodies (which
    the rewrite does not visit, so it cannot retype their readers)."""

    inputs: frozenset[str]
    outputs: frozenset[str]
    in_subgraphs: frozenset[str]

    @classmethod
    def of(cls, graph: gs.Graph) -> Boundary:
        return cls(frozenset(t.name for t in graph.inputs), frozenset(t.name for t in graph.outputs),
                   frozenset(subgraph_reads(graph)))


def drop_domain_import(graph: gs.Graph, domain: str) -> None:
    """Forget the opset import of ``domain`` (a lowering left no node of it)."""
    attrs = _kept_model_attrs(graph)
    if attrs is not None:
        attrs["opsets"].pop(domain, None)
    domains = getattr(graph, "import_domains", None)
    if domains:
        graph.import_domains = [d for d in domains if d.domain != domain]


def set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    model.metadata_props.add(key=key, value=value)


def save_model(model: onnx.ModelProto, path: str | os.PathLike, size_threshold: int = 1024) -> Path:
    """Save with all large initializers in one external file ``<name>.data`` beside the model.

    Works for any model size (the protobuf itself stays far below 2 GB) and leaves ``model``
    untouched: onnx's external-data writer clears raw data in place, so it gets a copy. The data
    file gets the usual mode (0666 less the umask), like the model file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    location = path.name + EXTERNAL_DATA_SUFFIX
    data_file = path.parent / location
    if data_file.exists():
        data_file.unlink()
    onnx.save_model(
        copy,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=location,
        size_threshold=size_threshold,
        convert_attribute=False,
    )
    if data_file.exists():
        honour_umask(data_file)  # onnx creates it 0600; the model beside it is 0666 less the umask
    return path


class GraphIndex:
    """O(1) use-def lookups on a graphsurgeon graph, rebuilt explicitly after rewrites."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self.tensors: dict[str, gs.Tensor] = graph.tensors()
        self._producer: dict[str, gs.Node] = {}
        self._consumers: dict[str, list[gs.Node]] = {}
        for node in graph.nodes:
            for out in node.outputs:
                self._producer[out.name] = node
            for inp in node.inputs:
                self._consumers.setdefault(inp.name, []).append(node)

    def producer(self, name: str) -> gs.Node | None:
        return self._producer.get(name)

    def consumers(self, name: str) -> list[gs.Node]:
        return self._consumers.get(name, [])

    def constant_value(self, tensor: gs.Tensor) -> np.ndarray | None:
        """The value of a tensor that is an initializer or a Constant node's output, else None."""
        if isinstance(tensor, gs.Constant):
            return np.asarray(tensor.values)
        node = self._producer.get(tensor.name)
        if node is not None and node.op == "Constant" and "value" in node.attrs:
            value = node.attrs["value"]
            return np.asarray(value.values if isinstance(value, gs.Constant) else value)
        if node is not None and node.op == "Identity":
            return self.constant_value(node.inputs[0])
        return None


def proto_bytes(model: onnx.ModelProto) -> int:
    """The serialized size of ``model``, also past 2 GB (where protobuf's ``ByteSize`` overflows):
    the initializers' data plus the rest of the graph."""
    data = sum(len(t.raw_data) for t in model.graph.initializer)
    if data < 1_000_000_000:
        return model.ByteSize()
    return data + sum(n.ByteSize() for n in model.graph.node)


# models at least this large reach onnxruntime through a temporary file when the caller gives
# them up (``consume``): serialized bytes beside the proto and onnxruntime's copy would triple them
CONSUME_VIA_FILE_BYTES = 64 * 2**20
# models at least this large reach onnxruntime through a temporary folder: serialized bytes are
# limited to 2 GB by protobuf
VIA_FILE_BYTES = 1_800_000_000


def make_session(model: onnx.ModelProto, optimize: bool = False, threads: int | None = None, consume: bool = False):
    """An onnxruntime CPU session on an in-memory model (via a temporary folder above 1.8 GB).

    ``optimize=False`` disables graph optimizations: equivalence checks must see our graph, not
    onnxruntime's rewrite of it. ``consume=True``: ``model`` is not needed afterwards; a large one
    is written out with its weights moved out of memory as they go, and emptied, so the weights
    are held once (by onnxruntime) instead of three times.
    """
    import onnxruntime as ort

    so = session_options(optimize, threads)
    size = proto_bytes(model)
    if consume and size >= CONSUME_VIA_FILE_BYTES:
        with tempfile.TemporaryDirectory(prefix="edgeq-session-") as tmp, temporary_files(tmp):
            path = Path(tmp) / "model.onnx"
            onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location="model.onnx" + EXTERNAL_DATA_SUFFIX, size_threshold=1024, convert_attribute=False)
            model.Clear()  # (saving moved the weights to the file; nothing else is left worth keeping)
            return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    if size < VIA_FILE_BYTES:
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory(prefix="edgeq-session-") as tmp:
        path = save_model(model, Path(tmp) / "model.onnx")
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def session_options(optimize: bool = False, threads: int | None = None):
    """The onnxruntime ``SessionOptions`` every edgeq session starts from: graph optimizations off
    (``optimize=False``: the graph as written) or onnxruntime's default level, ``threads`` intra-op
    threads, and log level 4 (fatal only): at 3 onnxruntime still prints its own
    ``[E:onnxruntime:...]`` line (a model it cannot initialize, a node failing at run time) before
    the one line edgeq reports it with."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    return so


def check_loads(model_path: Path) -> None:
    """An onnxruntime session on the saved model, built the cheapest way (no graph optimizations,
    no weight prepacking): an output must load, and a large one must not be held twice to show it."""
    import onnxruntime as ort

    so = session_options(optimize=False)
    so.add_session_config_entry("session.disable_prepacking", "1")
    ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])


def graph_session(graph: gs.Graph, prepare=None, optimize: bool = False, threads: int | None = None):
    """An onnxruntime CPU session on a graphsurgeon graph whose large constants go straight from
    numpy into an external data file: they are never serialized into protobuf (an export holds
    the bytes, the tensor proto, the graph's and the model's copy; 3 GB at peak for a block with a
    1 GB vocabulary table), so onnxruntime's copy is the only other one. ``prepare(model)`` edits
    the exported graph (outputs, inputs) before the session is built; ``graph`` is unchanged."""
    import onnxruntime as ort

    so = session_options(optimize, threads)
    with tempfile.TemporaryDirectory(prefix="edgeq-session-") as tmp, temporary_files(tmp):
        path = Path(tmp) / "model.onnx"
        with constants_as_external_data(graph, path.parent / ("model.onnx" + EXTERNAL_DATA_SUFFIX)):
            model = to_model(graph)
        if prepare is not None:
            prepare(model)
        onnx.save_model(model, str(path))
        del model
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@dataclass(frozen=True)
class InputSpec:
    """A graph input described like onnxruntime's NodeArg (name, 'tensor(int64)', shape with
    strings for symbolic dims), read from the proto so no session has to be built for it."""

    name: str
    type: str
    shape: list


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        type_name = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "float32"
        type_name = {"float32": "float", "float64": "double"}.get(type_name, type_name)
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        specs.append(InputSpec(vi.name, f"tensor({type_name})", shape))
    return specs


def unique_name(index: GraphIndex, base: str) -> str:
    """A tensor name not yet used in the graph (registers it so repeated calls differ)."""
    name, i = base, 0
    while name in index.tensors:
        i += 1
        name = f"{base}_{i}"
    index.tensors[name] = gs.Variable(name)
    return name
