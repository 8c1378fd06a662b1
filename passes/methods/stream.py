"""The residual stream of a pre-norm transformer: who reads it, who writes it, where it starts.

Rotation (``rotate``) and zero-mean conversion (``ln-to-rms``) are exact only if EVERY writer of
the stream is rewritten and nothing but norms, residual adds and elementwise casts reads it.
``analyze_stream`` collects exactly that or raises ``NotApplicable`` with the reason (e.g. BERT's
post-LN stream, where norm outputs feed the residual adds).

- readers: linears reading a norm's output (through reshapes and token selection);
- writers: linears whose output (through bias Add / reshapes) is a residual add's branch;
- sources: what writes the stream before the first block: embedding Gathers, graph inputs
  (embeddings computed outside the graph), constants added,
  concatenated or expanded into it (position embeddings, class tokens), a patch-embedding Conv;
- mlp_outputs: each MLP block's output linear (down_proj / fc2), where the online Hadamard goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq import ir
from edgeq.structure import Linear, Norm, analyze
from edgeq.passes.methods.weights import SHAPE_ONLY as _SHAPE_ONLY
from edgeq.passes.methods.weights import TRANSPARENT as _TRANSPARENT
from edgeq.passes.methods.weights import position_wise_readers


class NotApplicable(Exception):
    """The graph's residual stream is not one a stream rewrite can handle exactly."""


@dataclass(frozen=True)
class ResidualStream:
    hidden: int
    norms: tuple[Norm, ...]
    readers: tuple[Linear, ...]
    writers: tuple[Linear, ...]
    sources: tuple[dict, ...]
    mlp_outputs: tuple[Linear, ...]


def analyze_stream(graph: gs.Graph) -> ResidualStream:
    """Find the norms, readers, writers and sources of the residual stream, or raise
    ``NotApplicable`` saying what does not fit."""
    s = analyze(graph)
    index = ir.GraphIndex(graph)
    if not s.residual_adds or not s.norms:
        raise NotApplicable("no residual stream with norms found")
    for norm in s.norms:
        if norm.skip is not None:
            raise NotApplicable(f"fused Skip*Norm {norm.name}: the residual add is inside the op")
    by_node = {lin.node: lin for lin in s.linears if not lin.quantized}
    readers = []
    for norm in s.norms:
        for consumer in position_wise_readers(index, norm.output):
            lin = by_node.get(consumer.name)
            if lin is None:
                raise NotApplicable(f"norm {norm.name} output is read by {consumer.op} {consumer.name}, not a linear")
            readers.append(lin)
    norm_nodes = {name for norm in s.norms for name in norm.nodes}
    add_nodes = {r.node for r in s.residual_adds}
    stream = set()
    for r in s.residual_adds:
        stream.update([r.stream, r.output] if r.output else [r.stream])
    stream.update(norm.input for norm in s.norms)
    _check_stream_readers(graph, index, stream, norm_nodes | add_nodes)
    writers = [_writer(index, by_node, r.branch) for r in s.residual_adds]
    first = min(s.residual_adds, key=lambda r: _position(graph, r.node))
    sources = _sources(index, first.stream, stream)
    hidden = readers[0].k
    if any(lin.k != hidden for lin in readers) or any(lin.n != hidden for lin in writers):
        raise NotApplicable("readers and writers of the stream disagree on the hidden size")
    for src in sources:
        if src["kind"] == "transpose":
            continue
        if src["kind"] == "input":
            shape = index.tensors[src["tensor"]].shape
            if not shape or shape[-1] != hidden:
                raise NotApplicable(f"stream input {src['tensor']} has last dimension {shape and shape[-1]}, not {hidden}")
            continue
        node = next(n for n in graph.nodes if n.name == src["node"])
        value = index.constant_value(node.inputs[src["operand"]])
        width = value.shape[0] if src["kind"] == "conv" else value.shape[-1]
        if width != hidden:
            raise NotApplicable(f"stream source {node.name} has width {width}, not the hidden size {hidden}")
    mlp_outputs = [by_node[b.linears[-1]] for b in s.mlp_blocks if b.linears and b.linears[-1] in by_node]
    return ResidualStream(hidden, tuple(s.norms), tuple(_unique(readers)), tuple(_unique(writers)),
                          tuple(sources), tuple(_unique(mlp_outputs)))


def require_weightless_rms(graph: gs.Graph, stream: ResidualStream, pass_name: str) -> None:
    """Stream rewrites (rotate, resq) need every norm to be a weightless RMSNorm, i.e. fuse-norms
    and ln-to-rms before them; raise ``UserInputError`` naming the missing step otherwise."""
    from edgeq.errors import UserInputError
    from edgeq.passes.methods.weights import is_weightless

    index = ir.GraphIndex(graph)
    for norm in stream.norms:
        if not is_weightless(index, norm):
            raise UserInputError(f"{pass_name}: norm {norm.name} still has a scale/bias: put fuse-norms before {pass_name}")
        if norm.kind != "rms":
            raise UserInputError(f"{pass_name}: norm {norm.name} is a LayerNorm: put ln-to-rms before {pass_name}")


def _unique(linears):
    seen, out = set(), []
    for lin in linears:
        if lin.node not in seen:
            seen.add(lin.node)
            out.append(lin)
    return out


def _position(graph: gs.Graph, name: str) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n.name == name)


def _check_stream_readers(graph, index, stream: set[str], allowed: set[str]) -> None:
    todo = list(stream)
    seen = set()
    outputs = {t.name for t in graph.outputs}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in outputs:
            raise NotApplicable(f"residual stream tensor {name} is a graph output")
        for node in index.consumers(name):
            if node.name in allowed or node.op in ("Shape", "Size"):
                continue
            if node.op in _TRANSPARENT:
                todo.append(node.outputs[0].name)
                continue
            raise NotApplicable(f"residual stream tensor {name} is read by {node.op} {node.name}")


def _writer(index, by_node, branch: str):
    """The linear whose output (through bias Add / reshapes) is a residual add's branch."""
    name = branch
    while True:
        producer = index.producer(name)
        if producer is None:
            raise NotApplicable(f"block output {branch} has no producer")
        if producer.name in by_node:
            return by_node[producer.name]
        if producer.op in _SHAPE_ONLY or producer.op in _TRANSPARENT:
            name = producer.inputs[0].name
            continue
        if producer.op == "Add":
            lin = next((by_node[p.name] for t in producer.inputs if (p := index.producer(t.name)) is not None
                        and p.name in by_node and by_node[p.name].bias_add == producer.name), None)
            if lin is not None:
                return lin
        raise NotApplicable(f"block output {branch} is written by {producer.op} {producer.name}, not a linear")


def _square_constant(index, tensor) -> bool:
    value = index.constant_value(tensor)
    return value is not None and np.ndim(value) == 2 and value.shape[0] == value.shape[1]


def _sources(index, start: str, stream: set[str]) -> list[dict]:
    """What writes the stream before the first block: embedding Gathers, constant Adds/Concats
    (position embeddings, class tokens), a patch-embedding Conv."""
    sources, todo, seen = [], [start], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node = index.producer(name)
        if node is None:
            # a graph input (e.g. inputs_embeds of a vision-language model): the passes transform
            # it online, with one small op at the input
            sources.append({"kind": "input", "tensor": name})
            continue
        if node.op == "MatMul" and index.producer(node.inputs[0].name) is None and _square_constant(index, node.inputs[1]):
            # x @ M at a graph input (ln-to-rms's centring, rotate's Q): folds like a constant
            sources.append({"kind": "input-matmul", "node": node.name, "operand": 1})
        elif node.op == "Gather" and index.constant_value(node.inputs[0]) is not None:
            sources.append({"kind": "embedding", "node": node.name, "operand": 0})
        elif node.op in ("Add", "Concat", "Sub"):
            for i, t in enumerate(node.inputs):
                if index.constant_value(t) is not None:
                    if node.op == "Sub":
                        raise NotApplicable(f"constant subtracted from the stream at {node.name}")
                    sources.append({"kind": f"constant-{node.op.lower()}", "node": node.name, "operand": i})
                else:
                    todo.append(t.name)
        elif node.op in _TRANSPARENT or node.op in ("Reshape", "Flatten"):
            todo.append(node.inputs[0].name)
        elif node.op == "Transpose":
            todo.append(node.inputs[0].name)
            sources.append({"kind": "transpose", "node": node.name, "operand": -1})
        elif node.op in ("Expand", "Tile") and index.constant_value(node.inputs[0]) is not None:
            sources.append({"kind": "constant-expand", "node": node.name, "operand": 0})
        elif node.op == "Conv" and index.constant_value(node.inputs[1]) is not None:
            sources.append({"kind": "conv", "node": node.name, "operand": 1})
        else:
            raise NotApplicable(f"stream source {node.op} {node.name} is not an embedding, constant or conv")
    return sources


def transform_stream_input(graph, index, x, matrix: np.ndarray, tag: str) -> None:
    """Every reader of graph input ``x`` reads ``x @ matrix`` instead (interface unchanged); the
    MatMul is an ``input-matmul`` stream source that later passes fold into."""
    readers = list(x.outputs)
    out = gs.Variable(ir.unique_name(index, f"{x.name}_{tag}"), dtype=x.dtype, shape=x.shape)
    const = gs.Constant(ir.unique_name(index, f"{x.name}_{tag}_matrix"), matrix)
    graph.nodes.append(gs.Node("MatMul", f"{x.name}_{tag}", inputs=[x, const], outputs=[out]))
    for node in readers:
        for k, t in enumerate(node.inputs):
            if t is x:
                node.inputs[k] = out
