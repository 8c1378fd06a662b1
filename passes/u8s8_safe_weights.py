"""``u8s8-safe-weights``: no int8 weight read by a uint8 x int8 kernel can saturate it.

onnxruntime's CPU kernel for a uint8 activation times an int8 weight sums adjacent K pairs of
products into a saturating int16 on x86 without VNNI (AVX2, AVX-512 without VNNI); see
``edgeq.targets.saturation`` for the arithmetic and the bound. The quantizing passes already put
8-bit int8 weights on the pair-bounded grid (``QuantSpec.pair_axis``); this pass is the guarantee
behind them, run by ``compile`` after everything else (target lowering included) unless the
target allows full-range weights (``int8_weight_range = "full-vnni-only"``): weights quantized
elsewhere (GPTQ's 8-bit rows, ``symmetric-weights``, ``pow2-scales``, a graph quantized by another
tool) are found by their kernel pattern (MatMul / Gemm reading an 8-bit activation DequantizeLinear
and an int8 weight DequantizeLinear, per tensor or per channel) and every output channel whose
weight codes have a same-sign adjacent pair with ``|q0| + |q1| > 128`` is requantized from its
dequantized values onto the pair-bounded grid (a power-of-two scale stays a power of two; an
asymmetric weight becomes symmetric). LOSSY where it changes anything (the summary reports the
weight error); a graph with nothing at risk is left untouched.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passmanager.passbase import Exactness, Pass, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.quantize.quant import QuantSpec
from edgeq.targets.check import is_power_of_two
from edgeq.targets.requant import ErrorMeter, WeightDQ, broadcast_param, pow2_ceil, replace_weight
from edgeq.targets.saturation import PAIR_LIMIT, fix_pairs, pair_bounded_scale, worst_pair
from edgeq.targets.u8s8_sites import u8s8_weights


class U8S8SafeWeightsPass(Pass, name="u8s8-safe-weights", per_block=True, exactness=Exactness.LOSSY,
                          summary="requantize int8 weights of uint8 x int8 linears that could saturate CPUs without VNNI onto the pair-bounded grid"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        sites = u8s8_weights(graph, index)
        if not sites:
            raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND,
                                    "no uint8 x int8 linear (8-bit activation and int8 weight DequantizeLinear)")
        meter = ErrorMeter()
        changed_weights, channels, fixes = 0, 0, 0
        done: set[tuple] = set()
        for wdq, k_axis in sites:
            if wdq.key() in done:
                continue
            done.add(wdq.key())
            q_kn = np.moveaxis(wdq.q, k_axis, 0)
            if np.all(worst_pair(q_kn) <= PAIR_LIMIT):
                continue
            q, scale, n_channels, n_fixes = _requantize(wdq, k_axis)
            meter.add(wdq.dequantized(), q * broadcast_param(scale, wdq.spec, q.shape).astype(np.float64))
            spec = QuantSpec("int8", True, axis=wdq.spec.axis)
            replace_weight(graph, index, wdq, q, scale, np.zeros(np.shape(scale), np.int64), spec, "u8s8safe")
            changed_weights += 1
            channels += n_channels
            fixes += n_fixes
        summary = {"u8s8_linears": len(sites), "weights_requantized": changed_weights, "channels_rescaled": channels,
                   "pair_fixes": fixes}
        if not changed_weights:  # nothing at risk: the graph is left untouched
            raise PassNotApplicable(Reason.NO_SITES, f"no int8 weight of the {len(sites)} uint8 x int8 linear(s) has a "
                                    f"same-sign adjacent pair over {PAIR_LIMIT} (none can saturate)", **summary)
        summary.update(meter.summary())
        return PassResult(True, summary)


def _requantize(wdq: WeightDQ, k_axis: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """New symmetric codes and scale for the channels at risk (the others keep theirs)."""
    w = wdq.dequantized().astype(np.float64)
    w_kn = np.moveaxis(w, k_axis, 0)
    q_kn = np.moveaxis(wdq.q, k_axis, 0)
    per_channel = wdq.spec.axis is not None
    symmetric = wdq.symmetric and wdq.spec.signed
    old = np.asarray(wdq.scale, np.float64).reshape(-1) if per_channel else np.asarray(wdq.scale, np.float64).reshape(1)
    need = np.asarray(pair_bounded_scale(w_kn, per_channel), np.float64).reshape(-1)
    at_risk = (worst_pair(q_kn) > PAIR_LIMIT).reshape(-1) if per_channel else np.array([True])
    if not symmetric:  # raw codes of an asymmetric weight: move every channel to the symmetric grid
        at_risk[:] = True
    new = np.where(at_risk, need, old)
    new = np.where(at_risk & is_power_of_two(old), pow2_ceil(new), new).astype(np.float32)
    target = w_kn / (new[None, :] if per_channel else new[0])
    fresh = np.clip(np.round(target), -127, 127).astype(np.int64)
    kept = q_kn if symmetric else fresh
    q_new = np.where(at_risk[None, :] if per_channel else at_risk[0], fresh, kept)
    q_new, fixes = fix_pairs(q_new, np.where(at_risk[None, :] if per_channel else at_risk[0], target, q_new))
    scale = new if per_channel else new.reshape(np.shape(wdq.scale))
    return np.moveaxis(q_new, 0, k_axis), scale, int(at_risk.sum()), fixes
