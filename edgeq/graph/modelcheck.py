"""The structural check of a model at load (``edgeq.graph.ir.load_model``): what makes a graph invalid
before any pass or onnxruntime sees it, refused with one ``UserInputError`` line naming the model
and the node or tensor, instead of an internal error deep inside a pass (exit 1).

Cheap, one pass over the protobuf, no weights read (those stored as external data are checked
against their files by ``edgeq.graph.ir``):

- text: every name and string field is valid UTF-8 (a flipped byte that still parses leaves one
  that protobuf hands back as ``bytes``);
- wiring: the graph has outputs; every tensor a node reads or an output names is a graph input,
  an initializer or a node's output; each tensor has one writer (static single assignment); there
  is no cycle (a node reading its own output, or any loop: a topological sort);
- operators: a node of the ONNX domains is an operator of the opset the model imports, with an
  input and output count its schema allows; an ``edgeq`` node is one of edgeq's ops; any other
  domain is one onnxruntime or edgeq knows (``KNOWN_DOMAINS``) or the model's own functions';
- initializers: an ONNX data type, no negative dim, and as many bytes (or values) as their dims
  and type need;
- types: onnx's type and shape inference in strict mode on the graph with its initializers as
  typed inputs and no annotations but the inputs' and the outputs' element types (what onnxruntime
  checks when it builds a session, without the weights): an operator given an input type it does
  not take, an output whose element type is not the one declared, shapes that cannot meet.

The bodies of If / Loop / Scan get the operator check; their wiring (which may read outer-scope
names) is left to onnxruntime.
"""

from __future__ import annotations

import math
import os

import onnx
from google.protobuf.descriptor import FieldDescriptor

from edgeq.errors import UserInputError
from edgeq.graph.protowalk import proto_nodes

# domains whose operators are not in onnx's schema registry but that onnxruntime (its contrib and
# internal layouts, onnxruntime-extensions) or edgeq (its kernels' domain) runs
KNOWN_DOMAINS = frozenset({"com.microsoft", "com.microsoft.nchwc", "com.ms.internal.nhwc", "com.microsoft.extensions",
                           "ai.onnx.contrib", "edgeq.ort"})
# domains checked against onnx's schemas ("ai.onnx" is the default domain's long name)
ONNX_DOMAINS = frozenset({"", "ai.onnx.ml", "ai.onnx.preview.training", "ai.onnx.training"})
EDGEQ_DOMAIN = "edgeq"

# bits per element; sub-byte types are packed (onnx numpy_helper)
_BITS_BY_NAME = {"FLOAT": 32, "UINT8": 8, "INT8": 8, "UINT16": 16, "INT16": 16, "INT32": 32, "INT64": 64, "BOOL": 8,
                 "FLOAT16": 16, "DOUBLE": 64, "UINT32": 32, "UINT64": 64, "COMPLEX64": 64, "COMPLEX128": 128,
                 "BFLOAT16": 16, "FLOAT8E4M3FN": 8, "FLOAT8E4M3FNUZ": 8, "FLOAT8E5M2": 8, "FLOAT8E5M2FNUZ": 8,
                 "UINT4": 4, "INT4": 4, "FLOAT4E2M1": 4, "FLOAT8E8M0": 8, "UINT2": 2, "INT2": 2, "FLOAT6E2M3": 6,
                 "FLOAT6E3M2": 6}
ELEMENT_BITS = {getattr(onnx.TensorProto, k): v for k, v in _BITS_BY_NAME.items() if hasattr(onnx.TensorProto, k)}


def tensor_bytes(tensor: onnx.TensorProto) -> int | None:
    """The bytes ``tensor``'s dims and data type need (None for strings and unknown types)."""
    bits = ELEMENT_BITS.get(tensor.data_type)
    return None if bits is None else (math.prod(tensor.dims) * bits + 7) // 8


def check_structure(model: onnx.ModelProto, path: str | os.PathLike, types: bool = True) -> None:
    """Raise a one-line ``UserInputError`` for the first structural fault of ``model`` (see the
    module docstring); ``path`` names the model in the message. ``types=False`` leaves the type
    check (``check_types``) to the caller: it needs the values of external Constant tensors read in."""
    _check_text(model, path)
    _check_wiring(model.graph, path)
    _check_operators(model, path)
    _check_initializers(model.graph, path)
    if types:
        check_types(model, path)


# -- text ------------------------------------------------------------------------------------------


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)
    return repeated if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _undecodable(message) -> tuple[str, bytes] | None:
    """(field, value) of the first string field holding bytes that are not UTF-8 (protobuf hands a
    proto2 string it cannot decode back as ``bytes``). A tensor's data fields are not visited (its
    weights are never copied out for this)."""
    if isinstance(message, onnx.TensorProto):
        fields: list[tuple[str, str | bytes]] = [("TensorProto.name", message.name),
                                                 ("TensorProto.doc_string", message.doc_string)]
        fields += [("TensorProto.external_data", v) for e in message.external_data for v in (e.key, e.value)]
        return next(((f, v) for f, v in fields if isinstance(v, bytes)), None)
    for field, value in message.ListFields():
        items = value if _is_repeated(field) else (value,)
        if field.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
            for item in items:
                found = _undecodable(item)
                if found is not None:
                    return found
        elif field.type == FieldDescriptor.TYPE_STRING:
            for item in items:
                if isinstance(item, bytes):
                    return f"{field.containing_type.name}.{field.name}", item
    return None


def _check_text(model: onnx.ModelProto, path) -> None:
    found = _undecodable(model)
    if found is not None:
        field, value = found
        raise UserInputError(f"{path}: a {field} is not valid UTF-8 ({value[:60]!r}): the file is damaged")


# -- wiring ----------------------------------------------------------------------------------------


def _label(node: onnx.NodeProto) -> str:
    return node.name or node.op_type or "(unnamed)"


def _check_wiring(graph: onnx.GraphProto, path) -> None:
    if not graph.output:
        raise UserInputError(f"{path}: the graph has no outputs")
    sources = {vi.name for vi in graph.input}
    sources.update(t.name for t in graph.initializer)
    sources.update(t.values.name for t in graph.sparse_initializer)
    producer: dict[str, int] = {}
    nodes = graph.node
    for k, node in enumerate(nodes):
        for name in node.output:
            if not name:
                continue
            if name in producer:
                raise UserInputError(f"{path}: tensor '{name}' is written by two nodes ('{_label(nodes[producer[name]])}' "
                                     f"and '{_label(node)}')")
            if name in sources:
                raise UserInputError(f"{path}: node '{_label(node)}' writes '{name}', which is also a graph input or "
                                     "an initializer")
            producer[name] = k
    for node in nodes:
        for name in node.input:
            if name and name not in sources and name not in producer:
                raise UserInputError(f"{path}: node '{_label(node)}' reads tensor '{name}', which is not a graph "
                                     "input, an initializer or any node's output")
    for vi in graph.output:
        if vi.name not in sources and vi.name not in producer:
            raise UserInputError(f"{path}: graph output '{vi.name}' is not produced by any node, input or initializer")
    _check_acyclic(nodes, producer, path)


def _check_acyclic(nodes, producer: dict[str, int], path) -> None:
    """A topological sort (Kahn): every node must become ready once its producers have."""
    waiting = [0] * len(nodes)
    users: dict[int, list[int]] = {}
    preds: list[set[int]] = []
    for k, node in enumerate(nodes):
        deps = {producer[name] for name in node.input if name in producer}
        preds.append(deps)
        waiting[k] = len(deps)
        for d in deps:
            users.setdefault(d, []).append(k)
    ready = [k for k, n in enumerate(waiting) if n == 0]
    done = 0
    while ready:
        k = ready.pop()
        done += 1
        for u in users.get(k, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    if done == len(nodes):
        return
    k = next(k for k, n in enumerate(waiting) if n)
    seen = set()
    while k not in seen:  # walk back through unsorted producers until one repeats: it is on the cycle
        seen.add(k)
        k = next(d for d in sorted(preds[k]) if waiting[d])
    node = nodes[k]
    if k in preds[k]:
        own = next(name for name in node.input if producer.get(name) == k)
        raise UserInputError(f"{path}: node '{_label(node)}' reads its own output '{own}'")
    raise UserInputError(f"{path}: the graph has a cycle through node '{_label(node)}' (its inputs depend on its "
                         "own outputs)")


# -- operators -------------------------------------------------------------------------------------


def _check_operators(model: onnx.ModelProto, path) -> None:
    imports: dict[str, int] = {}
    for imp in model.opset_import:
        imports.setdefault("" if imp.domain == "ai.onnx" else imp.domain, imp.version)
    functions = {(f.domain, f.name) for f in model.functions}
    schemas: dict[tuple[str, str, int], onnx.defs.OpSchema | None] = {}
    edgeq_ops = None
    for node in proto_nodes(model.graph.node):
        domain = "" if node.domain == "ai.onnx" else node.domain
        label = _label(node)
        if not node.op_type:
            raise UserInputError(f"{path}: node '{label}' has no op_type")
        if (node.domain, node.op_type) in functions:
            continue
        if domain in ONNX_DOMAINS:
            version = imports.get(domain)
            shown = domain or "the default ONNX domain"
            if version is None:
                raise UserInputError(f"{path}: node '{label}' ({node.op_type}) is in {shown}, which the model does "
                                     "not import (opset_import)")
            if version < 1:
                raise UserInputError(f"{path}: the model imports version {version} of {shown}; versions start at 1")
            key = (domain, node.op_type, min(version, 2**31 - 1))
            if key not in schemas:
                try:
                    schemas[key] = onnx.defs.get_schema(node.op_type, key[2], domain)
                except onnx.defs.SchemaError:
                    schemas[key] = None
            schema = schemas[key]
            if schema is None:
                raise UserInputError(f"{path}: node '{label}' has op_type '{node.op_type}', which is not an operator of "
                                     f"{shown} at opset {version}")
            for what, count, low, high in (("inputs", len(node.input), schema.min_input, schema.max_input),
                                           ("outputs", len(node.output), schema.min_output, schema.max_output)):
                if not low <= count <= high:
                    allowed = str(low) if low == high else f"{low} or more" if high >= 2**31 - 1 else f"{low} to {high}"
                    raise UserInputError(f"{path}: node '{label}' ({node.op_type}) has {count} {what}; "
                                         f"{node.op_type}-{schema.since_version} takes {allowed}")
        elif domain == EDGEQ_DOMAIN:
            if edgeq_ops is None:
                from edgeq.runtime_ops.schema import SCHEMAS

                edgeq_ops = set(SCHEMAS)
            if node.op_type not in edgeq_ops:
                raise UserInputError(f"{path}: node '{label}' has op_type '{node.op_type}', which is not an edgeq op "
                                     f"(known: {', '.join(sorted(edgeq_ops))})")
        elif domain not in KNOWN_DOMAINS and not any(d == node.domain for d, _ in functions):
            raise UserInputError(f"{path}: node '{label}' ({node.op_type}) is in domain '{node.domain}', which neither "
                                 "onnxruntime nor edgeq knows and the model defines no function of")


# -- initializers ----------------------------------------------------------------------------------

_DATA_TYPES = frozenset(onnx.TensorProto.DataType.values()) - {onnx.TensorProto.UNDEFINED}
_COMPLEX = frozenset({onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128})


def _type_name(data_type: int) -> str:
    return onnx.TensorProto.DataType.Name(data_type) if data_type in _DATA_TYPES else str(data_type)


def _check_initializers(graph: onnx.GraphProto, path) -> None:
    for t in graph.initializer:
        if t.data_type not in _DATA_TYPES:
            raise UserInputError(f"{path}: initializer '{t.name}' has data type {t.data_type}, which is not an ONNX "
                                 "tensor type")
        dims = list(t.dims)
        if any(d < 0 for d in dims):
            raise UserInputError(f"{path}: initializer '{t.name}' has a negative dim: {dims}")
        if t.data_location == onnx.TensorProto.EXTERNAL:
            continue  # its bytes are checked against its file (edgeq.graph.ir)
        count = math.prod(dims)
        kind = _type_name(t.data_type)
        if t.HasField("raw_data"):
            want: int | str | None = tensor_bytes(t)
            if want is None:
                raise UserInputError(f"{path}: initializer '{t.name}' of type {kind} has raw_data, which that type "
                                     "cannot use")
            got = len(t.raw_data)
            if got != want:
                raise UserInputError(f"{path}: initializer '{t.name}' holds {got} bytes, but {kind} {dims} needs "
                                     f"{want}")
            continue
        field = onnx.helper.tensor_dtype_to_field(t.data_type)
        got = len(getattr(t, field))
        if ELEMENT_BITS.get(t.data_type, 8) < 8:  # packed several to a value
            bad = (got == 0) != (count == 0)
            want = "some"
        else:
            want = count * (2 if t.data_type in _COMPLEX else 1)
            bad = got != want
        if bad:
            raise UserInputError(f"{path}: initializer '{t.name}' holds {got} values in {field}, but {kind} {dims} "
                                 f"needs {want}")


# -- types -----------------------------------------------------------------------------------------


def _typed_skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without weights: its initializers become graph inputs of their type and dims, the
    intermediate annotations (``value_info``) are dropped and the outputs keep their element type
    only (onnxruntime merges stale shapes there leniently; strict inference would not)."""
    skeleton = onnx.ModelProto(ir_version=model.ir_version)
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    graph, source = skeleton.graph, model.graph
    graph.node.extend(source.node)
    graph.input.extend(source.input)
    listed = {vi.name for vi in source.input}
    graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                       for t in source.initializer if t.name not in listed)
    for vi in source.output:
        out = graph.output.add()
        out.name = vi.name
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            out.type.tensor_type.elem_type = vi.type.tensor_type.elem_type
    return skeleton


def check_types(model: onnx.ModelProto, path) -> None:
    """Graph inputs of tensor types, and the graph type-checks under onnx's strict inference."""
    for vi in model.graph.input:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type not in _DATA_TYPES:
            raise UserInputError(f"{path}: graph input '{vi.name}' has element type {vi.type.tensor_type.elem_type}, "
                                 "which is not an ONNX tensor type")
    skeleton = _typed_skeleton(model)
    if skeleton.ByteSize() >= 2**31 - 1:  # (weights in Constant nodes): protobuf cannot hand it over
        return
    try:
        onnx.shape_inference.infer_shapes(skeleton, check_type=True, strict_mode=True)
    except Exception as exc:  # noqa: BLE001 (InferenceError, ValidationError, ValueError: onnx's verdict on the file)
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise UserInputError(f"{path}: the graph does not type-check: {first}") from None
