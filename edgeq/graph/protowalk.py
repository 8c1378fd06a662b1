"""The one walker over a ModelProto's nodes, subgraph bodies included (a leaf module: the engine
and ``edgeq.runtime_ops`` both use it, and ``edgeq.graph.ir`` itself imports ``runtime_ops``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import onnx


def proto_nodes(nodes) -> Iterator[onnx.NodeProto]:
    """Every NodeProto of ``nodes`` (a graph's or a function's), depth first into subgraph bodies
    (If / Loop / Scan): the one walker for ModelProto graphs (``nodes_with_graphs`` is the
    graphsurgeon one)."""
    for node in nodes:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from proto_nodes(attr.g.node)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from proto_nodes(g.node)


def upstream(nodes, targets: Iterable[str], stop: Iterable[str] = ()) -> set[int]:
    """Positions in ``nodes`` (NodeProtos) of everything computing ``targets``, not climbing past
    ``stop`` tensors (subgraph bodies' outer reads are not followed: graphs without If/Loop)."""
    stop = set(stop)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    keep, todo = set(), [t for t in targets if t not in stop]
    while todo:
        k = producer.get(todo.pop())
        if k is None or k in keep:
            continue
        keep.add(k)
        todo.extend(x for x in nodes[k].input if x and x not in stop)
    return keep


def prune_to_outputs(model: onnx.ModelProto) -> None:
    """Drop the nodes and initializers the graph's outputs do not need: onnxruntime runs every
    node of a graph, needed or not (a calibration model that fetches a few tensors would otherwise
    still compute, and hold, the vocabulary head). Graphs with subgraphs are left as they are."""
    graph = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        return
    live = upstream(graph.node, [o.name for o in graph.output])
    if len(live) == len(graph.node):
        return
    for k in reversed(range(len(graph.node))):  # in place: no copy of the weights
        if k not in live:
            del graph.node[k]
    read = {x for n in graph.node for x in n.input}
    for k in reversed(range(len(graph.initializer))):
        if graph.initializer[k].name not in read:
            del graph.initializer[k]
