"""``edgeq check``: every node and tensor of a model that a target profile does not accept, and why.

The quantization parameters are read back from the graph with ``edgeq.quantize.qdq_encodings.collect_encodings``
(the same reading ``encodings.json`` gets), so the check judges what the model computes, not what
a pass meant to write. Rules, one violation line each:

- ``op``: a node (subgraphs included) whose op the profile does not run (standard op outside
  ``ops``, edgeq op outside ``edgeq_ops``, another domain outside ``domains``);
- ``dtype``: a tensor whose element type is outside ``dtypes``; the integer side of Q/DQ (Q
  outputs, DQ inputs, zero points, a narrowing Clip between them) is judged by the next rules;
- ``activation-*`` / ``weight-*`` (``dtype``, ``bits``, ``symmetric``, ``granularity``): a quantized
  activation (a QuantizeLinear, or a DequantizeLinear of a non-constant no Q in the graph feeds) or
  an integer weight feeding a DequantizeLinear outside ``[activations]`` / ``[weights]``;
- ``finite-scale`` / ``finite-zero-point``: whatever the profile, a Q/DQ (subgraphs included)
  whose constant scale or zero point holds NaN or inf;
- ``finite-initializer``: whatever the profile, any other float initializer the graph reads, or
  float Constant, holding NaN (or inf, but for a single value or an additive mask of 0 and -inf:
  ``edgeq.graph.loadcheck``), named as ``compile`` names it when it refuses such a model (exit 2);
- ``pow2-scale``: with ``power_of_two_scales``, a Q/DQ (subgraphs included) whose scale is not an
  exact power of two, or is computed at run time so that no power of two can be promised;
- ``positive-scale``: with ``positive_scales``, a Q/DQ (subgraphs included) whose constant scale
  has an entry <= 0 (full-range symmetric weights give negative ones; the HTP computes them wrongly);
- ``partial-block``: with ``whole_blocks``, a block-quantized constant DequantizeLinear whose
  blocked axis its ``block_size`` does not divide (the HTP computes the partial last block wrongly);
- ``u8s8-saturation``: unless the profile has ``int8_weight_range = "full-vnni-only"``, a linear
  onnxruntime runs as uint8 x int8 whose int8 weight codes have an adjacent K pair that can
  saturate VPMADDUBSW on CPUs without VNNI (``edgeq.targets.saturation``).

Element types come from the graph's declarations plus onnx type inference on a copy of the graph
without its large initializers (weights are never copied).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from edgeq.graph import protowalk
from edgeq.errors import EdgeqError
from edgeq.graph.loadcheck import nonfinite_tensors
from edgeq.quantize.qdq_encodings import collect_encodings
from edgeq.targets.node_units import broken_units, lookup_tables
from edgeq.targets.profile import QuantRules, TargetProfile, dtype_bits, dtype_name

_QDQ = ("QuantizeLinear", "DequantizeLinear")
_SMALL_INITIALIZER = 64  # elements: shape-like constants type inference may need to read
_FLOAT_ELEMS = frozenset(getattr(onnx.TensorProto, t) for t in (
    "FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ")
    if hasattr(onnx.TensorProto, t))


@dataclass(frozen=True)
class Violation:
    subject: str  # node or tensor name
    rule: str  # op, dtype, activation-bits, weight-symmetric, pow2-scale, ...
    message: str  # one line, naming the subject, what it is and which rule it breaks


@dataclass
class CheckResult:
    target: str
    violations: list[Violation]

    @property
    def clean(self) -> bool:
        return not self.violations

    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(v.rule for v in self.violations).items()))

    def to_dict(self) -> dict:
        return {"target": self.target, "clean": self.clean, "counts": self.counts(),
                "violations": [asdict(v) for v in self.violations]}

    def headline(self) -> str:
        if self.clean:
            return f"clean for target '{self.target}'"
        counts = ", ".join(f"{k}: {v}" for k, v in self.counts().items())
        return f"{len(self.violations)} violation(s) of target '{self.target}' ({counts})"


class TargetUnreachable(EdgeqError):
    """``compile --target``: the lowered model is still outside the profile (exit 3)."""

    exit_code = 3

    def __init__(self, result: CheckResult):
        first = result.violations[0].message
        super().__init__(f"lowering did not reach target '{result.target}': {result.headline()}; first: {first}")
        self.result = result


def check_model(model: onnx.ModelProto, profile: TargetProfile, encodings: dict | None = None) -> CheckResult:
    """Every violation of ``profile`` in ``model``, in graph order within each rule. ``encodings``:
    ``collect_encodings(model)`` when the caller has it already (compile reads them once)."""
    graph = model.graph
    violations: list[Violation] = []
    violations += _check_ops(graph, profile)
    integer_side = _integer_side_tensors(graph)
    violations += _check_dtypes(model, profile, integer_side)
    violations += _check_quantization(model, profile, encodings if encodings is not None else collect_encodings(model))
    violations += _check_finite_params(graph)
    violations += _check_finite_weights(model)
    if profile.power_of_two_scales:
        violations += _check_pow2(graph, profile)
    if profile.positive_scales:
        violations += _check_positive_scales(graph, profile)
    if profile.int8_weight_range == "u8s8-safe":
        violations += _check_u8s8(model)
    if profile.static_shapes:
        violations += _check_static_shapes(model)
    if profile.whole_blocks:
        violations += _check_whole_blocks(graph, profile)
    if profile.node_units:
        violations += [Violation(dq, "node-unit", f"{why} ({profile.name} takes a per-channel weight only inside a "
                                 "whole QDQ unit)") for dq, why in broken_units(graph, _constants(graph))]
    return CheckResult(profile.name, violations)


def _check_static_shapes(model: onnx.ModelProto) -> list[Violation]:
    """One violation per graph input or output whose shape is not static, and one for all the
    intermediate values shape inference leaves dynamic (a dynamic graph has thousands)."""
    inferred = _infer(_skeleton(model), data_prop=True)
    shapes: dict[str, list | None] = {}
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        tt = vi.type.tensor_type
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim] \
            if tt.HasField("shape") else None
    out = []
    inits = {t.name for t in model.graph.initializer}
    for vi in (*model.graph.input, *model.graph.output):
        dims = shapes.get(vi.name)
        if vi.name not in inits and (dims is None or not all(isinstance(d, int) and d > 0 for d in dims)):
            out.append(Violation(vi.name, "static-shape", f"tensor {vi.name}: shape {dims if dims is not None else 'unknown'} is not "
                                 "static (compile an LLM with --static prefill=S,context=C)"))
    inner = [o for n in model.graph.node for o in n.output if o and o not in {vi.name for vi in model.graph.output}
             and not ((dims := shapes.get(o)) and all(isinstance(d, int) for d in dims))]
    if inner:
        out.append(Violation(inner[0], "static-shape", f"{len(inner)} intermediate tensors have no static shape "
                             f"after shape inference (first: {inner[0]})"))
    return out


def _check_u8s8(model: onnx.ModelProto) -> list[Violation]:
    import onnx_graphsurgeon as gs

    from edgeq.targets.saturation import PAIR_LIMIT
    from edgeq.targets.u8s8_sites import find_u8s8_sites, static_risk

    risk = static_risk(find_u8s8_sites(gs.import_onnx(model)))
    return [Violation(name, "u8s8-saturation",
                      f"{name}: uint8 x int8 linear whose int8 weight codes reach |q0|+|q1| = {worst} > {PAIR_LIMIT} in "
                      "an adjacent K pair: onnxruntime's VPMADDUBSW kernel saturates on CPUs without VNNI (AVX2, "
                      "AVX-512 without VNNI); recompile with --target ort-cpu (or target ort-cpu-vnni on VNNI/AMX/ARM64 only)")
            for name, worst in risk.items()]


def _check_ops(graph: onnx.GraphProto, profile: TargetProfile) -> list[Violation]:
    out = []
    for node in protowalk.proto_nodes(graph.node):
        if profile.allows_op(node.domain, node.op_type):
            continue
        if node.domain in ("", "ai.onnx"):
            why = f"op {node.op_type} is not in {profile.name}'s op set"
        elif node.domain == "edgeq":
            why = f"op edgeq::{node.op_type} not run natively by {profile.name}"
        else:
            why = f"op {node.domain}::{node.op_type}: domain {node.domain} not supported by {profile.name}"
        out.append(Violation(node.name or node.output[0], "op", f"node {node.name or node.output[0]}: {why}"))
    return out


def _integer_side_tensors(graph: onnx.GraphProto) -> set[str]:
    """Tensors holding quantized integers or zero points (judged by the quantization rules)."""
    names: set[str] = set()
    q_outputs = set()
    for node in graph.node:
        if node.op_type == "QuantizeLinear":
            q_outputs.update(node.output)
            names.update(node.output)
            names.update(node.input[2:3])
        elif node.op_type == "DequantizeLinear":
            names.update(node.input[0:1])
            names.update(node.input[2:3])
    for node in graph.node:  # the Clip that narrows a Q's integers to fewer bits
        if node.op_type == "Clip" and node.input and node.input[0] in q_outputs:
            names.update(node.input)
            names.update(node.output)
    names.discard("")
    return names


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """name -> onnx element type of every main-graph tensor whose type is declared or inferable."""
    types = {init.name: init.data_type for init in model.graph.initializer}
    inferred = _infer(_skeleton(model))
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        elem = vi.type.tensor_type.elem_type
        if elem:
            types.setdefault(vi.name, elem)
    return types


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph without its large initializers (declared as inputs instead): what type and shape
    inference need, without copying weights."""
    skeleton = onnx.ModelProto()
    skeleton.ir_version = model.ir_version
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    g = skeleton.graph
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    g.value_info.extend(model.graph.value_info)
    declared = {vi.name for vi in model.graph.input}
    for init in model.graph.initializer:
        small = int(np.prod(init.dims)) <= _SMALL_INITIALIZER and init.data_location != onnx.TensorProto.EXTERNAL
        if small:
            g.initializer.append(init)
        elif init.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return skeleton


def _infer(skeleton: onnx.ModelProto, data_prop: bool = False) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(skeleton, check_type=False, strict_mode=False, data_prop=data_prop)
    except Exception:  # noqa: BLE001 (inference is best effort: declared types still count)
        return skeleton


def _check_dtypes(model: onnx.ModelProto, profile: TargetProfile, integer_side: set[str]) -> list[Violation]:
    if profile.dtypes is None:
        return []
    out = []
    allowed = ", ".join(sorted(profile.dtypes))
    for name, elem in tensor_types(model).items():
        dtype = dtype_name(elem)
        if name in integer_side or profile.allows_dtype(dtype):
            continue
        out.append(Violation(name, "dtype", f"tensor {name}: dtype {dtype} not allowed by {profile.name} (allowed: {allowed})"))
    return out


def _constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Initializers and Constant-node values, subgraphs included (Q/DQ parameters live there)."""
    found = {t.name: t for t in graph.initializer}
    for node in protowalk.proto_nodes(graph.node):
        if node.op_type != "Constant" or not node.attribute:
            continue
        attr = node.attribute[0]
        if attr.type == onnx.AttributeProto.TENSOR:
            found[node.output[0]] = attr.t
        elif attr.name in ("value_float", "value_floats", "value_int", "value_ints"):
            dtype = np.float32 if "float" in attr.name else np.int64
            value = np.asarray(onnx.helper.get_attribute_value(attr), dtype)
            found[node.output[0]] = numpy_helper.from_array(value, node.output[0])
    return found


def _check_quantization(model: onnx.ModelProto, profile: TargetProfile, enc: dict) -> list[Violation]:
    graph = model.graph
    constants = _constants(graph)
    producers = {o: n for n in graph.node for o in n.output}
    out = []
    q_nodes: dict[str, str] = {}
    for node in graph.node:
        if node.op_type == "QuantizeLinear":
            q_nodes.setdefault(node.input[0], node.name)
    for tensor, e in enc["activations"].items():
        out += _rule_violations("activation", tensor, q_nodes.get(tensor), e, profile.activations, profile.name)
    tables = lookup_tables(graph) if profile.node_units else set()
    for tensor, e in enc["weights"].items():  # a gathered table is an activation to a node-unit NPU
        side, rules = ("activation", profile.activations) if tensor in tables else ("weight", profile.weights)
        out += _rule_violations(side, tensor, None, e, rules, profile.name)
    # Q/DQ the encodings do not describe (float8, a Q without zero point, a DQ of a graph input):
    # their integer type is still known from the zero point (QuantizeLinear's default: uint8)
    for node in graph.node:
        if node.op_type not in _QDQ:
            continue
        src = node.input[0]
        if node.op_type == "QuantizeLinear":
            if src in enc["activations"]:
                continue
            side, rules = "activation", profile.activations
        elif src in enc["weights"]:
            continue
        elif src in constants:
            side, rules = "weight", profile.weights
        elif _fed_by_quantize(src, producers):
            continue
        else:
            side, rules = "activation", profile.activations
        dtype = _zero_point_dtype(node, constants, side == "weight")
        if dtype is not None and not rules.allows_dtype(dtype):
            e = {"dtype": dtype, "bits": dtype_bits(dtype), "symmetric": True, "granularity": None, "zero_point": []}
            out += _rule_violations(side, src, node.name, e, rules, profile.name)
    return out


def _fed_by_quantize(name: str, producers: dict) -> bool:
    node = producers.get(name)
    if node is not None and node.op_type == "Clip":
        node = producers.get(node.input[0])
    return node is not None and node.op_type == "QuantizeLinear"


def _zero_point_dtype(node: onnx.NodeProto, constants: dict, weight: bool) -> str | None:
    if weight and node.input[0] in constants:
        return dtype_name(constants[node.input[0]].data_type)
    if len(node.input) > 2 and node.input[2]:
        zp = constants.get(node.input[2])
        return None if zp is None else dtype_name(zp.data_type)
    return "uint8"  # QuantizeLinear / DequantizeLinear without a zero point


def _rule_violations(side: str, name: str, node: str | None, enc: dict, rules: QuantRules,
                     target: str) -> list[Violation]:
    """``enc`` is an ``encodings.json`` entry (dtype, bits, symmetric, granularity, zero_point)
    of tensor ``name``, quantized or dequantized by ``node`` (named in the message when known)."""
    out = []
    subject = f"{name} ({node})" if node else name
    dtype, bits = enc["dtype"], enc["bits"]
    if not rules.allows_dtype(dtype):
        max_bits = rules.max_bits
        if max_bits and bits > max_bits and dtype.startswith(("int", "uint")):
            out.append(Violation(name, f"{side}-bits", f"{side} {subject}: {side} bits {bits} > {max_bits} ({dtype})"))
        else:
            allowed = ", ".join(sorted(rules.dtypes or ()))
            out.append(Violation(name, f"{side}-dtype",
                                 f"{side} {subject}: dtype {dtype} not allowed by {target} (allowed: {allowed})"))
    if rules.symmetric and not enc["symmetric"]:
        zps = np.asarray(enc["zero_point"])
        mid = 0 if dtype.startswith("int") else (2 ** bits) // 2
        off = zps[zps != mid]
        shown = int(off[0]) if off.size else int(zps.ravel()[0])
        out.append(Violation(name, f"{side}-symmetric",
                             f"{side} {subject} zero point {shown}: asymmetric {side}s not allowed by {target}"))
    gran = enc["granularity"]
    if gran is not None and gran not in rules.granularity:
        out.append(Violation(name, f"{side}-granularity", f"{side} {subject}: per-{gran} scales not allowed by {target} "
                                                           f"(allowed: {', '.join(sorted(rules.granularity))})"))
    return out


def _check_finite_params(graph: onnx.GraphProto) -> list[Violation]:
    """A Q/DQ whose constant scale or zero point holds NaN or inf: every value it quantizes or
    dequantizes becomes NaN (or saturates), on any target."""
    constants = _constants(graph)
    out = []
    for node in protowalk.proto_nodes(graph.node):
        if node.op_type not in _QDQ:
            continue
        for what, name in zip(("scale", "zero point"), node.input[1:3]):
            tensor = constants.get(name) if name else None
            if tensor is None or tensor.data_type not in _FLOAT_ELEMS:  # (integers are always finite)
                continue
            values = np.asarray(numpy_helper.to_array(tensor)).astype(np.float64).ravel()
            bad = values[~np.isfinite(values)]
            if bad.size:
                label = f"{node.op_type} {node.name or node.output[0]}"
                extra = f" ({bad.size} of {values.size})" if values.size > 1 else ""
                out.append(Violation(node.name or node.output[0], f"finite-{what.replace(' ', '-')}",
                                     f"{label}: {what} {name} is {float(bad[0])}{extra}; every value it touches "
                                     f"becomes NaN or saturates"))
    return out


def _check_finite_weights(model: onnx.ModelProto) -> list[Violation]:
    """Float weights holding NaN or inf (``edgeq.graph.loadcheck.nonfinite_tensors``); a Q/DQ's scale or
    zero point is left to ``_check_finite_params``, which says which node it breaks."""
    params = {name for node in protowalk.proto_nodes(model.graph.node) if node.op_type in _QDQ for name in node.input[1:3]}
    return [Violation(found.name, "finite-initializer", f"{found.describe()}: every value computed from it is NaN "
                                                        "or inf, on any target")
            for found in nonfinite_tensors(model) if found.name not in params]


def _check_positive_scales(graph: onnx.GraphProto, profile: TargetProfile) -> list[Violation]:
    constants = _constants(graph)
    out = []
    for node in protowalk.proto_nodes(graph.node):
        scale = constants.get(node.input[1]) if node.op_type in _QDQ and len(node.input) > 1 else None
        if scale is None or scale.data_type not in _FLOAT_ELEMS:
            continue
        values = np.asarray(numpy_helper.to_array(scale)).astype(np.float64).ravel()
        bad = values[~(values > 0)]
        if bad.size:
            extra = f" ({bad.size} of {values.size} scales)" if values.size > 1 else ""
            out.append(Violation(node.name or node.output[0], "positive-scale",
                                 f"{node.op_type} {node.name or node.output[0]} scale {float(bad[0]):.6g} is not positive{extra} "
                                 f"({profile.name} computes such a node wrongly; lowering: positive-weight-scales)"))
    return out


def _check_whole_blocks(graph: onnx.GraphProto, profile: TargetProfile) -> list[Violation]:
    """A block-quantized constant DequantizeLinear whose blocked axis is not a multiple of its
    ``block_size`` (the last block partial)."""
    constants = _constants(graph)
    out = []
    for node in protowalk.proto_nodes(graph.node):
        if node.op_type != "DequantizeLinear" or node.input[0] not in constants:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        block = int(attrs.get("block_size", 0))
        dims = list(constants[node.input[0]].dims)
        if not block or not dims:
            continue
        length = dims[int(attrs.get("axis", 1)) % len(dims)]
        if length % block:
            name = node.name or node.output[0]
            out.append(Violation(name, "partial-block",
                                 f"DequantizeLinear {name}: axis of {length} in blocks of {block} leaves a partial last block "
                                 f"({profile.name} computes it wrongly; gptq: whole_blocks = true)"))
    return out


def is_power_of_two(values: np.ndarray) -> np.ndarray:
    """Elementwise: is each value exactly 2^k (k any integer)?"""
    values = np.asarray(values, np.float64)
    mantissa, _ = np.frexp(values)
    return (mantissa == 0.5) & np.isfinite(values)


def _check_pow2(graph: onnx.GraphProto, profile: TargetProfile) -> list[Violation]:
    constants = _constants(graph)
    out = []
    for node in protowalk.proto_nodes(graph.node):
        if node.op_type not in _QDQ or len(node.input) < 2:
            continue
        label = f"{node.op_type} {node.name or node.output[0]}"
        scale = constants.get(node.input[1])
        if scale is None:
            out.append(Violation(node.name, "pow2-scale", f"{label}: scale {node.input[1]} is computed at run time, "
                                                          f"so {profile.name} cannot be promised a power of two"))
            continue
        values = numpy_helper.to_array(scale).ravel()
        bad = values[~is_power_of_two(values)]
        if bad.size:
            extra = f" ({bad.size} of {values.size} scales)" if values.size > 1 else ""
            out.append(Violation(node.name, "pow2-scale", f"{label} scale {float(bad[0]):.6g} is not a power of two{extra}"))
    return out
