"""``linear-output-qdq``: quantize the output of every linear whose weight is per channel, so
Qualcomm's HTP sees whole QDQ node units (target lowering).

Measured on onnxruntime-qnn 2.7.0 (QNN 2.40 HTP backend, probe graphs in
``tests/test_qnn_vendor.py``): the HTP takes a per-tensor weight DequantizeLinear in any
context, but a per-channel one only inside a node unit, ``DQ(x) , DQ(W) -> MatMul -> Q``: the
linear's input AND its output quantized. Otherwise the EP refuses the weight's DQ ("does not
support a standalone DQ op with per-channel quantization") and, with CPU fallback disabled, the
whole model. edgeq's recipes quantize linear inputs only (what onnxruntime's CPU kernels fuse),
so this pass adds the missing half for QNN: ``y = MatMul(...)`` becomes ``MatMul -> y_raw ->
QuantizeLinear -> DequantizeLinear -> y``, the DequantizeLinear keeping ``y``'s name so every
reader (and a graph output) is untouched.

The output range is calibrated (min/max over the calibration windows: a clipped linear output
feeds the residual stream, where a clip is an error on every later layer) and stored at 16 bits
by default (``uint16`` asymmetric, the HTP's 16-bit activation type): a linear's output has the
range of the residual stream, which 8 bits resolve too coarsely (the reason Qualcomm ships its
LLMs with 16-bit activations). LOSSY: the summary gives the mean and worst relative step
(scale / max |y|).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq import ir
from edgeq.calib.observers import MinMaxObserver
from edgeq.passbase import Exactness, Pass, PassConfig, PassContext, PassResult, Reason
from edgeq.qdq_nodes import ensure_opset, insert_quantize
from edgeq.quant import QuantSpec

_LINEARS = ("MatMul", "Gemm", "Conv")
OUTPUT_DTYPES = ("uint16", "int16", "uint8", "int8")


@dataclass(frozen=True)
class LinearOutputQDQConfig(PassConfig):
    output_dtype: str = "uint16"  # the HTP's activation types: uint8, uint16, int16 (int8 for other NPUs)

    def __post_init__(self):
        if self.output_dtype not in OUTPUT_DTYPES:
            from edgeq.errors import UserInputError

            raise UserInputError(f"linear-output-qdq: output_dtype must be one of {', '.join(OUTPUT_DTYPES)}")


class LinearOutputQDQPass(Pass, name="linear-output-qdq", exactness=Exactness.LOSSY, config=LinearOutputQDQConfig,
                          calibrates=True,
                          summary="quantize the output of each linear with a per-channel weight (16-bit): whole QDQ "
                                  "node units for QNN's HTP (target lowering)"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        sites = [n for n in graph.nodes if n.op in _LINEARS and _per_channel_weight(index, n)
                 and not _output_quantized(index, n)]
        if not sites:
            return PassResult.skipped(Reason.NO_SITES, "no linear with a per-channel weight and a float output")
        names = [n.outputs[0].name for n in sites]
        observers = ctx.require_calibrator(self.name).observe(graph, {n: MinMaxObserver for n in names},
                                                              "linear-output-qdq:minmax")
        spec = QuantSpec(self.config.output_dtype, symmetric=False)
        ensure_opset(graph, spec)
        steps = []
        for node in sites:
            y = node.outputs[0]
            lo, hi = observers[y.name].range()
            raw = gs.Variable(ir.unique_name(index, f"{y.name}_float"), dtype=np.float32, shape=y.shape)
            node.outputs[0] = raw  # the node now writes raw; y is re-produced by the DequantizeLinear below
            q = insert_quantize(graph, index, raw, lo, hi, spec)
            y.inputs.clear()
            graph.nodes.append(gs.Node("DequantizeLinear", f"{node.name}_output_DequantizeLinear", {},
                                       [q.integer, q.scale, q.zero_point], [y]))
            steps.append(float(q.scale.values) / max(abs(lo), abs(hi), 1e-30))
        return PassResult(True, {"outputs_quantized": len(sites), "dtype": spec.dtype,
                                 "relative_step_mean": float(np.mean(steps)), "relative_step_max": float(np.max(steps))})


def _per_channel_weight(index: ir.GraphIndex, node: gs.Node) -> bool:
    """The node reads a constant integer weight through a DequantizeLinear with more than one scale."""
    if len(node.inputs) < 2:
        return False
    dq = index.producer(node.inputs[1].name)
    if dq is None or dq.op != "DequantizeLinear" or not isinstance(dq.inputs[0], gs.Constant):
        return False
    scale = dq.inputs[1]
    return isinstance(scale, gs.Constant) and np.asarray(scale.values).size > 1


def _output_quantized(index: ir.GraphIndex, node: gs.Node) -> bool:
    readers = index.consumers(node.outputs[0].name)
    return bool(readers) and all(r.op == "QuantizeLinear" for r in readers)
