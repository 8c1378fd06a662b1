"""Attention and MLP blocks, linear roles, layers and residual adds, all from data flow.

- Attention: a Softmax whose input comes (through mask/scale arithmetic) from a MatMul of two
  activations (q.k) and whose output feeds, through Where/Cast/Dropout, the first input of
  another such MatMul (p.v). Walking upstream from q, k and v finds the projecting linears (one
  linear on all three sides is a fused ``qkv``); walking downstream from p.v through
  Transpose/Reshape finds ``o_proj``.
- MLP: a linear whose input is reached, through elementwise ops, from other linears with an
  activation (Sigmoid, Erf, Tanh, Relu, Gelu...) on at least one path. Linears behind the
  activation are ``gate_proj`` (gated) or ``fc1``; linears reached only without crossing it are
  ``up_proj``; the consumer is ``down_proj`` / ``fc2``.
- Layers: blocks in topological order; a new layer starts whenever a block kind repeats inside
  the current one (so attn, mlp, attn, mlp and parallel mlp+attn both pair up).
- Heads: a linear outside every block whose output becomes a graph output is ``lm_head`` when
  its N equals an embedding's vocabulary (or it is tied to one), else ``classifier``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import onnx_graphsurgeon as gs

from edgeq.structure._graph import PASS_THROUGH, BreadthFirst, Walker, data_inputs, reaches_graph_output, trace_back
from edgeq.structure.linears import Embedding, Linear, tie
from edgeq.structure.norms import Norm

# Between the q.k MatMul and Softmax: scale, mask, soft-capping.
_SCORE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Cast", "Identity", "Reshape", "Tanh",
                        "Softcap", "QuantizeLinear", "DequantizeLinear"})
# Between Softmax and the p.v MatMul: NaN guards, casts, dropout.
_PROB_OPS = frozenset({"Where", "Cast", "Identity", "Dropout", "Reshape", "QuantizeLinear", "DequantizeLinear"})
# From q / k / v back to their projections: head split, RoPE, GQA repeat, fused-qkv Split.
_PROJ_OPS = PASS_THROUGH | frozenset({"Transpose", "Expand", "Slice", "Tile", "Split", "Gather",
                                      "Concat", "Add", "Sub", "Mul", "Div", "Neg", "Where", "Pad"})
# From p.v forward to o_proj: head merge.
_MERGE_OPS = PASS_THROUGH | frozenset({"Transpose"})
_ACTIVATIONS = frozenset({"Sigmoid", "Tanh", "Erf", "Relu", "Gelu", "FastGelu", "BiasGelu", "QuickGelu",
                          "Silu", "Swish", "HardSigmoid", "HardSwish", "LeakyRelu", "Elu", "Selu",
                          "Softplus", "Mish"})
# Inside an MLP around the activation: gating Mul, bias Add, decomposed GELU arithmetic.
_MLP_OPS = PASS_THROUGH | frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Neg"})
# A fused gate_up projection is split into its gate and up halves (Phi-3: two Slices).
_SPLIT_OPS = frozenset({"Slice", "Split"})

_SIDE_ROLES = {
    frozenset("q"): "q_proj", frozenset("k"): "k_proj", frozenset("v"): "v_proj",
    frozenset("qkv"): "qkv", frozenset("qk"): "qk_proj", frozenset("kv"): "kv_proj",
}
# Fallback only, for linears that no structural pattern explains (checked in order).
_NAME_HINTS = (
    ("qkv", r"qkv|c_attn|query_key_value"), ("q_proj", r"q_proj|query"), ("k_proj", r"k_proj|key"),
    ("v_proj", r"v_proj|value"), ("o_proj", r"o_proj|out_proj"), ("gate_proj", r"gate_proj"),
    ("up_proj", r"up_proj"), ("down_proj", r"down_proj"), ("fc1", r"fc1|c_fc"), ("fc2", r"fc2"),
    ("lm_head", r"lm_head"),
)


@dataclass(frozen=True)
class Block:
    """An attention or MLP block. ``linears``/``roles`` are parallel tuples of node names and
    roles, input side first; ``input`` is the tensor the input linears read, ``output`` what the
    output linear writes (after its bias); ``norm`` is the norm producing ``input``, if any."""

    kind: str  # 'attention' | 'mlp'
    name: str  # 'layers.<layer>'
    layer: int
    linears: tuple[str, ...]
    roles: tuple[str, ...]
    norm: Norm | None
    input: str | None
    output: str | None
    softmax: str | None = None
    qk_matmul: str | None = None
    pv_matmul: str | None = None
    activation: str | None = None
    gated: bool = False


@dataclass(frozen=True)
class ResidualAdd:
    """An add of a block's output (``branch``) into the residual ``stream``. ``fused`` marks a
    Skip*LayerNormalization doing the add; its ``output`` is the optional sum output or None.

    ``post_norm``: the block output goes through this norm before the add (Gemma's sandwich
    post_attention_layernorm / post_feedforward_layernorm); ``branch`` is then the tensor the add
    reads (the norm's output). ``parallel``: the add reads the sum of two blocks' outputs (Phi-2's
    ``h + attn(LN(h)) + mlp(LN(h))``), computed by that Add node; the add then has one record per
    block, each with ``branch`` the block's output as the sum reads it. Which families have either:
    ``Family.sandwich_norms`` / ``Family.parallel_block`` in ``edgeq.families``."""

    node: str
    stream: str
    branch: str
    output: str | None
    block: str
    kind: str
    fused: bool = False
    post_norm: Norm | None = None
    parallel: str | None = None


@dataclass
class _Draft:
    """A block before it is placed in a layer. ``pattern`` holds the ``Block`` fields the match
    itself fixes (an attention's softmax / qk_matmul / pv_matmul, an MLP's activation / gated),
    keyed by Block's field names: they are declared once, on Block, and passed through as they are."""

    kind: str
    anchor: gs.Node
    roles: dict[str, str]  # linear node name -> role, input side first
    output_linear: str | None
    pattern: dict[str, Any] = field(default_factory=dict)


class _Lookup:
    """Linears by node name, by output tensor (raw and after bias) and by input tensor."""

    def __init__(self, linears: list[Linear], w: Walker):
        self.by_node = {lin.node: lin for lin in linears}
        self.by_output: dict[str, Linear] = {}
        self.by_input: dict[str, list[Linear]] = {}
        nodes = {n.name: n for n in w.graph.nodes if n.name in self.by_node}
        for lin in linears:
            self.by_output[lin.output] = lin
            self.by_output[nodes[lin.node].outputs[0].name] = lin
            self.by_input.setdefault(lin.input, []).append(lin)
        self.nodes = nodes


def _search_up(w: Walker, start: gs.Tensor, ops: frozenset[str], want) -> gs.Node | None:
    """Breadth-first upstream search through ``ops`` for the first node satisfying ``want``."""
    walk = BreadthFirst(start)
    for tensor in walk:
        node = w.producer(tensor.name)
        if node is None:
            continue
        if want(node):
            return node
        if node.op in ops:
            walk.push(data_inputs(w, node))
    return None


def _upstream_linears(w: Walker, start: gs.Tensor, look: _Lookup) -> list[Linear]:
    """Linears whose outputs reach ``start`` through data-movement and elementwise ops only."""
    found, walk = [], BreadthFirst(start)
    for tensor in walk:
        lin = look.by_output.get(tensor.name)
        if lin is not None:
            if lin not in found:
                found.append(lin)
            continue
        node = w.producer(tensor.name)
        if node is not None and node.op in _PROJ_OPS:
            walk.push(data_inputs(w, node))
    return found


def _downstream_linear(w: Walker, start: gs.Tensor, look: _Lookup) -> Linear | None:
    """The first linear reading ``start`` through Transpose/Reshape-like ops (the o_proj)."""
    walk = BreadthFirst(start)
    for tensor in walk:
        for lin in look.by_input.get(tensor.name, []):
            return lin
        for user in w.consumers(tensor.name):
            if user.op in _MERGE_OPS and user.inputs[0].name == tensor.name:
                walk.push(user.outputs[:1])
    return None


def _is_act_matmul(w: Walker, look: _Lookup, node: gs.Node) -> bool:
    return (node.op == "MatMul" and node.name not in look.by_node
            and not any(w.is_const(t) for t in node.inputs))


def _attention(w: Walker, softmax: gs.Node, look: _Lookup) -> _Draft | None:
    qk = _search_up(w, softmax.inputs[0], _SCORE_OPS, lambda n: _is_act_matmul(w, look, n))
    if qk is None:
        return None
    pv = _find_pv(w, softmax, look)
    if pv is None:
        return None
    sides: dict[str, set[str]] = {}
    order: list[str] = []
    for side, tensor in (("q", qk.inputs[0]), ("k", qk.inputs[1]), ("v", pv.inputs[1])):
        for lin in _upstream_linears(w, tensor, look):
            sides.setdefault(lin.node, set()).add(side)
            if lin.node not in order:
                order.append(lin.node)
    roles = {name: _SIDE_ROLES.get(frozenset(sides[name]), "qkv") for name in order}
    o = _downstream_linear(w, pv.outputs[0], look)
    output = None
    if o is not None and o.node not in roles:
        roles[o.node], output = "o_proj", o.node
    return _Draft("attention", softmax, roles, output, dict(softmax=softmax.name, qk_matmul=qk.name, pv_matmul=pv.name))


def _find_pv(w: Walker, softmax: gs.Node, look: _Lookup) -> gs.Node | None:
    walk = BreadthFirst(softmax.outputs[0], limit=32)
    for tensor in walk:
        for user in w.consumers(tensor.name):
            if _is_act_matmul(w, look, user) and user.inputs[0].name == tensor.name:
                return user
            if user.op in _PROB_OPS:
                walk.push(user.outputs[:1])
    return None


def _mlp_sources(w: Walker, down: Linear, look: _Lookup):
    """Upstream linears of ``down`` with, per linear, whether some path crossed an activation;
    the linears whose output is split (Slice/Split) into a half that crosses the activation and
    one that does not (a fused gate_up projection, Phi-3); and the activation's name."""
    crossed: dict[str, bool] = {}
    via: dict[tuple[str, bool], set[str | None]] = {}  # (linear, through) -> split outputs on the way
    acts: set[str] = set()
    # (tensor name, crossed an activation, the split output passed on the way)
    walk = BreadthFirst((down.input, False, None), key=lambda item: item)
    for name, through, split in walk:
        lin = look.by_output.get(name)
        if lin is not None:
            crossed[lin.node] = crossed.get(lin.node, False) or through
            via.setdefault((lin.node, through), set()).add(split)
            continue
        node = w.producer(name)
        if node is None:
            continue
        if node.op in _ACTIVATIONS:
            acts.add(_silu_or(w, node))
            walk.push((t.name, True, split) for t in data_inputs(w, node)[:1])
        elif node.op in _SPLIT_OPS:
            walk.push((t.name, through, name) for t in data_inputs(w, node))
        elif node.op in _MLP_OPS:
            if node.op == "Pow" or (node.op == "Mul" and node.inputs[0].name == node.inputs[1].name):
                acts.add("Pow")  # x^3 of the tanh GELU, as Pow or as Mul(x, x)
            walk.push((t.name, through, split) for t in data_inputs(w, node))
    fused = set()
    for lin_node, through in crossed.items():
        gate = via.get((lin_node, True), set()) - {None}
        up = via.get((lin_node, False), set()) - {None}
        if through and gate and up - gate:
            fused.add(lin_node)
    return crossed, fused, acts


def _silu_or(w: Walker, node: gs.Node) -> str:
    """'Silu' for a Sigmoid whose output multiplies its own input (x * sigmoid(x)), else the op."""
    if node.op != "Sigmoid":
        return node.op
    x = node.inputs[0].name
    for user in w.consumers(node.outputs[0].name):
        if user.op == "Mul" and any(t.name == x for t in user.inputs):
            return "Silu"
    return node.op


def _activation_name(acts: set[str]) -> str:
    table = ((("Gelu", "FastGelu", "BiasGelu", "Erf"), "gelu"), (("QuickGelu",), "quick_gelu"),
             (("Silu", "Swish"), "silu"), (("Relu",), "relu"), (("HardSwish",), "hard_swish"))
    for ops, name in table:
        if acts & set(ops):
            return name
    if "Tanh" in acts:
        return "gelu_tanh" if "Pow" in acts else "tanh"
    return sorted(acts - {"Pow"})[0].lower()


def _mlp(w: Walker, down: Linear, look: _Lookup) -> _Draft | None:
    crossed, fused, acts = _mlp_sources(w, down, look)
    if not any(crossed.values()):
        return None
    activated = [n for n, c in crossed.items() if c and n not in fused]
    plain = [n for n, c in crossed.items() if not c]
    gated = bool(plain) or bool(fused)
    roles = {n: "gate_up_proj" for n in crossed if n in fused}
    roles.update({n: ("gate_proj" if gated else "fc1") for n in activated})
    roles.update({n: "up_proj" for n in plain})
    roles[down.node] = "down_proj" if gated else "fc2"
    return _Draft("mlp", look.nodes[down.node], roles, down.node, dict(activation=_activation_name(acts), gated=gated))


def detect_drafts(w: Walker, linears: list[Linear]) -> list[_Draft]:
    """Attention drafts from every Softmax, then MLP drafts from linears no attention claimed."""
    look = _Lookup(linears, w)
    drafts = [d for d in (_attention(w, n, look) for n in w.graph.nodes if n.op == "Softmax") if d]
    used = {name for d in drafts for name in d.roles}
    for lin in linears:
        if lin.node in used:
            continue
        draft = _mlp(w, lin, look)
        if draft is not None and not used.intersection(draft.roles):
            drafts.append(draft)
            used.update(draft.roles)
    drafts.sort(key=lambda d: w.position(_first_node(d, look)))
    return drafts


def _first_node(draft: _Draft, look: _Lookup) -> gs.Node:
    inputs = [look.nodes[n] for n, role in draft.roles.items() if n != draft.output_linear]
    return inputs[0] if inputs else draft.anchor


def _layers(drafts: list[_Draft]) -> list[int]:
    """Layer number per draft: a new layer whenever a kind repeats within the current one."""
    layers: list[int] = []
    current = -1
    kinds: set[str] = set()
    for draft in drafts:
        if current < 0 or draft.kind in kinds:
            current, kinds = current + 1, set()
        kinds.add(draft.kind)
        layers.append(current)
    return layers


def build_blocks(w: Walker, drafts: list[_Draft], linears: list[Linear], norms: list[Norm]) -> list[Block]:
    by_node = {lin.node: lin for lin in linears}
    norm_by_output = {n.output: n for n in norms}
    blocks = []
    for draft, layer in zip(drafts, _layers(drafts)):
        names = tuple(draft.roles)
        inputs = [by_node[n] for n in names if n != draft.output_linear]
        block_input = inputs[0].input if inputs else None
        norm = None
        if block_input is not None:
            origin = trace_back(w, w.index.tensors[block_input])
            norm = norm_by_output.get(origin.name) or norm_by_output.get(block_input)
        out = by_node[draft.output_linear].output if draft.output_linear else None
        blocks.append(Block(
            kind=draft.kind, name=f"layers.{layer}", layer=layer, linears=names,
            roles=tuple(draft.roles[n] for n in names), norm=norm, input=block_input, output=out,
            **draft.pattern,
        ))
    return blocks


def assign_roles(w: Walker, linears: list[Linear], blocks: list[Block],
                 embeddings: list[Embedding]) -> list[Linear]:
    """Roles and blocks from structure; heads from graph outputs; names only as a last hint."""
    placed = {name: (role, b) for b in blocks for name, role in zip(b.linears, b.roles)}
    # the token table is the largest; in a block-wise block the stand-ins count at their real size (the
    # last block reads a stand-in embedding, which rotation renames, beside the real head: still lm_head)
    vocab = max([e.rows for e in embeddings] + [max(shape) for shape in w.stand_ins().values()], default=None)
    result = []
    for lin in linears:
        if lin.node in placed:
            role, b = placed[lin.node]
            lin = dataclasses.replace(lin, role=role, block=b.name, layer=b.layer, role_source="structure")
        elif reaches_graph_output(w, w.index.tensors[lin.output]):
            lin = tie(w, lin, embeddings, check_values=True)
            real = w.stand_in_shape(lin.weight)  # (a block-wise block's small stand-in head)
            n = lin.n if real is None else max(real)  # (a vocabulary table's largest dimension is the vocabulary)
            role = "lm_head" if lin.tied_embedding or n == vocab else "classifier"
            lin = dataclasses.replace(lin, role=role, role_source="structure")
        else:
            lin = _name_hint(tie(w, lin, embeddings, check_values=False))
        result.append(lin)
    return result


def _name_hint(lin: Linear) -> Linear:
    text = f"{lin.node} {lin.weight}".lower()
    for role, pattern in _NAME_HINTS:
        if re.search(pattern, text):
            return dataclasses.replace(lin, role=role, role_source="name")
    return lin


def find_residual_adds(w: Walker, blocks: list[Block], norms: list[Norm]) -> list[ResidualAdd]:
    """Adds of two activations where exactly one side is a block's output (traced back through
    Reshape/Cast-like ops), a block output after a post-sublayer norm, or the sum of two blocks'
    outputs (a parallel block); fused Skip norms count when one of their inputs is."""
    outputs = {b.output: b for b in blocks if b.output}
    norm_by_output = {n.output: n for n in norms}
    found = []
    for node in w.graph.nodes:
        if node.op == "Add" and len(node.inputs) == 2 and not any(w.is_const(t) for t in node.inputs):
            found += _residual(w, node.name, node.inputs, node.outputs[0].name, outputs, norm_by_output, False)
    for norm in norms:
        if norm.skip is not None:
            tensors = [w.index.tensors[norm.input], w.index.tensors[norm.skip]]
            node = next(n for n in w.consumers(norm.input) if n.name == norm.name)
            total = node.outputs[3].name if len(node.outputs) > 3 and node.outputs[3].name else None
            found += _residual(w, norm.name, tensors, total, outputs, {}, True)
    return found


def _branch(w: Walker, tensor: gs.Tensor, block_outputs: dict, norm_by_output: dict) -> list[tuple]:
    """What block output(s) ``tensor`` carries: ``[(block, branch tensor, post norm, parallel add)]``,
    empty when it is none of: a block output, a block output after a norm, a sum of two blocks."""
    origin = trace_back(w, tensor)
    block = block_outputs.get(origin.name)
    if block is not None:
        return [(block, tensor.name, None, None)]
    norm = norm_by_output.get(origin.name)
    if norm is not None and norm.skip is None:
        block = block_outputs.get(trace_back(w, w.index.tensors[norm.input]).name)
        return [(block, tensor.name, norm, None)] if block is not None else []
    node = w.producer(origin.name)
    if node is None or node.op != "Add" or len(node.inputs) != 2 or any(w.is_const(t) for t in node.inputs):
        return []
    hits = [block_outputs.get(trace_back(w, t).name) for t in node.inputs]
    if hits[0] is None or hits[1] is None or hits[0] is hits[1]:
        return []
    return [(b, t.name, None, node.name) for b, t in zip(hits, node.inputs)]


def _residual(w, name, tensors, output, block_outputs, norm_by_output, fused) -> list[ResidualAdd]:
    hits = [_branch(w, t, block_outputs, norm_by_output) for t in tensors]
    if sum(bool(h) for h in hits) != 1:
        return []
    i = 0 if hits[0] else 1
    return [ResidualAdd(node=name, stream=tensors[1 - i].name, branch=branch, output=output, block=block.name,
                        kind=block.kind, fused=fused, post_norm=norm, parallel=parallel)
            for block, branch, norm, parallel in hits[i]]
