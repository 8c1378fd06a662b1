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
feeds the residual stream, where a clip is an error on every later layer). Every unit is 16-bit by
default (``activations = "uint16"``: an 8-bit input is widened to uint16 over the same range, and
the output is uint16): a linear's output has the range of the residual stream, which 8 bits resolve
too coarsely, and the HTP's 8-bit units depart from onnxruntime CPU on the same graph. Measured on
SmolLM2 (issue 43 item 5; the figures in docs/npu-handoff.md, ``htp-units-2026-11-28.json``):
mquant-w8a8's qnn-htp form with 8-bit units loses accuracy on CPU and, on the tiny pair, departs
on the HTP from CPU past the test's bound; with 16-bit units it does neither. ``"match"`` keeps each unit
at its input's type (the HTP refuses a unit whose input and output types differ). LOSSY: the summary
gives the mean and worst relative step (scale / max |y|).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.calib.observers import MinMaxObserver
from edgeq.passmanager.passbase import Exactness, Pass, PassConfig, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.quantize.qdq_nodes import ensure_opset, insert_dequantize, insert_quantize
from edgeq.quantize.quant import QuantSpec, scale_zero_point

_LINEARS = ("MatMul", "Gemm", "Conv")
ACTIVATION_DTYPES = ("uint16", "int16", "uint8", "int8")


@dataclass(frozen=True)
class LinearOutputQDQConfig(PassConfig):
    # a type name: every unit narrower than it is widened to it, input and output (the input's
    # QuantizeLinear keeps its range on a finer grid); "match": the output gets the linear's input
    # activation type (the HTP refuses a unit whose input and output types differ)
    activations: str = "uint16"

    def __post_init__(self):
        if self.activations != "match" and self.activations not in ACTIVATION_DTYPES:
            from edgeq.errors import UserInputError

            raise UserInputError(f"linear-output-qdq: activations must be 'match' or one of {', '.join(ACTIVATION_DTYPES)}")


class LinearOutputQDQPass(Pass, name="linear-output-qdq", per_block=True, exactness=Exactness.LOSSY, config=LinearOutputQDQConfig,
                          calibrates=True,
                          summary="quantize the output of each linear with a per-channel weight at its input's type: "
                                  "whole QDQ node units for QNN's HTP (target lowering)"):
    config: LinearOutputQDQConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        sites = [n for n in graph.nodes if n.op in _LINEARS and _per_channel_weight(index, n)
                 and not _output_quantized(index, n)]
        if not sites:
            raise PassNotApplicable(Reason.NO_SITES, "no linear with a per-channel weight and a float output")
        wide = None if self.config.activations == "match" else QuantSpec(self.config.activations, symmetric=False)
        inputs = {n.name: _input_quantizer(index, n) for n in sites}
        float_inputs = sorted({n.inputs[0].name for n in sites if inputs[n.name] is None})
        names = [n.outputs[0].name for n in sites] + float_inputs
        observers = ctx.require_calibrator(self.name).observe(graph, {n: MinMaxObserver for n in names},
                                                              "linear-output-qdq:minmax")
        widened = 0
        quantized_inputs = {}
        for name in float_inputs:  # a float input: the unit needs it quantized too (16-bit unless told)
            spec = wide or QuantSpec("uint16", symmetric=False)
            quantized_inputs[name] = (insert_quantize(graph, index, index.tensors[name], *observers[name].range(), spec), spec)
        dtypes: dict[str, int]
        steps, dtypes = [], {}
        for node in sites:
            quantizer = inputs[node.name]
            if quantizer is None:
                q_in, spec = quantized_inputs[node.inputs[0].name]
                node.inputs[0] = insert_dequantize(graph, index, q_in, node.name)
            else:
                spec = _spec_of(quantizer)
                if wide is not None and spec.bits < wide.bits:
                    widened += _widen(quantizer, spec, QuantSpec(wide.dtype, spec.symmetric))
                    spec = _spec_of(quantizer)
            spec = QuantSpec(spec.dtype, symmetric=False)
            ensure_opset(graph, spec)
            y = node.outputs[0]
            lo, hi = observers[y.name].range()
            raw = gs.Variable(ir.unique_name(index, f"{y.name}_float"), dtype=np.float32, shape=y.shape)
            node.outputs[0] = raw  # the node now writes raw; y is re-produced by the DequantizeLinear below
            q = insert_quantize(graph, index, raw, lo, hi, spec)
            graph.nodes.append(gs.Node("DequantizeLinear", f"{node.name}_output_DequantizeLinear", {},
                                       [q.integer, q.scale, q.zero_point], [y]))
            steps.append(float(q.scale.values) / max(abs(lo), abs(hi), 1e-30))
            dtypes[spec.dtype] = dtypes.get(spec.dtype, 0) + 1
        return PassResult(True, {"outputs_quantized": len(sites), "dtypes": dtypes, "inputs_widened": widened,
                                 "float_inputs_quantized": len(float_inputs),
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


def _input_quantizer(index: ir.GraphIndex, node: gs.Node) -> gs.Node | None:
    """The static per-tensor QuantizeLinear behind the linear's input DequantizeLinear, if any."""
    dq = index.producer(node.inputs[0].name)
    if dq is None or dq.op != "DequantizeLinear":
        return None
    q = index.producer(dq.inputs[0].name)
    if q is None or q.op != "QuantizeLinear" or not all(isinstance(t, gs.Constant) for t in q.inputs[1:3]):
        return None
    return q


def _spec_of(quantizer: gs.Node) -> QuantSpec:
    zp = np.asarray(quantizer.inputs[2].values)
    dtype = np.dtype(zp.dtype).name
    spec = QuantSpec(dtype, symmetric=False)
    mid = 0 if spec.signed else (spec.qmax + spec.qmin + 1) // 2
    return QuantSpec(dtype, symmetric=bool(np.all(zp == mid)))


def _widen(quantizer: gs.Node, old: QuantSpec, new: QuantSpec) -> int:
    """Store a static activation at a wider type over the same range: the QuantizeLinear's scale
    and zero point (shared with every DequantizeLinear of it) are rewritten in place."""
    scale, zp = (np.asarray(t.values) for t in quantizer.inputs[1:3])
    lo = (old.qmin - zp.astype(np.float64)) * scale
    hi = (old.qmax - zp.astype(np.float64)) * scale
    new_scale, new_zp = scale_zero_point(lo, hi, new)
    quantizer.inputs[1].values = np.asarray(new_scale, np.float32).reshape(scale.shape)
    quantizer.inputs[2].values = np.asarray(new_zp).reshape(zp.shape)
    quantizer.outputs[0].dtype = new.np_dtype
    return 1
