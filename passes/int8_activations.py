"""``int8-activations``: every unsigned integer activation re-expressed in the signed type.

Integer engines that take signed activations only (a power-of-two NPU, an int8 GEMM without an
unsigned-input path) cannot run a uint8 QuantizeLinear, which is what symmetric unsigned specs
write (zero point 128, the same grid as int8). Shifting the integers by half the range is exact:
for every q, ((q - 128) - (z - 128)) * s = (q - z) * s, and QuantizeLinear's saturation moves with
it (round(x / s) + z clipped to [0, 255], minus 128, is round(x / s) + z - 128 clipped to
[-128, 127]). So, per integer activation:

- uint8 -> int8 with zero point z - 128, uint16 -> int16 with z - 32768 (a Q/DQ without a zero
  point, i.e. z = 0 of uint8 or of ``output_dtype``, gets an explicit one);
- the same for every DequantizeLinear reading those integers, directly or through integer data
  movement (``encodings``' pass-through ops: MUXQ's Gather/Concat, Reshape, Slice, ...);
- a Clip on the integers (the narrowing Clip ``qdq_nodes.insert_quantize`` writes for fewer value
  bits) has its bounds shifted by the same amount.

The unit rewritten is a closed group of integer tensors: QuantizeLinear outputs and the
pass-through ops' outputs they reach (a Concat joins the groups of all its inputs), whose every
reader is a pass-through op (as data) or a DequantizeLinear (as input 0). A group that is not
closed (an integer graph input or output, another op reading the integers, a zero point or Clip
bound computed at run time, integers read inside a subgraph) is left as it is; ``skipped`` counts
its quantizers by reason. QuantizeLinear of constants (weights) and integer weights behind a DequantizeLinear
are not activations: ``symmetric-weights`` handles weights.

EXACT: outputs are bitwise unchanged. Note that for a narrowed unsigned range (e.g. 6-bit values
[0, 63] in uint8, zero point 32) the shifted range is [-128, -65] with zero point -96: still exact,
but ``encodings`` then calls it asymmetric (the signed midpoint is 0).
"""

from __future__ import annotations

import collections

from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passmanager.passbase import Exactness, Pass, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.targets.requant import read_constant

# unsigned storage -> (signed type, numpy type, onnx type, shift)
_SIGNED = {
    "uint8": ("int8", np.int8, onnx.TensorProto.INT8, 128),
    "uint16": ("int16", np.int16, onnx.TensorProto.INT16, 32768),
}
_ONNX_UNSIGNED: dict[int, str] = {onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.UINT16: "uint16"}
# ops that move integer elements without changing their grid (``edgeq.quantize.qdq_encodings._PASS_THROUGH``),
# with the input slots carrying the integers (None: every input)
_DATA_SLOTS: dict[str, tuple[int, ...] | None] = {
    "Clip": (0,), "Gather": (0,), "GatherElements": (0,), "Concat": None, "Reshape": (0,), "Transpose": (0,),
    "Squeeze": (0,), "Unsqueeze": (0,), "Slice": (0,), "Identity": (0,), "Flatten": (0,), "Expand": (0,),
    "Split": (0,), "Tile": (0,),
}


@dataclass
class _Group:
    """A closed set of integer tensors and the Q / DQ / pass-through nodes around them."""

    tensors: dict[str, gs.Variable]
    quantizers: list[gs.Node]
    dequantizers: list[gs.Node]
    movers: list[gs.Node]  # pass-through ops (Clip among them)


class Int8ActivationsPass(Pass, name="int8-activations", exactness=Exactness.EXACT,
                          summary="uint8/uint16 activations -> int8/int16, zero point and Clip bounds - 128 / - 32768 (exact; target lowering)"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        boundary = ir.Boundary.of(graph)
        skipped: collections.Counter[str] = collections.Counter()  # by reason
        seen: set[str] = set()
        shifted: collections.Counter[str] = collections.Counter()  # by dtype change
        counts = {"quantizers": 0, "dequantizers": 0, "clips": 0}
        new_consts: dict[tuple, gs.Constant] = {}
        for node in list(graph.nodes):
            if node.op != "QuantizeLinear" or node.outputs[0].name in seen:
                continue
            if _quantized_dtype(index, node) not in _SIGNED:
                continue
            if read_constant(index, node.inputs[0]) is not None:
                continue  # a weight quantized at run time: not an activation
            group, reason = _collect(index, node, boundary)
            seen.update(group.tensors if group is not None else (node.outputs[0].name,))
            if group is None:
                skipped[reason] += 1
                continue
            dtype = cast(str, _quantized_dtype(index, group.quantizers[0]))  # one of _SIGNED (_collect)
            _shift(index, group, dtype, new_consts)
            key = f"{dtype}->{_SIGNED[dtype][0]}"
            shifted[key] += len(group.quantizers)
            counts["quantizers"] += len(group.quantizers)
            counts["dequantizers"] += len(group.dequantizers)
            counts["clips"] += sum(n.op == "Clip" for n in group.movers)
        summary = {"activations_shifted": dict(shifted), **{f"{k}_rewritten": v for k, v in counts.items()},
                   "skipped": dict(skipped)}
        if not counts["quantizers"]:
            if not skipped:
                raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, "no uint8/uint16 activation QuantizeLinear",
                                        **summary)
            raise PassNotApplicable(Reason.NO_SITES, f"no uint8/uint16 activation can be made signed "
                                    f"({sum(skipped.values())} left as they are: see skipped)", **summary)
        return PassResult(True, summary)


def _zero_point(node: gs.Node) -> gs.Tensor | None:
    return node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None


def _quantized_dtype(index: ir.GraphIndex, node: gs.Node) -> str | None:
    """The integer storage type of a Q's output or a DQ's input, as far as the graph says."""
    zp_t = _zero_point(node)
    if zp_t is not None:
        zp = read_constant(index, zp_t)
        return None if zp is None else np.dtype(zp.dtype).name
    if node.op == "QuantizeLinear":
        return _ONNX_UNSIGNED.get(int(node.attrs.get("output_dtype", 0)) or onnx.TensorProto.UINT8)
    dtype = node.inputs[0].dtype
    return np.dtype(dtype).name if dtype is not None else None


def _collect(index: ir.GraphIndex, q: gs.Node, boundary: ir.Boundary) -> tuple[_Group | None, str]:
    """The closed group of integer tensors around ``q``'s output, or (None, why not)."""
    group = _Group({}, [], [], [])
    nodes: set[int] = set()
    work = [q.outputs[0]]

    def take(node: gs.Node, members: list[gs.Node]) -> None:
        """Put ``node`` in the group once (producer or reader alike); a pass-through op also
        brings every integer tensor it moves into the walk."""
        if id(node) in nodes:
            return
        nodes.add(id(node))
        members.append(node)
        if node.op in _DATA_SLOTS:
            work.extend(_data_inputs(node))
            work.extend(node.outputs)

    while work:
        tensor = work.pop()
        if tensor.name in group.tensors:
            continue
        if not isinstance(tensor, gs.Variable):
            return None, "integer constant"
        if tensor.name in boundary.outputs:
            return None, "integer graph output"
        if tensor.name in boundary.in_subgraphs:
            return None, "integers read in a subgraph"
        group.tensors[tensor.name] = tensor
        producer = index.producer(tensor.name)
        if producer is None:
            return None, "integer graph input"
        if id(producer) not in nodes:
            if producer.op == "QuantizeLinear":
                take(producer, group.quantizers)
            elif producer.op in _DATA_SLOTS:
                take(producer, group.movers)
            else:
                return None, f"integers produced by {producer.op}"
        for reader in index.consumers(tensor.name):
            slots = [i for i, t in enumerate(reader.inputs) if t.name == tensor.name]
            if reader.op == "DequantizeLinear" and slots == [0]:
                take(reader, group.dequantizers)
            elif reader.op in _DATA_SLOTS and all(_is_data_slot(reader, i) for i in slots):
                take(reader, group.movers)
            else:
                return None, f"integers read by {reader.op}"
    # a DQ without a zero point reads whatever type its input has: the quantizers' (onnx typing)
    typed = group.quantizers + [n for n in group.dequantizers if _zero_point(n) is not None]
    dtypes = {_quantized_dtype(index, n) for n in typed}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _SIGNED:
        return None, "zero point not constant or types differ"
    for node in group.quantizers + group.dequantizers:
        if _zero_point(node) is None and read_constant(index, node.inputs[1]) is None:
            return None, "no zero point and scale computed at run time"
        if node.op == "QuantizeLinear" and read_constant(index, node.inputs[0]) is not None:
            return None, "joined with a quantized weight"
    for clip in (n for n in group.movers if n.op == "Clip"):
        if any(t.name and read_constant(index, t) is None for t in clip.inputs[1:]):
            return None, "Clip bound computed at run time"
    return group, ""


def _is_data_slot(node: gs.Node, slot: int) -> bool:
    slots = _DATA_SLOTS[node.op]
    return slots is None or slot in slots


def _data_inputs(node: gs.Node) -> list[gs.Tensor]:
    return [t for i, t in enumerate(node.inputs) if t.name and _is_data_slot(node, i)]


def _shift(index: ir.GraphIndex, group: _Group, dtype: str, new_consts: dict) -> None:
    signed, np_type, onnx_type, shift = _SIGNED[dtype]

    def shifted(tensor: gs.Tensor) -> gs.Constant:
        """The signed constant for an unsigned zero point or Clip bound (shared like the old one)."""
        key = ("value", tensor.name)
        if key not in new_consts:
            value = np.asarray(read_constant(index, tensor)).astype(np.int64) - shift
            new_consts[key] = gs.Constant(ir.unique_name(index, f"{tensor.name}_{signed}"), np.asarray(value.astype(np_type)))
        return new_consts[key]

    def implicit(node: gs.Node) -> gs.Constant:
        """The zero point of a Q/DQ written without one: 0 in the unsigned type, -shift now."""
        scale = node.inputs[1]
        shape = np.shape(cast(np.ndarray, read_constant(index, scale)))  # a constant (_collect)
        key = ("implicit", scale.name, shape)
        if key not in new_consts:
            new_consts[key] = gs.Constant(ir.unique_name(index, f"{scale.name}_zero_point_{signed}"),
                                          np.full(shape, -shift, np_type))
        return new_consts[key]

    for node in group.quantizers + group.dequantizers:
        zp_t = _zero_point(node)
        new = shifted(zp_t) if zp_t is not None else implicit(node)
        if len(node.inputs) > 2:
            node.inputs[2] = new
        else:
            node.inputs.append(new)
        if node.op == "QuantizeLinear" and "output_dtype" in node.attrs:
            node.attrs["output_dtype"] = onnx_type
    for clip in (n for n in group.movers if n.op == "Clip"):
        for i in (1, 2):
            if i < len(clip.inputs) and clip.inputs[i].name:
                clip.inputs[i] = shifted(clip.inputs[i])
    for tensor in group.tensors.values():
        tensor.dtype = np_type
