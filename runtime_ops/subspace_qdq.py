"""``edgeq::SubspaceQDQ``: ResQ's mixed-precision quantize-dequantize of one GEMM input.

ResQ (paper 002, section 4.1) projects the activation onto ``U = P * blockdiag(R_low, R_high)``,
P holding the eigenvectors of the activation covariance in increasing eigenvalue order, so the
LAST ``rank`` (r) channels of the projected activation span the high-variance subspace. Those r
channels are quantized at high precision (8-bit) and the first ``d - r`` at low precision (4-bit),
each part with its own scale and zero point, and both parts feed the same GEMM. Why a custom op:
the mixed precision lives inside one GEMM's input, which a single QuantizeLinear cannot express;
a runtime or an NPU SDK with a native mixed-precision (W4/8 A4/8) kernel matches
``edgeq::SubspaceQDQ`` by domain and name. Why a function body: plain onnxruntime (or any ONNX
runtime) inlines it and runs the same numbers with standard ops.

Semantics, for each part p (low: the first d - r channels of the last axis, ``low_bits``; high:
the last r, ``high_bits``) with b bits; ``y = Concat(qdq(x_low), qdq(x_high))``, x's shape:

- static (``dynamic=0``, NPU): per-tensor ``scale_p`` (float32 scalar) and ``zero_point_p``
  (scalar of the storage type). The storage type is int8 when ``symmetric=1`` and uint8 when 0
  (the node helper and the reference check the zero points' type, the body cannot);
  values are clipped to the b-bit range inside it, [-2^(b-1), 2^(b-1) - 1] (int8: [-8, 7] at 4
  bits) or [0, 2^b - 1] (uint8: [0, 15]), exactly as ``edgeq.quantize.qdq_nodes.insert_quantize`` does for
  narrowed specs: ``DequantizeLinear(Clip(QuantizeLinear(x_p, s, z), qmin, qmax), s, z)``, i.e.
  ``(clip(round(x / s) + z, qmin, qmax) - z) * s``, rounding half to even.
- dynamic (``dynamic=1``): one (scale, zero point) per token (per row over the last axis),
  separately for the low and the high part, computed at run time; the scale and zero-point
  inputs are ignored and may be empty ("") names. With ``lo = min(min(row), 0)`` and
  ``hi = max(max(row), 0)`` (zero is always representable, as in ``edgeq.quantize.quant.scale_zero_point``
  and SpinQuant's/ResQ's activation quantizer):

  - ``symmetric=0`` (the paper's per-token asymmetric setting):
    ``s = max((hi - lo) / (2^b - 1), tiny)``, ``z = clip(round(-lo / s), 0, 2^b - 1)``,
    ``q = clip(round(x / s) + z, 0, 2^b - 1)``, ``y = (q - z) * s``;
  - ``symmetric=1`` (``edgeq.quantize.qdq_nodes.insert_token_fake_quant``'s per-token quantizer):
    ``s = max(max(-lo, hi) / (2^(b-1) - 1), tiny)``, ``z = 0``,
    ``q = clip(round(x / s), -(2^(b-1) - 1), 2^(b-1) - 1)``, ``y = q * s``.

  Written with Div/Round/Add/Clip/Sub/Mul: QuantizeLinear cannot take a per-row scale computed
  at run time.

The body (default-domain opset >= 18: ReduceMin/ReduceMax take their axes as an input):
``Split`` of the last axis into ``[d - r, r]`` (d from ``Shape(x, start=-1)``, so d may be
symbolic), then ``If(dynamic)`` with the per-token branch and the static Q/Clip/DQ branch, each
ending in ``Concat`` on the last axis. The condition is the attribute, a constant once the
function is instantiated: onnxruntime's constant folding (default level) replaces the If by the
taken branch; with optimizations off the If runs the taken branch only (no doubled work).

Optional inputs (dynamic mode may leave the four as empty names ""): an absent function input
must only ever reach optional input slots, or onnxruntime rejects the inlined graph ("input 0 is
marked single but has an empty string") and onnx's function shape inference fails inside the If
(onnx 1.23 types an absent outer-scope input as elem type 0 there: "Invalid tensor data type
0", under ``check_model(full_check=True)``). So the main body reads them once, through optional
slots: ``scale_given = Clip(1.0, scale, scale)`` (the scale, or 1.0 when absent) and
``zero_point_given = QuantizeLinear(0.0, 1.0, zero_point)`` (the zero point in its own type, or
uint8 0 when absent), and the static branch uses only those. In static mode all four must be
given (``make_subspace_qdq_node`` and the reference refuse otherwise; the body would quantize with
scale 1). onnxruntime also accepts the four inputs left off the node; onnx's ReferenceEvaluator
does not (it wants all five, "" included), so the node helper writes "".

Inputs: ``x`` float32 [..., d]; ``low_scale``, ``low_zero_point``, ``high_scale``,
``high_zero_point`` (optional in dynamic mode). Attributes: ``rank`` (int, required, 1 <= r < d),
``low_bits`` (4), ``high_bits`` (8), both in [2, 8]; ``symmetric`` (1); ``dynamic`` (0).
Output ``y``: float32, x's shape.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

from edgeq.runtime_ops.domain import DOMAIN

OP_TYPE = "SubspaceQDQ"
INPUTS = ("x", "low_scale", "low_zero_point", "high_scale", "high_zero_point")
OUTPUTS = ("y",)
MIN_OPSET = 18  # ReduceMin / ReduceMax with axes as an input
DEFAULT_LOW_BITS = 4
DEFAULT_HIGH_BITS = 8
TINY = np.finfo(np.float32).tiny  # the smallest scale (an all-zero token)
ATTRIBUTE_DEFAULTS = {"low_bits": DEFAULT_LOW_BITS, "high_bits": DEFAULT_HIGH_BITS, "symmetric": 1, "dynamic": 0}


def _attr_constant(output: str, attr: str) -> onnx.NodeProto:
    """``Constant(value_int=@attr)``: an int64 scalar holding the op's attribute."""
    node = helper.make_node("Constant", [], [output])
    node.attribute.append(helper.make_attribute_ref("value_int", AttributeProto.INT))
    node.attribute[0].ref_attr_name = attr
    return node


def _float(name: str, value: float) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.FLOAT, [], [value]))


def _static_part(p: str) -> list[onnx.NodeProto]:
    """QuantizeLinear -> Clip to the b-bit range in the storage type -> DequantizeLinear, the
    pattern ``edgeq.quantize.qdq_nodes.insert_quantize`` writes for narrowed specs."""
    v = lambda s: f"static_{p}_{s}"  # noqa: E731
    return [
        helper.make_node("QuantizeLinear", [f"x_{p}", f"{p}_scale_given", f"{p}_zero_point_given"], [v("q")]),
        helper.make_node("CastLike", [f"{p}_static_qmin", v("q")], [v("qmin")]),
        helper.make_node("CastLike", [f"{p}_static_qmax", v("q")], [v("qmax")]),
        helper.make_node("Clip", [v("q"), v("qmin"), v("qmax")], [v("q_narrow")]),
        helper.make_node("DequantizeLinear", [v("q_narrow"), f"{p}_scale_given", f"{p}_zero_point_given"], [v("y")]),
    ]


def _dynamic_part(p: str) -> list[onnx.NodeProto]:
    """Per-token min/max (zero included) scale and zero point, then the same Q/DQ in float ops."""
    n = lambda op, ins, out, **kw: helper.make_node(op, ins, [f"dyn_{p}_{out}"], **kw)  # noqa: E731
    v = lambda s: f"dyn_{p}_{s}"  # noqa: E731
    return [
        n("ReduceMin", [f"x_{p}", "last_axis"], "min", keepdims=1),
        n("ReduceMax", [f"x_{p}", "last_axis"], "max", keepdims=1),
        n("Min", [v("min"), "zero_f"], "lo"),
        n("Max", [v("max"), "zero_f"], "hi"),
        # asymmetric: (hi - lo) / (2^b - 1); symmetric: max(-lo, hi) / (2^(b-1) - 1)
        n("Sub", [v("hi"), v("lo")], "range"),
        n("Div", [v("range"), f"{p}_levels_m1"], "scale_asym"),
        n("Neg", [v("lo")], "neg_lo"),
        n("Max", [v("neg_lo"), v("hi")], "absmax"),
        n("Div", [v("absmax"), f"{p}_half_m1"], "scale_sym"),
        n("Where", ["symmetric_b", v("scale_sym"), v("scale_asym")], "scale_raw"),
        n("Max", [v("scale_raw"), "tiny_f"], "scale"),
        # zero point: clip(round(-lo / s), 0, 2^b - 1), or 0 when symmetric
        n("Div", [v("neg_lo"), v("scale")], "zp_scaled"),
        n("Round", [v("zp_scaled")], "zp_rounded"),
        n("Clip", [v("zp_rounded"), "zero_f", f"{p}_levels_m1"], "zp_asym"),
        n("Where", ["symmetric_b", "zero_f", v("zp_asym")], "zp"),
        # integer range: [0, 2^b - 1], or [-(2^(b-1) - 1), 2^(b-1) - 1] when symmetric
        n("Neg", [f"{p}_half_m1"], "neg_half_m1"),
        n("Where", ["symmetric_b", v("neg_half_m1"), "zero_f"], "qmin"),
        n("Where", ["symmetric_b", f"{p}_half_m1", f"{p}_levels_m1"], "qmax"),
        n("Div", [f"x_{p}", v("scale")], "scaled"),
        n("Round", [v("scaled")], "rounded"),
        n("Add", [v("rounded"), v("zp")], "shifted"),
        n("Clip", [v("shifted"), v("qmin"), v("qmax")], "q"),
        n("Sub", [v("q"), v("zp")], "centered"),
        n("Mul", [v("centered"), v("scale")], "y"),
    ]


def subspace_qdq_function(opset: int) -> onnx.FunctionProto:
    """The function body, importing the default domain at ``opset`` (valid from 18 on; the
    schema table's ``ensure_functions`` refuses older models)."""
    nodes = [
        _attr_constant("rank_scalar", "rank"),
        helper.make_node("Constant", [], ["zero_axis"], value=helper.make_tensor("zero_axis", TensorProto.INT64, [1], [0])),
        helper.make_node("Constant", [], ["last_axis"], value=helper.make_tensor("last_axis", TensorProto.INT64, [1], [-1])),
        helper.make_node("Unsqueeze", ["rank_scalar", "zero_axis"], ["rank_1d"]),
        helper.make_node("Shape", ["x"], ["d_1d"], start=-1),
        helper.make_node("Sub", ["d_1d", "rank_1d"], ["low_width"]),
        helper.make_node("Concat", ["low_width", "rank_1d"], ["split_sizes"], axis=0),
        helper.make_node("Split", ["x", "split_sizes"], ["x_low", "x_high"], axis=-1),
        _float("zero_f", 0.0), _float("one_f", 1.0), _float("two_f", 2.0), _float("half_f", 0.5),
        _float("tiny_f", float(TINY)),
        _attr_constant("symmetric_i", "symmetric"),
        helper.make_node("Cast", ["symmetric_i"], ["symmetric_b"], to=TensorProto.BOOL),
        helper.make_node("Cast", ["symmetric_i"], ["symmetric_f"], to=TensorProto.FLOAT),
        _attr_constant("dynamic_i", "dynamic"),
        helper.make_node("Cast", ["dynamic_i"], ["dynamic_b"], to=TensorProto.BOOL),
    ]
    for p in ("low", "high"):
        nodes += [
            _attr_constant(f"{p}_bits_i", f"{p}_bits"),
            helper.make_node("Cast", [f"{p}_bits_i"], [f"{p}_bits_f"], to=TensorProto.FLOAT),
            helper.make_node("Pow", ["two_f", f"{p}_bits_f"], [f"{p}_levels"]),  # 2^b, exact
            helper.make_node("Sub", [f"{p}_levels", "one_f"], [f"{p}_levels_m1"]),  # 2^b - 1
            helper.make_node("Mul", [f"{p}_levels", "half_f"], [f"{p}_half"]),  # 2^(b-1)
            helper.make_node("Sub", [f"{p}_half", "one_f"], [f"{p}_half_m1"]),  # 2^(b-1) - 1
            # the static range in the storage type: signed [-2^(b-1), 2^(b-1) - 1] or unsigned [0, 2^b - 1]
            helper.make_node("Mul", ["symmetric_f", f"{p}_half"], [f"{p}_signed_shift"]),
            helper.make_node("Neg", [f"{p}_signed_shift"], [f"{p}_static_qmin"]),
            helper.make_node("Sub", [f"{p}_levels_m1", f"{p}_signed_shift"], [f"{p}_static_qmax"]),
            # the given scale and zero point, read through optional input slots only, so that the
            # inputs may be empty names (dynamic mode): Clip(1, s, s) = s, or 1.0 without s;
            # QuantizeLinear(0, 1, z) = z (z's type), or uint8 0 without z
            helper.make_node("Clip", ["one_f", f"{p}_scale", f"{p}_scale"], [f"{p}_scale_given"]),
            helper.make_node("QuantizeLinear", ["zero_f", "one_f", f"{p}_zero_point"], [f"{p}_zero_point_given"]),
        ]
    dynamic_branch = helper.make_graph(
        _dynamic_part("low") + _dynamic_part("high")
        + [helper.make_node("Concat", ["dyn_low_y", "dyn_high_y"], ["dyn_y"], axis=-1)],
        "subspace_qdq_dynamic", [], [helper.make_tensor_value_info("dyn_y", TensorProto.FLOAT, None)])
    static_branch = helper.make_graph(
        _static_part("low") + _static_part("high")
        + [helper.make_node("Concat", ["static_low_y", "static_high_y"], ["static_y"], axis=-1)],
        "subspace_qdq_static", [], [helper.make_tensor_value_info("static_y", TensorProto.FLOAT, None)])
    nodes.append(helper.make_node("If", ["dynamic_b"], ["y"], then_branch=dynamic_branch, else_branch=static_branch))
    return helper.make_function(
        DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), nodes, [helper.make_opsetid("", opset)],
        attributes=["rank"],
        attribute_protos=[helper.make_attribute(k, v) for k, v in ATTRIBUTE_DEFAULTS.items()],
        doc_string=__doc__.split("\n\n")[0],
    )


def _check_attributes(d: int | None, rank, low_bits, high_bits) -> None:
    """rank in [1, d - 1] (d None: unknown, rank >= 1) and bit widths in [2, 8]."""
    if rank is None:
        raise ValueError(f"{OP_TYPE}: the rank attribute is required")
    if int(rank) < 1 or (d is not None and int(rank) >= d):
        raise ValueError(f"{OP_TYPE}: rank {rank} outside [1, d - 1] (d = {d})")
    for label, bits in (("low_bits", low_bits), ("high_bits", high_bits)):
        if not 2 <= int(bits) <= 8:
            raise ValueError(f"{OP_TYPE}: {label} {bits} outside [2, 8] (int8/uint8 storage)")


def _bounds(bits: int, symmetric: bool) -> tuple[int, int]:
    """The static integer range of a b-bit part in its storage type."""
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2 ** bits - 1)


def _static_qdq(x, scale, zero_point, bits, symmetric):
    if scale is None or zero_point is None or np.size(scale) == 0 or np.size(zero_point) == 0:
        raise ValueError(f"{OP_TYPE}: static mode needs every scale and zero point")
    zp = np.asarray(zero_point)
    want = np.int8 if symmetric else np.uint8
    if zp.dtype != want:
        raise ValueError(f"{OP_TYPE}: symmetric={int(symmetric)} stores in {np.dtype(want).name}; zero point is {zp.dtype}")
    qmin, qmax = _bounds(bits, symmetric)
    s = np.float32(np.asarray(scale, np.float32).reshape(()))
    z = np.float32(zp.reshape(()))
    q = np.clip(np.round(x / s) + z, qmin, qmax).astype(np.float32)
    return ((q - z) * s).astype(np.float32)


def _dynamic_qdq(x, bits, symmetric):
    f = np.float32
    lo = np.minimum(x.min(axis=-1, keepdims=True), f(0))
    hi = np.maximum(x.max(axis=-1, keepdims=True), f(0))
    levels_m1, half_m1 = f(2 ** bits - 1), f(2 ** (bits - 1) - 1)
    if symmetric:
        s = np.maximum(np.maximum(-lo, hi) / half_m1, f(TINY))
        z, qmin, qmax = f(0), -half_m1, half_m1
    else:
        s = np.maximum((hi - lo) / levels_m1, f(TINY))
        z = np.clip(np.round(-lo / s), f(0), levels_m1)
        qmin, qmax = f(0), levels_m1
    q = np.clip(np.round(x / s) + z, qmin, qmax)
    return ((q - z) * s).astype(np.float32)


def subspace_qdq_reference(x, low_scale=None, low_zero_point=None, high_scale=None, high_zero_point=None,
                           rank=None, low_bits=DEFAULT_LOW_BITS, high_bits=DEFAULT_HIGH_BITS, symmetric=1, dynamic=0):
    """Numpy reference: the body's float32 operations in the body's order (round half to even,
    ``np.round``), so it equals onnxruntime bit for bit. Returns ``(y,)``."""
    x = np.asarray(x, np.float32)
    d = x.shape[-1]
    _check_attributes(d, rank, low_bits, high_bits)
    split = d - int(rank)
    parts = ((x[..., :split], low_scale, low_zero_point, int(low_bits)),
             (x[..., split:], high_scale, high_zero_point, int(high_bits)))
    if dynamic:
        ys = [_dynamic_qdq(xp, bits, bool(symmetric)) for xp, _, _, bits in parts]
    else:
        ys = [_static_qdq(xp, s, z, bits, bool(symmetric)) for xp, s, z, bits in parts]
    return (np.concatenate(ys, axis=-1),)


def make_subspace_qdq_node(
    x_name: str, y_name: str, rank: int, low_scale: float | None = None, low_zero_point: int | None = None,
    high_scale: float | None = None, high_zero_point: int | None = None, low_bits: int = DEFAULT_LOW_BITS,
    high_bits: int = DEFAULT_HIGH_BITS, symmetric: bool = True, dynamic: bool = False, name: str | None = None,
) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """A SubspaceQDQ NodeProto (domain edgeq, every attribute written: onnx's ReferenceEvaluator
    does not apply function attribute defaults) plus its initializers, named after ``y_name``.

    Static: the four scalars become initializers, the zero points int8 (``symmetric``) or uint8,
    checked against the b-bit range. Dynamic: no initializers; the four inputs are written as
    empty names "" (onnxruntime also accepts them left off, onnx's ReferenceEvaluator does not).
    """
    _check_attributes(None, rank, low_bits, high_bits)
    attrs: dict[str, Any] = dict(rank=int(rank), low_bits=int(low_bits), high_bits=int(high_bits),
                 symmetric=int(bool(symmetric)), dynamic=int(bool(dynamic)))
    inits: list[onnx.TensorProto] = []
    if dynamic:
        inputs = [x_name, "", "", "", ""]
    else:
        given = (low_scale, low_zero_point, high_scale, high_zero_point)
        if any(v is None for v in given):
            raise ValueError(f"{OP_TYPE}: static mode needs low/high scale and zero point")
        assert low_scale is not None and low_zero_point is not None  # none is None (checked above)
        assert high_scale is not None and high_zero_point is not None
        storage = np.int8 if symmetric else np.uint8
        for label, zp, bits in (("low", low_zero_point, low_bits), ("high", high_zero_point, high_bits)):
            lo, hi = _bounds(int(bits), bool(symmetric))
            if not lo <= int(zp) <= hi:
                raise ValueError(f"{OP_TYPE}: {label}_zero_point {zp} outside the {bits}-bit range [{lo}, {hi}]")
        for label, s in (("low", low_scale), ("high", high_scale)):
            if not (np.isfinite(float(s)) and float(s) > 0):
                raise ValueError(f"{OP_TYPE}: {label}_scale must be finite and > 0, got {s}")
        names = [f"{y_name}_{n}" for n in INPUTS[1:]]
        inits = [
            onnx.numpy_helper.from_array(np.asarray(low_scale, np.float32).reshape(()), names[0]),
            onnx.numpy_helper.from_array(np.asarray(int(low_zero_point), storage).reshape(()), names[1]),
            onnx.numpy_helper.from_array(np.asarray(high_scale, np.float32).reshape(()), names[2]),
            onnx.numpy_helper.from_array(np.asarray(int(high_zero_point), storage).reshape(()), names[3]),
        ]
        inputs = [x_name, *names]
    node = helper.make_node(OP_TYPE, inputs, [y_name], name=name or f"{y_name}_node", domain=DOMAIN, **attrs)
    return node, inits
