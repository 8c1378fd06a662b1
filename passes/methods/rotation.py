"""Rotating the residual stream and folding online Hadamards (QuaRot / MQuant), shared by the
``rotate`` and ``resq`` passes: ``rotate_stream`` folds an orthogonal Q into every stream source
and reader (``E Q``, ``Q^T W``), ``fold_online_rotations`` puts an ``edgeq::OnlineHadamard`` before
each down_proj / fc2 with ``H^T`` folded into its weight, ``set_writer_weights`` writes the
rotated writer weights back."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from edgeq import ir
from edgeq.passes.methods.stream import transform_stream_input
from edgeq.passes.methods.weights import LinearEditor
from edgeq.runtime_ops.hadamard import is_hadamard_size, randomized_hadamard
from edgeq.runtime_ops.online_hadamard import hadamard_matrix_for_fold, insert_online_hadamard


def fold_online_rotations(graph: gs.Graph, stream, editor: LinearEditor, writers_w: dict[str, np.ndarray],
                           seed: int) -> dict[str, str]:
    """Put an online Hadamard (``edgeq.OnlineHadamard``) before each MLP output linear and fold
    ``H^T`` into ``writers_w`` (its weight, by node); a dense seeded random orthogonal MatMul where
    no Kronecker Hadamard of that size exists. Returns node -> "hadamard" | "dense-random-orthogonal"."""
    online = {}
    nodes = {n.name: n for n in graph.nodes}
    for lin in stream.mlp_outputs:
        n = lin.k
        node = nodes[lin.node]
        if is_hadamard_size(n):
            node.inputs[0] = insert_online_hadamard(graph, node.inputs[0], n, f"{lin.node}_online_hadamard")
            h = hadamard_matrix_for_fold(n)
            online[lin.node] = "hadamard"
        else:
            h, _ = randomized_hadamard(n, seed=seed + 1)
            const = gs.Constant(ir.unique_name(editor.index, f"{lin.node}_online_rotation"), h.astype(np.float32))
            out = gs.Variable(ir.unique_name(editor.index, f"{lin.node}_rotated_input"), dtype=np.float32)
            graph.nodes.append(gs.Node("MatMul", f"{lin.node}_online_rotation", inputs=[node.inputs[0], const], outputs=[out]))
            node.inputs[0] = out
            online[lin.node] = "dense-random-orthogonal"
        w = writers_w.get(lin.node, editor.weight(lin))
        writers_w[lin.node] = h.T @ w
    return online


def set_writer_weights(stream, editor: LinearEditor, writers_w: dict[str, np.ndarray]) -> None:
    """Store the rewritten weights of every stream writer and MLP output linear."""
    for lin in {**{w.node: w for w in stream.writers}, **{m.node: m for m in stream.mlp_outputs}}.values():
        editor.set_weight(lin, writers_w[lin.node])


def rotate_stream(graph: gs.Graph, stream, editor: LinearEditor, q: np.ndarray) -> dict[str, np.ndarray]:
    """Put the residual stream in the basis ``q`` (orthogonal, float64): sources ``E q``, readers
    ``q^T W``, writer biases ``b q``. Returns the writers' new weights ``W q`` by node, not yet
    set, so a caller can fold more into them (rotate: the online Hadamard's ``H^T``)."""
    for lin in stream.readers:
        editor.set_weight(lin, q.T @ editor.weight(lin))
    writers_w = {lin.node: editor.weight(lin) @ q for lin in stream.writers}
    for lin in stream.writers:
        b = editor.bias(lin)
        if b is not None:
            editor.set_bias(lin, b @ q)
    for source in stream.sources:
        _rotate_source(graph, editor.index, source, q)
    return writers_w


def _rotate_source(graph: gs.Graph, index: ir.GraphIndex, source: dict, q: np.ndarray) -> None:
    kind = source["kind"]
    if kind == "transpose":
        return  # the layout change is handled where the constant or conv sits
    if kind == "input":
        transform_stream_input(graph, index, index.tensors[source["tensor"]], q.astype(np.float32), "rotated")
        return
    nodes = {n.name: n for n in graph.nodes}
    node = nodes[source["node"]]
    i = source["operand"]
    value = np.asarray(index.constant_value(node.inputs[i]))
    if kind == "conv":
        # output channels are axis 0 of the weight; the bias rotates like a row vector
        w = np.tensordot(q.T, value.astype(np.float64), axes=([1], [0]))
        node.inputs[1] = gs.Constant(ir.unique_name(index, f"{node.name}_rotated_weight"), w.astype(value.dtype))
        if len(node.inputs) > 2 and index.constant_value(node.inputs[2]) is not None:
            b = np.asarray(index.constant_value(node.inputs[2]), np.float64) @ q
            node.inputs[2] = gs.Constant(ir.unique_name(index, f"{node.name}_rotated_bias"), b.astype(value.dtype))
        return
    rotated = (value.astype(np.float64) @ q).astype(value.dtype)
    node.inputs[i] = gs.Constant(ir.unique_name(index, f"{node.name}_rotated_{i}"), rotated)
