"""The residual stream of a pre-norm transformer: who reads it, who writes it, where it starts.

Rotation (``rotate``) and zero-mean conversion (``ln-to-rms``) are exact only if EVERY writer of
the stream is rewritten and nothing but norms, residual adds and elementwise casts reads it.
``analyze_stream`` collects exactly that or raises ``PassNotApplicable`` (``structure-not-found``)
with the reason (e.g. BERT's post-LN stream, where norm outputs feed the residual adds).

- norms: the stream norms, whose input is the residual stream (per-head q/k norms and other norms
  inside a block are not);
- readers: linears reading a stream norm's output (through reshapes and token selection);
- writers: linears whose output (through bias Add / reshapes) is a residual add's branch (both
  blocks' output linears of a parallel block, whose outputs are summed into one add);
- post_norms: norms on a block's write path (Gemma's sandwich norms) with the linear feeding them;
- sources: what writes the stream before the first block: embedding Gathers, graph inputs
  (embeddings computed outside the graph), constants added,
  concatenated or expanded into it (position embeddings, class tokens), a patch-embedding Conv,
  seen through scalar scalings (Gemma's sqrt(hidden));
- mlp_outputs: each MLP block's output linear (down_proj / fc2), where the online Hadamard goes.

The stream itself may pass through casts and Reshapes that keep the hidden axis last (OPT
flattens it to ``[b * s, h]`` around the MLP): those move whole hidden vectors.

The families named here are examples; what each declared family has (``pre_norm``,
``sandwich_norms``, ``head_norms``, ``embedding_scale``, ...) is its entry in ``edgeq.families``,
checked against ``analyze_stream`` by ``tests/test_families.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passmanager.passbase import PassNotApplicable, Reason
from edgeq.structure import Linear, Norm, analyze
from edgeq.passes.methods.weights import SHAPE_ONLY as _SHAPE_ONLY
from edgeq.passes.methods.weights import TRANSPARENT as _TRANSPARENT
from edgeq.passes.methods.weights import position_wise_readers


def _not_applicable(detail: str) -> PassNotApplicable:
    """The graph's residual stream is not one a stream rewrite can handle exactly (the passes let
    it propagate: the pipeline records it as ``structure-not-found``)."""
    return PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, detail)


@dataclass(frozen=True)
class PostNorm:
    """A norm on a block's write path (Gemma's sandwich norms): ``writer`` (o_proj / down_proj)
    feeds ``norm``, whose output ``branch`` the residual Add ``add`` reads. ``RMSNorm(y) * g``
    does not commute with a rotation of the stream, so stream rewrites keep the writer's output
    unrotated and rotate the norm's output online instead (``rotation.rotate_post_norms``)."""

    norm: Norm
    writer: Linear
    add: str
    branch: str


@dataclass(frozen=True)
class ResidualStream:
    hidden: int
    norms: tuple[Norm, ...]  # the stream norms (their input is the residual stream)
    readers: tuple[Linear, ...]
    writers: tuple[Linear, ...]  # linears that write the stream directly (their output is rotated)
    sources: tuple[dict, ...]
    mlp_outputs: tuple[Linear, ...]
    post_norms: tuple[PostNorm, ...] = ()


def analyze_stream(graph: gs.Graph) -> ResidualStream:
    """Find the norms, readers, writers and sources of the residual stream, or raise
    ``PassNotApplicable`` (``structure-not-found``) saying what does not fit.

    The stream is found from data flow: the tensors the residual adds read and write, followed
    through casts and position-wise Reshapes (those keeping the hidden axis last, as OPT's
    ``[b, s, h] -> [b * s, h]``). A norm whose input is on the stream is a stream norm (its
    readers must all be linears); a norm on a block's write path (the residual add reads its
    output) is a post-sublayer norm; any other norm (Qwen3's and Gemma 3's per-head q/k norms)
    is inside a block and no business of a stream rewrite."""
    s = analyze(graph)
    index = ir.GraphIndex(graph)
    if not s.residual_adds:
        raise _not_applicable("no residual stream with norms found")
    for norm in s.norms:
        if norm.skip is not None:
            raise _not_applicable(f"fused Skip*Norm {norm.name}: the residual add is inside the op")
    by_node = {lin.node: lin for lin in s.linears if not lin.quantized}
    writers, post_norms = [], []
    for r in s.residual_adds:
        if r.post_norm is None:
            writers.append(_writer(index, by_node, r.branch))
        else:
            post_norms.append(PostNorm(r.post_norm, _writer(index, by_node, r.post_norm.input), r.node, r.branch))
    hidden = writers[0].n if writers else post_norms[0].writer.n
    if any(lin.n != hidden for lin in writers) or any(p.writer.n != hidden for p in post_norms):
        raise _not_applicable("the writers of the residual stream disagree on the hidden size")
    stream = _stream_tensors(index, s.residual_adds, hidden)
    norms = [norm for norm in s.norms if norm.input in stream]
    if not norms:
        raise _not_applicable("no residual stream with norms found")
    readers = []
    for norm in norms:
        for consumer in position_wise_readers(index, norm.output):
            lin = by_node.get(consumer.name)
            if lin is None:
                raise _not_applicable(f"norm {norm.name} output is read by {consumer.op} {consumer.name}, not a linear")
            readers.append(lin)
    norm_nodes = {name for norm in norms for name in norm.nodes}
    add_nodes = {r.node for r in s.residual_adds}
    _check_stream_readers(graph, index, stream, norm_nodes | add_nodes, hidden)
    first = min(s.residual_adds, key=lambda r: _position(graph, r.node))
    sources = _sources(index, first.stream, stream)
    if any(lin.k != hidden for lin in readers):
        raise _not_applicable("readers and writers of the stream disagree on the hidden size")
    for src in sources:
        if src["kind"] == "transpose":
            continue
        if src["kind"] == "input":
            shape = index.tensors[src["tensor"]].shape
            if not shape or shape[-1] != hidden:
                raise _not_applicable(f"stream input {src['tensor']} has last dimension {shape and shape[-1]}, not {hidden}")
            continue
        node = next(n for n in graph.nodes if n.name == src["node"])
        value = cast(np.ndarray, index.constant_value(node.inputs[src["operand"]]))  # a constant (_sources)
        width = value.shape[0] if src["kind"] == "conv" else value.shape[-1]
        if width != hidden:
            raise _not_applicable(f"stream source {node.name} has width {width}, not the hidden size {hidden}")
    mlp_outputs = [by_node[b.linears[-1]] for b in s.mlp_blocks if b.linears and b.linears[-1] in by_node]
    return ResidualStream(hidden, tuple(norms), tuple(_unique(readers)), tuple(_unique(writers)),
                          tuple(sources), tuple(_unique(mlp_outputs)), tuple(post_norms))


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


def _check_stream_readers(graph, index, stream: set[str], allowed: set[str], hidden: int) -> None:
    todo = list(stream)
    seen = set()
    outputs = {t.name for t in graph.outputs}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in outputs:
            raise _not_applicable(f"residual stream tensor {name} is a graph output")
        for node in index.consumers(name):
            if node.name in allowed or node.op in ("Shape", "Size"):
                continue
            if node.op in _TRANSPARENT or _keeps_last_dim(index, node, name, stream, hidden):
                todo.append(node.outputs[0].name)
                continue
            raise _not_applicable(f"residual stream tensor {name} is read by {node.op} {node.name}")


def _stream_tensors(index, adds, hidden: int) -> set[str]:
    """The tensors that carry the residual stream: what the residual adds read and write, the
    tensors those are cast from (the stream before a Cast the norm and the add share), and
    everything reached from them through casts and position-wise Reshapes."""
    stream = set()
    for r in adds:
        stream.update([r.stream, r.output] if r.output else [r.stream])
    for name in list(stream):  # upstream through casts: llama's embedding output before the Cast
        for _ in range(8):
            node = index.producer(name)
            if node is None or node.op not in _TRANSPARENT:
                break
            name = node.inputs[0].name
            stream.add(name)
    todo = list(stream)
    while todo:
        name = todo.pop()
        for node in index.consumers(name):
            if not node.outputs or node.inputs[0].name != name:
                continue
            if node.op in _TRANSPARENT or _keeps_last_dim(index, node, name, stream, hidden):
                out = node.outputs[0].name
                if out not in stream:
                    stream.add(out)
                    todo.append(out)
    return stream


def _keeps_last_dim(index, node: gs.Node, name: str, stream: set[str], hidden: int) -> bool:
    """Whether ``node`` is a Reshape of ``name`` that keeps the last (hidden) axis, so it moves
    whole hidden vectors and is position-wise (OPT flattens ``[b, s, h]`` to ``[b * s, h]``
    around its MLP and back). Proven from the shape operand: its last entry is the constant
    ``hidden``, or the last dimension of a stream tensor (``Shape``, then ``Gather``/``Slice`` of
    its last axis, through Concat/Unsqueeze/Squeeze)."""
    if node.op != "Reshape" or len(node.inputs) < 2 or node.inputs[0].name != name:
        return False
    last = _shape_last_entry(index, node.inputs[1])
    if last is None:
        return False
    if last[0] == "const":
        return last[1] == hidden
    _, tensor, axis = last
    if tensor != name and tensor not in stream:
        return False
    if axis == -1:
        return True
    rank = _rank(index, index.tensors[tensor])
    return rank is not None and axis == rank - 1


def _shape_last_entry(index, tensor, depth: int = 0):
    """The last entry of a 1-D shape tensor: ``("const", v)``, ``("dim", tensor, axis)`` or None."""
    if depth > 16:
        return None
    value = index.constant_value(tensor)
    if value is not None:
        flat = np.ravel(value)
        return ("const", int(flat[-1])) if flat.size else None
    node = index.producer(tensor.name)
    if node is None or not node.inputs:
        return None
    if node.op == "Concat":
        return _shape_last_entry(index, node.inputs[-1], depth + 1)
    if node.op in ("Unsqueeze", "Squeeze", "Cast", "Identity"):
        return _shape_last_entry(index, node.inputs[0], depth + 1)
    if node.op == "Shape":
        if node.attrs.get("end") is not None:
            return None
        return ("dim", node.inputs[0].name, -1)
    source = index.producer(node.inputs[0].name)
    if source is None or source.op != "Shape" or source.attrs.get("start") or source.attrs.get("end") is not None:
        return None
    if node.op == "Gather" and len(node.inputs) > 1:
        idx = index.constant_value(node.inputs[1])
        if idx is None or np.size(idx) != 1:
            return None
        return ("dim", source.inputs[0].name, int(np.ravel(idx)[-1]))
    if node.op == "Slice" and len(node.inputs) >= 3:
        ends = index.constant_value(node.inputs[2])
        steps = index.constant_value(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else None
        if ends is None or np.size(ends) != 1 or (steps is not None and int(np.ravel(steps)[0]) != 1):
            return None
        end = int(np.ravel(ends)[0])
        if end >= 2**31 - 1:
            return ("dim", source.inputs[0].name, -1)
        return ("dim", source.inputs[0].name, end - 1) if end != 0 else None
    return None


def _rank(index, tensor, depth: int = 0) -> int | None:
    """The rank of ``tensor`` from its recorded shape or, failing that, from how it was made
    (elementwise ops, Gather, Reshape by a shape of known length, MatMul, Gemm), else None."""
    if tensor.shape is not None:
        return len(tensor.shape)
    value = index.constant_value(tensor)
    if value is not None:
        return int(np.ndim(value))
    if depth > 64:
        return None
    node = index.producer(tensor.name)
    if node is None or not node.inputs:
        return None
    if node.op in ("Add", "Sub", "Mul", "Div", "Where", "MatMul"):
        ranks = [_rank(index, t, depth + 1) for t in node.inputs if t.name]
        return None if any(r is None for r in ranks) else max(cast("list[int]", ranks))
    if node.op in ("Cast", "Identity", "LayerNormalization", "Softmax", "Relu", "Gelu", "Tanh", "Sigmoid", "Erf"):
        return _rank(index, node.inputs[0], depth + 1)
    if node.op == "Gemm":
        return 2
    if node.op == "Gather":
        data, idx = _rank(index, node.inputs[0], depth + 1), _rank(index, node.inputs[1], depth + 1)
        return None if data is None or idx is None else data + idx - 1
    if node.op == "Reshape":
        shape = node.inputs[1].shape
        if shape is not None and len(shape) == 1 and isinstance(shape[0], (int, np.integer)):
            return int(shape[0])
        value = index.constant_value(node.inputs[1])
        if value is not None:
            return int(np.size(value))
        concat = index.producer(node.inputs[1].name)
        if concat is not None and concat.op == "Concat":
            lengths = [_vector_length(index, t) for t in concat.inputs]
            return None if any(n is None for n in lengths) else sum(cast("list[int]", lengths))
    return None


def _vector_length(index, tensor) -> int | None:
    """The length of a small 1-D shape piece: a constant, or an Unsqueeze of a scalar."""
    value = index.constant_value(tensor)
    if value is not None:
        return int(np.size(value))
    node = index.producer(tensor.name)
    if node is not None and node.op == "Unsqueeze":
        inner = index.producer(node.inputs[0].name)
        if inner is not None and inner.op == "Gather" and np.ndim(index.constant_value(inner.inputs[1])) == 0:
            return 1
        if inner is not None and inner.op == "Squeeze":
            return 1
    return None


def _writer(index, by_node, branch: str):
    """The linear whose output (through bias Add / reshapes) is a residual add's branch."""
    name = branch
    while True:
        producer = index.producer(name)
        if producer is None:
            raise _not_applicable(f"block output {branch} has no producer")
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
        raise _not_applicable(f"block output {branch} is written by {producer.op} {producer.name}, not a linear")


def _square_constant(index, tensor) -> bool:
    value = index.constant_value(tensor)
    return value is not None and np.ndim(value) == 2 and value.shape[0] == value.shape[1]


def _scalar_operand(index, node: gs.Node) -> int | None:
    """Which input of a binary Mul/Div is a one-element constant (for Div only the divisor)."""
    if len(node.inputs) != 2:
        return None
    for k in ((1,) if node.op == "Div" else (0, 1)):
        value = index.constant_value(node.inputs[k])
        if value is not None and np.size(value) == 1 and index.constant_value(node.inputs[1 - k]) is None:
            return k
    return None


def _sources(index, start: str, stream: set[str]) -> list[dict]:
    """What writes the stream before the first block: embedding Gathers, constant Adds/Concats
    (position embeddings, class tokens), a patch-embedding Conv."""
    sources: list[dict]
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
                        raise _not_applicable(f"constant subtracted from the stream at {node.name}")
                    sources.append({"kind": f"constant-{node.op.lower()}", "node": node.name, "operand": i})
                else:
                    todo.append(t.name)
        elif node.op in _TRANSPARENT or node.op in ("Reshape", "Flatten"):
            todo.append(node.inputs[0].name)
        elif node.op in ("Mul", "Div") and (k := _scalar_operand(index, node)) is not None:
            # a scalar scaling of the stream (Gemma's embedding times sqrt(hidden)) commutes with
            # a rotation and keeps a zero mean: nothing to rewrite, look through it
            todo.append(node.inputs[1 - k].name)
        elif node.op == "Transpose":
            todo.append(node.inputs[0].name)
            sources.append({"kind": "transpose", "node": node.name, "operand": -1})
        elif node.op in ("Expand", "Tile") and index.constant_value(node.inputs[0]) is not None:
            sources.append({"kind": "constant-expand", "node": node.name, "operand": 0})
        elif node.op == "Conv" and index.constant_value(node.inputs[1]) is not None:
            sources.append({"kind": "conv", "node": node.name, "operand": 1})
        else:
            raise _not_applicable(f"stream source {node.op} {node.name} is not an embedding, constant or conv")
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
