"""A small node builder for passes that add whole subgraphs (index arithmetic, masks).

Why: AIFS and MSQ both build integer index/mask subgraphs node by node; one helper keeps their
node and tensor names unique and prefixed with the pass name, so users can tell in a viewer which
pass added what, and collects the added nodes for the pass summary.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir


class NodeBuilder:
    def __init__(self, graph: gs.Graph, index: ir.GraphIndex, prefix: str):
        self.graph, self.index, self.prefix = graph, index, prefix.strip("/")
        self.nodes: list[gs.Node] = []

    def const(self, name: str, value) -> gs.Constant:
        return gs.Constant(ir.unique_name(self.index, f"/{self.prefix}/{name}"), np.asarray(value))

    def op(self, op: str, name: str, inputs, dtype=None, attrs=None, out_name: str | None = None) -> gs.Variable:
        out = gs.Variable(out_name or ir.unique_name(self.index, f"/{self.prefix}/{name}_output_0"), dtype=dtype)
        self.add(gs.Node(op, ir.unique_name(self.index, f"/{self.prefix}/{name}"), attrs=attrs or {},
                         inputs=list(inputs), outputs=[out]))
        return out

    def add(self, node: gs.Node) -> gs.Node:
        self.graph.nodes.append(node)
        self.nodes.append(node)
        return node
