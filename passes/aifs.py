"""``aifs``: MQuant's Attention-Invariant Flexible Switching (section 3.1, Eq. 4-5, appendix A.2, A.4).

Why: MSQ gives every activation quantization site two static per-tensor scales, one for visual
tokens and one for text tokens. That is only cheap when each modality is a contiguous block of
rows: with the image in the middle of the sequence every quantized op would have to slice,
quantize twice and concatenate. AIFS reorders the sequence once, at the graph inputs, so that the
visual block comes first and all text tokens follow in their original order::

    new order per batch row b:  [0, p_b) + [v_b, v_b + n_b)   then every other token, in order

(``p_b`` = left padding, the leading zeros of ``attention_mask``, counted as part of the visual
block as in appendix A.4; ``v_b`` / ``n_b`` = ``visual_start`` / ``visual_len``). Attention is
made invariant to the reorder: token i' may attend token j' iff ``orig(j') <= orig(i')`` (Eq. 5 in
its general form), RoPE reads the permuted position ids (so each token keeps its original angle,
appendix A.2; for M-RoPE all three rows are permuted alike), and the padding mask reads the
permuted ``attention_mask``. Every per-token op (linears, norms, MLP) is row-wise, so each token's
result is the original one; the outputs are gathered back with the inverse permutation, so callers
see the original order. At infinite precision the graph is unchanged (FLOAT_EQUIV: softmax sums run
in another order).

How (all in-graph, dynamic batch, sequence and span per row, exact integer ops):

- ``idx = Range(0, S)``; ``first = idx < p_b  or  v_b <= idx < v_b + n_b``;
  ``dest = first ? CumSum(first) - 1 : n_first + CumSum(not first) - 1`` is the new position of
  original token i (the inverse permutation); ``perm = ScatterElements(idx, dest, idx)`` holds at
  new position i' the original index of the token moved there.
- ``inputs_embeds``: ``Gather(Flatten(x, 2), perm + b * S, axis=0)`` (one row-gather over [B*S, D]);
  ``attention_mask`` / ``position_ids``: ``GatherElements`` along the sequence axis.
- The causal comparison of the shared additive mask: its query / key index tensors (``Range``
  through ``Unsqueeze``s to [1,1,S,1] / [1,1,1,S]) are replaced by ``perm`` unsqueezed to
  [B,1,S,1] / [B,1,1,S]; the padding part, And and Expand broadcast to [B,1,S,S] as before.
- Each graph output [B, S, ...] is renamed ``<name>_aifs_permuted`` at its producer and the original
  name is re-created by ``Gather(Flatten(y, 2), dest + b * S, axis=0)``; when the output is written
  by a linear (the vocab head), its input is gathered instead (row-wise op: same result, and
  hidden-size rows move instead of vocabulary-size ones; the tensor is listed in the metadata as
  being in the original order).

The mask is found structurally: every Softmax's additive input is followed back (through Slice /
Cast / Expand / Identity) to one shared ``Where(cond, 0, very negative)``; the cone of ``cond``
must hold exactly one index comparison whose inputs are ``Range(0, S, 1)`` chains of ``Unsqueeze``
(node names are reported, not relied on). When the graph has no visual span inputs, or the pattern
is not there, the pass does not apply (``structure-not-found``) and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.graph.graph_builder import NodeBuilder
from edgeq.modality_mask import span_input_names, visual_block_mask
from edgeq.passmanager.passbase import Exactness, Pass, PassConfig, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.structure import BreadthFirst

# value "span=START,LEN;visual_count=TENSOR;original_order=T1,T2": MSQ reads the count, and knows
# that the listed tensors (inputs of output linears, un-permuted early) are in the original order
AIFS_KEY = facts.AIFS.key  # the model metadata key aifs leaves (tests read it)
COMPARISONS = ("LessOrEqual", "GreaterOrEqual", "Less", "Greater")
# ops the additive mask may pass through between the shared Where and a layer's Softmax Add
_MASK_PASSTHROUGH = ("Slice", "Cast", "Expand", "Identity", "Reshape")
# ops allowed in the cone of the Where condition (walked back to find the causal comparison)
_COND_OPS = ("And", "Or", "Not", "Cast", "Expand", "Reshape", "Identity", "Unsqueeze", "Squeeze")
PERMUTED_EMBEDS = "inputs_embeds_aifs"  # the reordered embeddings (visual block first)


@dataclass(frozen=True)
class AifsConfig(PassConfig):
    embeds_input: str = "inputs_embeds"
    mask_input: str = "attention_mask"
    position_input: str = "position_ids"


class AifsPass(Pass, name="aifs", exactness=Exactness.FLOAT_EQUIV, config=AifsConfig, establishes=facts.AIFS,
               summary="reorder tokens visual-first (padding counted as visual) with an order-invariant causal mask"):
    config: AifsConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: AifsConfig = self.config
        found = _match(graph, cfg)
        if isinstance(found, str):
            raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, found)
        summary = _rewrite(graph, found)
        facts.AIFS.set(graph, span=f"{found['start'].name},{found['length'].name}", visual_count=summary["visual_count"],
                       original_order=",".join(summary["original_order_tensors"]))
        return PassResult(True, summary)


# ---------------------------------------------------------------------------------------------
# Matching
# ---------------------------------------------------------------------------------------------


def _match(graph: gs.Graph, cfg: AifsConfig) -> dict | str:
    """The tensors and nodes the rewrite needs, or a reason why the pass does not apply."""
    if graph.opset < 13:
        return f"opset {graph.opset} < 13 (Unsqueeze/ReduceSum with axes inputs)"
    inputs = {t.name: t for t in graph.inputs}
    span_names = span_input_names(ir.graph_metadata(graph))
    if len(span_names) != 2 or not all(n in inputs for n in span_names):
        return f"no visual span inputs {'/'.join(span_names)}"
    for name in (cfg.embeds_input, cfg.mask_input, cfg.position_input):
        if name not in inputs:
            return f"no graph input '{name}'"
    embeds, mask, pos = inputs[cfg.embeds_input], inputs[cfg.mask_input], inputs[cfg.position_input]
    if embeds.shape is None or len(embeds.shape) != 3:
        return f"'{embeds.name}' is not [batch, seq, hidden]"
    if mask.shape is None or len(mask.shape) != 2:
        return f"'{mask.name}' is not [batch, seq]"
    if pos.shape is None or len(pos.shape) not in (2, 3):
        return f"'{pos.name}' is neither [batch, seq] nor [rows, batch, seq]"
    seq_dims = tuple(embeds.shape[:2])
    outputs = []
    for out in graph.outputs:
        if out.shape is None or len(out.shape) != 3 or tuple(out.shape[:2]) != seq_dims:
            return f"output '{out.name}' is not [batch, seq, n] with the embeddings' batch/seq dims"
        outputs.append(out)

    index = ir.GraphIndex(graph)
    softmaxes = [n for n in graph.nodes if n.op == "Softmax"]
    if not softmaxes:
        return "no Softmax"
    wheres: dict[str, gs.Node] = {}
    for sm in softmaxes:
        add = index.producer(sm.inputs[0].name)
        if add is None or add.op != "Add":
            return f"Softmax {sm.name} does not read an Add of scores and mask"
        hits = [w for w in (_mask_where(index, t) for t in add.inputs) if w is not None]
        if len(hits) != 1:
            return f"Softmax {sm.name}: no additive Where(cond, 0, -large) mask found"
        wheres[hits[0].name] = hits[0]
    if len(wheres) != 1:
        return f"{len(wheres)} different additive masks (expected one shared by every layer)"
    where = next(iter(wheres.values()))

    comparisons = _cone_comparisons(index, where.inputs[0])
    if len(comparisons) != 1:
        return f"{len(comparisons)} index comparisons in the mask condition (expected the causal one)"
    cmp = comparisons[0]
    roles = {}
    for slot, t in enumerate(cmp.inputs):
        axis = _range_axis(index, t)
        if axis not in (2, 3):
            return f"{cmp.name} input {slot} is not Range(0, S, 1) unsqueezed to rank 4"
        roles[slot] = "query" if axis == 2 else "key"
    if sorted(roles.values()) != ["key", "query"]:
        return f"{cmp.name} does not compare a query index with a key index"
    if mask.name not in _cone_inputs(index, where.inputs[0]):
        return f"the mask condition does not read '{mask.name}'"
    return {"embeds": embeds, "mask": mask, "pos": pos, "start": inputs[span_names[0]],
            "length": inputs[span_names[1]], "outputs": outputs, "where": where, "cmp": cmp,
            "roles": roles, "softmaxes": len(softmaxes), "index": index}


def _mask_where(index: ir.GraphIndex, tensor: gs.Tensor) -> gs.Node | None:
    """The ``Where(cond, 0, very negative)`` that ``tensor`` is a pass-through of, if any."""
    for _ in range(8):
        node = index.producer(tensor.name)
        if node is None:
            return None
        if node.op == "Where":
            hi, lo = index.constant_value(node.inputs[1]), index.constant_value(node.inputs[2])
            if hi is not None and lo is not None and hi.size == 1 and lo.size == 1 \
                    and float(hi.reshape(-1)[0]) == 0.0 and float(lo.reshape(-1)[0]) < -1e30:
                return node
            return None
        if node.op not in _MASK_PASSTHROUGH:
            return None
        tensor = node.inputs[0]
    return None


def _cone_comparisons(index: ir.GraphIndex, cond: gs.Tensor) -> list[gs.Node]:
    found, seen, stack = [], set(), [cond]
    while stack:
        t = stack.pop()
        node = index.producer(t.name)
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op in COMPARISONS:
            if all(_range_axis(index, x) is not None for x in node.inputs):
                found.append(node)
            continue
        if node.op in _COND_OPS:
            stack.extend(node.inputs[:1] if node.op in ("Expand", "Reshape", "Unsqueeze", "Squeeze") else node.inputs)
    return found


def _cone_inputs(index: ir.GraphIndex, tensor: gs.Tensor, limit: int = 400) -> set[str]:
    """Names of the graph inputs and constants ``tensor`` is computed from (``limit`` tensors at most)."""
    names, walk = set(), BreadthFirst(tensor, limit=limit)
    for t in walk:
        node = index.producer(t.name)
        if node is None:
            names.add(t.name)
        else:
            walk.push(node.inputs)
    return names


def _range_axis(index: ir.GraphIndex, tensor: gs.Tensor) -> int | None:
    """Where ``Range(0, S, 1)`` lands in ``tensor`` if it is that range through rank-raising
    ``Unsqueeze``s to rank 4 (2: a query index [1,1,S,1], 3: a key index [1,1,1,S]), else None."""
    chain = []
    node = index.producer(tensor.name)
    while node is not None and node.op == "Unsqueeze":
        chain.append(node)
        node = index.producer(node.inputs[0].name)
    if node is None or node.op != "Range":
        return None
    start, delta = index.constant_value(node.inputs[0]), index.constant_value(node.inputs[2])
    if start is None or delta is None or start.size != 1 or delta.size != 1 \
            or int(start.reshape(-1)[0]) != 0 or int(delta.reshape(-1)[0]) != 1:
        return None
    rank, pos = 1, 0
    for unsq in reversed(chain):
        axes = index.constant_value(unsq.inputs[1]) if len(unsq.inputs) > 1 else np.asarray(unsq.attrs.get("axes", []))
        if axes is None:
            return None
        new_rank = rank + axes.size
        positions = sorted(int(a) % new_rank for a in axes.reshape(-1))
        kept = [d for d in range(new_rank) if d not in positions]
        pos, rank = kept[pos], new_rank
    return pos if rank == 4 else None


# ---------------------------------------------------------------------------------------------
# Rewrite
# ---------------------------------------------------------------------------------------------


def _rewrite(graph: gs.Graph, m: dict) -> dict:
    index: ir.GraphIndex = m["index"]
    embeds, mask, pos = m["embeds"], m["mask"], m["pos"]
    # consumers of the original inputs, taken before the new nodes read them
    readers = {t.name: list(index.consumers(t.name)) for t in (embeds, mask, pos)}
    b = NodeBuilder(graph, index, "aifs")
    i64 = np.int64

    block = visual_block_mask(b, embeds, mask, m["start"], m["length"])
    batch, seq, row, first = block["batch"], block["seq"], block["row"], block["first"]
    first64 = b.op("Cast", "FirstInt64", [first], i64, {"to": 7})
    text64 = b.op("Cast", "TextInt64", [b.op("Not", "IsText", [first], np.bool_)], i64, {"to": 7})
    n_first = b.op("ReduceSum", "FirstLen", [first64, b.const("axes_1d", np.array([1], i64))], i64, {"keepdims": 1})
    axis1 = b.const("cumsum_axis", np.int64(1))
    one = b.const("one_i64", np.int64(1))
    dest_first = b.op("Sub", "DestFirst", [b.op("CumSum", "CumFirst", [first64, axis1], i64), one], i64)
    dest_text = b.op("Sub", "DestText", [b.op("Add", "CumTextShift", [b.op("CumSum", "CumText", [text64, axis1], i64), n_first], i64), one], i64)
    dest = b.op("Where", "InversePerm", [first, dest_first, dest_text], i64)  # [B, S]: new position of token i
    mshape = b.op("Shape", "MaskShape", [mask], i64)
    row_bs = b.op("Expand", "RowIndexBS", [row, mshape], i64)
    perm = b.op("ScatterElements", "Perm", [row_bs, dest, row_bs], i64, {"axis": 1})  # [B, S]: original index at i'

    # flat row offsets b * S for gathers over [B*S, ...]
    bidx = b.op("Range", "BatchRange", [b.const("brange_start", np.int64(0)), batch, b.const("brange_step", np.int64(1))], i64)
    offset = b.op("Mul", "RowOffset", [b.op("Unsqueeze", "BatchCol", [bidx, b.const("axes_1e", np.array([1], i64))], i64), seq], i64)
    flat_perm = b.op("Add", "FlatPerm", [perm, offset], i64)
    flat_dest = b.op("Add", "FlatInversePerm", [dest, offset], i64)

    new_embeds = b.op("Gather", "GatherEmbeds", [b.op("Flatten", "FlattenEmbeds", [embeds], embeds.dtype, {"axis": 2}), flat_perm],
                      embeds.dtype, {"axis": 0}, out_name=ir.unique_name(index, PERMUTED_EMBEDS))
    new_mask = b.op("GatherElements", "GatherMask", [mask, perm], mask.dtype, {"axis": 1})
    if len(pos.shape) == 2:
        new_pos = b.op("GatherElements", "GatherPositions", [pos, perm], pos.dtype, {"axis": 1})
    else:  # [rows, B, S] (M-RoPE): every row alike
        perm3 = b.op("Expand", "PermRows", [b.op("Unsqueeze", "PermRow", [perm, b.const("axes_0b", np.array([0], i64))], i64),
                                            b.op("Shape", "PositionShape", [pos], i64)], i64)
        new_pos = b.op("GatherElements", "GatherPositions", [pos, perm3], pos.dtype, {"axis": 2})
    for old, new in ((embeds, new_embeds), (mask, new_mask), (pos, new_pos)):
        for node in readers[old.name]:
            for slot, t in enumerate(node.inputs):
                if t is old:
                    node.inputs[slot] = new

    # the causal comparison reads the permuted original indices instead of arange(S)
    cmp = m["cmp"]
    q_idx = b.op("Unsqueeze", "QueryOrigIndex", [perm, b.const("axes_13", np.array([1, 3], i64))], i64)  # [B,1,S,1]
    k_idx = b.op("Unsqueeze", "KeyOrigIndex", [perm, b.const("axes_12", np.array([1, 2], i64))], i64)  # [B,1,1,S]
    replaced = {}
    for slot, role in m["roles"].items():
        replaced[role] = cmp.inputs[slot].name
        cmp.inputs[slot] = q_idx if role == "query" else k_idx

    # un-permute the outputs under their original names; an output written by a linear (the vocab
    # head: [B, S, 49152] logits) is un-permuted at the linear's narrow input instead, which is the
    # same since a linear is row-wise, and gathers hidden-size rows instead of vocabulary-size ones
    outputs, original_order = [], []
    for out in m["outputs"]:
        producer = cast(gs.Node, index.producer(out.name))  # (an output no node writes fails below, as before)
        head_input = _linear_input_of(index, producer)
        if head_input is not None:
            flat = b.op("Flatten", f"Flatten_{head_input.name}", [head_input], head_input.dtype, {"axis": 2})
            restored = b.op("Gather", f"Unpermute_{head_input.name}", [flat, flat_dest], head_input.dtype, {"axis": 0})
            producer.inputs[0] = restored
            original_order.append(restored.name)
        else:
            inner = gs.Variable(ir.unique_name(index, f"{out.name}_aifs_permuted"), dtype=out.dtype)
            producer.outputs[producer.outputs.index(out)] = inner
            flat = b.op("Flatten", f"Flatten_{out.name}", [inner], out.dtype, {"axis": 2})
            b.add(gs.Node("Gather", f"/aifs/Unpermute_{out.name}", attrs={"axis": 0}, inputs=[flat, flat_dest], outputs=[out]))
        outputs.append(out.name)

    return {
        "span_inputs": [m["start"].name, m["length"].name],
        "reordered_inputs": {embeds.name: new_embeds.name, mask.name: new_mask.name, pos.name: new_pos.name},
        "position_rows": 1 if len(pos.shape) == 2 else int(pos.shape[0]) if isinstance(pos.shape[0], int) else "dynamic",
        "mask": {"where": m["where"].name, "comparison": cmp.name, "query_index_was": replaced["query"],
                 "key_index_was": replaced["key"], "query_index": q_idx.name, "key_index": k_idx.name},
        "softmax_layers": m["softmaxes"],
        "unpermuted_outputs": outputs,
        "original_order_tensors": original_order,  # un-permuted inside the graph (inputs of output linears)
        "permutation": perm.name,
        "visual_count": n_first.name,  # [B, 1]: rows [0, n) of every batch row are the visual block
        "inverse_permutation": dest.name,
        "nodes_added": len(b.nodes),
    }


def _linear_input_of(index: ir.GraphIndex, node: gs.Node | None) -> gs.Tensor | None:
    """The activation input of ``node`` when it is a MatMul by a 2-D constant whose activation
    nobody else reads (then un-permuting that input is the same as un-permuting the output)."""
    if node is None or node.op != "MatMul" or len(node.inputs) != 2:
        return None
    weight = index.constant_value(node.inputs[1])
    if weight is None or np.ndim(weight) != 2:
        return None
    x = node.inputs[0]
    if x.shape is not None and len(x.shape) != 3:
        return None
    return x if len(index.consumers(x.name)) == 1 else None
