"""The attention sites of a decoder graph with a KV cache, as ``kvquant`` rewrites them.

Why structural: optimum / torch exports of eager attention read the cache as
``present.{i}.key = Concat(past_key_values.{i}.key, k_new)``, repeat it for GQA (Unsqueeze,
Expand, Reshape), transpose it, and compute ``Softmax(MatMul(q, k^T) * scale + mask) @ v``. The
site is found from the cache outward, so node names are never relied on:

- the score MatMul: the first MatMul reached from ``present.{i}.key`` through repeat / transpose
  ops and scalar scalings, as its B input;
- the probability MatMul: the same from ``present.{i}.value``;
- between them: scalar Mul / Div (the softmax scale), an optional Add of the additive mask, the
  Softmax over the last axis, optional Cast / Identity and torch's ``Where(IsNaN(p), 0, p)`` guard
  (the op gives NaN, as a softmax does, only for rows masked entirely: padded queries, never a
  decode step).

``logit_scale`` is the product of every scalar factor on the key path and after the score MatMul:
``edgeq::VisualKVAttention`` divides by sqrt(head_dim) itself, so queries are multiplied by
``logit_scale * sqrt(head_dim)`` when that is not 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.errors import UserInputError

from edgeq.kv_cache import PAST_PREFIX, PRESENT_PREFIX
_REPEAT_OPS = ("Unsqueeze", "Expand", "Reshape", "Transpose", "Identity")
_PASS_THROUGH_PROBS = ("Cast", "Identity")


@dataclass
class KVSite:
    layer: int
    key: str  # present.{i}.key (text cache + the new token's key, [B, KVH, T, D])
    value: str
    q: gs.Tensor  # the score MatMul's A input (post-RoPE queries [B, H, S, D], any q-side scaling kept)
    mask: gs.Tensor | None  # the additive mask [.., S, T], or None
    out: gs.Tensor  # the probability MatMul's output (the attention output the op will write)
    pv: gs.Node
    logit_scale: float
    kv_heads: int
    head_dim: int


def _scalar(index: ir.GraphIndex, node: gs.Node, data: gs.Tensor) -> float | None:
    """The scalar factor a Mul (or the divisor of a Div) applies to ``data``, else None."""
    if node.op not in ("Mul", "Div") or len(node.inputs) != 2:
        return None
    other = node.inputs[1] if node.inputs[0] is data else node.inputs[0]
    value = index.constant_value(other)
    if value is None or np.size(value) != 1:
        return None
    v = float(np.asarray(value).reshape(-1)[0])
    if node.op == "Div":
        return 1.0 / v if node.inputs[0] is data and v != 0 else None
    return v


def _forward_to_matmul(index: ir.GraphIndex, tensor: gs.Tensor) -> tuple[gs.Node, float] | None:
    """The MatMul reading ``tensor`` as its B input through repeat / transpose ops and scalar
    scalings, with the product of those scalings."""
    stack = [(tensor, 1.0)]
    while stack:
        t, factor = stack.pop()
        for node in index.consumers(t.name):
            if node.op == "MatMul" and node.inputs[1] is t:
                return node, factor
            if node.op in _REPEAT_OPS and node.inputs[0] is t:
                stack.append((node.outputs[0], factor))
            elif (s := _scalar(index, node, t)) is not None:
                stack.append((node.outputs[0], factor * s))
    return None


def _single_consumer(index: ir.GraphIndex, t: gs.Tensor) -> gs.Node | None:
    consumers = index.consumers(t.name)
    return consumers[0] if len(consumers) == 1 else None


def _skip_nan_guard(index: ir.GraphIndex, probs: gs.Tensor) -> gs.Tensor:
    """``Where(IsNaN(p), 0, p)`` after the Softmax (torch's guard for fully masked rows): its output."""
    consumers = index.consumers(probs.name)
    ops = sorted(n.op for n in consumers)
    if ops != ["IsNaN", "Where"]:
        return probs
    where = next(n for n in consumers if n.op == "Where")
    isnan = next(n for n in consumers if n.op == "IsNaN")
    if where.inputs[0] is isnan.outputs[0] and where.inputs[2] is probs:
        return where.outputs[0]
    return probs


def _site(graph: gs.Graph, index: ir.GraphIndex, layer: int, tensors: dict) -> KVSite:
    key, value = tensors[f"{PRESENT_PREFIX}{layer}.key"], tensors[f"{PRESENT_PREFIX}{layer}.value"]
    where = f"layer {layer}"
    found = _forward_to_matmul(index, key)
    if found is None:
        raise UserInputError(f"kvquant: no score MatMul reads {key.name} ({where})")
    qk, scale = found
    node, t, mask = _single_consumer(index, qk.outputs[0]), qk.outputs[0], None
    while node is not None and (s := _scalar(index, node, t)) is not None:
        scale *= s
        t = node.outputs[0]
        node = _single_consumer(index, t)
    if node is not None and node.op == "Add":
        mask = node.inputs[1] if node.inputs[0] is t else node.inputs[0]
        t = node.outputs[0]
        node = _single_consumer(index, t)
    if node is None or node.op != "Softmax" or int(node.attrs.get("axis", -1)) not in (-1, 3):
        raise UserInputError(f"kvquant: the scores of {where} do not reach a last-axis Softmax "
                             f"through a scale and an additive mask (found {node.op if node else 'a fork'})")
    t = _skip_nan_guard(index, node.outputs[0])
    node = _single_consumer(index, t)
    while node is not None and node.op in _PASS_THROUGH_PROBS:
        t = node.outputs[0]
        node = _single_consumer(index, t)
    found_v = _forward_to_matmul(index, value)
    if node is None or node.op != "MatMul" or found_v is None or found_v[0] is not node or found_v[1] != 1.0:
        raise UserInputError(f"kvquant: the probabilities of {where} are not multiplied by {value.name}")
    past = tensors.get(f"{PAST_PREFIX}{layer}.key")
    shape = list(getattr(past, "shape", None) or [])
    if len(shape) != 4 or not all(isinstance(d, int) for d in (shape[1], shape[3])):
        raise UserInputError(f"kvquant: {PAST_PREFIX}{layer}.key needs a static [batch, kv_heads, past, head_dim] shape, got {shape}")
    return KVSite(layer, key.name, value.name, qk.inputs[0], mask, node.outputs[0], node, scale, shape[1], shape[3])


def find_kv_sites(graph: gs.Graph) -> list[KVSite]:
    """One site per layer with a ``present.{i}.key`` / ``.value`` output pair, by layer; raises
    ``UserInputError`` (one line) when the graph has no cache or a site does not match."""
    outputs = {t.name for t in graph.outputs}
    layers = sorted({int(m.group(1)) for name in outputs if (m := re.fullmatch(r"present\.(\d+)\.key", name))})
    if not layers or not any(t.name.startswith(PAST_PREFIX) for t in graph.inputs):
        raise UserInputError("kvquant needs a decoder graph with a KV cache (past_key_values.{i}.key/.value inputs, "
                             "present.{i}.* outputs): export it with --with-past")
    index = ir.GraphIndex(graph)
    tensors = graph.tensors()
    return [_site(graph, index, i, tensors) for i in layers]
