"""Grouped-query attention without the repeated cache: an exact rewrite of a static graph.

The exporter writes GQA (``kv_heads`` < ``heads``) as ``repeat_kv``: the cache [1, Hkv, T, D] is
unsqueezed, expanded to [1, Hkv, G, T, D] and reshaped to [1, H, T, D] (H = Hkv * G) before the
score and value MatMuls. In a static graph T is the whole context (C + W slots), so every decode
step copies the cache G times per layer (and the transpose and scaling after it run on the copy).
The same numbers come from grouping the queries instead: head h = kv * G + g, so

    scores = MatMul(Reshape(Q [1, H, W, D] -> [1, Hkv, G*W, D]), K^T [1, Hkv, D, T]) -> [1, H, W, T]
    out    = MatMul(Reshape(P [1, H, W, T] -> [1, Hkv, G*W, T]), V [1, Hkv, T, D]) -> [1, H, W, D]

with the Reshapes of queries and results free (no data moves) and the cache read once per group.
Each product is the same dot product over D (or T) as before, so the rewrite is exact up to the
order the MatMul kernel sums in.

Matched per site: ``Unsqueeze(axis 2) -> Expand -> Reshape`` of a 4-D cache, then a chain of
transposes of the last two axes and scalar Mul/Div, ending as input B of a MatMul. Anything else
is left as it is (the graph stays correct, only slower).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

_SCALAR_OPS = ("Mul", "Div")


def _const(graph_name: str, values) -> gs.Constant:
    return gs.Constant(graph_name, np.asarray(values, np.int64))


def _repeat_kv(expand: gs.Node):
    """(cache tensor X [1, Hkv, T, D], groups G, the Reshape node) of a repeat_kv site, or None."""
    src = expand.inputs[0]
    unsq = src.inputs[0] if src.inputs else None
    if unsq is None or unsq.op != "Unsqueeze" or len(expand.outputs[0].outputs) != 1:
        return None
    axes = unsq.attrs.get("axes") if "axes" in unsq.attrs else (
        unsq.inputs[1].values.tolist() if len(unsq.inputs) > 1 and isinstance(unsq.inputs[1], gs.Constant) else None)
    x = unsq.inputs[0]
    reshape = expand.outputs[0].outputs[0]
    out_shape = expand.outputs[0].shape
    if list(np.atleast_1d(axes) if axes is not None else []) != [2] or reshape.op != "Reshape" or x.shape is None:
        return None
    if out_shape is None or len(x.shape) != 4 or len(out_shape) != 5 or not all(isinstance(d, int) for d in out_shape):
        return None
    groups = out_shape[2]
    r_shape = reshape.outputs[0].shape
    if r_shape is None or list(r_shape) != [out_shape[0], out_shape[1] * groups, out_shape[3], out_shape[4]]:
        return None
    return x, groups, reshape


def _chain_to_matmul(tensor: gs.Tensor):
    """The nodes from ``tensor`` to the MatMul that reads it as input B, if only head-wise ops
    (last-two-axes transposes, scalar Mul/Div) lie between; else None."""
    chain: list[gs.Node] = []
    while True:
        if len(tensor.outputs) != 1:
            return None
        node = tensor.outputs[0]
        if node.op == "MatMul" and node.inputs[1] is tensor:
            return chain, node
        if node.op == "Transpose" and list(node.attrs.get("perm", [])) == [0, 1, 3, 2]:
            pass
        elif node.op in _SCALAR_OPS and node.inputs[0] is tensor and isinstance(node.inputs[1], gs.Constant) \
                and node.inputs[1].values.size == 1:
            pass
        else:
            return None
        chain.append(node)
        tensor = node.outputs[0]


def group_queries(graph: gs.Graph) -> int:
    """Rewrite every matched repeat_kv site (see the module docstring); returns how many."""
    done = 0
    for expand in [n for n in graph.nodes if n.op == "Expand"]:
        site = _repeat_kv(expand)
        if site is None:
            continue
        x, groups, reshape = site
        found = _chain_to_matmul(reshape.outputs[0])
        if found is None:
            continue
        chain, matmul = found
        a, result = matmul.inputs[0], matmul.outputs[0]
        if a.shape is None or result.shape is None or len(a.shape) != 4 or len(result.shape) != 4:
            continue
        kv_heads = x.shape[1]
        heads = kv_heads * groups
        first = chain[0] if chain else matmul
        first.inputs = [x if t is reshape.outputs[0] else t for t in first.inputs]
        for node in chain:
            node.outputs[0].shape = None  # re-inferred: Hkv heads now
        tag = matmul.name or result.name
        grouped_a = gs.Variable(f"{tag}/grouped_a", dtype=a.dtype)
        graph.nodes.append(gs.Node("Reshape", name=f"{tag}/group_queries", outputs=[grouped_a],
                                   inputs=[a, _const(f"{tag}/grouped_a_shape", [1, kv_heads, -1, a.shape[3]])]))
        grouped_y = gs.Variable(f"{tag}/grouped_out", dtype=result.dtype)
        matmul.inputs = [grouped_a, matmul.inputs[1]]
        matmul.outputs = [grouped_y]
        graph.nodes.append(gs.Node("Reshape", name=f"{tag}/ungroup_heads", inputs=[
            grouped_y, _const(f"{tag}/ungrouped_shape", [1, heads, -1, result.shape[3]])], outputs=[result]))
        done += 1
    if done:
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return done
