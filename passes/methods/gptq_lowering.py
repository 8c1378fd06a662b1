"""``gptq`` with ``lowering = "matmulnbits"``: each 4-bit grouped linear becomes onnxruntime's
``com.microsoft::MatMulNBits`` in the saved graph.

Why: onnxruntime's CPU 4-bit kernel. With default session settings onnxruntime fuses the plain
``DequantizeLinear(block) + MatMul`` form into the same op itself (``edgeq/matmulnbits.py``), so
this lowering is for runtimes or sessions that do not optimize (``ORT_ENABLE_BASIC`` or less),
and it fixes the op's numerics in the file: accuracy level 0 (fp32 compute), where the fusion
picks level 4 (int8 activations, ``session.qdq_matmulnbits_accuracy_level``).
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passes.methods.gptq import GptqResult
from edgeq.passes.methods.matmulnbits import insert_matmulnbits
from edgeq.structure.linears import Linear


def lower_to_matmulnbits(graph: gs.Graph, index: ir.GraphIndex, linears: list[Linear], nodes: dict[str, gs.Node],
                         results: dict[str, GptqResult], group_size: int, signed: bool) -> int:
    """Replace each quantized MatMul by a MatMulNBits over the same integers and scales; returns
    how many. The DequantizeLinear weights left without readers are removed by cleanup."""
    count = 0
    by_weight = {lin.weight: results[lin.node] for lin in linears if lin.node in results}
    for lin in linears:
        node = nodes[lin.node]
        res = by_weight[lin.weight]
        out = node.outputs[0]
        node.outputs.clear()
        insert_matmulnbits(graph, node.inputs[0], out, res.q, res.scale, res.zero_point, group_size, signed,
                           ir.unique_name(index, lin.node))
        count += 1
    graph.cleanup()
    return count
