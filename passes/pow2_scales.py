"""``pow2-scales``: re-express every QuantizeLinear / DequantizeLinear scale as a power of two.

For integer accelerators whose requantization is a shift (no multiplier): each scale s becomes
2^ceil(log2 s) >= s, so the range an encoding covered is still covered (no new clipping), at the
price of a coarser grid (up to 2x).

- Activations (a Q, or a DQ that does not read a constant weight): the new (scale, zero point)
  is a function of the old values only, so a Q and the DQs of the same tensor, which share their
  parameters, get the same new ones (and share the new constants). A symmetric zero point stays;
  an asymmetric one moves to zp' = round(qmin + (zp - qmin) * s / s') (the lower end of the old
  range stays the lower end, qmin being the narrowing Clip's bound where there is one).
- Weights (integer constants behind a DQ): dequantized, given the power-of-two scale per tensor,
  channel or block (the same ceil, and the same zero-point rule), requantized (round to nearest
  even, saturating). A symmetric weight that uses only part of its storage range (u = max |q - zp|
  below the type's symmetric limit L, e.g. a 4-bit weight widened to int8 by ``int8-weights``:
  u = 8, L = 127) gets 2^ceil(log2(s u / L)) instead: the smallest power of two that still holds
  every value, a finer grid than its own (full-range weights: u = L, the same ceil of s).

LOSSY. The summary says what it cost: scales changed, the relative scale change (s' - s) / s over
every distinct scale element rewritten (max, mean), and the weights' requantization error (RMS of
the change in dequantized weights relative to their RMS, overall and the worst weight).
Float8 Q/DQ, scales computed at run time and Q/DQ in subgraphs (If / Loop bodies) are left
alone; the first two are counted in the summary (``skipped``), and ``edgeq check`` flags all that
a power-of-two profile cannot accept.
"""

from __future__ import annotations


import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passmanager.passbase import Exactness, Pass, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.quantize.qdq_nodes import integer_constant
from edgeq.quantize.quant import QuantSpec, dequantize_weight
from edgeq.targets.requant import (QDQ_OPS, ErrorMeter, pow2_ceil, integer_dtype, read_constant, replace_weight, requantize, set_inputs,
                                   weight_dequantizers)


def moved_zero_point(zp: np.ndarray, scale: np.ndarray, new_scale: np.ndarray, qmin: int, qmax: int,
                     mid: int) -> np.ndarray:
    """The zero point on the new grid: kept where symmetric (== mid), else the old range's lower end kept."""
    zp = np.asarray(zp, np.int64)
    ratio = np.asarray(scale, np.float64) / np.asarray(new_scale, np.float64)
    moved = np.clip(np.round(qmin + (zp - qmin) * ratio), qmin, qmax).astype(np.int64)
    return np.where(zp == mid, zp, moved)


class _ScaleStats:
    def __init__(self) -> None:
        self.changes: list[np.ndarray] = []

    def add(self, old: np.ndarray, new: np.ndarray) -> None:
        old = np.asarray(old, np.float64).ravel()
        self.changes.append((np.asarray(new, np.float64).ravel() - old) / old)

    def summary(self) -> dict:
        rel = np.concatenate(self.changes) if self.changes else np.zeros(0)
        return {"scale_elements": int(rel.size), "max_rel_scale_change": float(rel.max(initial=0.0)),
                "mean_rel_scale_change": float(rel.mean()) if rel.size else 0.0}


class Pow2ScalesPass(Pass, name="pow2-scales", exactness=Exactness.LOSSY,
                     summary="every Q/DQ scale -> 2^ceil(log2 s); weights requantized, activation zero points moved (target lowering)"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        stats, meter = _ScaleStats(), ErrorMeter()
        skipped = {"scale_not_constant": 0, "not_integer": 0, "scale_not_positive": 0, "weights_skipped": 0}
        weights = weight_dequantizers(graph, index)
        weight_nodes = {id(w.node) for w in weights}
        done: dict[tuple, tuple] = {}
        weight_changes = 0
        for w in weights:
            if not _positive(w.scale):
                skipped["scale_not_positive"] += 1
                continue
            key = w.key()
            if key in done:  # another DQ of the same weight: share the new constants
                set_inputs(w.node, 0, done[key])
                weight_changes += 1
                continue
            new_scale = pow2_ceil(w.scale * _unused_range(w))
            if np.array_equal(new_scale, w.scale):
                continue
            spec = w.spec
            zp = moved_zero_point(w.zero_point, w.scale, new_scale, spec.qmin, spec.qmax, w.mid)
            old = w.dequantized()
            q = requantize(old, new_scale, zp, spec)
            meter.add(old, dequantize_weight(q, new_scale, zp, spec))
            stats.add(w.scale, new_scale)
            done[key] = replace_weight(graph, index, w, q, new_scale, zp, spec, "pow2")
            weight_changes += 1
        activation_changes = 0
        shared: dict[tuple, tuple] = {}
        for node in list(graph.nodes):
            if node.op not in QDQ_OPS or id(node) in weight_nodes or len(node.inputs) < 2:
                continue
            changed = _rescale_activation(graph, index, node, shared, stats, skipped)
            activation_changes += int(changed)
        summary = {"scales_changed": weight_changes + activation_changes, "activation_scales_changed": activation_changes,
                   "weight_scales_changed": weight_changes, **stats.summary(),
                   "weights_requantized": meter.count, **meter.summary(),
                   "skipped": {k: v for k, v in skipped.items() if v}}
        if not (weight_changes or activation_changes):
            if not any(n.op in QDQ_OPS for n in graph.nodes):
                raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, "no QuantizeLinear/DequantizeLinear", **summary)
            raise PassNotApplicable(Reason.NO_SITES, "every Q/DQ scale is a power of two already or is left as it is "
                                    "(see skipped)", **summary)
        return PassResult(True, summary)


def _unused_range(w) -> float:
    """u / L for a symmetric weight using the integers [-u, u] of a type whose symmetric limit is L
    (1.0 for asymmetric or full-range weights): scaling s by it keeps every value representable."""
    if not w.symmetric or w.q.size == 0:
        return 1.0
    limit = min(w.spec.qmax - w.mid, w.mid - w.spec.qmin)
    used = int(np.abs(np.asarray(w.q, np.int64) - w.mid).max())
    return used / limit if 0 < used < limit else 1.0


def _positive(scale) -> bool:
    s = np.asarray(scale, np.float64)
    return bool(np.all(np.isfinite(s)) and np.all(s > 0))


def _rescale_activation(graph: gs.Graph, index: ir.GraphIndex, node: gs.Node, shared: dict, stats: _ScaleStats,
                        skipped: dict) -> bool:
    if node.op == "DequantizeLinear" and read_constant(index, node.inputs[0]) is not None:
        skipped["weights_skipped"] += 1  # float8 weights, or a zero point that is not a constant: not requantizable
        return False
    scale_t = node.inputs[1]
    scale = read_constant(index, scale_t)
    if scale is None:
        skipped["scale_not_constant"] += 1
        return False
    if not _positive(scale):
        skipped["scale_not_positive"] += 1
        return False
    zp_t = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
    zp = read_constant(index, zp_t) if zp_t is not None else np.zeros((), np.uint8)
    if zp is None:
        skipped["scale_not_constant"] += 1
        return False
    dtype = integer_dtype(np.asarray(zp))
    if dtype is None:  # float8 Q/DQ: the scale is not an integer grid's step
        skipped["not_integer"] += 1
        return False
    new_scale = pow2_ceil(scale)
    if np.array_equal(new_scale, scale):
        return False
    spec = QuantSpec(dtype)
    qmin, qmax = _integer_range(index, node, spec)
    key = (scale_t.name, zp_t.name if zp_t is not None else "", qmin, qmax)
    if key not in shared:
        mid = 0 if spec.signed else (spec.qmax + spec.qmin + 1) // 2
        new_zp = moved_zero_point(zp, scale, new_scale, qmin, qmax, mid)
        consts = [gs.Constant(ir.unique_name(index, f"{scale_t.name}_pow2"), np.asarray(new_scale))]
        if zp_t is not None and np.array_equal(new_zp, zp):
            consts.append(zp_t)
        elif zp_t is not None:
            values = new_zp.astype(spec.np_dtype).reshape(np.shape(zp))
            consts.append(integer_constant(ir.unique_name(index, f"{zp_t.name}_pow2"), values, spec))
        shared[key] = tuple(consts)
        stats.add(scale, new_scale)
    set_inputs(node, 1, shared[key])
    return True


def _integer_range(index: ir.GraphIndex, node: gs.Node, spec: QuantSpec) -> tuple[int, int]:
    """The integers actually used: the storage range, or the bounds of the Clip that narrows a
    Q's output (``qdq_nodes.insert_quantize`` with fewer value bits) before its DQs."""
    if node.op == "QuantizeLinear":
        clips = [c for c in index.consumers(node.outputs[0].name) if c.op == "Clip"]
        clip = clips[0] if clips else None
    else:
        clip = index.producer(node.inputs[0].name)
        clip = clip if clip is not None and clip.op == "Clip" else None
    if clip is not None and len(clip.inputs) == 3:
        lo, hi = (read_constant(index, t) for t in clip.inputs[1:])
        if lo is not None and hi is not None:
            return int(lo), int(hi)
    return spec.qmin, spec.qmax
