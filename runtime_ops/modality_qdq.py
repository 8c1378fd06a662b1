"""``edgeq::ModalityQDQ``: MQuant's MSQ quantize-dequantize with one static scale per modality.

After AIFS every batch row holds its visual block (left padding included) first, then its text
tokens, so a static per-tensor scale per modality means: rows ``[0, visual_count[b])`` of row b
use the visual (scale, zero point), the rest the text ones. A native kernel quantizes the two
contiguous slices with their own scale; the function body, which must handle a different visual
count in every batch row without loops, computes both static Q/DQ pairs over the whole tensor and
selects per token (``Where`` on ``position < visual_count``): the same numbers, twice the
elementwise work.

Inputs: ``x`` [B, S, ...] float; ``visual_count`` [B] int64; ``visual_scale``, ``visual_zero_point``,
``text_scale``, ``text_zero_point``: scalars (the zero points' integer type is the quantized type,
as for QuantizeLinear). Output ``y``: x's shape and type, each token quantized-dequantized with its
modality's parameters.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from edgeq.runtime_ops.domain import DOMAIN

OP_TYPE = "ModalityQDQ"
INPUTS = ("x", "visual_count", "visual_scale", "visual_zero_point", "text_scale", "text_zero_point")
OUTPUTS = ("y",)


def modality_qdq_function(opset: int) -> onnx.FunctionProto:
    """The function body, importing the default domain at ``opset`` (>= 13)."""
    def const(name, values):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values))

    nodes = [
        const("zero", [0]), const("one", [1]), const("two", [2]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Slice", ["x_shape", "one", "two"], ["seq"]),
        helper.make_node("Squeeze", ["seq", "zero"], ["seq_scalar"]),
        helper.make_node("Constant", [], ["start"], value=helper.make_tensor("start", onnx.TensorProto.INT64, [], [0])),
        helper.make_node("Constant", [], ["step"], value=helper.make_tensor("step", onnx.TensorProto.INT64, [], [1])),
        helper.make_node("Range", ["start", "seq_scalar", "step"], ["positions"]),  # [S]
        helper.make_node("Unsqueeze", ["visual_count", "one"], ["count_col"]),  # [B, 1]
        helper.make_node("Less", ["positions", "count_col"], ["is_visual"]),  # [B, S]
        # broadcast the [B, S] mask over x's trailing dims: reshape to [B, S, 1, ...]
        helper.make_node("Shape", ["x"], ["rank_probe"]),
        helper.make_node("Size", ["rank_probe"], ["rank"]),
        helper.make_node("Sub", ["rank", "two"], ["trailing"]),
        helper.make_node("Reshape", ["trailing", "one"], ["trailing_1d"]),
        helper.make_node("Expand", ["one", "trailing_1d"], ["ones"]),
        helper.make_node("Shape", ["is_visual"], ["mask_shape"]),
        helper.make_node("Concat", ["mask_shape", "ones"], ["mask_target"], axis=0),
        helper.make_node("Reshape", ["is_visual", "mask_target"], ["mask"]),
        helper.make_node("QuantizeLinear", ["x", "visual_scale", "visual_zero_point"], ["qv"]),
        helper.make_node("DequantizeLinear", ["qv", "visual_scale", "visual_zero_point"], ["yv"]),
        helper.make_node("QuantizeLinear", ["x", "text_scale", "text_zero_point"], ["qt"]),
        helper.make_node("DequantizeLinear", ["qt", "text_scale", "text_zero_point"], ["yt"]),
        helper.make_node("Where", ["mask", "yv", "yt"], ["y"]),
    ]
    return helper.make_function(DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), nodes,
                                [helper.make_opsetid("", opset)], doc_string=__doc__.split("\n\n")[0])


def _qdq(x, scale, zero_point):
    info = np.iinfo(np.asarray(zero_point).dtype)
    q = np.clip(np.round(x.astype(np.float32) / np.float32(scale)) + np.float32(zero_point), info.min, info.max)
    return ((q - np.float32(zero_point)) * np.float32(scale)).astype(np.float32)


def modality_qdq_reference(x, visual_count, visual_scale, visual_zero_point, text_scale, text_zero_point):
    """Numpy reference: each batch row's first ``visual_count[b]`` tokens with the visual
    parameters, the rest with the text ones (round half to even, saturating, like QuantizeLinear)."""
    x = np.asarray(x, np.float32)
    y = _qdq(x, text_scale, text_zero_point)
    for b, n in enumerate(np.asarray(visual_count).reshape(-1)):
        n = int(min(max(n, 0), x.shape[1]))
        y[b, :n] = _qdq(x[b, :n], visual_scale, visual_zero_point)
    return (y,)
