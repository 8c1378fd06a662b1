"""``encodings.json``: every quantized tensor's parameters, read back from the final graph.

Reading them from the graph (not from the passes' bookkeeping) guarantees the file describes
exactly what the model computes, whichever pass wrote the Q/DQ. Vendor-neutral layout, version
``edgeq-encodings/1``::

    {"version": ..., "activations": {tensor: enc}, "weights": {tensor: enc},
     "unrepresented": {node: {"op", "tensor", "reason"}}}
    enc = {"dtype", "bits", "symmetric", "granularity": "tensor"|"channel"|"block",
           "axis", "block_size", "scale": [...], "zero_point": [...],
           "qmin", "qmax", "scale_shape", "shape", "float_name"}

``dtype`` is the ONNX storage type (int8, uint8, int16, uint16, int4, uint4, int2, uint2, int32,
or a float8/float4 name); ``qmin``/``qmax`` is the integer range the graph can actually produce
(narrower than the type when a Clip follows the QuantizeLinear, e.g. 6-bit values in int8) and
``bits`` its width, which is what a converter must program; both are None for float grids.
``scale``/``zero_point`` are flattened in C order from a tensor of shape ``scale_shape`` (the
layout DequantizeLinear takes: 1-D along ``axis`` per channel; the data's shape with ``axis``
divided by ``block_size`` per block); ``shape`` is the quantized tensor's shape when the graph
knows it (always for weights). Real value = (q - zero_point) * scale.

Keys. Activation entries are keyed by the float tensor a QuantizeLinear quantizes (or, for a
DequantizeLinear of an integer graph input, by the float tensor it produces). Weight entries are
keyed by the integer constant feeding a DequantizeLinear, or by the constant float tensor a
QuantizeLinear quantizes (DPQ's FP8 step); ``float_name`` is the float tensor the consuming op
reads (the DequantizeLinear's output, resp. the quantized float tensor): the name a converter
sees once it folds the DequantizeLinear, and the key vendor exports use.

Coverage: every QuantizeLinear and DequantizeLinear of the main graph is accounted for. A
DequantizeLinear reading a QuantizeLinear's integers (directly, through the narrowing Clip or
through integer data movement such as MUXQ's Gather/Concat) with the same parameters is covered
by that QuantizeLinear's entry; anything that cannot be described by static parameters (scale
computed at run time, differing parameters, a second encoding of one tensor) is listed under
``unrepresented`` with a reason rather than dropped silently.

Layout history: ``qmin``, ``qmax``, ``scale_shape``, ``shape``, ``float_name`` and
``unrepresented`` were added without changing the earlier keys; ``bits`` now reports the
narrowed width where a Clip narrows an activation (it was the storage width before).

Beside ``edgeq.quantize.qdq_nodes`` (which writes the Q/DQ) so that every reader imports it from below: the
compiler (``edgeq.artifacts`` writes the file and AIMET's layout of it), the target checks
(``edgeq.targets.check``) and the static pair (``edgeq.static.compile``).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

ENCODINGS_VERSION = "edgeq-encodings/1"

# onnx element type -> (name, qmin, qmax) of the integer grids Q/DQ can produce or read
_INT_TYPES = {
    TensorProto.INT8: ("int8", -128, 127),
    TensorProto.UINT8: ("uint8", 0, 255),
    TensorProto.INT16: ("int16", -32768, 32767),
    TensorProto.UINT16: ("uint16", 0, 65535),
    TensorProto.INT4: ("int4", -8, 7),
    TensorProto.UINT4: ("uint4", 0, 15),
    TensorProto.INT32: ("int32", -(2**31), 2**31 - 1),  # DequantizeLinear of int32 biases
}
for _t, _name, _lo, _hi in (("INT2", "int2", -2, 1), ("UINT2", "uint2", 0, 3)):  # onnx >= 1.20
    if hasattr(TensorProto, _t):
        _INT_TYPES[getattr(TensorProto, _t)] = (_name, _lo, _hi)
STORAGE_RANGES = {name: (lo, hi) for name, lo, hi in _INT_TYPES.values()}  # dtype name -> full integer range
# onnx element type -> (name, bits) of the float grids (FP8 QuantizeLinear, opset 19+; FP4, 23+)
_FLOAT_TYPES = {
    getattr(TensorProto, t): (t.lower(), 4 if t.startswith("FLOAT4") else 8)
    for t in ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT4E2M1")
    if hasattr(TensorProto, t)
}
# ops that move or select integer elements without changing their grid: a DequantizeLinear behind
# them reads the grid of the QuantizeLinear in front (Clip only narrows it)
_PASS_THROUGH = frozenset({"Clip", "Gather", "GatherElements", "Concat", "Reshape", "Transpose", "Squeeze",
                           "Unsqueeze", "Slice", "Identity", "Flatten", "Expand", "Split", "Tile"})


def collect_encodings(model: onnx.ModelProto, base_dir: str = "") -> dict:
    """The encodings of every QuantizeLinear/DequantizeLinear in ``model``'s main graph
    (``base_dir``: where initializers still stored as external data are read from)."""
    return _Reader(model, base_dir).collect()


class _Reader:
    """One pass of lookups over the graph (constants, producers, consumers, element types)."""

    def __init__(self, model: onnx.ModelProto, base_dir: str = ""):
        self.base_dir = base_dir
        graph = model.graph
        self.nodes = list(graph.node)
        self.tensors = {t.name: t for t in graph.initializer}
        for n in self.nodes:
            if n.op_type == "Constant" and len(n.attribute) == 1:
                a = n.attribute[0]
                if a.name == "value":
                    self.tensors[n.output[0]] = a.t
                elif a.name in ("value_float", "value_int"):  # scalar scales/zero points written inline
                    elem = TensorProto.FLOAT if a.name == "value_float" else TensorProto.INT64
                    self.tensors[n.output[0]] = onnx.helper.make_tensor(n.output[0], elem, [], [a.f if a.name == "value_float" else a.i])
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.consumers: dict[str, list] = {}
        for n in self.nodes:
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
        self.elem_types = {v.name: v.type.tensor_type.elem_type
                           for v in (*graph.input, *graph.value_info, *graph.output) if v.type.HasField("tensor_type")}
        self.shapes = {t: list(p.dims) for t, p in self.tensors.items()}
        graph_inputs = {v.name for v in graph.input}
        self.constant = set(self.tensors) - graph_inputs  # an initializer that is also an input can be fed
        for n in self.nodes:  # nodes are topologically sorted (ONNX rule): one forward pass suffices
            if n.op_type != "Constant" and n.input and all(i in self.constant for i in n.input if i):
                self.constant.update(o for o in n.output if o)

    def value(self, name: str) -> np.ndarray | None:
        t = self.tensors.get(name) if name else None
        return None if t is None else numpy_helper.to_array(t, self.base_dir)

    def elem_type(self, name: str) -> int | None:
        t = self.tensors.get(name)
        return t.data_type if t is not None else self.elem_types.get(name)

    # -- the walk ---------------------------------------------------------------------------
    def collect(self) -> dict:
        self.activations: dict[str, dict] = {}
        self.weights: dict[str, dict] = {}
        self.unrepresented: dict[str, dict] = {}
        quantizers = {}  # QuantizeLinear output -> (node, encoding or None)
        for node in self.nodes:
            if node.op_type == "QuantizeLinear":
                quantizers[node.output[0]] = (node, self._quantize(node))
            elif node.op_type == "DequantizeLinear":
                self._dequantize(node, quantizers)
        return {"version": ENCODINGS_VERSION, "activations": self.activations, "weights": self.weights,
                "unrepresented": self.unrepresented}

    def _skip(self, node, tensor: str, reason: str) -> None:
        self.unrepresented[node.name or node.output[0]] = {"op": node.op_type, "tensor": tensor, "reason": reason}

    def _store(self, table: dict, key: str, enc: dict, node) -> None:
        old = table.get(key)
        if old is None or old == enc:
            table[key] = enc
        else:
            self._skip(node, key, "the tensor already has a different encoding")

    def _params(self, node) -> tuple[np.ndarray | None, np.ndarray | None, int | None]:
        """(scale, zero point, storage element type) of a Q/DQ node; scale None when not static."""
        scale = self.value(node.input[1])
        zp_name = node.input[2] if len(node.input) > 2 else ""
        zp = self.value(zp_name)
        if zp_name and zp is None:
            return None, None, None  # zero point computed at run time
        if zp_name:
            elem = self.elem_type(zp_name)
        elif node.op_type == "QuantizeLinear":
            elem = _attrs(node).get("output_dtype") or TensorProto.UINT8  # the ONNX default
        else:
            elem = self.elem_type(node.input[0])
        return scale, zp, elem

    def _quantize(self, node) -> dict | None:
        x = node.input[0]
        scale, zp, elem = self._params(node)
        if scale is None:
            self._skip(node, x, "scale or zero point is computed at run time")
            return None
        enc = _encoding(scale, zp, elem, _attrs(node), self.shapes.get(x), self._clip_range(node.output[0]))
        if enc is None:
            self._skip(node, x, f"unknown quantized element type {elem}")
            return None
        enc["float_name"] = x
        self._store(self.weights if x in self.constant else self.activations, x, enc, node)
        return enc

    def _dequantize(self, node, quantizers: dict) -> None:
        x, out = node.input[0], node.output[0]
        scale, zp, elem = self._params(node)
        source = self._upstream_quantizer(x, quantizers)
        if source is not None:
            q_node, q_enc = source
            if q_enc is not None and not self._same_params(node, q_node):
                self._skip(node, out, f"parameters differ from those of QuantizeLinear '{q_node.name}'")
            return  # covered by the QuantizeLinear's entry (or its unrepresented note)
        if scale is None:
            self._skip(node, out, "scale or zero point is computed at run time")
            return
        if x in self.tensors:  # an integer constant: a weight
            enc = _encoding(scale, zp, elem, _attrs(node), self.shapes.get(x), None)
            if enc is None:
                self._skip(node, x, f"unknown quantized element type {elem}")
                return
            enc["float_name"] = out
            self._store(self.weights, x, enc, node)
        elif x in self.constant:
            self._skip(node, x, f"integer weight computed by '{self.producer[x].op_type}' from constants")
        else:  # integers from outside the graph (e.g. a quantized cache input)
            enc = _encoding(scale, zp, elem, _attrs(node), None, None)
            if enc is None:
                self._skip(node, out, f"unknown quantized element type {elem}")
                return
            enc["float_name"] = out
            self._store(self.activations, out, enc, node)

    def _same_params(self, dq, q) -> bool:
        """Whether a DequantizeLinear reads its QuantizeLinear's grid: same scale, zero point
        (absent = 0), axis and block size."""
        def params(node):
            zp_name = node.input[2] if len(node.input) > 2 else ""
            scale = self.value(node.input[1])
            zp = self.value(zp_name) if zp_name else np.zeros(np.shape(scale))
            a = _attrs(node)
            return scale, zp, a.get("axis", 1), a.get("block_size", 0)

        (s1, z1, a1, b1), (s2, z2, a2, b2) = params(dq), params(q)
        if s1 is None or z1 is None or np.shape(s1) != np.shape(s2) or (a1, b1) != (a2, b2) and np.size(s1) > 1:
            return False
        return bool(np.array_equal(s1, s2) and np.array_equal(np.asarray(z1, np.float64), np.asarray(z2, np.float64)))

    def _upstream_quantizer(self, name: str, quantizers: dict):
        """The QuantizeLinear whose integers reach ``name`` through grid-preserving ops, if any."""
        for _ in range(64):
            if name in quantizers:
                return quantizers[name]
            producer = self.producer.get(name)
            if producer is None or producer.op_type not in _PASS_THROUGH:
                return None
            name = producer.input[0]
        return None

    def _clip_range(self, q_out: str) -> tuple[int, int] | None:
        """(lo, hi) when every reader of a QuantizeLinear's output is the same constant Clip."""
        readers = self.consumers.get(q_out, [])
        bounds = set()
        for n in readers:
            if n.op_type != "Clip" or n.input[0] != q_out or len(n.input) < 3:
                return None
            lo, hi = self.value(n.input[1]), self.value(n.input[2])
            if lo is None or hi is None:
                return None
            bounds.add((int(lo), int(hi)))
        return bounds.pop() if len(bounds) == 1 else None


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _encoding(scale, zp, elem, attrs: dict, shape: list | None, clip: tuple[int, int] | None) -> dict | None:
    qmin: int | None
    qmax: int | None
    if elem in _INT_TYPES:
        dtype, qmin, qmax = _INT_TYPES[elem]
        if clip is not None:
            qmin, qmax = max(qmin, clip[0]), min(qmax, clip[1])
        bits = math.ceil(math.log2(qmax - qmin + 1))
        mid = 0 if _INT_TYPES[elem][1] < 0 else (qmin + qmax + 1) // 2
        zp = np.zeros(np.shape(scale), np.int64) if zp is None else zp.astype(np.int64)
        symmetric = bool(np.all(zp == mid))
        zero_point = zp.ravel().tolist()
    elif elem in _FLOAT_TYPES:
        dtype, bits = _FLOAT_TYPES[elem]
        qmin = qmax = None
        zp = np.zeros(np.shape(scale)) if zp is None else zp.astype(np.float64)
        symmetric = bool(np.all(zp == 0))
        zero_point = zp.ravel().tolist()
    else:
        return None
    block = int(attrs.get("block_size", 0))
    granularity = "tensor" if scale.ndim == 0 or scale.size == 1 and block == 0 else ("block" if block else "channel")
    axis = None
    if granularity != "tensor":
        axis = int(attrs.get("axis", 1))
        rank = len(shape) if shape is not None else scale.ndim if granularity == "block" else None
        axis = axis % rank if rank else axis
    return {
        "dtype": dtype,
        "bits": bits,
        "symmetric": symmetric,
        "granularity": granularity,
        "axis": axis,
        "block_size": block,
        "scale": np.asarray(scale, np.float64).ravel().tolist(),
        "zero_point": zero_point,
        "qmin": qmin,
        "qmax": qmax,
        "scale_shape": list(np.shape(scale)),
        "shape": None if shape is None else [int(d) for d in shape],
    }
