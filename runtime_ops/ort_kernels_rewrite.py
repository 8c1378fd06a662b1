"""``use_ort_kernels(model)``: move the edgeq nodes that the onnxruntime kernels can run to the
kernel domain ``edgeq.ort``, prepared the way the kernels need them.

Why a rewrite: the kernels (``ort_kernels``) are onnxruntime-extensions Python ops, which need
every attribute on the node, no empty inputs, no 4-bit tensors, declared input types, and lose
FLOAT attribute digits (see ``ort_kernels_spec``). So for each ``edgeq`` node whose op is selected
and whose input element types are known and accepted, the rewrite:

- writes every attribute (schema defaults for the missing ones) and, for each FLOAT attribute a,
  the STRING attribute ``a__exact`` = repr of its float32 value;
- gives SubspaceQDQ's absent scale / zero-point inputs (dynamic mode ignores them) shared
  placeholder initializers;
- casts W4A8Linear's int4 / uint4 weight and zero point to int8 (a Cast of initializers, which
  onnxruntime folds when the session is made);
- sets the node's domain to ``edgeq.ort``.

Every other node (unselected op, unknown or unaccepted type, missing required attribute) stays in
``edgeq`` and runs its function body. The rewritten model keeps running without the kernels too:
it carries a copy of each moved op's FunctionProto in ``edgeq.ort``, and onnxruntime uses a
registered kernel before a model function of the same domain and name (probed with onnxruntime
1.32 and onnxruntime-extensions 0.15.2), the function otherwise. Returns a new model (the input is
not modified); idempotent.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgeq.runtime_ops.domain import DOMAIN
from edgeq.runtime_ops.ort_kernels_spec import (
    CAST_TO_INT8,
    EXACT_SUFFIX,
    FOUR_BIT,
    INPUT_TYPES,
    KERNEL_DOMAIN,
    KERNEL_DOMAIN_VERSION,
    KERNEL_OPS,
)
from edgeq.runtime_ops.schema import SCHEMAS

_PLACEHOLDER_SCALE = "edgeq_ort_absent_scale"  # float32 1.0
_PLACEHOLDER_ZERO_POINT = "edgeq_ort_absent_zero_point"  # int8 0


def _graphs(graph: onnx.GraphProto):
    """``graph`` and every subgraph (If / Loop / Scan bodies), outermost first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else
                      attr.graphs if attr.type == onnx.AttributeProto.GRAPHS else []):
                yield from _graphs(g)


def _element_types(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor name -> onnx element type, from initializers, graph inputs / outputs / value_info."""
    types = {}
    for g in _graphs(model.graph):
        for init in g.initializer:
            types[init.name] = init.data_type
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                types[vi.name] = vi.type.tensor_type.elem_type
    return types


def _attribute_values(node: onnx.NodeProto) -> dict | None:
    """The node's schema attributes with defaults filled in; None when a required one is missing."""
    given = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    values = {}
    for spec in SCHEMAS[node.op_type].attributes:
        value = given.get(spec.name, spec.default)
        if value is None:
            return None
        values[spec.name] = value
    return values


def _inputs(node: onnx.NodeProto, attrs: dict) -> list[str] | None:
    """The node's inputs, all of them present (placeholders for SubspaceQDQ's dynamic-mode
    scales and zero points); None when an input is absent that the op needs."""
    names = list(node.input) + [""] * (len(SCHEMAS[node.op_type].inputs) - len(node.input))
    if "" not in names:
        return names
    if node.op_type != "SubspaceQDQ" or not attrs["dynamic"] or names[0] == "":
        return None
    return [n or (_PLACEHOLDER_SCALE if i % 2 else _PLACEHOLDER_ZERO_POINT) for i, n in enumerate(names)]


def _accepted(op_type: str, inputs: list[str], types: dict[str, int]) -> bool:
    return all(types.get(name) in allowed for name, allowed in zip(inputs, INPUT_TYPES[op_type]))


def _prepare(node: onnx.NodeProto, types: dict[str, int]) -> list[onnx.NodeProto] | None:
    """Rewrite ``node`` in place for the kernel; returns the Cast nodes to put before it, or None
    (node untouched) when the kernel cannot take it."""
    attrs = _attribute_values(node)
    inputs = None if attrs is None else _inputs(node, attrs)
    if inputs is None or not _accepted(node.op_type, inputs, types):
        return None
    assert attrs is not None  # inputs is None whenever attrs is
    casts = []
    for i in CAST_TO_INT8.get(node.op_type, ()):
        if types[inputs[i]] in FOUR_BIT:
            cast_out = f"{inputs[i]}_int8_for_{node.output[0]}"
            casts.append(helper.make_node("Cast", [inputs[i]], [cast_out], to=onnx.TensorProto.INT8,
                                          name=f"{node.name or node.output[0]}_cast_{i}"))
            inputs[i] = cast_out
    del node.input[:]
    node.input.extend(inputs)
    written = dict(attrs)
    for spec in SCHEMAS[node.op_type].attributes:
        if spec.type == "FLOAT":
            written[spec.name + EXACT_SUFFIX] = repr(float(np.float32(attrs[spec.name])))
    kept = [a for a in node.attribute if a.name not in written]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(k, v) for k, v in written.items()])
    node.domain = KERNEL_DOMAIN
    return casts


def _default_opset(model: onnx.ModelProto) -> int:
    return next(i.version for i in model.opset_import if i.domain in ("", "ai.onnx"))


def _add_fallback_functions(model: onnx.ModelProto, op_types: Iterable[str]) -> None:
    """A copy of each op's FunctionProto in the kernel domain (runs when no kernel is registered),
    declaring the ``__exact`` attributes it ignores; and the kernel domain's opset import."""
    existing = {(f.domain, f.name) for f in model.functions}
    for op_type in sorted(op_types):
        if (KERNEL_DOMAIN, op_type) in existing:
            continue
        schema = SCHEMAS[op_type]
        fn = schema.function_builder(_default_opset(model))
        fn.domain = KERNEL_DOMAIN
        fn.attribute.extend(a.name + EXACT_SUFFIX for a in schema.attributes if a.type == "FLOAT")
        model.functions.append(fn)
    if op_types and KERNEL_DOMAIN not in {i.domain for i in model.opset_import}:
        model.opset_import.append(helper.make_opsetid(KERNEL_DOMAIN, KERNEL_DOMAIN_VERSION))


def use_ort_kernels(model: onnx.ModelProto, ops: Iterable[str] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` whose edgeq nodes of the ops ``ops`` (default: every op in
    ``KERNEL_OPS``) run the onnxruntime kernels wherever the kernels can take them (module
    docstring); a copy with nothing changed when none can. Unknown op names raise ValueError."""
    selected = set(KERNEL_OPS if ops is None else ops)
    if selected - set(KERNEL_OPS):
        raise ValueError(f"no onnxruntime kernel for {sorted(selected - set(KERNEL_OPS))}; kernels: {list(KERNEL_OPS)}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    candidates = [n for g in _graphs(out.graph) for n in g.node if n.domain == DOMAIN and n.op_type in selected]
    if not candidates:
        return out
    types = _element_types(out)
    types.update({_PLACEHOLDER_SCALE: onnx.TensorProto.FLOAT, _PLACEHOLDER_ZERO_POINT: onnx.TensorProto.INT8})
    if any(name and name not in types for n in candidates for name in n.input):
        try:  # types of intermediate tensors; a model past protobuf's 2 GB cannot be inferred in memory
            types = {**_element_types(onnx.shape_inference.infer_shapes(out)), **types}
        except Exception:  # noqa: BLE001  (nodes whose input types stay unknown keep their body)
            pass
    moved, placeholders = set(), False
    # innermost graphs first: rebuilding a graph's node list copies its nodes, subgraphs included
    for graph in reversed(list(_graphs(out.graph))):
        nodes = []
        for node in graph.node:
            casts = _prepare(node, types) if node.domain == DOMAIN and node.op_type in selected else None
            if casts is not None:
                moved.add(node.op_type)
                placeholders |= any(n in (_PLACEHOLDER_SCALE, _PLACEHOLDER_ZERO_POINT) for n in node.input)
            nodes += (casts or []) + [node]
        if len(nodes) != len(graph.node):
            snapshot = [onnx.NodeProto.FromString(n.SerializeToString()) for n in nodes]
            del graph.node[:]
            graph.node.extend(snapshot)
    if placeholders and _PLACEHOLDER_SCALE not in {i.name for i in out.graph.initializer}:
        out.graph.initializer.extend([numpy_helper.from_array(np.array(1.0, np.float32), _PLACEHOLDER_SCALE),
                                      numpy_helper.from_array(np.array(0, np.int8), _PLACEHOLDER_ZERO_POINT)])
    _add_fallback_functions(out, moved)
    return out
