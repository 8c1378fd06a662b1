"""``int8-weights``: every 4-bit (or 2-bit) integer weight behind a DequantizeLinear widened to int8.

Integer engines whose GEMMs take int8 weights only (a power-of-two NPU) cannot read int4 / uint4
initializers, which is what the 4-bit recipes write (gptq, W4 RTN, the side branches of a W8A8
recipe). Widening changes the storage, not the values: for every q, (q' - z') * s = (q - z) * s
when q' - z' = q - z. Per weight initializer:

- int4 / int2 -> int8 with the same integers and zero point;
- uint4 -> int8 with q - 8 and zero point z - 8, uint2 -> int8 with q - 2 and z - 2 (a
  DequantizeLinear without a zero point, i.e. z = 0, gets an explicit one of the scale's shape);
- every DequantizeLinear reading it (per tensor, per channel or blocked: scale, axis and
  block_size unchanged) reads the new constant and zero point.

The unit rewritten is one weight tensor, with every DequantizeLinear reading it: a weight also
read by another op (or by a DequantizeLinear as other than its input 0), a graph output, read
inside a subgraph, or behind a DequantizeLinear whose zero point is computed at run time (or
absent for an unsigned weight with a run-time scale) is left as it is; ``skipped`` counts such
weights by reason, and 4-bit DequantizeLinear inputs that are graph inputs among them. Integer
activations (a DequantizeLinear input computed at run time) are not weights.

EXACT: the dequantized weights, hence the outputs, are bitwise unchanged. Whether the widened
weights are then allowed by a target (symmetry, granularity) is other lowering passes' business.
"""

from __future__ import annotations

import collections
from typing import cast


import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passmanager.passbase import Exactness, Pass, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.targets.requant import read_constant, set_inputs

# narrow storage -> shift subtracted from the integers and zero point to land in int8
_SHIFT = {"int4": 0, "int2": 0, "uint4": 8, "uint2": 2}


class Int8WeightsPass(Pass, name="int8-weights", exactness=Exactness.EXACT,
                      summary="int4/uint4 (int2/uint2) weights behind DequantizeLinear -> int8, same values (exact; target lowering)"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        boundary = ir.Boundary.of(graph)
        widened: collections.Counter[str]
        skipped: collections.Counter[str]
        widened, skipped = collections.Counter(), collections.Counter()  # summary counts by kind / reason
        rewritten = 0
        seen: set[str] = set()
        new_zps: dict[tuple, gs.Constant] = {}
        for node in list(graph.nodes):
            if node.op != "DequantizeLinear" or node.inputs[0].name in seen:
                continue
            tensor = node.inputs[0]
            dtype = _narrow_dtype(index, tensor)
            if dtype is None:
                continue
            seen.add(tensor.name)
            if tensor.name in boundary.inputs:
                reason = "weight is a graph input"
            else:
                reason = _check(index, tensor, dtype, boundary)
            if reason:
                skipped[reason] += 1
                continue
            rewritten += _widen(index, tensor, dtype, new_zps)
            key = f"{dtype}->int8"
            widened[key] += 1
        summary = {"weights_widened": dict(widened), "dequantizers_rewritten": rewritten, "skipped": dict(skipped)}
        if not seen:
            raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, "no int4/uint4/int2/uint2 weight behind a "
                                    "DequantizeLinear", **summary)
        if not rewritten:
            raise PassNotApplicable(Reason.NO_SITES, f"no 4-bit/2-bit weight can be widened ({len(seen)} left as "
                                    "they are: see skipped)", **summary)
        return PassResult(True, summary)


def _dtype_name(dtype) -> str | None:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return None


def _narrow_dtype(index: ir.GraphIndex, tensor: gs.Tensor) -> str | None:
    """'int4' / 'uint4' / 'int2' / 'uint2' for a narrow integer weight (or graph input), else None."""
    if isinstance(tensor, gs.Constant):  # the declared type: no need to load the values
        name = _dtype_name(tensor.dtype)
        return name if name in _SHIFT else None
    if tensor.dtype is not None and index.producer(tensor.name) is None:  # a graph input
        name = _dtype_name(tensor.dtype)
        return name if name in _SHIFT else None
    value = read_constant(index, tensor)  # a Constant node's output
    name = None if value is None else _dtype_name(value.dtype)
    return name if name in _SHIFT else None


def _zero_point(node: gs.Node) -> gs.Tensor | None:
    return node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None


def _check(index: ir.GraphIndex, tensor: gs.Tensor, dtype: str, boundary: ir.Boundary) -> str:
    """Why the weight cannot be widened with all its readers ('' when it can)."""
    if tensor.name in boundary.outputs:
        return "weight is a graph output"
    if tensor.name in boundary.in_subgraphs:
        return "weight read in a subgraph"
    for reader in index.consumers(tensor.name):
        slots = [i for i, t in enumerate(reader.inputs) if t.name == tensor.name]
        if reader.op != "DequantizeLinear":
            return f"weight read by {reader.op}"
        if slots != [0]:
            return "weight read by DequantizeLinear as scale or zero point"
        zp_t = _zero_point(reader)
        if zp_t is not None:
            zp = read_constant(index, zp_t)
            if zp is None:
                return "zero point computed at run time"
            if _dtype_name(zp.dtype) != dtype:
                return "zero point type differs"
        elif _SHIFT[dtype] and read_constant(index, reader.inputs[1]) is None:
            return "no zero point and scale computed at run time"
    return ""


def _widen(index: ir.GraphIndex, tensor: gs.Tensor, dtype: str, new_zps: dict) -> int:
    """Rewire every DequantizeLinear reading ``tensor`` to its int8 copy; returns how many."""
    shift = _SHIFT[dtype]
    q = np.asarray(read_constant(index, tensor)).astype(np.int64) - shift
    weight = gs.Constant(ir.unique_name(index, f"{tensor.name}_int8"), np.ascontiguousarray(q.astype(np.int8)))
    readers = list(index.consumers(tensor.name))
    for reader in readers:
        reader.inputs[0] = weight
        zp_t = _zero_point(reader)
        if zp_t is not None:
            key: tuple = ("value", zp_t.name)
            if key not in new_zps:
                z = np.asarray(read_constant(index, zp_t)).astype(np.int64) - shift
                new_zps[key] = gs.Constant(ir.unique_name(index, f"{zp_t.name}_int8"), np.asarray(z.astype(np.int8)))
            set_inputs(reader, 2, (new_zps[key],))
        elif shift:  # z = 0 of the unsigned type: explicit -shift of the scale's shape
            scale = reader.inputs[1]
            shape = np.shape(cast(np.ndarray, read_constant(index, scale)))  # a constant (_check)
            key = ("implicit", scale.name, shape, shift)
            if key not in new_zps:
                new_zps[key] = gs.Constant(ir.unique_name(index, f"{scale.name}_zero_point_int8"),
                                           np.full(shape, -shift, np.int8))
            set_inputs(reader, 2, (new_zps[key],))
    return len(readers)
