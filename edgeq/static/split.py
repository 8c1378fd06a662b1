"""``--max-context-mb MB``: one static graph cut into consecutive parts whose weights each fit MB.

An NPU context holds its graph's weights in device memory, and a large graph fails to compose
(Qualcomm ships Llama-3.2-1B in 3 parts, Olive's QNN recipe splits in 4). A decoder splits
naturally along its residual stream: between two blocks, one hidden state carries everything the
rest of the model needs from the tokens. The parts pass that hidden state on; each part reads the
graph inputs it needs itself (the attention mask, positions and its own layers' cache slices) and
returns its own layers' new cache entries, so the host runs the parts in order and owns the cache
as it does for the whole graph (``edgeq.static.specialize``).

Where a graph may be cut is read from its dataflow, not from node names: a tensor ``t`` can carry
the split when every path from ``input_ids`` to ``logits`` passes through it (a dominator of the
head). In a topological order of the tensors on such paths that is exactly when no edge jumps over
``t``. Between two blocks the residual stream passes a run of such tensors (the block's last Add,
its QuantizeLinear, the DequantizeLinear); the cut takes the quantized one where there is one, so
on the HTP the parts exchange the same uint16 tensor the unsplit graph carried, with no float I/O.
What depends only on the mask or positions (the causal mask, rotary tables) is recomputed in each
part from the graph inputs: cheap, and no extra tensors cross.

Parts are packed greedily in graph order: a part grows while its weights (each initializer once)
fit the budget. A stretch between two cut points that alone exceeds it is a one-line error naming
its block and size.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from edgeq.errors import UserInputError

PART_KEY = "edgeq.part"
_LAYER = re.compile(r"layers\.(\d+)")
_SOURCE, _SINK = "input_ids", "logits"
_SMALL = 1024  # bytes: an initializer this small (an activation's scale, zero point) is not a weight to place
_TABLE_ROWS = 16  # a float Gather table with fewer rows is shape bookkeeping, not a lookup table (gather-table-qdq's)
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


@dataclass(frozen=True)
class Part:
    """One consecutive part: its graph, what it takes and gives, what it holds."""

    model: onnx.ModelProto
    inputs: list[str]
    outputs: list[str]
    weight_bytes: int
    blocks: str  # the decoder blocks whose weights it holds, e.g. "0-9" or "3" ("" when none)

    def file_name(self, role: str, index: int, count: int) -> str:
        return f"{role}_part{index}of{count}.onnx"


def initializer_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes of an initializer's data, external or inline, without reading it."""
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    count = int(np.prod(tensor.dims)) if tensor.dims else 1
    if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (count + 1) // 2
    return count * dtype.itemsize


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MB" if size >= 2**20 else f"{size / 2**10:.1f} KB"


def _descendants(graph: onnx.GraphProto, start: str) -> set[str]:
    seen = {start}
    for node in graph.node:  # graphs are stored in topological order
        if any(i in seen for i in node.input):
            seen.update(o for o in node.output if o)
    return seen


def _ancestors(graph: onnx.GraphProto, end: str) -> set[str]:
    seen = {end}
    for node in reversed(graph.node):
        if any(o in seen for o in node.output):
            seen.update(i for i in node.input if i)
    return seen


@dataclass(frozen=True)
class _Stream:
    """The residual-stream view of a graph: its relevant nodes in order and where it may be cut."""

    order: list[int]  # indices (into graph.node) of nodes on input_ids -> logits paths
    relevant: set[str]  # the tensors on those paths
    cuts: list[int]  # positions in ``order`` whose single relevant output dominates the head
    tensor: dict[int, str]  # position -> that output's name


def _stream(graph: onnx.GraphProto) -> _Stream:
    relevant = _descendants(graph, _SOURCE) & _ancestors(graph, _SINK)
    order = [i for i, n in enumerate(graph.node) if any(o in relevant for o in n.output)]
    position = {_SOURCE: -1}  # the source precedes every node: its readers' edges start there
    for pos, i in enumerate(order):
        for o in graph.node[i].output:
            if o in relevant:
                position[o] = pos
    covered = np.zeros(len(order) + 2, np.int64)
    for pos, i in enumerate(order):
        for name in graph.node[i].input:
            start = position.get(name)
            if start is not None and pos - start > 1:  # the edge jumps over start+1 .. pos-1
                covered[start + 1] += 1
                covered[pos] -= 1
    covered = np.cumsum(covered)
    cuts, tensor = [], {}
    for pos, i in enumerate(order):
        outs = [o for o in graph.node[i].output if o in relevant]
        if covered[pos] == 0 and len(outs) == 1 and outs[0] != _SINK:
            cuts.append(pos)
            tensor[pos] = outs[0]
    return _Stream(order=order, relevant=relevant, cuts=cuts, tensor=tensor)


def _segment_of_nodes(graph: onnx.GraphProto, stream: _Stream) -> dict[int, int]:
    """Node index -> the segment (0 .. len(cuts)) its relevant work lies in; a node off the stream
    (a weight's DequantizeLinear, the mask's arithmetic) takes the segments of its first readers on it."""
    segment = {}
    bounds = stream.cuts
    k = 0
    for pos, i in enumerate(stream.order):
        while k < len(bounds) and bounds[k] < pos:
            k += 1
        segment[i] = k  # a cut node closes its segment (it is the last node before the boundary)
    return segment


def _initializer_segments(graph: onnx.GraphProto, segment: dict[int, int]) -> dict[str, set[int]]:
    """Initializer -> the segments whose stream nodes read it, directly or through off-stream nodes."""
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            readers.setdefault(name, []).append(i)
    segs_of_tensor: dict[str, set[int]] = {}

    def segments(name: str, depth: int = 0) -> set[int]:
        if name in segs_of_tensor:
            return segs_of_tensor[name]
        found: set[int] = set()
        segs_of_tensor[name] = found  # (graphs are acyclic; this guards the recursion only)
        for i in readers.get(name, []):
            if i in segment:
                found.add(segment[i])
            elif depth < 64:
                for out in graph.node[i].output:
                    found |= segments(out, depth + 1)
        return found

    return {t.name: segments(t.name) for t in graph.initializer}


def _block_name(graph: onnx.GraphProto, nodes: list[int]) -> str:
    layers = Counter(m.group(1) for i in nodes for m in [_LAYER.search(graph.node[i].name)] if m)
    if layers:
        return f"block {layers.most_common(1)[0][0]}"
    named = [graph.node[i].name for i in nodes if graph.node[i].name]
    return f"'{named[0]}'" if named else "a stretch of the graph"


def stored_table_bits(lowering: list) -> int:
    """Bits per value a lookup table ends up with after the target's ``lowering`` passes
    (gather-table-qdq's integer type; 32 when no pass rewrites float tables)."""
    for p in lowering:
        if p.name == "gather-table-qdq":
            return int(np.dtype(p.config.dtype).itemsize * 8)
    return 32


def check_tables_fit(model: onnx.ModelProto, budget_bytes: int, table_bits: int) -> None:
    """Before any work: refuse, in one line, a budget that a float lookup table (the token
    embedding, read by a Gather) cannot fit once the target stores it at ``table_bits`` per value.
    The same refusal ``plan_parts`` makes after the compile, made before it (a 1.5B model's blocks
    take half an hour) where the table's size is already known from its shape."""
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        table = initializers.get(node.input[0]) if node.op_type == "Gather" and node.input else None
        if table is None or len(table.dims) != 2 or table.dims[0] < _TABLE_ROWS or table.data_type not in _FLOATS:
            continue
        size = int(table.dims[0]) * int(table.dims[1]) * table_bits // 8
        if size > budget_bytes:
            raise UserInputError(f"--max-context-mb {budget_bytes / 2**20:.3g}: the table of {node.name or node.output[0]} "
                                 f"holds {_mb(size)} as the target stores it ({table_bits}-bit), more than one part "
                                 f"may hold: give at least {size / 2**20:.1f}")


def plan_parts(model: onnx.ModelProto, budget_bytes: int) -> list[tuple[int, int]]:
    """The cut positions (into the stream order) of ``model`` for ``budget_bytes``: a list of
    (first segment, last segment) per part. Raises a one-line error when a stretch between two
    cut points holds more weights than the budget."""
    graph = model.graph
    stream = _stream(graph)
    if not stream.cuts:
        raise UserInputError("--max-context-mb: this graph has no point between input_ids and logits where one "
                             "hidden state carries everything (not a decoder's residual stream): it cannot be split")
    segment = _segment_of_nodes(graph, stream)
    sizes = {t.name: initializer_bytes(t) for t in graph.initializer}
    per_segment: list[set[str]] = [set() for _ in range(len(stream.cuts) + 1)]
    for name, segs in _initializer_segments(graph, segment).items():
        for s in segs:
            per_segment[s].add(name)
    weight = lambda names: sum(sizes[n] for n in names)  # noqa: E731
    for s, names in enumerate(per_segment):
        if weight(names) > budget_bytes:
            nodes = [i for i, seg in segment.items() if seg == s]
            raise UserInputError(f"--max-context-mb {budget_bytes / 2**20:.3g}: {_block_name(graph, nodes)} holds "
                                 f"{_mb(weight(names))} of weights, more than one part may hold")
    parts, first, held = [], 0, set(per_segment[0])
    for s in range(1, len(per_segment)):
        grown = held | per_segment[s]
        if weight(grown) > budget_bytes:
            parts.append((first, s - 1))
            first, held = s, set(per_segment[s])
        else:
            held = grown
    parts.append((first, len(per_segment) - 1))
    return _prefer_quantized_cuts(graph, stream, per_segment, sizes, parts)


def _prefer_quantized_cuts(graph, stream: _Stream, per_segment, sizes, parts):
    """Move each boundary back over segments without weights (only scales, zero points) to a QuantizeLinear's output where one is
    reachable that way (the parts then exchange the uint16 hidden state, not a float one)."""
    parts = list(parts)
    for k in range(len(parts) - 1):
        first, last = parts[k]
        candidates, q = [last], last
        while q > first and all(sizes[n] < _SMALL for n in per_segment[q]):
            q -= 1
            candidates.append(q)
        end = next((c for c in candidates if graph.node[stream.order[stream.cuts[c]]].op_type == "QuantizeLinear"), last)
        parts[k] = (first, end)
        parts[k + 1] = (end + 1, parts[k + 1][1])
    return parts


def split_graph(model: onnx.ModelProto, budget_bytes: int, role: str,
                boundaries: list[str] | None = None) -> list[Part]:
    """``model`` (a static graph whose weights may be external) cut into consecutive parts of at
    most ``budget_bytes`` of weights each (one part when it all fits). ``boundaries``: cut at these
    tensors instead (the other graph of the pair's cuts, so part i of both holds the same weights)."""
    graph = model.graph
    stream = _stream(graph)
    if boundaries is None:
        plan = plan_parts(model, budget_bytes)
        boundaries = [stream.tensor[stream.cuts[last]] for _, last in plan[:-1]]
    else:
        index = {stream.tensor[c]: k for k, c in enumerate(stream.cuts)}
        absent = [b for b in boundaries if b not in index]
        if absent:
            raise RuntimeError(f"split: {absent[0]} carries the hidden state in one graph of the pair but not the other")
        ends = [index[b] for b in boundaries]
        plan = list(zip([0] + [e + 1 for e in ends], ends + [len(stream.cuts)]))
    graph_inputs = [i.name for i in graph.input]
    outputs_by_part = _outputs_by_part(graph, stream, plan)
    parts = []
    for k in range(len(plan)):
        inputs = ([boundaries[k - 1]] if k else []) + graph_inputs
        outputs = outputs_by_part[k] + ([boundaries[k]] if k < len(plan) - 1 else [])
        parts.append(_extract(model, inputs, outputs, role, k, len(plan)))
    return parts


def boundaries_of(parts: list[Part]) -> list[str]:
    """The tensors the parts hand on (the last output of every part but the last)."""
    return [p.outputs[-1] for p in parts[:-1]]


def _outputs_by_part(graph: onnx.GraphProto, stream: _Stream, plan) -> list[list[str]]:
    """The graph outputs each part gives: each output goes with the part holding the last stream
    node it depends on (a layer's new cache entries go with that layer's part)."""
    position = {i: pos for pos, i in enumerate(stream.order)}
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output}
    result: list[list[str]] = [[] for _ in plan]
    for out in graph.output:
        pos = -1
        stack, seen = [out.name], set()
        while stack:
            name = stack.pop()
            if name in seen or name not in producer:
                continue
            seen.add(name)
            i = producer[name]
            if i in position:
                pos = max(pos, position[i])
                continue
            stack.extend(graph.node[i].input)
        seg = sum(1 for c in stream.cuts if c < pos)
        part = next(k for k, (first, last) in enumerate(plan) if first <= seg <= last)
        result[part].append(out.name)
    return result


def _layer_of(node: onnx.NodeProto, readers: dict[str, list[onnx.NodeProto]], constant: set[str],
              hops: int = 3) -> int | None:
    """The decoder block a weight-reading node belongs to: its own name's ``layers.N``; for a node
    that computes on weights alone (a weight's DequantizeLinear is named after the weight,
    ``onnx::MatMul_8767_..._DequantizeLinear``), that of the first node its value reaches within
    ``hops`` (the MatMul it feeds carries the block). A node reading activations with no block in its
    name (the embedding's Gather, the head) belongs to none. ``constant``: the values computed from
    initializers alone (``_constant_values``)."""
    frontier = [node]
    for _ in range(hops + 1):
        for n in frontier:
            m = _LAYER.search(n.name)
            if m:
                return int(m.group(1))
        frontier = [r for n in frontier if all(o in constant for o in n.output)
                    for o in n.output for r in readers.get(o, ())]
    return None


def _constant_values(nodes: list[onnx.NodeProto], initializers: set[str]) -> set[str]:
    """The initializers and every value computed from them alone (``nodes`` in topological order)."""
    constant = set(initializers)
    for n in nodes:
        if all(not i or i in constant for i in n.input):
            constant.update(n.output)
    return constant


def _extract(model: onnx.ModelProto, inputs: list[str], outputs: list[str], role: str, index: int,
             count: int) -> Part:
    """The sub-graph computing ``outputs`` from ``inputs`` (graph inputs it does not read dropped),
    with the whole graph's metadata and its own ``edgeq.part`` record (its blocks: those whose
    weights it holds, so a part cut inside a block shares that block with its neighbour; the mask
    and rotary nodes every part recomputes carry block 0's name but no weights)."""
    import json

    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    keep, stack, stop = [], list(outputs), set(inputs)
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen or name in stop or name not in producer:
            continue
        seen.add(name)
        node = producer[name]
        keep.append(id(node))
        stack.extend(i for i in node.input if i)
    kept = set(keep)
    nodes = [n for n in graph.node if id(n) in kept]
    read = {i for n in nodes for i in n.input}
    types = {vi.name: vi for vi in (*graph.input, *graph.value_info, *graph.output)}
    missing = [n for n in inputs + outputs if n not in types]
    if missing:
        raise RuntimeError(f"split: no type for {missing[:3]} (the static graph lost its value_info)")
    part_inputs = [types[n] for n in inputs if n in read]
    initializers = [t for t in graph.initializer if t.name in read]
    values = [vi for vi in graph.value_info if vi.name in seen and vi.name not in outputs]
    part_graph = helper.make_graph(nodes, f"{graph.name}_part{index + 1}of{count}", part_inputs,
                                   [types[n] for n in outputs], initializers, value_info=values)
    part = helper.make_model(part_graph, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                             producer_name=model.producer_name, producer_version=model.producer_version)
    part.functions.extend(model.functions)
    for prop in model.metadata_props:
        part.metadata_props.add(key=prop.key, value=prop.value)
    weights = {t.name for t in initializers if initializer_bytes(t) >= _SMALL}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    constant = _constant_values(nodes, {t.name for t in initializers})
    layers = (_layer_of(n, readers, constant) for n in nodes if any(i in weights for i in n.input))
    blocks = sorted({layer for layer in layers if layer is not None})
    span = "" if not blocks else str(blocks[0]) if blocks[0] == blocks[-1] else f"{blocks[0]}-{blocks[-1]}"
    record = {"role": role, "index": index + 1, "count": count, "blocks": span,
              "inputs": [vi.name for vi in part_inputs], "outputs": outputs}
    part.metadata_props.add(key=PART_KEY, value=json.dumps(record))
    return Part(part, [vi.name for vi in part_inputs], outputs, sum(initializer_bytes(t) for t in initializers), span)
