"""``ln-to-rms``: LayerNorm to RMSNorm by making the residual stream zero-mean (MQuant A.13/A.14,
SliceGPT).

LayerNorm(x) = RMSNorm(x) when x has zero mean over the hidden axis. The stream is a sum of what
its writers write, so subtracting each writer's per-row mean makes every stream value zero-mean:
embedding rows and other stream constants ``E' = E - mean(E)``, a patch-embedding Conv over its
output channels, and every block output linear ``W' = W - mean_N(W)``, ``b' = b - mean(b)``.
Every writer must be covered or the equivalence silently breaks, so the pass works from
``analyze_stream`` and does not apply (``structure-not-found``) when the stream is not fully known.
Each LayerNorm then becomes an RMSNorm with the same epsilon, scale and bias: a fused
LayerNormalization is replaced by its RMS decomposition, a decomposed one loses its mean
subtraction.
"""

from __future__ import annotations


import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passmanager.passbase import Exactness, Pass, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.passes.methods.stream import analyze_stream, transform_stream_input
from edgeq.structure import Norm
from edgeq.passes.methods.weights import LinearEditor


class LnToRmsPass(Pass, name="ln-to-rms", per_block=True, exactness=Exactness.FLOAT_EQUIV,
                  summary="LayerNorm -> RMSNorm by making every residual-stream writer zero-mean"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        stream = analyze_stream(graph)  # PassNotApplicable (structure-not-found) when the stream does not fit
        layer_norms = [n for n in stream.norms if n.kind == "layer"]
        if not layer_norms:
            raise PassNotApplicable(Reason.NO_SITES, "no LayerNorm on the residual stream (its norms are RMSNorms)",
                                    layer_norms=0)
        if stream.post_norms:
            # a post-sublayer norm's output (norm(y) * g + b) writes the stream and is not zero-mean
            raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, f"post-sublayer norm {stream.post_norms[0].norm.name} "
                                    "writes the residual stream; its output cannot be made zero-mean")
        editor = LinearEditor(graph)
        index = editor.index
        for lin in stream.writers:
            w = editor.weight(lin)
            editor.set_weight(lin, w - w.mean(axis=1, keepdims=True))
            b = editor.bias(lin)
            if b is not None:
                editor.set_bias(lin, b - b.mean())
        nodes = {n.name: n for n in graph.nodes}
        for src in stream.sources:
            if src["kind"] == "transpose":
                continue
            if src["kind"] == "input":
                _centre_input(graph, index, src["tensor"])
                continue
            node = nodes[src["node"]]
            i = src["operand"]
            value = np.asarray(index.constant_value(node.inputs[i]))
            v = value.astype(np.float64)
            centred = v - v.mean(axis=0, keepdims=True) if src["kind"] == "conv" else v - v.mean(axis=-1, keepdims=True)
            node.inputs[i] = gs.Constant(ir.unique_name(index, f"{node.name}_zero_mean_{i}"), centred.astype(value.dtype))
            if src["kind"] == "conv" and len(node.inputs) > 2 and index.constant_value(node.inputs[2]) is not None:
                b = np.asarray(index.constant_value(node.inputs[2]), np.float64)
                node.inputs[2] = gs.Constant(ir.unique_name(index, f"{node.name}_zero_mean_bias"), (b - b.mean()).astype(value.dtype))
        for norm in layer_norms:
            _to_rms(graph, index, nodes, norm)
        return PassResult(True, {"layer_norms_converted": len(layer_norms), "writers_centred": len(stream.writers),
                                 "sources_centred": [s["kind"] for s in stream.sources]})


def _centre_input(graph: gs.Graph, index: ir.GraphIndex, name: str) -> None:
    """A stream that starts at a graph input is made zero-mean online by ``x @ (I - 11^T / d)``,
    read by every reader of the input in its place. A MatMul rather than ``x - mean(x)``: that
    Sub/ReduceMean pair in front of the first RMSNorm would read as a LayerNorm again, while a
    constant matrix at the input is a stream source later passes fold into (``rotate``)."""
    x = index.tensors[name]
    d = int(x.shape[-1])
    centring = np.eye(d) - np.full((d, d), 1.0 / d)
    transform_stream_input(graph, index, x, centring.astype(np.float32), "zero_mean")


def _to_rms(graph: gs.Graph, index: ir.GraphIndex, nodes: dict, norm: Norm) -> None:
    if not norm.fused:
        sub = next(nodes[name] for name in norm.nodes if nodes[name].op == "Sub")
        centred, x = sub.outputs[0], sub.inputs[0]
        for consumer in list(centred.outputs):
            for i, t in enumerate(consumer.inputs):
                if t is centred:
                    consumer.inputs[i] = x
        sub.outputs.clear()
        return
    node = nodes[norm.nodes[-1]]
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    out = node.outputs[0]
    node.outputs.clear()
    eps = float(norm.eps if norm.eps is not None else 1e-5)
    dtype = np.asarray(index.constant_value(scale)).dtype if index.constant_value(scale) is not None else np.float32

    def var(suffix):
        return gs.Variable(ir.unique_name(index, f"{norm.name}_rms_{suffix}"), dtype=dtype)

    # the same decomposition optimum exports for Llama's RMSNorm, so structure recognition
    # (and every later pass) sees an ordinary RMSNorm
    sq, ms, ms_eps, rms, inv, normed = var("sq"), var("mean_sq"), var("mean_sq_eps"), var("rms"), var("inv"), var("normed")
    two = gs.Constant(ir.unique_name(index, f"{norm.name}_rms_two"), np.array(2.0, dtype))
    one = gs.Constant(ir.unique_name(index, f"{norm.name}_rms_one"), np.array(1.0, dtype))
    eps_c = gs.Constant(ir.unique_name(index, f"{norm.name}_rms_eps"), np.array(eps, dtype))
    if graph.opset >= 18:
        axes = gs.Constant(ir.unique_name(index, f"{norm.name}_rms_axes"), np.array([-1], np.int64))
        mean = gs.Node("ReduceMean", f"{norm.name}_rms_mean", attrs={"keepdims": 1}, inputs=[sq, axes], outputs=[ms])
    else:
        mean = gs.Node("ReduceMean", f"{norm.name}_rms_mean", attrs={"keepdims": 1, "axes": [-1]}, inputs=[sq], outputs=[ms])
    new = [
        gs.Node("Pow", f"{norm.name}_rms_pow", inputs=[x, two], outputs=[sq]),
        mean,
        gs.Node("Add", f"{norm.name}_rms_add_eps", inputs=[ms, eps_c], outputs=[ms_eps]),
        gs.Node("Sqrt", f"{norm.name}_rms_sqrt", inputs=[ms_eps], outputs=[rms]),
        gs.Node("Div", f"{norm.name}_rms_inv", inputs=[one, rms], outputs=[inv]),
        gs.Node("Mul", f"{norm.name}_rms_normalize", inputs=[x, inv], outputs=[normed]),
    ]
    scale_v = index.constant_value(scale)
    bias_v = index.constant_value(bias) if bias is not None else None
    has_scale = scale_v is None or not np.all(np.asarray(scale_v) == 1)
    has_bias = bias is not None and (bias_v is None or not np.all(np.asarray(bias_v) == 0))
    last = normed
    if has_scale:
        scaled = out if not has_bias else var("scaled")
        new.append(gs.Node("Mul", f"{norm.name}_rms_scale", inputs=[last, scale], outputs=[scaled]))
        last = scaled
    if has_bias:
        new.append(gs.Node("Add", f"{norm.name}_rms_bias", inputs=[last, bias], outputs=[out]))
        last = out
    if last is not out:
        new.append(gs.Node("Identity", f"{norm.name}_rms_out", inputs=[last], outputs=[out]))
    graph.nodes.extend(new)
