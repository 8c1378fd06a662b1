"""A GEMV side branch added back to a linear's output, shared by the passes that split channels.

MQuant's RMS (channel 0 after the online Hadamard) and ``massive-split`` (massive-activation
channels before it) both compute ``y = main(x) + x_c @ W_c`` where ``x_c`` are a few input
channels and ``W_c`` their weight rows. The branch is added where the linear's output (after its
bias) was, so everything downstream is untouched; its precision is the calling pass's choice
(config field ``branch``), and ``SideBranchPass`` derives what that choice means for the pass.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import Exactness, Pass
from edgeq.quantize.qdq_nodes import ensure_opset, insert_dequantize, insert_quantize, insert_weight_dequantize
from edgeq.quantize.quant import QuantSpec

# branch precision -> (weight dtype, activation dtype); None: float (kept out of the qdq pass)
BRANCH_PRECISIONS: dict[str, tuple[str, str] | None] = {
    "float": None,
    "w8a16": ("int8", "int16"),
    "w8a8": ("int8", "uint8"),
    "w4a8": ("int4", "uint8"),
}


def check_branch(pass_name: str, branch: str) -> None:
    """A config's check of its ``branch`` field (one of ``BRANCH_PRECISIONS``)."""
    if branch not in BRANCH_PRECISIONS:
        raise UserInputError(f"{pass_name}: branch must be one of {', '.join(BRANCH_PRECISIONS)}, got '{branch}'")


def branch_quantized(config) -> bool:
    """Whether a config's ``branch`` is quantized: it then needs the branch inputs' calibrated
    ranges (``rms`` declares ``calibrates=branch_quantized``)."""
    return BRANCH_PRECISIONS[config.branch] is not None


class SideBranchPass(Pass):
    """Not registered and declares nothing: the base of the passes that split channels into a side
    branch (``rms``, ``massive-split``), whose config has a ``branch`` precision.

    The split itself is float-equivalent (the class's ``exactness``); a quantized branch makes the
    configured pass LOSSY (what ``describe()`` and ``edgeq passes`` report) and needs the branch
    inputs' calibrated ranges (``branch_quantized``, for the passes' ``calibrates=``). One
    definition, so the two passes cannot disagree on it.
    """

    @property
    def quantized_branch(self) -> bool:
        return branch_quantized(self.config)

    @property
    def output_exactness(self) -> Exactness:
        return Exactness.LOSSY if self.quantized_branch else self.exactness


def add_branch(graph: gs.Graph, index: ir.GraphIndex, node: gs.Node, lin, x_branch: gs.Variable,
               w_branch: np.ndarray, tag: str, gain: float = 1.0) -> dict:
    """Insert ``out = main_out + gain * (x_branch @ w_branch)`` after ``lin`` (its bias included).

    A ``gain`` other than 1 is applied to the GEMV's output (MUXQ Eq. 7's 2^e - 1), so the
    branch weight keeps the original values and quantizes on their own scale.

    Returns the branch's MatMul node, its input tensor and its float weight, for quantization.
    """
    out = node.outputs[0] if lin.bias_add is None else next(n for n in graph.nodes if n.name == lin.bias_add).outputs[0]
    producer = out.inputs[0]
    main_out = gs.Variable(ir.unique_name(index, f"{lin.node}_{tag}_main_out"), dtype=out.dtype)
    producer.outputs[producer.outputs.index(out)] = main_out
    branch_out = gs.Variable(ir.unique_name(index, f"{lin.node}_{tag}_branch_out"), dtype=out.dtype)
    w_const = gs.Constant(ir.unique_name(index, f"{lin.node}_{tag}_branch_weight"), np.ascontiguousarray(w_branch))
    gemv_out = branch_out
    if gain != 1.0:
        gemv_out = gs.Variable(ir.unique_name(index, f"{lin.node}_{tag}_branch_gemv"), dtype=out.dtype)
        gain_const = gs.Constant(ir.unique_name(index, f"{lin.node}_{tag}_branch_gain"), np.asarray(gain, w_const.values.dtype))
        graph.nodes.append(gs.Node("Mul", f"{lin.node}_{tag}_branch_gain", inputs=[gemv_out, gain_const], outputs=[branch_out]))
    matmul = gs.Node("MatMul", f"{lin.node}_{tag}_branch", inputs=[x_branch, w_const], outputs=[gemv_out])
    graph.nodes.append(matmul)
    graph.nodes.append(gs.Node("Add", f"{lin.node}_{tag}_add", inputs=[main_out, branch_out], outputs=[out]))
    return {"matmul": matmul, "x": x_branch, "w": np.asarray(w_branch)}


def quantize_branches(graph: gs.Graph, index: ir.GraphIndex, branches: list[dict],
                      ranges: dict[str, tuple[float, float]], precision: str, u8s8_safe: bool = True) -> None:
    """Static per-tensor symmetric activation Q/DQ and per-output-channel weight DQ on each branch
    (int8 weights on the u8s8 pair-bounded grid unless ``u8s8_safe`` is off).

    ``ranges``: calibrated (lo, hi) of each branch input, by tensor name. ``float`` branches are
    listed in the graph's keep-float set instead, so the qdq pass leaves them alone.
    """
    dtypes = BRANCH_PRECISIONS[precision]
    if dtypes is None:
        facts.KEEP_FLOAT.add(graph, [b["matmul"].name for b in branches])
        return
    w_dtype, a_dtype = dtypes
    a_spec = QuantSpec(a_dtype, symmetric=True)
    w_spec = QuantSpec(w_dtype, symmetric=True, axis=1, pair_axis=0 if u8s8_safe else None)
    ensure_opset(graph, a_spec, w_spec)
    for b in branches:
        lo, hi = ranges[b["x"].name]
        quantized = insert_quantize(graph, index, b["x"], lo, hi, a_spec)
        matmul = b["matmul"]
        matmul.inputs[0] = insert_dequantize(graph, index, quantized, matmul.name)
        matmul.inputs[1] = insert_weight_dequantize(graph, index, b["w"], w_spec, f"{matmul.name}_w")
