"""``positive-weight-scales``: every weight DequantizeLinear scale made positive.

Full-range symmetric weights (GPTQ/ResQ ``full_range``, onnxruntime's MatMulNBits quantizer) map a
channel's largest-magnitude value to qmin exactly, which gives that channel a negative scale when
the value is positive. onnxruntime's CPU kernels compute such weights exactly; Qualcomm's HTP
(onnxruntime-qnn 2.7.0, QNN 2.40) prepares them without complaint and then computes unrelated
results (measured: a tiny Llama pair, logits max diff 0.34 of 0.65 against CPU with GPTQ
``full_range``, 0.004 without). The flip is real = (q - z) * s = (q' - z) * (-s) with
q' = 2z - q: exact except where q' leaves the integer range (q = qmin with z = 0 gives qmax + 1),
where it saturates to qmax. Those codes are counted and their error reported.

LOSSY as a class (exact when no code saturates). The summary counts flipped channels, saturated
codes and the change in dequantized weights relative to their RMS.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passmanager.passbase import Exactness, Pass, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.quantize.quant import dequantize_weight
from edgeq.targets.requant import ErrorMeter, broadcast_param, replace_weight, set_inputs, weight_dequantizers


class PositiveWeightScalesPass(Pass, name="positive-weight-scales", per_block=True, exactness=Exactness.LOSSY,
                               summary="negative weight scales flipped with their integers (target lowering: the HTP needs scale > 0)"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        meter = ErrorMeter()
        weights = channels = saturated = 0
        done: dict[tuple, tuple] = {}
        found = weight_dequantizers(graph, index)
        for w in found:
            negative = np.asarray(w.scale) < 0
            if not negative.any():
                continue
            key = w.key()
            if key in done:
                set_inputs(w.node, 0, done[key])
                continue
            flip = broadcast_param(negative, w.spec, w.q.shape)
            zp = broadcast_param(w.zero_point, w.spec, w.q.shape)
            flipped = np.where(flip, 2 * zp - w.q, w.q)
            q = np.clip(flipped, w.spec.qmin, w.spec.qmax)
            scale = np.where(negative, -w.scale, w.scale).astype(w.scale.dtype)
            old = w.dequantized()
            meter.add(old, dequantize_weight(q, scale, w.zero_point, w.spec))
            weights += 1
            channels += int(negative.sum())
            saturated += int((q != flipped).sum())
            done[key] = replace_weight(graph, index, w, q, scale, w.zero_point, w.spec, "pos")
        summary = {"weights_flipped": weights, "channels_flipped": channels, "codes_saturated": saturated, **meter.summary()}
        if not found:
            raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, "no DequantizeLinear of a constant integer weight",
                                    **summary)
        if not weights:
            raise PassNotApplicable(Reason.NO_SITES, f"no negative scale on the {len(found)} weight DequantizeLinear(s)",
                                    **summary)
        return PassResult(True, summary)
