"""QDQ node units: how an NPU compiler groups ``DQ -> op -> Q`` into one integer op, and what the
profile check needs to know about them.

Measured on Qualcomm's HTP through onnxruntime-qnn 2.7.0 (the probe matrix in
``tests/test_qnn_vendor.py``): a per-tensor weight DequantizeLinear is taken in any context, but
a per-channel one only when its linear is a whole unit, the input dequantized and the output
quantized at the same activation type (uint8/uint8, uint16/uint16, int16/int16; uint16 in and
int16 out is refused; int4 weights with int8 activations are refused too). Profiles with
``node_units = true`` get that rule.

A lookup table (an integer constant behind a DequantizeLinear read only as a Gather's data) is
an activation-like tensor to the HTP, not a weight: it is judged by the ``[activations]`` rules.
"""

from __future__ import annotations

import numpy as np
import onnx

from edgeq.targets.profile import dtype_name

_LINEARS = ("MatMul", "Gemm", "Conv")


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            if name:
                readers.setdefault(name, []).append((node, slot))
    return readers


def lookup_tables(graph: onnx.GraphProto) -> set[str]:
    """Integer constants dequantized only to be gathered from (embedding tables)."""
    constants = {t.name for t in graph.initializer}
    readers = _consumers(graph)
    tables = set()
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in constants:
            continue
        uses = readers.get(node.output[0], [])
        if uses and all(r.op_type == "Gather" and slot == 0 for r, slot in uses):
            tables.add(node.input[0])
    return tables


def broken_units(graph: onnx.GraphProto, constants: dict[str, onnx.TensorProto]) -> list[tuple[str, str]]:
    """(weight DequantizeLinear, why) for each per-channel weight whose linear is not a whole unit."""
    producers = {o: n for n in graph.node for o in n.output}
    readers = _consumers(graph)
    out = []
    for node in graph.node:
        if node.op_type not in _LINEARS or len(node.input) < 2:
            continue
        dq = producers.get(node.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in constants:
            continue
        scale = constants.get(dq.input[1])
        if scale is None or int(np.prod(scale.dims)) <= 1:
            continue  # per tensor: taken anywhere
        in_type = _dequantized_type(node.input[0], producers, constants)
        outs = readers.get(node.output[0], [])
        out_types = {_zero_point_type(r, constants) for r, _ in outs if r.op_type == "QuantizeLinear"}
        label = dq.name or dq.output[0]
        if in_type is None:
            out.append((label, f"per-channel weight of {node.op_type} {node.name}: its input is not dequantized"))
        elif not outs or len(out_types) != 1 or any(r.op_type != "QuantizeLinear" for r, _ in outs):
            out.append((label, f"per-channel weight of {node.op_type} {node.name}: its output is not quantized"))
        elif in_type == "int8" and dtype_name(constants[dq.input[0]].data_type) == "int4":
            out.append((label, f"per-channel int4 weight of {node.op_type} {node.name} with int8 activations "
                               "(the HTP takes int4 weights with uint8, uint16 or int16)"))
        elif out_types != {in_type}:
            out.append((label, f"per-channel weight of {node.op_type} {node.name}: input {in_type}, output "
                               f"{out_types.pop()} (a unit takes one activation type)"))
    return out


def _dequantized_type(name: str, producers: dict, constants: dict) -> str | None:
    dq = producers.get(name)
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    return _zero_point_type(dq, constants)


def _zero_point_type(node: onnx.NodeProto, constants: dict) -> str | None:
    if len(node.input) > 2 and node.input[2] in constants:
        return dtype_name(constants[node.input[2]].data_type)
    return "uint8"
