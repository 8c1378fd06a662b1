"""Normalisation layers, decomposed or fused.

Decomposed forms are matched from their ReduceMean anchor:

- RMSNorm (optimum's llama/qwen2 export): ``Pow(x, 2) | Mul(x, x) -> ReduceMean -> Add(eps) ->
  Sqrt -> (Div(1, .) | Reciprocal) -> Mul(x, .)`` or ``Div(x, Sqrt)``, then an optional Cast and
  ``Mul(gamma)``. ``x`` is the tensor the pattern squares; a Cast in front of it (optimum casts the
  residual stream to float32) is left outside the norm because the residual Add reads it too.
- LayerNorm: ``ReduceMean(x) -> Sub(x, mean) -> Pow(., 2) -> ReduceMean -> Add(eps) -> Sqrt ->
  Div(d, .)`` then optional ``Mul(gamma)`` and ``Add(beta)``.

Fused: ONNX ``LayerNormalization`` / ``RMSNormalization`` (opset 23) and com.microsoft
``SimplifiedLayerNormalization``, ``SkipLayerNormalization``, ``SkipSimplifiedLayerNormalization``
(the Skip forms also perform the residual add; ``skip`` names their second input).

Which kind each model family's export has: ``Family.norm`` in ``edgeq.families`` (Gemma's
``(1 + w)`` scale, ``Family.norm_scale_offset``, is one constant in the graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.structure._graph import Walker


@dataclass(frozen=True)
class Norm:
    """One normalisation. ``scale``/``bias`` name the tensors the norm reads (possibly an
    Identity's or Constant node's output: read them with ``GraphIndex.constant_value``);
    ``scale_node``/``bias_node`` are the nodes reading them, for passes that fold into gamma.
    ``nodes`` lists every node of the pattern, producer of ``output`` last."""

    kind: str  # 'rms' | 'layer'
    fused: bool
    input: str
    output: str
    scale: str | None
    bias: str | None
    eps: float | None
    nodes: tuple[str, ...]
    axis: int | tuple[int, ...] | None
    op: str = "decomposed"
    skip: str | None = None
    scale_node: str | None = None
    bias_node: str | None = None

    @property
    def name(self) -> str:
        return self.nodes[-1]


_FUSED = {
    # op -> (kind, has skip input, index of scale, index of bias or None, default epsilon)
    "LayerNormalization": ("layer", False, 1, 2, 1e-5),
    "RMSNormalization": ("rms", False, 1, None, 1e-5),
    "SimplifiedLayerNormalization": ("rms", False, 1, None, None),
    "SkipLayerNormalization": ("layer", True, 2, 3, None),
    "SkipSimplifiedLayerNormalization": ("rms", True, 2, None, None),
}


def find_norms(w: Walker) -> list[Norm]:
    """Every norm in graph order; each ReduceMean anchors at most one decomposed match."""
    norms: list[Norm] = []
    claimed: set[str] = set()
    for node in w.graph.nodes:
        if node.op in _FUSED:
            norms.append(_fused(w, node))
        elif node.op == "ReduceMean" and node.name not in claimed:
            norm = _match_layer(w, node) or _match_rms(w, node)
            if norm is not None:
                claimed.update(norm.nodes)
                norms.append(norm)
    return norms


def _input(node: gs.Node, i: int) -> gs.Tensor | None:
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i].name else None


def _fused(w: Walker, node: gs.Node) -> Norm:
    kind, has_skip, scale_i, bias_i, default_eps = _FUSED[node.op]
    scale = _input(node, scale_i)
    bias = _input(node, bias_i) if bias_i is not None else None
    eps = node.attrs.get("epsilon", default_eps)
    return Norm(
        kind=kind, fused=True, input=node.inputs[0].name, output=node.outputs[0].name,
        scale=scale.name if scale is not None else None, bias=bias.name if bias is not None else None,
        eps=float(eps) if eps is not None else None, nodes=(node.name,), axis=int(node.attrs.get("axis", -1)),
        op=node.op, skip=node.inputs[1].name if has_skip else None,
        scale_node=node.name if scale is not None else None, bias_node=node.name if bias is not None else None,
    )


def _reduce_axes(w: Walker, node: gs.Node) -> int | tuple[int, ...] | None:
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1].name:
        value = w.value(node.inputs[1])
        axes = None if value is None else np.asarray(value).reshape(-1).tolist()
    if axes is None:
        return None
    axes = tuple(int(a) for a in axes)
    return axes[0] if len(axes) == 1 else axes


def _squared(w: Walker, node: gs.Node | None) -> gs.Tensor | None:
    """``x`` when ``node`` computes ``x ** 2`` (Pow by a constant 2, or Mul(x, x))."""
    if node is None:
        return None
    if node.op == "Pow" and len(node.inputs) == 2 and w.scalar(node.inputs[1]) == 2.0:
        return node.inputs[0]
    if node.op == "Mul" and len(node.inputs) == 2 and node.inputs[0].name == node.inputs[1].name:
        return node.inputs[0]
    return None


def _other(node: gs.Node, name: str) -> gs.Tensor | None:
    """The input of a binary ``node`` that is not ``name`` (None if both are)."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a.name == name and b.name != name:
        return b
    if b.name == name and a.name != name:
        return a
    return None


def _centered(w: Walker, x: gs.Tensor) -> bool:
    """Whether ``x`` is ``y - ReduceMean(y)``: then its square is a LayerNorm variance, not RMS."""
    sub = w.producer(x.name)
    if sub is None or sub.op != "Sub" or len(sub.inputs) != 2:
        return False
    mean = w.producer(sub.inputs[1].name)
    return mean is not None and mean.op == "ReduceMean" and mean.inputs[0].name == sub.inputs[0].name


def _match_tail(w: Walker, reduce: gs.Node, x: gs.Tensor) -> tuple[float | None, gs.Tensor, list[gs.Node]] | None:
    """From the variance ReduceMean to ``x / sqrt(var + eps)``: ``(eps, normalised, nodes)``."""
    nodes: list[gs.Node] = []
    nxt = w.sole_consumer(reduce.outputs[0])
    eps = None
    if nxt is not None and nxt.op == "Add":
        other = _other(nxt, reduce.outputs[0].name)
        eps = w.scalar(other) if other is not None else None
        if eps is None:
            return None
        nodes.append(nxt)
        nxt = w.sole_consumer(nxt.outputs[0])
    if nxt is None or nxt.op != "Sqrt":
        return None
    nodes.append(nxt)
    sqrt_out = nxt.outputs[0]
    inv = w.sole_consumer(sqrt_out)
    if inv is None:
        return None
    if inv.op == "Div" and inv.inputs[1].name == sqrt_out.name and inv.inputs[0].name == x.name:
        return eps, inv.outputs[0], nodes + [inv]
    is_recip = inv.op == "Reciprocal" or (
        inv.op == "Div" and inv.inputs[1].name == sqrt_out.name and w.scalar(inv.inputs[0]) == 1.0)
    if not is_recip:
        return None
    mul = w.sole_consumer(inv.outputs[0])
    if mul is None or mul.op != "Mul" or _other(mul, inv.outputs[0].name) is None:
        return None
    if cast(gs.Tensor, _other(mul, inv.outputs[0].name)).name != x.name:  # not None (checked above)
        return None
    return eps, mul.outputs[0], nodes + [inv, mul]


def _const_vector(w: Walker, tensor: gs.Tensor | None) -> bool:
    shape = w.const_shape(tensor) if tensor is not None else None
    return shape is not None and int(np.prod(shape)) > 1


def _match_affine(w: Walker, y: gs.Tensor, with_bias: bool):
    """Optional Cast, ``Mul(gamma)`` and (LayerNorm) ``Add(beta)`` after the normalised ``y``.

    Returns ``(output, scale, scale_node, bias, bias_node, nodes)``; a Cast is only taken when a
    gamma Mul follows it, so a bare cast of the output stays outside the norm.
    """
    out, nodes = y, []
    scale = scale_node = bias = bias_node = None
    nxt = w.sole_consumer(out)
    cast = None
    if nxt is not None and nxt.op == "Cast":
        cast, nxt = nxt, w.sole_consumer(nxt.outputs[0])
    if nxt is not None and nxt.op == "Mul":
        src = cast.outputs[0] if cast is not None else out
        gamma = _other(nxt, src.name)
        if gamma is not None and _const_vector(w, gamma):
            nodes += ([cast] if cast is not None else []) + [nxt]
            out, scale, scale_node = nxt.outputs[0], gamma.name, nxt.name
    if with_bias:
        add = w.sole_consumer(out)
        beta = _other(add, out.name) if add is not None and add.op == "Add" else None
        if beta is not None and _const_vector(w, beta):
            assert add is not None  # beta is only found on an add
            nodes.append(add)
            out, bias, bias_node = add.outputs[0], beta.name, add.name
    return out, scale, scale_node, bias, bias_node, nodes


def _decomposed(w: Walker, kind: str, anchor: gs.Node, x: gs.Tensor, d: gs.Tensor,
                head: list[gs.Node]) -> Norm | None:
    """The rest of a decomposed norm of ``x`` once its head matched: the ``head`` nodes end at the
    variance ReduceMean of ``d`` (``x`` itself for RMSNorm, ``x - mean`` for LayerNorm), then
    ``d / sqrt(var + eps)`` (``_match_tail``) and gamma, plus beta for LayerNorm (``_match_affine``).
    RMSNorm and LayerNorm differ only in their heads, so both finish here; ``anchor`` is the
    ReduceMean the match started from, whose axes are the norm's."""
    tail = _match_tail(w, head[-1], d)
    if tail is None:
        return None
    eps, y, tail_nodes = tail
    out, scale, scale_node, bias, bias_node, affine = _match_affine(w, y, with_bias=kind == "layer")
    nodes = head + tail_nodes + affine
    return Norm(kind=kind, fused=False, input=x.name, output=out.name, scale=scale, bias=bias,
                eps=eps, nodes=tuple(n.name for n in nodes), axis=_reduce_axes(w, anchor),
                scale_node=scale_node, bias_node=bias_node)


def _match_rms(w: Walker, reduce: gs.Node) -> Norm | None:
    square = w.producer(reduce.inputs[0].name)
    x = _squared(w, square)
    if x is None or _centered(w, x) or w.is_const(x):
        return None
    return _decomposed(w, "rms", reduce, x, x, [square, reduce])


def _match_layer(w: Walker, mean: gs.Node) -> Norm | None:
    x = mean.inputs[0]
    if w.is_const(x):
        return None
    sub = next((n for n in w.consumers(mean.outputs[0].name) if n.op == "Sub" and len(n.inputs) == 2
                and n.inputs[0].name == x.name and n.inputs[1].name == mean.outputs[0].name), None)
    if sub is None:
        return None
    d = sub.outputs[0]
    square = next((n for n in w.consumers(d.name) if _squared(w, n) is not None), None)
    var = w.sole_consumer(square.outputs[0]) if square is not None else None
    if var is None or var.op != "ReduceMean":
        return None
    return _decomposed(w, "layer", mean, x, d, [mean, sub, square, var])
