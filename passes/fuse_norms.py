"""``fuse-norms``: fold each norm's scale (gamma) and bias (beta) into the linears reading it.

``norm(x) * gamma + beta`` feeding ``y = . @ W + b`` equals ``norm(x)`` feeding
``W' = diag(gamma) W``, ``b' = b + beta @ W``. Afterwards every norm is weightless, which is what
makes RMSNorm commute with a rotation of the residual stream (``rotate``). Tied embeddings are
untied on the way: the head gets its own initializer, the embedding Gather keeps the table.

A norm is folded only when every reader of its output (looking through reshapes) is a linear with
a constant weight; otherwise another reader would see changed values (e.g. BERT's post-LN, where
the norm output is also the residual stream). Such norms are left alone and listed in the summary.

``sandwich = "keep"``: on a family with post-sublayer norms (Gemma 2/3's sandwich norms) the stream
norms keep their scales, and ``rotate`` then rotates at the norm outputs instead of the stream (see
``rotate``): Gemma 3's norm scales span 0 to 60 within one norm, and folded into the weights they
cost 3.8x fp32 perplexity with int8 per-channel weights alone (15.8x once rotated). The default,
``"fold"``, folds them like any other (what ResQ's stream rewrite needs).
"""

from __future__ import annotations


import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from dataclasses import dataclass
from typing import cast

from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import Exactness, Pass, PassConfig, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.structure import Linear, Norm, analyze
from edgeq.passes.methods.weights import LinearEditor, is_weightless, norm_weights, position_wise_readers, scale_rows


@dataclass(frozen=True)
class FuseNormsConfig(PassConfig):
    sandwich: str = "fold"  # fold | keep: the stream norms' scales of a sandwich-norm family

    def __post_init__(self):
        if self.sandwich not in ("fold", "keep"):
            raise UserInputError(f"fuse-norms: sandwich must be fold or keep, got '{self.sandwich}'")


class FuseNormsPass(Pass, name="fuse-norms", per_block=True, exactness=Exactness.FLOAT_EQUIV, config=FuseNormsConfig,
                    summary="fold norm scales/biases into the linears that read them; untie tied embeddings"):
    config: FuseNormsConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        structure = analyze(graph)
        kept = _sandwich_stream_norms(graph) if self.config.sandwich == "keep" else set()
        editor = LinearEditor(graph)
        index = editor.index
        by_node = {lin.node: lin for lin in structure.linears if not lin.quantized}
        folded, skipped, untied = [], {}, 0
        for norm in structure.norms:
            if norm.skip is not None or is_weightless(index, norm):
                if norm.skip is not None:
                    skipped[norm.name] = "fused Skip*Norm (residual add inside the op)"
                continue
            if norm.name in kept:
                skipped[norm.name] = "sandwich-norm family: scale kept (sandwich = keep; rotate rotates at the norm outputs)"
                continue
            readers = position_wise_readers(index, norm.output)
            linears = [by_node.get(n.name) for n in readers]
            if not readers or any(lin is None for lin in linears):
                skipped[norm.name] = "output has readers that are not linears"
                continue
            gamma, beta = norm_weights(index, norm)
            for lin in cast("list[Linear]", linears):  # (no None: checked above)
                w = editor.stored(lin)
                if beta is not None:
                    b = editor.bias(lin)
                    editor.set_bias(lin, (b if b is not None else 0.0) + beta @ np.asarray(w, np.float64))
                if gamma is not None:
                    w = scale_rows(w, gamma)
                untied += int(lin.tied_embedding is not None)
                editor.set_weight(lin, w)
            _drop_norm_affine(graph, index, norm)
            folded.append(norm.name)
        summary = {"norms_folded": len(folded), "heads_untied": untied, "norms_skipped": skipped}
        if not structure.norms:
            raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, "no LayerNorm/RMSNorm in the graph", **summary)
        if not folded:  # nothing was changed above: every norm was passed over
            raise PassNotApplicable(Reason.NO_SITES, "no LayerNorm/RMSNorm with a scale or bias that only linears "
                                    "read (the others are weightless or listed in norms_skipped)", **summary)
        return PassResult(True, summary)


def _sandwich_stream_norms(graph: gs.Graph) -> set[str]:
    """The stream norms' names when the stream has post-sublayer norms, else none."""
    from edgeq.passmanager.passbase import PassNotApplicable
    from edgeq.passes.methods.stream import analyze_stream

    try:
        stream = analyze_stream(graph)
    except PassNotApplicable:  # no stream rewrite will run: no sandwich norms to keep
        return set()
    return {norm.name for norm in stream.norms} if stream.post_norms else set()


def _drop_norm_affine(graph: gs.Graph, index: ir.GraphIndex, norm: Norm) -> None:
    """Make the norm weightless: bypass the decomposed Mul/Add, or give the fused op ones/zeros."""
    nodes = {n.name: n for n in graph.nodes}
    if norm.fused:
        node = nodes[norm.nodes[-1]]
        scale = index.constant_value(index.tensors[norm.scale]) if norm.scale else None
        if scale is not None:
            node.inputs[1] = gs.Constant(ir.unique_name(index, f"{norm.name}_unit_scale"), np.ones_like(scale))
        if norm.bias is not None:
            bias = index.constant_value(index.tensors[norm.bias])
            node.inputs[2] = gs.Constant(ir.unique_name(index, f"{norm.name}_zero_bias"), np.zeros_like(bias))
        return
    for name, const in ((norm.bias_node, norm.bias), (norm.scale_node, norm.scale)):
        if name is None:
            continue
        node = nodes[name]
        other = next(t for t in node.inputs if t.name != const)
        out = node.outputs[0]
        for consumer in list(out.outputs):  # graphsurgeon keeps tensor.outputs current
            for i, t in enumerate(consumer.inputs):
                if t is out:
                    consumer.inputs[i] = other
        for g_out in graph.outputs:
            if g_out is out:
                # keep the graph output's name: an Identity carries it
                node.op, node.inputs, node.attrs = "Identity", [other], {}
                break
        else:
            node.outputs.clear()
