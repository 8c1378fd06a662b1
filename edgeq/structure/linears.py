"""Linear layers (MatMul / Gemm with a constant weight) and token embeddings.

A linear is recognised by its weight operand, never by a name: B must resolve to a 2-D float
constant through Identity, a 2-D Transpose (the weight is then stored [N, K]) or, for already
quantized graphs, a DequantizeLinear of an integer constant. Roles and blocks are filled in later
by ``blocks.assign_roles``; this module only finds the raw facts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.structure._graph import Walker

# Roles a linear can get. Structure decides them; a node-name hint is only the fallback.
ATTENTION_ROLES = ("q_proj", "k_proj", "v_proj", "qkv", "qk_proj", "kv_proj", "o_proj")
MLP_ROLES = ("gate_proj", "up_proj", "gate_up_proj", "down_proj", "fc1", "fc2")
# every role (``blocks.assign_roles``; "linear": none found): what recipes may name in skip_roles
ROLES = ATTENTION_ROLES + MLP_ROLES + ("lm_head", "classifier", "linear")


@dataclass(frozen=True)
class Linear:
    """One MatMul/Gemm whose weight is a constant.

    ``weight`` names the constant that holds the values (after following Identity / Transpose /
    DequantizeLinear), ``weight_input`` the tensor the node actually reads as B. The effective
    math is ``output = input @ W (+ bias)`` with ``W`` of shape [k, n]; ``weight_transposed``
    means the stored constant is [n, k] (behind a Transpose, or Gemm ``transB=1``, the two
    cancelling when both are present). A pass that rewrites a Gemm weight in stored layout must
    therefore set ``transB = int(weight_transposed)``.

    ``quantized``: the weight already comes from DequantizeLinear (``weight`` is then the integer
    constant); ``find_linears`` leaves these out unless asked, so the QDQ pass never sees them.
    ``tied_embedding`` names the embedding Gather reading the same table (``tied_copy`` when the
    head has its own, value-equal initializer instead of sharing one).
    """

    node: str
    op: str
    input: str
    weight: str
    weight_transposed: bool
    bias: str | None
    k: int
    n: int
    role: str = "linear"
    block: str | None = None
    layer: int | None = None
    output: str = ""
    weight_input: str = ""
    bias_add: str | None = None
    quantized: bool = False
    tied_embedding: str | None = None
    tied_copy: bool = False
    role_source: str = "default"  # 'structure' | 'name' | 'default'


@dataclass(frozen=True)
class Embedding:
    """A Gather from a constant 2-D float table with computed indices (token/position lookup)."""

    node: str
    table: str
    rows: int
    dim: int


def _is_float(dtype: np.dtype | None) -> bool:
    return dtype is not None and (dtype.kind == "f" or "float" in str(dtype))


def _swap_2d(node: gs.Node) -> bool | None:
    """True for a 2-D transpose, False for the identity permutation, None for anything else."""
    perm = node.attrs.get("perm")
    if perm is None or list(perm) == [1, 0]:
        return True
    return False if list(perm) == [0, 1] else None


def resolve_weight(w: Walker, tensor: gs.Tensor) -> tuple[gs.Tensor, bool, bool] | None:
    """Follow a B operand to its constant: ``(constant tensor, transposed, quantized)``."""
    transposed = quantized = False
    for _ in range(8):
        src = w.const_source(tensor)
        if src is not None:
            return src, transposed, quantized
        node = w.producer(tensor.name)
        if node is None or not node.inputs:
            return None
        if node.op == "Transpose":
            swap = _swap_2d(node)
            if swap is None:
                return None
            transposed ^= swap
        elif node.op == "DequantizeLinear" and not quantized:
            quantized = True
        elif node.op != "Identity":
            return None
        tensor = node.inputs[0]
    return None


def _raw_linear(w: Walker, node: gs.Node) -> Linear | None:
    if node.op not in ("MatMul", "Gemm") or len(node.inputs) < 2 or not node.outputs:
        return None
    if node.op == "Gemm" and node.attrs.get("transA", 0):
        return None
    act, b = node.inputs[0], node.inputs[1]
    if w.is_const(act):
        return None
    found = resolve_weight(w, b)
    if found is None:
        return None
    src, transposed, quantized = found
    shape = w.const_shape(src)
    if shape is None or len(shape) != 2:
        return None
    if not quantized and not _is_float(w.const_dtype(src)):
        return None
    if node.op == "Gemm" and node.attrs.get("transB", 0):
        transposed = not transposed
    k, n = (shape[1], shape[0]) if transposed else shape
    lin = Linear(node=node.name, op=node.op, input=act.name, weight=src.name,
                 weight_transposed=transposed, bias=None, k=int(k), n=int(n),
                 output=node.outputs[0].name, weight_input=b.name, quantized=quantized)
    return _with_bias(w, node, lin)


def _bias_size_ok(w: Walker, tensor: gs.Tensor, n: int) -> bool:
    shape = w.const_shape(tensor)
    return shape is not None and len(shape) >= 1 and shape[-1] == n and int(np.prod(shape)) == n


def _with_bias(w: Walker, node: gs.Node, lin: Linear) -> Linear:
    """Attach Gemm's C, or an Add of a [N] constant that is the output's only reader."""
    if node.op == "Gemm" and len(node.inputs) > 2 and node.inputs[2].name:
        c = node.inputs[2]
        return dataclasses.replace(lin, bias=c.name) if w.is_const(c) else lin
    out = node.outputs[0]
    add = w.sole_consumer(out)
    if add is None or add.op != "Add" or len(add.inputs) != 2:
        return lin
    other = add.inputs[1] if add.inputs[0].name == out.name else add.inputs[0]
    if other.name == out.name or not w.is_const(other) or not _bias_size_ok(w, other, lin.n):
        return lin
    return dataclasses.replace(lin, bias=other.name, bias_add=add.name, output=add.outputs[0].name)


def raw_linears(w: Walker) -> list[Linear]:
    """Every linear in graph order, roles not yet assigned."""
    found = (_raw_linear(w, node) for node in w.graph.nodes)
    return [lin for lin in found if lin is not None]


def find_embeddings(w: Walker) -> list[Embedding]:
    """Gathers from constant 2-D float tables with non-constant indices, along axis 0."""
    found = []
    for node in w.graph.nodes:
        if node.op != "Gather" or len(node.inputs) < 2 or node.attrs.get("axis", 0) != 0:
            continue
        table, idx = node.inputs[0], node.inputs[1]
        src = w.const_source(table)
        if src is None or w.is_const(idx) or not _is_float(w.const_dtype(src)):
            continue
        shape = w.stand_in_shape(src.name) or w.const_shape(src)
        if shape is not None and len(shape) == 2:
            found.append(Embedding(node.name, src.name, int(shape[0]), int(shape[1])))
    return found


def tie(w: Walker, lin: Linear, embeddings: list[Embedding], check_values: bool) -> Linear:
    """Mark ``lin`` tied to an embedding: the same table, or (``check_values``) an equal copy.

    The copy check compares shapes first and only then values (``allclose`` at 1e-4), so it
    costs one pass over the head weight and only for the few linears that feed graph outputs.
    """
    for emb in embeddings:
        if lin.weight == emb.table:
            return dataclasses.replace(lin, tied_embedding=emb.node, tied_copy=False)
    if not check_values or lin.quantized:
        return lin
    for emb in embeddings:
        if (emb.rows, emb.dim) != (lin.n, lin.k):
            continue
        # a linear's weight and an embedding's table are constants
        weight = cast(np.ndarray, w.value(w.index.tensors[lin.weight]))
        table = cast(np.ndarray, w.value(w.index.tensors[emb.table]))
        stored_nk = weight if lin.weight_transposed else weight.T
        if _values_equal(stored_nk, table):
            return dataclasses.replace(lin, tied_embedding=emb.node, tied_copy=True)
    return lin


def _values_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    probe = (slice(0, 4),)
    if not np.allclose(a[probe], b[probe], rtol=1e-4, atol=1e-4):
        return False
    return bool(np.allclose(a, b, rtol=1e-4, atol=1e-4))
