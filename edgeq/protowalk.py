"""The one walker over a ModelProto's nodes, subgraph bodies included (a leaf module: the engine
and ``edgeq.runtime_ops`` both use it, and ``edgeq.ir`` itself imports ``runtime_ops``)."""

from __future__ import annotations

from typing import Iterator

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
