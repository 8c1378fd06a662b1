"""DPQ's ``lowering = "custom"``: each quantized linear becomes one ``edgeq::W4A8Linear`` node.

Why: a runtime or NPU SDK with a native W4A8 kernel (INT4 weights dequantized to FP8 in registers,
FP8 MMA: ``kernels/w4a8_gemm_triton.py``) matches one node by name instead of pattern-matching a
DequantizeLinear / Q / DQ / Q / DQ / MatMul chain; the op's function body is that chain, so plain
onnxruntime still runs the model (``runtime_ops/w4a8_linear.py``).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passes.methods.gptq import GptqResult
from edgeq.quantize.qdq_nodes import integer_constant
from edgeq.quantize.quant import QuantSpec
from edgeq.runtime_ops.domain import DOMAIN
from edgeq.structure.linears import Linear


def lower_to_w4a8_linear(graph: gs.Graph, index: ir.GraphIndex, linears: list[Linear],
                         weights: dict[str, tuple[GptqResult, float, bool]], act_scales: dict[str, float],
                         group_size: int, spec: QuantSpec) -> None:
    """Replace each linear (MatMul, or Gemm without bias) by ``W4A8Linear(x, w, w_scale,
    w_zero_point, w_fp8_scale, x_scale)``; the weight in its [K, N] layout."""
    consts: dict[str, list[gs.Constant]] = {}
    nodes = {n.name: n for n in graph.nodes}
    for lin in linears:
        res, s8, _ = weights[lin.weight]
        if lin.weight not in consts:
            base = f"{lin.weight}_{spec.dtype}"
            consts[lin.weight] = [
                integer_constant(ir.unique_name(index, base), res.q.astype(spec.np_dtype), spec),
                gs.Constant(ir.unique_name(index, base + "_scale"), res.scale.astype(np.float32)),
                integer_constant(ir.unique_name(index, base + "_zero_point"), res.zero_point.astype(spec.np_dtype), spec),
                gs.Constant(ir.unique_name(index, base + "_fp8_scale"), np.asarray(s8, np.float32).reshape(())),
            ]
        node = nodes[lin.node]
        x_scale = gs.Constant(ir.unique_name(index, f"{lin.input}_fp8_scale"), np.asarray(act_scales[lin.input], np.float32).reshape(()))
        out = node.outputs[0]
        bias = node.inputs[2] if lin.op == "Gemm" and len(node.inputs) > 2 else None
        node.outputs.clear()
        y = gs.Variable(ir.unique_name(index, f"{lin.node}_w4a8"), dtype=np.float32) if bias is not None else out
        graph.nodes.append(gs.Node("W4A8Linear", ir.unique_name(index, f"{lin.node}_W4A8Linear"), {"block_size": group_size},
                                   [index.tensors[lin.input], *consts[lin.weight], x_scale], [y], domain=DOMAIN))
        if bias is not None:  # a Gemm's bias (alpha = beta = 1 for the linears edgeq finds)
            graph.nodes.append(gs.Node("Add", ir.unique_name(index, f"{lin.node}_bias"), inputs=[y, bias], outputs=[out]))
