"""Reading and rewriting Q/DQ parameters on a graphsurgeon graph, for the target lowering passes
(``pow2-scales``, ``symmetric-weights``).

Both passes do the same three things: find the integer weights behind DequantizeLinear nodes with
their layout (per tensor, per channel, per block), dequantize them with ``edgeq.quantize.quant``'s numpy
reference, and write requantized integers back as new constants (4-bit packing through
``qdq_nodes.integer_constant``). Keeping that here means the two passes agree on what a weight is
and measure their error the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from edgeq.graph import ir
from edgeq.quantize.qdq_nodes import integer_constant
from edgeq.quantize.quant import QuantSpec, dequantize_weight, expand_blocks

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
INTEGER_DTYPES = ("int8", "uint8", "int16", "uint16", "int4", "uint4")


@dataclass
class WeightDQ:
    """An integer weight and the DequantizeLinear reading it, in ``quantize_weight``'s layout."""

    node: gs.Node
    q: np.ndarray  # int64 values, the weight's shape
    scale: np.ndarray  # as stored: scalar, 1-D along axis, or blocked
    zero_point: np.ndarray  # int64, scale's shape
    spec: QuantSpec  # dtype, axis (None: per tensor), block_size

    @property
    def mid(self) -> int:
        """The zero point of a symmetric encoding in this dtype (0 signed, the midpoint unsigned)."""
        return 0 if self.spec.signed else (self.spec.qmax + self.spec.qmin + 1) // 2

    @property
    def symmetric(self) -> bool:
        return bool(np.all(self.zero_point == self.mid))

    def dequantized(self) -> np.ndarray:
        return dequantize_weight(self.q, self.scale, self.zero_point, self.spec)

    def key(self) -> tuple:
        """What makes two DequantizeLinear nodes read the same weight (shared constants)."""
        return tuple(t.name for t in self.node.inputs) + (self.spec.axis, self.spec.block_size)


def read_constant(index: ir.GraphIndex, tensor: gs.Tensor) -> np.ndarray | None:
    """A constant's value without materializing it in the graph: graphsurgeon's ``.values``
    replaces a lazily loaded tensor by its numpy array, which it then cannot export for 4-bit
    types (see ``qdq_nodes.integer_constant``), so lazy tensors are loaded on the side."""
    if isinstance(tensor, gs.Constant) and isinstance(tensor._values, LazyValues):  # noqa: SLF001 (no public read-only accessor)
        return np.asarray(tensor._values.load())  # noqa: SLF001
    return index.constant_value(tensor)


def integer_dtype(values: np.ndarray) -> str | None:
    """The QuantSpec dtype name of an integer array (ml_dtypes int4 included), else None."""
    name = np.dtype(values.dtype).name
    return name if name in INTEGER_DTYPES else None


def weight_dequantizers(graph: gs.Graph, index: ir.GraphIndex) -> list[WeightDQ]:
    """Every DequantizeLinear whose input is a constant integer tensor (an offline-quantized weight)."""
    found = []
    for node in graph.nodes:
        if node.op != "DequantizeLinear":
            continue
        q = read_constant(index, node.inputs[0])
        scale = read_constant(index, node.inputs[1]) if len(node.inputs) > 1 else None
        if q is None or scale is None:
            continue
        dtype = integer_dtype(q)
        if dtype is None:  # float8 weights: not integer quantization
            continue
        zp_t = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
        zp = read_constant(index, zp_t) if zp_t is not None else np.zeros(np.shape(scale), np.int64)
        if zp is None:
            continue
        block = int(node.attrs.get("block_size", 0))
        per_tensor = np.size(scale) == 1 and not block
        axis = None if per_tensor else int(node.attrs.get("axis", 1)) % q.ndim
        spec = QuantSpec(dtype, axis=axis, block_size=block)
        found.append(WeightDQ(node, q.astype(np.int64), np.asarray(scale), np.asarray(zp).astype(np.int64), spec))
    return found


def broadcast_param(param: np.ndarray, spec: QuantSpec, shape: tuple[int, ...]) -> np.ndarray:
    """A scale or zero point in DequantizeLinear's layout, broadcast against the weight."""
    param = np.asarray(param)
    if spec.axis is None:
        return param.reshape(())
    if spec.block_size:
        return expand_blocks(param, spec.axis, spec.block_size, shape[spec.axis])
    bshape = [1] * len(shape)
    bshape[spec.axis] = -1
    return param.reshape(bshape)


def requantize(w: np.ndarray, scale: np.ndarray, zp: np.ndarray, spec: QuantSpec) -> np.ndarray:
    """Round-to-nearest-even, saturating integers of ``w`` on the grid (scale, zp) in ``spec``'s layout."""
    s = broadcast_param(scale, spec, w.shape).astype(np.float32)
    z = broadcast_param(zp, spec, w.shape).astype(np.float32)
    q = np.round(w.astype(np.float32) / s) + z
    return np.clip(q, spec.qmin, spec.qmax).astype(np.int64)


def replace_weight(graph: gs.Graph, index: ir.GraphIndex, wdq: WeightDQ, q: np.ndarray, scale: np.ndarray,
                   zp: np.ndarray, spec: QuantSpec, tag: str) -> tuple[gs.Constant, gs.Constant, gs.Constant]:
    """New constants (named ``<old>_<tag>``) for the weight, its scale and zero point, wired into
    ``wdq.node``; returned so DequantizeLinear nodes sharing the old ones can share the new."""
    old_q, old_s = wdq.node.inputs[0], wdq.node.inputs[1]
    q_c = integer_constant(ir.unique_name(index, f"{old_q.name}_{tag}"), q.astype(spec.np_dtype), spec)
    s_c = gs.Constant(ir.unique_name(index, f"{old_s.name}_{tag}"), np.asarray(scale, wdq.scale.dtype).reshape(wdq.scale.shape))
    z_c = integer_constant(ir.unique_name(index, f"{old_q.name}_zero_point_{tag}"),
                           np.asarray(zp).astype(spec.np_dtype).reshape(wdq.scale.shape), spec)
    set_inputs(wdq.node, 0, (q_c, s_c, z_c))
    return q_c, s_c, z_c


def set_inputs(node: gs.Node, start: int, tensors) -> None:
    """``node.inputs[start:start + len(tensors)] = tensors``, appending past the end (a Q/DQ
    written without its optional zero point gets one)."""
    for offset, tensor in enumerate(tensors):
        slot = start + offset
        if slot < len(node.inputs):
            node.inputs[slot] = tensor
        else:
            node.inputs.append(tensor)


@dataclass
class ErrorMeter:
    """Weight requantization error: RMS of (new - old dequantized weight) relative to the old's RMS,
    over all weights together and the worst single weight."""

    err2: float = 0.0
    ref2: float = 0.0
    worst: float = 0.0
    count: int = 0

    def add(self, old: np.ndarray, new: np.ndarray) -> None:
        old = np.asarray(old, np.float64)
        e2 = float(np.sum((np.asarray(new, np.float64) - old) ** 2))
        r2 = float(np.sum(old * old))
        self.err2 += e2
        self.ref2 += r2
        self.worst = max(self.worst, relative_rms(e2, r2))
        self.count += 1

    def summary(self) -> dict:
        return {"weight_rel_rms_error": relative_rms(self.err2, self.ref2), "weight_max_rel_rms_error": self.worst}


def relative_rms(err2: float, ref2: float) -> float:
    """sqrt(sum err^2 / sum ref^2): 0 for no error, and 0 for an all-zero reference with no error."""
    if err2 == 0.0:
        return 0.0
    return float(np.sqrt(err2 / ref2)) if ref2 > 0 else float("inf")


def pow2_ceil(scale: np.ndarray) -> np.ndarray:
    """2^ceil(log2 s), exactly (frexp: s = m 2^e with m in [0.5, 1); m = 0.5 is already 2^(e-1))."""
    s = np.asarray(scale, np.float64)
    mantissa, exponent = np.frexp(s)
    return np.where(mantissa == 0.5, s, np.ldexp(1.0, exponent)).astype(np.asarray(scale).dtype)
