"""``rotate``: QuaRot-style rotation of the residual stream plus an online Hadamard before each
MLP output linear (down_proj / fc2).

With weightless RMSNorms (``fuse-norms``, ``ln-to-rms`` first), RMSNorm(x Q) = RMSNorm(x) Q for an
orthogonal Q, so the whole residual stream can live in a rotated basis at no runtime cost:
embedding tables and other stream sources ``E' = E Q`` (a stream that starts at a graph input,
e.g. ``inputs_embeds``, gets one ``x @ Q`` MatMul at the input), readers ``W' = Q^T W``, writers
``W' = W Q, b' = b Q``. Q is a seeded randomized Hadamard built in float64 (fp16/bf16 rotations
collapse numerically), a dense random orthogonal matrix where no Hadamard of that size exists.
Rotation spreads activation outliers over all channels, so one static per-tensor scale fits.

The online part: ``x -> OnlineHadamard(x)`` (an ``edgeq`` custom op with a Kronecker-form
function body) before each MLP output linear, whose weight absorbs ``H^T``. Where no Kronecker
construction exists, a dense random orthogonal MatMul is inserted instead and reported.

The pass refuses to guess: if anything other than norms, residual adds and elementwise casts reads
the residual stream, or a block output is not written by a linear, it leaves the graph unchanged
and says why in its summary (e.g. BERT's post-LN stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq import ir
from edgeq.passbase import Exactness, Pass, PassConfig, PassContext, PassResult
from edgeq.registry import register_pass
from edgeq.runtime_ops.hadamard import is_hadamard_size, randomized_hadamard
from edgeq.runtime_ops.online_hadamard import hadamard_matrix_for_fold, insert_online_hadamard
from edgeq.stream import NotApplicable, analyze_stream, require_weightless_rms, transform_stream_input
from edgeq.weights import LinearEditor

ROTATED_KEY = "edgeq.rotate"


@dataclass(frozen=True)
class RotateConfig(PassConfig):
    seed: int = 0
    online_hadamard: bool = True


@register_pass
class RotatePass(Pass):
    name = "rotate"
    exactness = Exactness.FLOAT_EQUIV
    Config = RotateConfig
    requires = ("fuse-norms", "ln-to-rms")
    summary_line = "randomized-Hadamard residual rotation (offline) + online Hadamard before down_proj/fc2"

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        if ROTATED_KEY in ir.graph_metadata(graph):
            return PassResult(False, {"already_rotated": ir.graph_metadata(graph)[ROTATED_KEY]})
        cfg: RotateConfig = self.config
        try:
            stream = analyze_stream(graph)
        except NotApplicable as exc:
            return PassResult(False, {"not_applicable": str(exc)})
        require_weightless_rms(graph, stream, self.name)
        editor = LinearEditor(graph)
        d = stream.hidden
        q, is_hadamard = randomized_hadamard(d, seed=cfg.seed)
        kind = "randomized-hadamard" if is_hadamard else "dense-random-orthogonal"
        writers_w = rotate_stream(graph, stream, editor, q)
        online = fold_online_rotations(graph, stream, editor, writers_w, cfg.seed) if cfg.online_hadamard else {}
        set_writer_weights(stream, editor, writers_w)
        ir.set_graph_metadata(graph, ROTATED_KEY, f"seed={cfg.seed};kind={kind}")
        return PassResult(True, {
            "hidden": d, "rotation": kind, "readers": len(stream.readers), "writers": len(stream.writers),
            "stream_sources": [s["kind"] for s in stream.sources],
            "online": {"hadamard": sum(v == "hadamard" for v in online.values()),
                       "dense_fallback": sorted(k for k, v in online.items() if v != "hadamard")},
        })


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
