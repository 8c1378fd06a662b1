"""Which tokens are visual, computed in the graph from the visual span inputs.

MQuant's AIFS (appendix A.4) and MSQ share one definition: a token belongs to the visual block when
it lies in ``[visual_start, visual_start + visual_len)`` of its batch row or is left padding (the
leading zeros of ``attention_mask``; padding is masked out of attention, so which scale it gets
does not matter, and counting it as visual keeps the visual block contiguous after AIFS).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph.facts import VISUAL_SPAN_INPUTS
from edgeq.graph.graph_builder import NodeBuilder

SPAN_METADATA_KEY = VISUAL_SPAN_INPUTS.key  # as written by edgeq.models.composed_vlm
DEFAULT_SPAN_INPUTS = ("visual_start", "visual_len")


def span_input_names(meta: dict[str, str]) -> tuple[str, ...]:
    """The names of the (start, length) graph inputs: from the model metadata, else the defaults."""
    return tuple(meta.get(SPAN_METADATA_KEY, ",".join(DEFAULT_SPAN_INPUTS)).split(","))


def visual_block_mask(b: NodeBuilder, embeds: gs.Tensor, mask: gs.Tensor, start: gs.Tensor, length: gs.Tensor) -> dict:
    """Nodes computing ``first`` [B, S] bool (padding or visual span) in the original token order;
    also returns the shared index tensors (``batch``, ``seq`` scalars, ``row`` = Range(S) as [1, S])."""
    i64 = np.int64
    shape = b.op("Shape", "Shape", [embeds], i64)
    batch = b.op("Gather", "Batch", [shape, b.const("zero", i64(0))], i64, {"axis": 0})
    seq = b.op("Gather", "Seq", [shape, b.const("one", i64(1))], i64, {"axis": 0})
    idx = b.op("Range", "Range", [b.const("range_start", i64(0)), seq, b.const("range_step", i64(1))], i64)
    row = b.op("Unsqueeze", "RowIndex", [idx, b.const("axes_0", np.array([0], i64))], i64)  # [1, S]
    mask64 = b.op("Cast", "MaskInt64", [mask], i64, {"to": 7})
    is_pad = b.op("Equal", "IsPadToken", [mask64, b.const("mask_zero", i64(0))], np.bool_)
    pad_len = b.op("ReduceSum", "PadLen", [b.op("Cast", "PadInt64", [is_pad], i64, {"to": 7}),
                                           b.const("axes_1", np.array([1], i64))], i64, {"keepdims": 1})  # [B, 1]
    vstart = b.op("Unsqueeze", "VisualStart", [start, b.const("axes_1b", np.array([1], i64))], i64)
    vend = b.op("Add", "VisualEnd", [vstart, b.op("Unsqueeze", "VisualLen", [length, b.const("axes_1c", np.array([1], i64))], i64)], i64)
    in_pad = b.op("Less", "InPadding", [row, pad_len], np.bool_)
    in_vis = b.op("And", "InVisual", [b.op("GreaterOrEqual", "AfterVisualStart", [row, vstart], np.bool_),
                                      b.op("Less", "BeforeVisualEnd", [row, vend], np.bool_)], np.bool_)
    first = b.op("Or", "FirstBlock", [in_pad, in_vis], np.bool_)  # [B, S]
    return {"batch": batch, "seq": seq, "row": row, "first": first}


def prefix_mask(b: NodeBuilder, embeds: gs.Tensor, first_len: gs.Tensor) -> gs.Variable:
    """[B, S] bool: position < first_len[b] (``first_len`` [B, 1]), the visual block after AIFS."""
    i64 = np.int64
    seq = b.op("Gather", "Seq", [b.op("Shape", "Shape", [embeds], i64), b.const("one", i64(1))], i64, {"axis": 0})
    idx = b.op("Range", "Range", [b.const("range_start", i64(0)), seq, b.const("range_step", i64(1))], i64)
    row = b.op("Unsqueeze", "RowIndex", [idx, b.const("axes_0", np.array([0], i64))], i64)
    return b.op("Less", "VisualPrefix", [row, first_len], np.bool_)
