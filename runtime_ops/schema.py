"""The one schema table of the ``edgeq`` custom-op domain.

Every edgeq op is declared here once: its inputs, outputs and attributes, a builder of its ONNX
function body, and a numpy reference. Why a function body for every op: onnxruntime inlines
model-local functions, so a compiled model runs anywhere ONNX runs, with no custom-op library;
a runtime or an NPU SDK with a native kernel can match the op by domain and name instead.

- ``ensure_functions(model)``: after a pass added edgeq nodes, put the function bodies of the
  ops the graph uses into ``model.functions`` (once) and import the ``edgeq`` domain.
- ``reference_evaluator_ops()``: ``OpRun`` classes for ``onnx.reference.ReferenceEvaluator``
  (``new_ops=``), so tests can check a function body against an independent reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

# the op modules themselves, not names of the package (whose __init__ imports this module)
import edgeq.runtime_ops.modality_qdq as _mq
import edgeq.runtime_ops.online_hadamard as _oh
import edgeq.runtime_ops.subspace_qdq as _sq
import edgeq.runtime_ops.visual_kv_attention as _vk
import edgeq.runtime_ops.visual_kv_attention_kivi as _vkk
import edgeq.runtime_ops.w4a8_linear as _w4
from edgeq.graph.protowalk import proto_nodes
from edgeq.runtime_ops.domain import DOMAIN, DOMAIN_VERSION


@dataclass(frozen=True)
class IOSpec:
    """One input or output: its name and what it holds."""

    name: str
    doc: str


@dataclass(frozen=True)
class AttrSpec:
    """One attribute: name, onnx AttributeProto type name ('INT', 'FLOAT', ...), default, doc."""

    name: str
    type: str
    default: object
    doc: str


@dataclass(frozen=True)
class OpSchema:
    """An edgeq op. ``function_builder(opset)`` returns the FunctionProto whose body imports the
    default domain at ``opset``; ``reference(*inputs, **attributes)`` returns a tuple of outputs."""

    name: str
    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]
    doc: str
    function_builder: Callable[[int], onnx.FunctionProto]
    reference: Callable[..., tuple[np.ndarray, ...]]
    attributes: tuple[AttrSpec, ...] = field(default=())
    domain: str = DOMAIN
    version: int = DOMAIN_VERSION
    min_opset: int = 1  # the oldest default-domain opset the function body is valid at (checked by ensure_functions)


def _vk_inputs(v_codes: str, v_alpha: str, v_scale: str) -> tuple[IOSpec, ...]:
    """The inputs of VisualKVAttention and its KIVI sibling: they differ in the values' docs only."""
    return (
        IOSpec("q", "float32 [B, H, S, D]: decode queries, not pre-scaled (the op applies 1 / sqrt(D)); "
                    "B, S may be symbolic"),
        IOSpec("k_codes", "uint8 [B, KVH, Nv, D * bits / 8]: the visual keys' channel-wise codes, packed MSB "
                          "first (entry i of each group of 8 / bits at shift 8 - bits * (i + 1)); H % KVH == 0"),
        IOSpec("k_alpha", "float32 [B, KVH, 1, D]: per-channel minimum of the visual keys"),
        IOSpec("k_scale", "float32 [B, KVH, 1, D]: per-channel (max - min) / (2^bits - 1) of the visual keys"),
        IOSpec("v_codes", v_codes),
        IOSpec("v_alpha", v_alpha),
        IOSpec("v_scale", v_scale),
        IOSpec("k_text", "float32 [B, KVH, Nt, D]: the text keys in full precision (Nt >= 0)"),
        IOSpec("v_text", "float32 [B, KVH, Nt, D]: the text values in full precision"),
        IOSpec("mask", "float32, broadcastable to [B, H, S, Nv + Nt]: additive, before the softmax; must be "
                       "present in a graph (a scalar 0 for none, as the node helper writes): onnxruntime "
                       "cannot run the body with an empty name; the numpy reference takes None"),
    )


_VK_ATTRIBUTES = (
    AttrSpec("bits", "INT", None, "required: code width of the visual K and V, 1, 2, 4 or 8"),
    AttrSpec("tau1", "FLOAT", 0.0, "calibration: the visual minimum logit gamma moves to gamma - tau1"),
    AttrSpec("tau2", "FLOAT", 0.0, "calibration: the visual maximum logit delta moves to delta - tau2"),
    AttrSpec("calibrate", "INT", 1, "1: apply g(x) = (delta - gamma + tau1 - tau2) / (delta - gamma) * "
                                    "(x - gamma) + gamma - tau1 to the visual logits of each (b, h, s); 0: off"),
)


def _schema(module, inputs: tuple[IOSpec, ...], outputs: tuple[IOSpec, ...],
            function_builder: Callable[[int], onnx.FunctionProto], reference: Callable[..., tuple[np.ndarray, ...]],
            attributes: tuple[AttrSpec, ...] = ()) -> OpSchema:
    """The schema of the op that ``module`` implements. Its name (``OP_TYPE``), doc (the module's
    docstring) and oldest valid default-domain opset (``MIN_OPSET``; 1 where the module sets none)
    are declared by the module itself, once; the table below adds what only the schema says."""
    return OpSchema(name=module.OP_TYPE, inputs=inputs, outputs=outputs, doc=module.__doc__,
                    function_builder=function_builder, reference=reference, attributes=attributes,
                    min_opset=getattr(module, "MIN_OPSET", 1))


SCHEMAS: dict[str, OpSchema] = {schema.name: schema for schema in (
    _schema(
        _oh,
        inputs=(
            IOSpec("x", "float tensor [..., n], n = K * P; any rank >= 1, leading dims may be symbolic"),
            IOSpec("h_k", "[K, K] normalized Hadamard factor (orthogonal), same dtype as x"),
            IOSpec("h_p", "[P, P] normalized Sylvester Hadamard, P = 2^m; a native kernel may run a "
                          "fast Walsh-Hadamard transform instead of reading it"),
        ),
        outputs=(IOSpec("y", "x @ kron(h_k, h_p) over the last axis; same shape and dtype as x"),),
        function_builder=_oh.online_hadamard_function,
        reference=_oh.online_hadamard_reference,
    ),
    _schema(
        _mq,
        inputs=(
            IOSpec("x", "float tensor [B, S, ...], visual tokens first in every row (after aifs)"),
            IOSpec("visual_count", "int64 [B]: rows [0, visual_count[b]) of row b are visual (left padding included)"),
            IOSpec("visual_scale", "float scalar: static scale of the visual tokens"),
            IOSpec("visual_zero_point", "integer scalar (int8/uint8/int16...): the visual zero point, its type the quantized type"),
            IOSpec("text_scale", "float scalar: static scale of the text tokens"),
            IOSpec("text_zero_point", "integer scalar, same type as visual_zero_point"),
        ),
        outputs=(IOSpec("y", "x quantized-dequantized per modality; same shape and type as x"),),
        function_builder=_mq.modality_qdq_function,
        reference=_mq.modality_qdq_reference,
    ),
    _schema(
        _w4,
        inputs=(
            IOSpec("x", "float32 [..., K]; any rank >= 1, leading dims may be symbolic"),
            IOSpec("w", "uint4 or int4 [K, N]: the stored 4-bit weight, K-major (DequantizeLinear axis 0)"),
            IOSpec("w_scale", "float32 [ceil(K / block_size), N]: real-domain group scales (s_g * s8)"),
            IOSpec("w_zero_point", "w's type, w_scale's shape: group zero points (zeros for symmetric int4)"),
            IOSpec("w_fp8_scale", "float32 scalar s8 (a power of two): the weight's per-tensor float8 e4m3fn scale"),
            IOSpec("x_scale", "float32 scalar: the activation's static float8 e4m3fn scale"),
        ),
        outputs=(IOSpec("y", "float32 [..., N]: fp8(x) @ fp8(dequantized w), FP8 rounding saturating at +-448"),),
        function_builder=_w4.w4a8_linear_function,
        reference=_w4.w4a8_linear_reference,
        attributes=(AttrSpec("block_size", "INT", _w4.DEFAULT_BLOCK_SIZE,
                             "rows of w per (scale, zero point) group along K; the last group may be shorter"),),
    ),
    _schema(
        _sq,
        inputs=(
            IOSpec("x", "float32 [..., d], projected onto ResQ's U (eigenvalues ascending): the first d - r channels "
                        "are the low-precision subspace, the last r the high-precision one; leading dims and d may be symbolic"),
            IOSpec("low_scale", "float32 scalar: static per-tensor scale of the first d - r channels; optional "
                                "(may be \"\") when dynamic=1"),
            IOSpec("low_zero_point", "int8 (symmetric=1) or uint8 (symmetric=0) scalar within the low_bits range "
                                     "([-8, 7] or [0, 15] at 4 bits); optional when dynamic=1"),
            IOSpec("high_scale", "float32 scalar: static per-tensor scale of the last r channels; optional when dynamic=1"),
            IOSpec("high_zero_point", "low_zero_point's type, within the high_bits range; optional when dynamic=1"),
        ),
        outputs=(IOSpec("y", "float32, x's shape: Concat(qdq_low(x[..., :d - r]), qdq_high(x[..., d - r:])) on the last axis"),),
        function_builder=_sq.subspace_qdq_function,
        reference=_sq.subspace_qdq_reference,
        attributes=(
            AttrSpec("rank", "INT", None, "required: r, the high-precision channels (the last r), 1 <= r < d"),
            AttrSpec("low_bits", "INT", _sq.DEFAULT_LOW_BITS, "bit width of the first d - r channels, 2 to 8"),
            AttrSpec("high_bits", "INT", _sq.DEFAULT_HIGH_BITS, "bit width of the last r channels, 2 to 8"),
            AttrSpec("symmetric", "INT", 1, "static: 1 = int8 storage, signed range [-2^(b-1), 2^(b-1) - 1]; "
                                            "0 = uint8, [0, 2^b - 1]. dynamic: 1 = per-token absmax / (2^(b-1) - 1), "
                                            "zero point 0; 0 = per-token min/max asymmetric (ResQ's setting)"),
            AttrSpec("dynamic", "INT", 0, "0: static per-tensor scales from the inputs (NPU); 1: per-token scales and "
                                          "zero points computed at run time from each row's min/max, inputs ignored"),
        ),
    ),
    _schema(
        _vk,
        inputs=_vk_inputs(
            v_codes="uint8 [B, KVH, Nv, D * bits / 8]: the visual values' codes, packed as k_codes",
            v_alpha="float32 [B, KVH, 1, D]: per-channel minimum of the visual values; or [B, KVH, 1, 1]: one "
                    "minimum per batch row and KV head (the global-V ablation), v_scale alike",
            v_scale="float32 [B, KVH, 1, D] (or [B, KVH, 1, 1], as v_alpha): scale of the visual values",
        ),
        outputs=(IOSpec("y", "float32 [B, H, S, D]: softmax([g(l_vis), l_txt] + mask) over the post-scaled visual "
                             "and the float text cache, times [dequantized visual V; text V]"),),
        function_builder=_vk.visual_kv_attention_function,
        reference=_vk.visual_kv_attention_reference,
        attributes=_VK_ATTRIBUTES,
    ),
    _schema(
        _vkk,
        inputs=_vk_inputs(
            v_codes="uint8 [B, KVH, Nv, D * bits / 8]: the visual values' per-token codes (min/max over the D "
                    "channels of each token), packed as k_codes",
            v_alpha="float32 [B, KVH, Nv, 1]: per-token minimum of the visual values",
            v_scale="float32 [B, KVH, Nv, 1]: per-token (max - min) / (2^bits - 1) of the visual values",
        ),
        outputs=(IOSpec("y", "float32 [B, H, S, D]: VisualKVAttention's softmax, times [per-token dequantized visual "
                             "V; text V]: (p_vis * v_scale^T) . c_v + p_vis . v_alpha + p_txt . v_text"),),
        function_builder=_vkk.visual_kv_attention_kivi_function,
        reference=_vk.visual_kv_attention_kivi_reference,
        attributes=_VK_ATTRIBUTES,
    ),
)}


def get_schema(op_type: str) -> OpSchema:
    """The schema of an edgeq op; KeyError naming the known ops otherwise."""
    try:
        return SCHEMAS[op_type]
    except KeyError:
        raise KeyError(f"unknown {DOMAIN} op {op_type!r}; known: {sorted(SCHEMAS)}") from None


def used_ops(model: onnx.ModelProto) -> set[str]:
    """Names of the edgeq ops the model's graph (and its functions) use."""
    nodes = list(proto_nodes(model.graph.node))
    for fn in model.functions:
        if fn.domain != DOMAIN:
            nodes.extend(proto_nodes(fn.node))
    return {n.op_type for n in nodes if n.domain == DOMAIN}


def _default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    raise ValueError("model imports no default-domain opset")


def ensure_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the function body of every edgeq op the model uses, and the edgeq opset import.

    In place (and returned). Idempotent: an existing body is replaced only when it imports a
    different default opset than the model (a pass may have raised the model's opset since).
    Unknown edgeq op names raise KeyError; a model opset older than an op's ``min_opset`` raises
    ValueError (its body would not be valid there).
    """
    ops = used_ops(model)
    if not ops:
        return model
    opset = _default_opset(model)
    existing = {(f.domain, f.name): i for i, f in enumerate(model.functions)}
    for op in sorted(ops):
        schema = get_schema(op)
        if opset < schema.min_opset:
            raise ValueError(f"{DOMAIN}::{op} needs default-domain opset >= {schema.min_opset}; the model imports {opset}")
        fn = schema.function_builder(opset)
        i = existing.get((DOMAIN, op))
        if i is None:
            model.functions.append(fn)
        else:
            old = {imp.domain: imp.version for imp in model.functions[i].opset_import}
            if old.get("", old.get("ai.onnx")) != opset:
                model.functions[i].CopyFrom(fn)
    imports = {imp.domain: imp for imp in model.opset_import}
    if DOMAIN not in imports:
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    elif imports[DOMAIN].version != DOMAIN_VERSION:
        raise ValueError(f"model imports {DOMAIN} version {imports[DOMAIN].version}; edgeq has {DOMAIN_VERSION}")
    return model


def reference_evaluator_ops() -> list[type]:
    """``onnx.reference.op_run.OpRun`` subclasses (class name = op name, ``op_domain`` = edgeq),
    one per schema, running the numpy references; pass them as ``ReferenceEvaluator(new_ops=)``."""
    from onnx.reference.op_run import OpRun

    classes = []
    for schema in SCHEMAS.values():
        # OpRun.run passes the attributes a node carries (function-linked ones resolved) as
        # keywords; the schema supplies the defaults of the others
        attr_defaults = tuple((a.name, a.default) for a in schema.attributes)

        def _run(self, *inputs, _schema=schema, _attrs=attr_defaults, **given):
            kwargs = {name: given.get(name, default) for name, default in _attrs}
            return tuple(_schema.reference(*inputs, **kwargs))

        classes.append(type(schema.name, (OpRun,), {"op_domain": schema.domain, "_run": _run}))
    return classes
