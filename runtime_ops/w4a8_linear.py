"""``edgeq::W4A8Linear``: DPQ's fused W4A8 linear (4-bit stored weights, FP8 weights and activations).

DPQ stores the weight as 4-bit integers with one (scale, zero point) per group of ``block_size``
input rows; at run time the group-dequantized weight is requantized to float8 e4m3fn with one
power-of-two per-tensor scale ``s8`` (the group scales are stored already multiplied by it), the
activation is quantized to float8 with a static scale, and an FP8 GEMM produces the output. Why a
custom op: a runtime or an NPU SDK with a native W4A8 kernel matches ``edgeq::W4A8Linear`` by
domain and name and runs that FP8 GEMM on the packed 4-bit weight. Why a function body: plain
onnxruntime (or any ONNX runtime) inlines it and runs the same numbers with standard ops.

The body (default-domain opset >= 21, the first with int4/uint4 and block-wise DequantizeLinear)::

    wf = DequantizeLinear(w, w_scale, w_zero_point, axis=0, block_size=block_size)
    wr = Cast(QuantizeLinear(wf, w_fp8_scale, fp8 0), float) * w_fp8_scale
    xr = Cast(QuantizeLinear(x, x_scale, fp8 0), float) * x_scale
    y  = MatMul(xr, wr)

QuantizeLinear to float8 rounds to nearest even and saturates to +-448 (``saturate=1``).
``Cast(q8, float) * scale`` is DequantizeLinear with a zero zero point, bit for bit; it is written
so because onnxruntime's QDQ MatMul selector (ORT_ENABLE_EXTENDED and up, the default level)
would fuse DequantizeLinear -> MatMul <- DequantizeLinear into MatMulIntegerToFloat without
checking for float8, and the session would fail to load ("Type 'tensor(float8e4m3fn)' of input
parameter ... of operator (MatMulIntegerToFloat) ... is invalid", onnxruntime 1.31).
onnxruntime's CPU provider runs this body emulated: the FP8 quantize/dequantize round the values
onto the FP8 grid, and the MatMul runs in float32 (MLAS sgemm); there is no FP8 GEMM on CPU, so
the result equals a real W4A8 kernel up to its accumulation order, not its speed.

Inputs: ``x`` float32 [..., K]; ``w`` uint4/int4 [K, N] (K-major, as DequantizeLinear axis 0 reads
it); ``w_scale`` float32 [ceil(K / block_size), N] (real-domain group scales, s_g * s8);
``w_zero_point`` w's type, w_scale's shape (zeros for symmetric int4); ``w_fp8_scale`` float32
scalar s8; ``x_scale`` float32 scalar. Attribute ``block_size`` (int, default 128). Output ``y``
float32 [..., N].
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

from edgeq.runtime_ops.domain import DOMAIN

OP_TYPE = "W4A8Linear"
INPUTS = ("x", "w", "w_scale", "w_zero_point", "w_fp8_scale", "x_scale")
OUTPUTS = ("y",)
MIN_OPSET = 21  # int4/uint4 and DequantizeLinear's block_size
DEFAULT_BLOCK_SIZE = 128
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value


def w4a8_linear_function(opset: int) -> onnx.FunctionProto:
    """The function body, importing the default domain at ``opset`` (valid from 21 on; the
    schema table's ``ensure_functions`` refuses older models, which cannot hold int4 anyway)."""
    fp8_zero = helper.make_tensor("fp8_zero", TensorProto.FLOAT8E4M3FN, [], [0.0])
    dequantize_w = helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero_point"], ["wf"], axis=0)
    dequantize_w.attribute.append(helper.make_attribute_ref("block_size", AttributeProto.INT))  # the op's attribute
    nodes = [
        # the zero point's type selects QuantizeLinear's output type: float8 e4m3fn
        helper.make_node("Constant", [], ["fp8_zero"], value=fp8_zero),
        dequantize_w,
        helper.make_node("QuantizeLinear", ["wf", "w_fp8_scale", "fp8_zero"], ["w8"]),
        # the FP8 dequantizations as Cast + Mul (see the module docstring for why not DequantizeLinear)
        helper.make_node("Cast", ["w8"], ["w8f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["w8f", "w_fp8_scale"], ["wr"]),
        helper.make_node("QuantizeLinear", ["x", "x_scale", "fp8_zero"], ["x8"]),
        helper.make_node("Cast", ["x8"], ["x8f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x8f", "x_scale"], ["xr"]),
        helper.make_node("MatMul", ["xr", "wr"], ["y"]),
    ]
    return helper.make_function(
        DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), nodes, [helper.make_opsetid("", opset)],
        attribute_protos=[helper.make_attribute("block_size", DEFAULT_BLOCK_SIZE)],
        doc_string=__doc__.split("\n\n")[0],
    )


def _as_int(a) -> np.ndarray:
    """int32 values of an integer array: plain numpy, ml_dtypes int4/uint4, or onnx's older
    structured 4-bit dtypes (one 'int4'/'uint4' field)."""
    a = np.asarray(a)
    if a.dtype.names:
        a = a[a.dtype.names[0]]
    return a.astype(np.int32)


def fp8_e4m3fn_round(v: np.ndarray) -> np.ndarray:
    """float32 values rounded to float8 e4m3fn (nearest even) with QuantizeLinear's saturation to
    +-448: ml_dtypes' cast alone turns values past the largest finite into NaN."""
    import ml_dtypes  # a dependency of onnx itself

    v = np.asarray(v, np.float32)
    return np.clip(v, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def dequantize_blocked(w, w_scale, w_zero_point, block_size: int = DEFAULT_BLOCK_SIZE) -> np.ndarray:
    """float32 (w - zp) * scale, row k using group k // block_size (the last group may be short)."""
    q = _as_int(w)
    k = q.shape[0]
    scale = np.asarray(w_scale, np.float32)
    groups = -(-k // block_size)
    if q.ndim != 2 or scale.shape != (groups, q.shape[1]):
        raise ValueError(f"w {q.shape} with block_size {block_size} needs w_scale [{groups}, N]; got {scale.shape}")
    rows = np.arange(k) // block_size
    zp = _as_int(w_zero_point).reshape(scale.shape)
    return ((q - zp[rows]).astype(np.float32) * scale[rows]).astype(np.float32)


def w4a8_linear_reference(x, w, w_scale, w_zero_point, w_fp8_scale, x_scale, block_size=DEFAULT_BLOCK_SIZE):
    """Numpy reference: the body's numbers, the matmul accumulated in float64 and rounded once
    to float32 (a native kernel's accumulation order differs from both at fp32 rounding level)."""
    s8 = np.float32(np.asarray(w_fp8_scale).reshape(()))
    sx = np.float32(np.asarray(x_scale).reshape(()))
    wf = dequantize_blocked(w, w_scale, w_zero_point, int(block_size))
    wr = fp8_e4m3fn_round(wf / s8) * s8
    xr = fp8_e4m3fn_round(np.asarray(x, np.float32) / sx) * sx
    return ((xr.astype(np.float64) @ wr.astype(np.float64)).astype(np.float32),)


def make_w4a8_linear_node(
    x_name: str, y_name: str, w: np.ndarray, w_scale: np.ndarray, w_zero_point: np.ndarray,
    w_fp8_scale: float, x_scale: float, block_size: int = DEFAULT_BLOCK_SIZE, signed: bool = False,
    name: str | None = None,
) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """A W4A8Linear NodeProto plus its five initializers (named after ``y_name``), for code that
    edits protos directly. ``w`` and ``w_zero_point`` are integer arrays in int4 (``signed``) or
    uint4 range; they are stored as 4-bit tensors, packed two per byte by onnx."""
    import ml_dtypes

    dtype = ml_dtypes.int4 if signed else ml_dtypes.uint4
    lo, hi = (-8, 7) if signed else (0, 15)
    for label, values in (("w", w), ("w_zero_point", w_zero_point)):
        if np.asarray(values).size and not lo <= np.min(values) <= np.max(values) <= hi:
            raise ValueError(f"{label} outside the {'int4' if signed else 'uint4'} range [{lo}, {hi}]")
    names = [f"{y_name}_{n}" for n in INPUTS[1:]]
    inits = [
        onnx.numpy_helper.from_array(np.asarray(w).astype(dtype), names[0]),
        onnx.numpy_helper.from_array(np.asarray(w_scale, np.float32), names[1]),
        onnx.numpy_helper.from_array(np.asarray(w_zero_point).astype(dtype), names[2]),
        onnx.numpy_helper.from_array(np.asarray(w_fp8_scale, np.float32).reshape(()), names[3]),
        onnx.numpy_helper.from_array(np.asarray(x_scale, np.float32).reshape(()), names[4]),
    ]
    node = helper.make_node(OP_TYPE, [x_name, *names], [y_name], name=name or f"{y_name}_node",
                            domain=DOMAIN, block_size=int(block_size))
    return node, inits
