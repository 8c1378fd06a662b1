"""The per-head tensors of an attention block: post-RoPE queries and keys, and the values, in the
head-major layout ``[batch, heads, seq, head_dim]`` a KV cache stores.

Why: ResQ projects keys (``U_C``, online, on queries and keys after RoPE) and values (``U_B``,
folded into v_proj / o_proj), and quantizes K and V where a cache would hold them. Those tensors
have no linear of their own, so they are found by walking back from the score MatMul (``q @ k^T``)
and the probability MatMul (``p @ v``) that structure analysis already located:

- queries: back from the score MatMul's A input through scalar scalings to the RoPE output (an
  Add, or with partial RoPE the Concat of the rotated part and the rest along head_dim) or,
  without RoPE, to the head-split Transpose;
- keys: the same from its B input, also through the ``k^T`` Transpose and GQA's repeat_kv
  (Unsqueeze, Expand, Reshape), so the tensor is the one before the head repetition;
- values: back from the probability MatMul's B input through repeat_kv to the head-split
  Transpose (perm [0, 2, 1, 3]).

Head counts and head_dim come from the projections: ``head_dim`` from the value reshape's
constant last dimension, heads = q_proj outputs / head_dim, KV heads = v_proj outputs / head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.structure import analyze

_SCALE_OPS = ("Mul", "Div")
_REPEAT_OPS = ("Unsqueeze", "Expand", "Reshape")
_HEAD_SPLIT = [0, 2, 1, 3]


class AttentionNotFound(Exception):
    """An attention block whose head tensors do not follow the recognised patterns."""


@dataclass(frozen=True)
class AttentionTensors:
    layer: int
    q: str  # post-RoPE queries [B, H, S, D]
    k: str  # post-RoPE keys before head repetition [B, KVH, S, D]
    v: str  # values [B, KVH, S, D]
    q_proj: str
    k_proj: str
    v_proj: str
    o_proj: str
    heads: int
    kv_heads: int
    head_dim: int


def _scalar_operand(index: ir.GraphIndex, node: gs.Node) -> int | None:
    """Which input of a Mul/Div is the data when the other is a scalar constant, else None."""
    for i, t in enumerate(node.inputs[:2]):
        value = index.constant_value(t)
        if value is not None and np.size(value) == 1:
            return 1 - i
    return None


def _walk_back(index: ir.GraphIndex, tensor: gs.Tensor, through_repeat: bool, through_kt: bool) -> gs.Tensor:
    """Follow ``tensor`` upstream through scalar scalings (and, when asked, repeat_kv ops and a
    [0, 1, 3, 2] transpose) to the RoPE Add or head-split Transpose that produced it."""
    for _ in range(16):
        node = index.producer(tensor.name)
        if node is None:
            raise AttentionNotFound(f"{tensor.name} has no producer")
        if node.op == "Add":
            return tensor
        if node.op == "Concat" and int(node.attrs.get("axis", 0)) in (-1, 3) and any(
                (p := index.producer(t.name)) is not None and p.op == "Add" for t in node.inputs):
            return tensor  # partial RoPE (Phi-2): the rotated part (an Add) and the rest, joined on head_dim
        if node.op == "Transpose":
            perm = list(node.attrs.get("perm", []))
            if perm == _HEAD_SPLIT:
                return tensor
            if through_kt and perm == [0, 1, 3, 2]:
                tensor = node.inputs[0]
                continue
            raise AttentionNotFound(f"unexpected Transpose {node.name} perm {perm}")
        if node.op in _SCALE_OPS and _scalar_operand(index, node) is not None:
            tensor = node.inputs[_scalar_operand(index, node)]
            continue
        if through_repeat and node.op in _REPEAT_OPS:
            tensor = node.inputs[0]
            continue
        raise AttentionNotFound(f"{node.op} {node.name} between the projection and the attention MatMul")
    raise AttentionNotFound(f"no RoPE/head-split found above {tensor.name}")


def _head_dim(index: ir.GraphIndex, v_proj_out: str) -> int:
    """The constant last entry of the shape the v projection is reshaped to."""
    for node in index.consumers(v_proj_out):
        if node.op != "Reshape":
            continue
        shape = index.constant_value(node.inputs[1])
        if shape is not None:
            return int(np.asarray(shape).reshape(-1)[-1])
        concat = index.producer(node.inputs[1].name)
        if concat is not None and concat.op == "Concat":
            last = index.constant_value(concat.inputs[-1])
            if last is not None:
                return int(np.asarray(last).reshape(-1)[-1])
    raise AttentionNotFound(f"no head reshape with a constant head_dim after {v_proj_out}")


def find_attention_tensors(graph: gs.Graph) -> list[AttentionTensors]:
    """Every attention block's q/k/v head tensors, by layer; raises ``AttentionNotFound``."""
    s = analyze(graph)
    index = ir.GraphIndex(graph)
    nodes = {n.name: n for n in graph.nodes}
    by_node = {lin.node: lin for lin in s.linears}
    out = []
    for block in s.attention_blocks:
        roles = dict(zip(block.roles, block.linears))
        if not all(r in roles for r in ("q_proj", "k_proj", "v_proj", "o_proj")) or not block.qk_matmul or not block.pv_matmul:
            raise AttentionNotFound(f"attention block {block.name} has no separate q/k/v/o projections")
        qk, pv = nodes[block.qk_matmul], nodes[block.pv_matmul]
        q = _walk_back(index, qk.inputs[0], through_repeat=False, through_kt=False)
        k = _walk_back(index, qk.inputs[1], through_repeat=True, through_kt=True)
        v = _walk_back(index, pv.inputs[1], through_repeat=True, through_kt=False)
        v_lin = by_node[roles["v_proj"]]
        d = _head_dim(index, nodes[v_lin.node].outputs[0].name if v_lin.bias_add is None else nodes[v_lin.bias_add].outputs[0].name)
        q_lin = by_node[roles["q_proj"]]
        if q_lin.n % d or v_lin.n % d:
            raise AttentionNotFound(f"head_dim {d} does not divide the projections of {block.name}")
        out.append(AttentionTensors(block.layer, q.name, k.name, v.name, roles["q_proj"], roles["k_proj"],
                                    roles["v_proj"], roles["o_proj"], q_lin.n // d, v_lin.n // d, d))
    return out
