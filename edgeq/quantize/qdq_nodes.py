"""Building blocks for Q/DQ in a graphsurgeon graph, shared by every pass that quantizes.

One place creates QuantizeLinear/DequantizeLinear nodes and integer constants, so scales, zero
points, 4-bit packing and naming are the same whether the qdq pass or a method pass (e.g. RMS's
GEMV branch) quantizes a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.errors import UserInputError
from edgeq.quantize.quant import QuantSpec, quantize_weight, require_finite, scale_zero_point


def integer_constant(name: str, values: np.ndarray, spec: QuantSpec) -> gs.Constant:
    """An integer constant; 4-bit values are packed two per byte by onnx itself.

    graphsurgeon (0.6 with onnx >= 1.20) would write ml_dtypes int4 arrays unpacked, so 4-bit
    tensors are handed to it as an already-serialized TensorProto (``LazyValues``), which its
    exporter passes through untouched.
    """
    if spec.dtype not in ("int4", "uint4"):
        return gs.Constant(name, values)
    import ml_dtypes  # a dependency of onnx itself
    from onnx_graphsurgeon.ir.tensor import LazyValues

    packed = onnx.numpy_helper.from_array(values.astype(ml_dtypes.int4 if spec.dtype == "int4" else ml_dtypes.uint4), name)
    return gs.Constant(name, LazyValues(packed))


@dataclass(frozen=True)
class QuantizedTensor:
    """An integer activation and the parameters its DequantizeLinear nodes share."""

    integer: gs.Variable
    scale: gs.Constant
    zero_point: gs.Constant
    source: str  # the float tensor it quantizes


def insert_quantize(graph: gs.Graph, index: ir.GraphIndex, tensor: gs.Tensor, lo: float, hi: float,
                    spec: QuantSpec) -> QuantizedTensor:
    """A static per-tensor QuantizeLinear of ``tensor`` covering [lo, hi] (plus a Clip to the
    usable range when ``spec`` narrows its storage type)."""
    name = tensor.name
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise UserInputError(f"calibration saw no finite values for '{name}'")
    scale, zp = scale_zero_point(np.array(lo), np.array(hi), spec)
    s_const = gs.Constant(ir.unique_name(index, f"{name}_scale"), np.asarray(scale, np.float32).reshape(()))
    z_const = gs.Constant(ir.unique_name(index, f"{name}_zero_point"), np.asarray(zp).reshape(()))
    quant = gs.Variable(ir.unique_name(index, f"{name}_quantized"), dtype=spec.np_dtype)
    node = gs.Node("QuantizeLinear", ir.unique_name(index, f"{name}_QuantizeLinear"), {}, [tensor, s_const, z_const], [quant])
    graph.nodes.append(node)
    if spec.narrowed:
        narrow = gs.Variable(ir.unique_name(index, f"{name}_quantized_{spec.bits}bit"), dtype=spec.np_dtype)
        bounds = [gs.Constant(ir.unique_name(index, f"{name}_q{side}"), np.asarray(v, spec.np_dtype).reshape(()))
                  for side, v in (("min", spec.qmin), ("max", spec.qmax))]
        graph.nodes.append(gs.Node("Clip", f"{name}_QuantizeLinear_{spec.bits}bit", {}, [quant, *bounds], [narrow]))
        quant = narrow
    return QuantizedTensor(quant, s_const, z_const, name)


def insert_dequantize(graph: gs.Graph, index: ir.GraphIndex, quantize: QuantizedTensor, consumer: str) -> gs.Variable:
    """A DequantizeLinear of ``quantize``'s output dedicated to one consumer node.

    onnxruntime's QDQ selectors only fuse a DQ with a single consumer, so every linear gets its
    own DQ while the QuantizeLinear (the integer activation) is shared.
    """
    quant, s_const, z_const = quantize.integer, quantize.scale, quantize.zero_point
    deq = gs.Variable(ir.unique_name(index, f"{quantize.source}_dequantized"), dtype=np.float32)
    graph.nodes.append(gs.Node("DequantizeLinear", f"{consumer}_input_DequantizeLinear", {}, [quant, s_const, z_const], [deq]))
    return deq


def insert_weight_dequantize(graph: gs.Graph, index: ir.GraphIndex, w: np.ndarray, spec: QuantSpec,
                             base: str, params: tuple | None = None) -> gs.Variable:
    """Quantize a float weight offline (round to nearest, or take ``params`` = (q, scale, zero
    point) already computed, e.g. by GPTQ, in ``quantize_weight``'s layout); return the output of
    its DequantizeLinear."""
    require_finite(w, f"weight '{base}'")
    q, scale, zp = params if params is not None else quantize_weight(np.asarray(w, np.float32), spec)
    require_finite(scale, f"the scale of weight '{base}'")
    q, zp = np.asarray(q).astype(spec.np_dtype), np.asarray(zp).astype(spec.np_dtype)
    prefix = f"{base}_{spec.dtype}"
    q_const = integer_constant(ir.unique_name(index, prefix), q, spec)
    s_const = gs.Constant(ir.unique_name(index, prefix + "_scale"), np.asarray(scale, np.float32))
    z_const = integer_constant(ir.unique_name(index, prefix + "_zero_point"), zp, spec)
    out = gs.Variable(ir.unique_name(index, f"{base}_dequantized"), dtype=np.float32, shape=list(np.shape(w)))
    attrs = {}
    if spec.axis is not None:
        attrs["axis"] = spec.axis
    if spec.block_size:
        attrs["block_size"] = spec.block_size
    graph.nodes.append(gs.Node("DequantizeLinear", f"{base}_DequantizeLinear", attrs, [q_const, s_const, z_const], [out]))
    return out


def check_weights_finite(index: ir.GraphIndex, linears) -> None:
    """Refuse a model whose linears about to be quantized (``structure.Linear``s) have a NaN or
    inf in their weights, naming the weight, before any calibration runs on it."""
    for lin in linears:
        if not lin.quantized:
            value = index.constant_value(index.tensors[lin.weight])
            if value is not None:
                require_finite(value, f"weight '{lin.weight}' (of {lin.node})")


def ensure_opset(graph: gs.Graph, *specs: QuantSpec) -> None:
    """int16 and int4 Q/DQ and block sizes need opset 21.

    Bumping an opset-18+ graph to 21 is safe for the ops transformer exports use (18 -> 21 only
    widened types and added attributes with backward-compatible defaults); older graphs would
    need real conversion (e.g. ReduceMean's axes moved to an input in 18), so they are refused.
    """
    need = max(s.min_opset for s in specs)
    if any(s.block_size for s in specs):
        need = max(need, 21)
    if graph.opset >= need:
        return
    if graph.opset < 18:
        raise UserInputError(f"this quantization needs opset {need}; the model has opset {graph.opset} (re-export with opset >= 18)")
    graph.opset = need


def insert_token_fake_quant(graph: gs.Graph, index: ir.GraphIndex, tensor: gs.Tensor, spec: QuantSpec) -> gs.Variable:
    """Dynamic per-token symmetric quantize-dequantize of ``tensor`` (scale = |x|max of each token
    / qmax, computed at run time), in standard ops.

    QuantizeLinear cannot take a per-row scale computed at run time (its scale is a scalar, 1-D
    along one axis, or blocked with static shape rules), so this is written as
    ``Clip(Round(x / s), -qmax, qmax) * s``: numerically the per-token quantizer (round half to
    even, like QuantizeLinear), for accuracy studies and per-token NPU runtimes; onnxruntime does
    not turn it into integer kernels.
    """
    name = tensor.name
    half = float((spec.qmax - spec.qmin) // 2)

    def var(suffix):
        return gs.Variable(ir.unique_name(index, f"{name}_{suffix}"), dtype=np.float32)

    def const(suffix, value, dtype=np.float32):
        return gs.Constant(ir.unique_name(index, f"{name}_{suffix}"), np.asarray(value, dtype))

    absx, amax, scale, scaled, rounded, clipped, out = (var(s) for s in (
        "token_abs", "token_absmax", "token_scale", "token_scaled", "token_rounded", "token_clipped", "token_fakequant"))
    nodes = [
        gs.Node("Abs", f"{name}_token_Abs", inputs=[tensor], outputs=[absx]),
        gs.Node("ReduceMax", f"{name}_token_ReduceMax", {"keepdims": 1}, [absx, const("token_axes", [-1], np.int64)], [amax]),
        gs.Node("Div", f"{name}_token_scale", inputs=[amax, const("token_qmax", half)], outputs=[scale]),
    ]
    safe = var("token_scale_safe")
    nodes += [
        gs.Node("Max", f"{name}_token_scale_floor", inputs=[scale, const("token_tiny", np.finfo(np.float32).tiny)], outputs=[safe]),
        gs.Node("Div", f"{name}_token_Div", inputs=[tensor, safe], outputs=[scaled]),
        gs.Node("Round", f"{name}_token_Round", inputs=[scaled], outputs=[rounded]),
        gs.Node("Clip", f"{name}_token_Clip", inputs=[rounded, const("token_lo", -half), const("token_hi", half)], outputs=[clipped]),
        gs.Node("Mul", f"{name}_token_Mul", inputs=[clipped, safe], outputs=[out]),
    ]
    graph.nodes.extend(nodes)
    return out


def insert_token_fake_quant_asymmetric(graph: gs.Graph, index: ir.GraphIndex, tensor: gs.Tensor, bits: int) -> gs.Variable:
    """Dynamic per-token asymmetric ``bits``-bit quantize-dequantize (ResQ's and SpinQuant's
    activation quantizer) in standard ops, the same formula as ``edgeq::SubspaceQDQ``'s dynamic
    asymmetric branch: ``lo = min(min(row), 0)``, ``hi = max(max(row), 0)``,
    ``s = max((hi - lo) / (2^b - 1), tiny)``, ``z = clip(round(-lo / s), 0, 2^b - 1)``,
    ``y = (clip(round(x / s) + z, 0, 2^b - 1) - z) * s``."""
    name = tensor.name
    levels = float(2 ** bits - 1)

    def var(suffix):
        return gs.Variable(ir.unique_name(index, f"{name}_{suffix}"), dtype=np.float32)

    def const(suffix, value, dtype=np.float32):
        return gs.Constant(ir.unique_name(index, f"{name}_{suffix}"), np.asarray(value, dtype))

    axes, zero = const("tok_axes", [-1], np.int64), const("tok_zero", 0.0)
    t = {k: var(f"tok_{k}") for k in ("min", "max", "lo", "hi", "range", "s0", "s", "neg", "zr", "z", "xs", "xr", "q0", "q", "qz", "y")}
    top = const("tok_levels", levels)
    nodes = [
        gs.Node("ReduceMin", f"{name}_tok_ReduceMin", {"keepdims": 1}, [tensor, axes], [t["min"]]),
        gs.Node("ReduceMax", f"{name}_tok_ReduceMax", {"keepdims": 1}, [tensor, axes], [t["max"]]),
        gs.Node("Min", f"{name}_tok_lo", inputs=[t["min"], zero], outputs=[t["lo"]]),
        gs.Node("Max", f"{name}_tok_hi", inputs=[t["max"], zero], outputs=[t["hi"]]),
        gs.Node("Sub", f"{name}_tok_range", inputs=[t["hi"], t["lo"]], outputs=[t["range"]]),
        gs.Node("Div", f"{name}_tok_s0", inputs=[t["range"], top], outputs=[t["s0"]]),
        gs.Node("Max", f"{name}_tok_s", inputs=[t["s0"], const("tok_tiny", np.finfo(np.float32).tiny)], outputs=[t["s"]]),
        gs.Node("Div", f"{name}_tok_neg", inputs=[t["lo"], t["s"]], outputs=[t["neg"]]),
        gs.Node("Neg", f"{name}_tok_negate", inputs=[t["neg"]], outputs=[t["zr"]]),
    ]
    zr = var("tok_zround")
    nodes += [
        gs.Node("Round", f"{name}_tok_zround", inputs=[t["zr"]], outputs=[zr]),
        gs.Node("Clip", f"{name}_tok_z", inputs=[zr, zero, top], outputs=[t["z"]]),
        gs.Node("Div", f"{name}_tok_Div", inputs=[tensor, t["s"]], outputs=[t["xs"]]),
        gs.Node("Round", f"{name}_tok_Round", inputs=[t["xs"]], outputs=[t["xr"]]),
        gs.Node("Add", f"{name}_tok_Add", inputs=[t["xr"], t["z"]], outputs=[t["q0"]]),
        gs.Node("Clip", f"{name}_tok_Clip", inputs=[t["q0"], zero, top], outputs=[t["q"]]),
        gs.Node("Sub", f"{name}_tok_Sub", inputs=[t["q"], t["z"]], outputs=[t["qz"]]),
        gs.Node("Mul", f"{name}_tok_Mul", inputs=[t["qz"], t["s"]], outputs=[t["y"]]),
    ]
    graph.nodes.extend(nodes)
    return t["y"]


def fp8_zero_point(name: str) -> gs.Constant:
    """A float8 e4m3fn scalar 0: the zero point that makes QuantizeLinear produce FP8."""
    import ml_dtypes  # a dependency of onnx itself
    from onnx_graphsurgeon.ir.tensor import LazyValues

    proto = onnx.numpy_helper.from_array(np.zeros((), ml_dtypes.float8_e4m3fn), name)
    return gs.Constant(name, LazyValues(proto))


def insert_fp8_qdq(graph: gs.Graph, index: ir.GraphIndex, tensor: gs.Tensor, scale: float, base: str) -> gs.Variable:
    """QuantizeLinear to float8 e4m3fn (static per-tensor ``scale``, saturating) and its
    DequantizeLinear: the FP8 compute precision of DPQ's weights and activations (opset >= 19)."""
    s_const = gs.Constant(ir.unique_name(index, f"{base}_fp8_scale"), np.asarray(scale, np.float32).reshape(()))
    z_const = fp8_zero_point(ir.unique_name(index, f"{base}_fp8_zero_point"))
    q = gs.Variable(ir.unique_name(index, f"{base}_fp8"))
    out = gs.Variable(ir.unique_name(index, f"{base}_fp8_dequantized"), dtype=np.float32, shape=tensor.shape)
    graph.nodes.append(gs.Node("QuantizeLinear", ir.unique_name(index, f"{base}_fp8_QuantizeLinear"), {"saturate": 1},
                               [tensor, s_const, z_const], [q]))
    graph.nodes.append(gs.Node("DequantizeLinear", ir.unique_name(index, f"{base}_fp8_DequantizeLinear"), {},
                               [q, s_const, z_const], [out]))
    return out
