"""``expand-functions``: replace every ``edgeq``-domain node by its ONNX function body.

For targets that run standard ops only (a generic QDQ runtime, an NPU SDK without edgeq kernels):
afterwards the graph holds no custom op and no model-local edgeq function. The body inlined is the
one the model carries (what onnxruntime itself inlines when it loads the model), or, for a model
that lost it, the schema table's builder at the model's opset; so outputs are bitwise unchanged
(EXACT).

The inlining itself is onnx's (``onnx.inliner``: attribute references, defaults, optional inputs,
If/Loop bodies and outer-scope names), run on a one-node model per edgeq node, so the weights are
never serialized; the inlined nodes are spliced into the graphsurgeon graph and their internal
tensors renamed ``<node name>/<body name>`` (unique in the graph).
"""

from __future__ import annotations

from collections import Counter

import onnx
import onnx.inliner
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from edgeq.graph import ir
from edgeq.passmanager.passbase import Exactness, Pass, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.runtime_ops.domain import DOMAIN, DOMAIN_VERSION
from edgeq.runtime_ops.schema import get_schema


class ExpandFunctionsPass(Pass, name="expand-functions", per_block=True, exactness=Exactness.EXACT,
                          summary="inline every edgeq custom op as its ONNX function body (standard ops only; target lowering)"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        sites = [(g, n) for g, n in ir.nodes_with_graphs(graph) if n.domain == DOMAIN]
        nodes = [node for _, node in sites]
        carried = [f for f in graph.functions if f.domain == DOMAIN]
        if not nodes and not carried:
            raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, "no edgeq custom op or function in the graph",
                                    nodes_expanded={})
        functions = {f.name: OnnxExporter.export_function(f) for f in carried}
        for op in {n.op for n in nodes} - set(functions):
            functions[op] = get_schema(op).function_builder(graph.opset)
        index = ir.GraphIndex(graph)
        added = 0
        for owner, node in sites:
            added += _inline(owner, index, node, list(functions.values()))
        graph.functions = [f for f in graph.functions if f.domain != DOMAIN]
        ir.drop_domain_import(graph, DOMAIN)
        return PassResult(True, {"nodes_expanded": dict(sorted(Counter(n.op for n in nodes).items())),
                                 "nodes_added": added})


def _inline(graph: gs.Graph, index: ir.GraphIndex, node: gs.Node, functions: list[onnx.FunctionProto]) -> int:
    """Replace ``node`` in ``graph`` (the main graph or the subgraph holding it) by its inlined
    body; returns the number of nodes added. ``index`` (of the main graph) hands out the names."""
    outer = {t.name: t for t in node.inputs if t.name}
    outer.update({t.name: t for t in node.outputs})
    mini_graph = onnx.helper.make_graph(
        [OnnxExporter.export_node(node)], "edgeq_inline",
        [onnx.ValueInfoProto(name=name) for name in dict.fromkeys(t.name for t in node.inputs if t.name)],
        [onnx.ValueInfoProto(name=t.name) for t in node.outputs])
    mini = onnx.helper.make_model(mini_graph, functions=functions, opset_imports=[
        onnx.helper.make_opsetid("", graph.opset), onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION)])
    body = gs.import_onnx(onnx.inliner.inline_local_functions(mini))
    node.inputs.clear()
    node.outputs.clear()
    renamed: set[int] = set()
    for _, inner in ir.nodes_with_graphs(body):
        for i, t in enumerate(inner.inputs):
            if t.name in outer:
                inner.inputs[i] = outer[t.name]
    for inner in body.nodes:
        for i, t in enumerate(inner.outputs):
            if t.name in outer:
                inner.outputs[i] = outer[t.name]
    for _, inner in ir.nodes_with_graphs(body):
        if inner.name:
            inner.name = f"{node.name}/{inner.name}"
        for t in (*inner.inputs, *inner.outputs):
            if t.name and t.name not in outer and id(t) not in renamed:
                renamed.add(id(t))
                t.name = ir.unique_name(index, f"{node.name}/{t.name}")
    graph.nodes.extend(body.nodes)
    return len(body.nodes)
