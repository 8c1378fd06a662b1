"""``encodings.json``: every quantized tensor's parameters, read back from the final graph.

Reading them from the graph (not from the passes' bookkeeping) guarantees the file describes
exactly what the model computes. Vendor-neutral layout, version ``edgeq-encodings/1``::

    {"version": ..., "activations": {tensor: enc}, "weights": {tensor: enc}}
    enc = {"dtype", "bits", "symmetric", "granularity": "tensor"|"channel"|"block",
           "axis", "block_size", "scale": [...], "zero_point": [...]}

Activation entries are keyed by the float tensor that is quantized; weight entries by the
integer initializer feeding a DequantizeLinear.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from edgeq.quant import QuantSpec

ENCODINGS_VERSION = "edgeq-encodings/1"
_ONNX_TO_NAME = {QuantSpec(d).onnx_type: d for d in ("int8", "uint8", "int16", "uint16", "int4", "uint4")}


def collect_encodings(model: onnx.ModelProto) -> dict:
    inits = {t.name: t for t in model.graph.initializer}
    constants = {n.output[0]: n.attribute[0].t for n in model.graph.node if n.op_type == "Constant" and n.attribute}

    def value(name):
        t = inits.get(name) or constants.get(name)
        return None if t is None else numpy_helper.to_array(t)

    activations, weights = {}, {}
    for node in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "QuantizeLinear":
            zp_t = inits.get(node.input[2]) or constants.get(node.input[2])
            enc = _encoding(value(node.input[1]), value(node.input[2]), zp_t, attrs)
            if enc:
                activations[node.input[0]] = enc
        elif node.op_type == "DequantizeLinear" and node.input[0] in inits:
            enc = _encoding(value(node.input[1]), value(node.input[2]), inits[node.input[0]], attrs)
            if enc:
                weights[node.input[0]] = enc
    return {"version": ENCODINGS_VERSION, "activations": activations, "weights": weights}


def _encoding(scale, zp, typed_tensor, attrs) -> dict | None:
    if scale is None or typed_tensor is None:
        return None
    dtype = _ONNX_TO_NAME.get(typed_tensor.data_type)
    if dtype is None:
        return None
    spec = QuantSpec(dtype)
    zp = np.zeros_like(scale, dtype=np.int64) if zp is None else zp.astype(np.int64)
    mid = 0 if spec.signed else (spec.qmax + spec.qmin + 1) // 2
    block = int(attrs.get("block_size", 0))
    granularity = "tensor" if scale.ndim == 0 or scale.size == 1 and block == 0 else ("block" if block else "channel")
    return {
        "dtype": dtype,
        "bits": spec.bits,
        "symmetric": bool(np.all(zp == mid)),
        "granularity": granularity,
        "axis": None if granularity == "tensor" else int(attrs.get("axis", 1)),
        "block_size": block,
        "scale": np.asarray(scale, np.float64).ravel().tolist(),
        "zero_point": zp.ravel().tolist(),
    }
