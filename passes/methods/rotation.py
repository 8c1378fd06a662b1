"""Rotating the residual stream and folding online Hadamards (QuaRot / MQuant), shared by the
``rotate`` and ``resq`` passes: ``rotate_stream`` folds an orthogonal Q into every stream source
and reader (``E Q``, ``Q^T W``), ``fold_online_rotations`` puts an ``edgeq::OnlineHadamard`` before
each down_proj / fc2 with ``H^T`` folded into its weight, ``set_writer_weights`` writes the
rotated writer weights back."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.passes.methods.stream import transform_stream_input
from edgeq.passes.methods.weights import LinearEditor
from edgeq.quantize.quant import column_blocks
from edgeq.runtime_ops.hadamard import is_hadamard_size, randomized_hadamard
from edgeq.runtime_ops.online_hadamard import hadamard_matrix_for_fold, hadamard_times, insert_online_hadamard


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
            h = None  # H^T @ W through H's Kronecker factors (hadamard_times), never the dense n x n
            online[lin.node] = "hadamard"
        else:
            h, _ = randomized_hadamard(n, seed=seed + 1)
            const = gs.Constant(ir.unique_name(editor.index, f"{lin.node}_online_rotation"), h.astype(np.float32))
            out = gs.Variable(ir.unique_name(editor.index, f"{lin.node}_rotated_input"), dtype=np.float32)
            graph.nodes.append(gs.Node("MatMul", f"{lin.node}_online_rotation", inputs=[node.inputs[0], const], outputs=[out]))
            node.inputs[0] = out
            online[lin.node] = "dense-random-orthogonal"
        w = writers_w.get(lin.node, editor.weight(lin))
        writers_w[lin.node] = hadamard_times(w, transpose=True) if h is None else h.T @ w
    return online


def set_writer_weights(stream, editor: LinearEditor, writers_w: dict[str, np.ndarray]) -> None:
    """Store the rewritten weights of every stream writer and MLP output linear (and of the
    linears feeding post-sublayer norms, where a caller folded something into them)."""
    linears = {**{w.node: w for w in stream.writers}, **{m.node: m for m in stream.mlp_outputs},
               **{p.writer.node: p.writer for p in stream.post_norms}}
    for node, lin in linears.items():
        if node in writers_w:
            editor.set_weight(lin, writers_w[node])


def hadamard_signs(q: np.ndarray) -> np.ndarray | None:
    """``s`` when ``q == diag(s) @ H`` for the normalized Hadamard H the OnlineHadamard op
    computes (``randomized_hadamard``'s form: H's first column is all ones, so
    ``s = q[:, 0] * sqrt(n)``), else None."""
    n = q.shape[0]
    if not is_hadamard_size(n):
        return None
    s = np.sign(q[:, 0])
    if np.any(s == 0) or not np.allclose(s[:, None] * hadamard_matrix_for_fold(n), q, rtol=0, atol=1e-12):
        return None
    return s


def rotate_at_norm_outputs(graph: gs.Graph, stream, editor: LinearEditor, q: np.ndarray, tag: str) -> int:
    """Rotate what the linears read, not the stream: an online Hadamard after each stream norm
    (its scale kept, the signs of ``q = diag(s) H`` folded into it), the readers absorb ``q^T``.
    ``(RMSNorm(x) * g) @ q == (RMSNorm(x) * (g * s)) @ H``. For sandwich-norm families (Gemma), where
    the stream placement already needs an online Hadamard per post-norm: the same count, and the
    norm scales (0 to 60 within one Gemma 3 norm) stay out of the weights. Returns the count."""
    signs = hadamard_signs(q)
    if signs is None:
        raise ValueError("norm-output rotation needs a randomized Hadamard of the hidden size")
    index = editor.index
    nodes = {n.name: n for n in graph.nodes}
    for norm in stream.norms:
        name = f"{norm.name}_{tag}"
        scale_norm_output(graph, index, nodes, norm, signs, name)
        out = index.tensors[norm.output]
        readers = list(out.outputs)
        rotated = insert_online_hadamard(graph, out, stream.hidden, f"{name}_online_hadamard")
        for reader in readers:
            for i, t in enumerate(reader.inputs):
                if t is out:
                    reader.inputs[i] = rotated
    for lin in stream.readers:
        editor.set_weight(lin, rotate_rows(editor.stored(lin), q))
    return len(stream.norms)


def rotate_post_norms(graph: gs.Graph, stream, editor: LinearEditor, q: np.ndarray, tag: str) -> dict[str, int]:
    """Enter each post-sublayer norm's output into the rotated stream: the residual add reads
    ``norm(y) @ q`` instead of ``norm(y)``.

    ``RMSNorm(y) * g`` does not commute with q, so the writer feeding the norm keeps its output
    unrotated and q is applied after the norm. For ``q = diag(s) H`` (a randomized Hadamard),
    ``(RMSNorm(y) * g) @ q == (RMSNorm(y) * (g * s)) @ H``: the sign vector folds into the norm's
    scale (and bias) and an ``edgeq.OnlineHadamard`` computes ``@ H`` (one per post-norm);
    otherwise (no Hadamard of this size, or a PCA basis) a dense ``@ q`` MatMul, kept in float.
    Returns how many of each were inserted."""
    signs = hadamard_signs(q)
    index = editor.index
    nodes = {n.name: n for n in graph.nodes}
    counts = {"hadamard": 0, "dense": 0}
    for post in stream.post_norms:
        add = nodes[post.add]
        branch = index.tensors[post.branch]
        name = f"{post.norm.name}_{tag}"
        if signs is not None:
            scale_norm_output(graph, index, nodes, post.norm, signs, name)
            rotated = insert_online_hadamard(graph, branch, stream.hidden, f"{name}_online_hadamard")
            counts["hadamard"] += 1
        else:
            const = gs.Constant(ir.unique_name(index, f"{name}_matrix"), q.astype(np.float32))
            rotated = gs.Variable(ir.unique_name(index, f"{name}_rotated"), dtype=branch.dtype)
            graph.nodes.append(gs.Node("MatMul", f"{name}_online_rotation", inputs=[branch, const], outputs=[rotated]))
            facts.KEEP_FLOAT.add(graph, [f"{name}_online_rotation"])  # an online rotation, not a layer
            counts["dense"] += 1
        for i, t in enumerate(add.inputs):
            if t.name == post.branch:
                add.inputs[i] = rotated
    return counts


def scale_norm_output(graph: gs.Graph, index: ir.GraphIndex, nodes: dict, norm, signs: np.ndarray, name: str) -> None:
    """Multiply a norm's output by ``signs`` (exactly: sign flips) through its scale and bias, or
    with a Mul after it when it has no scale."""
    for const_name, node_name, label in ((norm.scale, norm.scale_node, "scale"), (norm.bias, norm.bias_node, "bias")):
        if const_name is None:
            if label == "scale":
                out = index.tensors[norm.output]
                signed = gs.Variable(ir.unique_name(index, f"{name}_signed"), dtype=out.dtype)
                for reader in list(out.outputs):
                    for i, t in enumerate(reader.inputs):
                        if t is out:
                            reader.inputs[i] = signed
                sign_const = gs.Constant(ir.unique_name(index, f"{name}_signs"), signs.astype(np.float32))
                graph.nodes.append(gs.Node("Mul", f"{name}_signs", inputs=[out, sign_const], outputs=[signed]))
            continue
        node = nodes[node_name]
        i = next(k for k, t in enumerate(node.inputs) if t.name == const_name)
        value = np.asarray(index.constant_value(node.inputs[i]))
        flipped = (np.broadcast_to(value, signs.shape) * signs).astype(value.dtype)
        node.inputs[i] = gs.Constant(ir.unique_name(index, f"{name}_signed_{label}"), flipped)


def rotate_stream(graph: gs.Graph, stream, editor: LinearEditor, q: np.ndarray) -> dict[str, np.ndarray]:
    """Put the residual stream in the basis ``q`` (orthogonal, float64): sources ``E q``, readers
    ``q^T W``, writer biases ``b q``. Returns the writers' new weights ``W q`` by node, not yet
    set, so a caller can fold more into them (rotate: the online Hadamard's ``H^T``)."""
    for lin in stream.readers:
        editor.set_weight(lin, rotate_rows(editor.stored(lin), q))
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
    rotated = rotate_columns(value, q)
    node.inputs[i] = gs.Constant(ir.unique_name(index, f"{node.name}_rotated_{i}"), rotated)


def rotate_rows(w_kn: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``q^T W`` for a [K, N] weight, in float64, stored in W's dtype; computed in column blocks
    (``edgeq.quantize.quant.column_blocks``) so a vocabulary head never has a whole float64 copy."""
    out = np.empty(w_kn.shape, w_kn.dtype)
    for cols in column_blocks(w_kn):
        out[:, cols] = q.T @ np.asarray(w_kn[:, cols], np.float64)
    return out


def rotate_columns(value: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``V q`` for a [rows, d] table (the embedding), in float64, in V's dtype, by row blocks."""
    out = np.empty(value.shape, value.dtype)
    for rows in column_blocks(value.T):
        out[rows] = np.asarray(value[rows], np.float64) @ q
    return out
