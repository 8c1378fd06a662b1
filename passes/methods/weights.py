"""Read and rewrite the weight and bias of a recognised linear in its math layout.

Every float-equivalent rewrite (norm fusion, rotation, RMS) thinks of a linear as
``y = x @ W + b`` with ``W`` of shape [K, N]. These helpers hide how the graph stores it (plain
[K, N] initializer, behind a Transpose, Gemm with transB, bias in Gemm's C or in a following
Add) and always write NEW constants: a table shared with another node (a tied embedding) is never
changed under its other reader. Math is float64; stored values keep the original dtype.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.quantize.quant import column_blocks
from edgeq.structure import Linear, Norm


class LinearEditor:
    """Weight/bias access for the linears of one graph (build once per pass run)."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self.index = ir.GraphIndex(graph)
        self.nodes = {n.name: n for n in graph.nodes if n.name}

    def weight(self, lin: Linear) -> np.ndarray:
        """W as [K, N] float64."""
        return np.asarray(self.stored(lin), np.float64)

    def stored(self, lin: Linear) -> np.ndarray:
        """W as [K, N] in its stored dtype, a view (no copy) of the constant."""
        w = np.asarray(self.index.constant_value(self.index.tensors[lin.weight]))
        return w.T if lin.weight_transposed else w

    def bias(self, lin: Linear) -> np.ndarray | None:
        if lin.bias is None:
            return None
        return np.asarray(self.index.constant_value(self.index.tensors[lin.bias]), np.float64).reshape(-1)

    def dtype(self, lin: Linear) -> np.dtype:
        return np.asarray(self.index.constant_value(self.index.tensors[lin.weight])).dtype

    def set_weight(self, lin: Linear, w_kn: np.ndarray) -> None:
        """Store ``w_kn`` ([K, N]) as a new constant read directly by the node (no Transpose)."""
        node = self.nodes[lin.node]
        dtype = self.dtype(lin)
        const = gs.Constant(ir.unique_name(self.index, f"{lin.weight}_rewritten"), np.ascontiguousarray(w_kn.astype(dtype, copy=False)))
        node.inputs[1] = const
        if node.op == "Gemm":
            node.attrs["transB"] = 0

    def set_bias(self, lin: Linear, b: np.ndarray) -> None:
        """Set the bias, creating a Gemm C input or an Add after a MatMul when there was none."""
        node = self.nodes[lin.node]
        dtype = self.dtype(lin)
        const = gs.Constant(ir.unique_name(self.index, f"{lin.node}_bias"), np.asarray(b, dtype).reshape(-1))
        if node.op == "Gemm":
            if len(node.inputs) >= 3:
                node.inputs[2] = const
            else:
                node.inputs.append(const)
            return
        if lin.bias_add is not None:
            add = self.nodes[lin.bias_add]
            idx = next(i for i, t in enumerate(add.inputs) if isinstance(t, gs.Constant) or self.index.constant_value(t) is not None)
            add.inputs[idx] = const
            return
        out = node.outputs[0]
        new_out = gs.Variable(ir.unique_name(self.index, f"{out.name}_nobias"), dtype=out.dtype)
        node.outputs[0] = new_out
        self.graph.nodes.append(gs.Node("Add", f"{lin.node}_bias_add", inputs=[new_out, const], outputs=[out]))


def scale_rows(w_kn: np.ndarray, gamma: np.ndarray) -> np.ndarray:
    """``diag(gamma) W`` for a [K, N] weight, in float64, stored in W's dtype; by column blocks
    (``edgeq.quantize.quant.column_blocks``) so a vocabulary head never has a whole float64 copy."""
    out = np.empty(w_kn.shape, w_kn.dtype)
    g = np.asarray(gamma, np.float64)[:, None]
    for cols in column_blocks(w_kn):
        out[:, cols] = g * np.asarray(w_kn[:, cols], np.float64)
    return out


SHAPE_ONLY = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")
TRANSPARENT = ("Cast", "Identity")


def position_wise_readers(index, tensor: str) -> list[gs.Node]:
    """Nodes reading ``tensor`` through ops that act per position and keep the hidden axis last:
    reshapes, casts, and token selection (Gather/Slice on an axis other than the last, e.g.
    ViT picking the class token before its classifier)."""
    out, todo, seen = [], [tensor], set()
    while todo:
        name = todo.pop()
        for node in index.consumers(name):
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.op in ("Shape", "Size"):
                continue  # reads only the shape, which no weight rewrite changes
            if node.inputs[0].name == name and (node.op in SHAPE_ONLY or node.op in TRANSPARENT or _selects_tokens(index, node)):
                todo.append(node.outputs[0].name)
            else:
                out.append(node)
    return out


def _selects_tokens(index, node: gs.Node) -> bool:
    if node.op == "Gather":
        return node.attrs.get("axis", 0) not in (-1, _rank(node) - 1)
    if node.op == "Slice" and len(node.inputs) > 3:
        axes = index.constant_value(node.inputs[3])
        return axes is not None and all(int(a) not in (-1, _rank(node) - 1) for a in np.ravel(axes))
    return False


def _rank(node: gs.Node) -> int:
    shape = node.inputs[0].shape
    return len(shape) if shape is not None else 3



def norm_weights(index: ir.GraphIndex, norm: Norm) -> tuple[np.ndarray | None, np.ndarray | None]:
    """gamma and beta as float64 arrays (None when absent)."""
    def value(name):
        if name is None:
            return None
        v = index.constant_value(index.tensors[name])
        return None if v is None else np.asarray(v, np.float64).reshape(-1)

    return value(norm.scale), value(norm.bias)


def is_weightless(index: ir.GraphIndex, norm: Norm) -> bool:
    gamma, beta = norm_weights(index, norm)
    return (gamma is None or bool(np.all(gamma == 1.0))) and (beta is None or bool(np.all(beta == 0.0)))
