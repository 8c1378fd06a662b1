"""``symmetric-weights``: every integer weight stored symmetric and signed (zero point 0).

NPUs such as Hexagon's HTP (and any power-of-two integer engine) take signed symmetric weights
only: their integer GEMMs have no weight zero-point correction. Two cases, per weight behind a
DequantizeLinear:

- unsigned storage with the midpoint zero point (e.g. uint8 / 128, what a symmetric spec writes
  in unsigned types): the integers shift to the signed type of the same width, q - mid, with the
  same scale: exact;
- a zero point off the midpoint (asymmetric, any storage): dequantized and requantized with
  ``quant.quantize_weight``'s symmetric spec in the signed type (same width, granularity, axis and
  block size: scale = max |w| / qmax per channel): lossy.

LOSSY as a class. The summary counts both cases and gives the requantization error (RMS of the
change in dequantized weights relative to their RMS, overall and the worst weight).
"""

from __future__ import annotations


import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passmanager.passbase import Exactness, Pass, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.quantize.quant import QuantSpec, dequantize_weight, quantize_weight
from edgeq.targets.requant import ErrorMeter, replace_weight, set_inputs, weight_dequantizers

_SIGNED = {"uint8": "int8", "uint4": "int4", "uint16": "int16", "int8": "int8", "int4": "int4", "int16": "int16"}


class SymmetricWeightsPass(Pass, name="symmetric-weights", per_block=True, exactness=Exactness.LOSSY,
                           summary="integer weights -> signed symmetric (uint shifted exactly, asymmetric requantized; target lowering)"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        meter = ErrorMeter()
        shifted = requantized = 0
        done: dict[tuple, tuple] = {}
        found = weight_dequantizers(graph, index)
        for w in found:
            if w.spec.signed and w.symmetric:
                continue
            key = w.key()
            if key in done:
                set_inputs(w.node, 0, done[key])
                continue
            signed = QuantSpec(_SIGNED[w.spec.dtype], symmetric=True, axis=w.spec.axis, block_size=w.spec.block_size)
            old = w.dequantized()
            if w.symmetric:  # unsigned with the midpoint: q - mid in the signed type, same scale
                q, scale, zp = w.q - w.mid, w.scale, np.zeros_like(w.zero_point)
                shifted += 1
            else:
                q, scale, zp = quantize_weight(old, signed)
                requantized += 1
            meter.add(old, dequantize_weight(q, scale, zp, signed))
            done[key] = replace_weight(graph, index, w, q, scale, zp, signed, "sym")
        summary = {"weights_shifted_exactly": shifted, "weights_requantized": requantized, **meter.summary()}
        if not found:
            raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, "no DequantizeLinear of a constant integer weight",
                                    **summary)
        if not (shifted or requantized):
            raise PassNotApplicable(Reason.NO_SITES, f"the {len(found)} weight DequantizeLinear(s) are signed and "
                                    "symmetric already", **summary)
        return PassResult(True, summary)
