"""``rms``: MQuant's Rotation Magnitude Suppression (section 3.2, appendix A.3 and A.7).

After ``rotate`` an online Hadamard feeds each MLP output linear, whose weight is ``H^T W``.
Row 0 of that weight is ``sqrt(n) * mean(W[:, j])`` (Eq. 8) and becomes an outlier in layers that
meet Eq. 9; channel 0 of the rotated activation likewise carries ``sqrt(n) * mean(x)``. RMS splits
channel 0 off into a GEMV branch::

    y = x_r[:, 1:] @ W_r[1:, :]  +  x_r[:, :1] @ W_r[:1, :]

so neither the main GEMM's weight nor its per-tensor activation scale sees channel 0. The sum is
exact before quantization. The branch is added back before the next op. Its precision is a
setting: ``w4a8`` (the paper's: a 4-bit per-output-channel weight row, which a single row
represents exactly, and an 8-bit static activation), ``w8a8``, ``w8a16`` or ``float`` (kept out of the QDQ
pass through the graph's ``edgeq.keep_float`` list).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.calib.observers import MinMaxObserver
from edgeq.passes.methods.eq9 import eq9_columns
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import Exactness, PassConfig, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.runtime_ops.online_hadamard import OP_TYPE, hadamard_times
from edgeq.passes.methods.side_branch import SideBranchPass, add_branch, branch_quantized, check_branch, quantize_branches
from edgeq.structure import analyze
from edgeq.passes.methods.weights import LinearEditor



@dataclass(frozen=True)
class RmsConfig(PassConfig):
    mode: str = "eq9"  # eq9: only layers meeting Eq. 9 | all: every linear behind an online Hadamard
    branch: str = "w4a8"  # float | w8a16 | w8a8 | w4a8

    def __post_init__(self):
        if self.mode not in ("eq9", "all"):
            raise UserInputError(f"rms: mode must be eq9 or all, got '{self.mode}'")
        check_branch("rms", self.branch)


class RmsPass(SideBranchPass, name="rms", per_block=True, exactness=Exactness.FLOAT_EQUIV, config=RmsConfig,
              requires=("fuse-norms", "ln-to-rms", "rotate"), establishes=facts.RMS, calibrates=branch_quantized,
              summary="MQuant RMS: split rotated channel 0 of Eq. 9 layers into a GEMV branch"):
    config: RmsConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: RmsConfig = self.config
        editor = LinearEditor(graph)
        index = editor.index
        eq9, branches = {}, []
        for lin in analyze(graph).linears:
            producer = index.producer(lin.input)
            if lin.quantized or producer is None or producer.op != OP_TYPE:
                continue
            w_r = editor.weight(lin)
            w_pre = hadamard_times(w_r)  # the weight before H^T was folded in
            meeting = int(eq9_columns(w_pre).sum())
            eq9[lin.node] = meeting
            if cfg.mode == "eq9" and meeting == 0:
                continue
            branches.append(_split(graph, index, editor, editor.nodes[lin.node], lin, w_r))
        if not eq9:
            raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, "no float linear reads an online Hadamard (rotate's "
                                    "online_hadamard puts one before each down_proj/fc2)", online_hadamard_linears=0)
        if branches:
            ranges = {}
            if self.quantized_branch:
                observers = ctx.require_calibrator(self.name).observe(
                    graph, {b["x"].name: MinMaxObserver for b in branches}, "rms:branch:minmax")
                ranges = {name: obs.range() for name, obs in observers.items()}
            quantize_branches(graph, index, branches, ranges, cfg.branch, ctx.u8s8_safe)
        facts.RMS.set(graph, mode=cfg.mode, branch=cfg.branch)
        summary = {
            "online_hadamard_linears": len(eq9),
            "meeting_eq9": sum(v > 0 for v in eq9.values()),
            "split": len(branches),
            "branch": cfg.branch,
            "eq9_columns": {k: v for k, v in eq9.items() if v},
        }
        if not branches:  # (mode eq9) the graph is unchanged but for the marker: a later run is already-applied
            raise PassNotApplicable(Reason.NO_SITES, f"no weight column of the {len(eq9)} linear(s) behind an online "
                                    "Hadamard meets Eq. 9 (mode eq9): no channel 0 to split off", **summary)
        return PassResult(True, summary)


def _split(graph, index, editor: LinearEditor, node: gs.Node, lin, w_r: np.ndarray) -> dict:
    """Main GEMM on channels 1.., GEMV branch on channel 0, summed where the linear's output was."""
    x_r = node.inputs[0]

    def const(name, value):
        return gs.Constant(ir.unique_name(index, f"{lin.node}_rms_{name}"), np.asarray(value))

    x_main = gs.Variable(ir.unique_name(index, f"{lin.node}_rms_main_input"), dtype=np.float32)
    x0 = gs.Variable(ir.unique_name(index, f"{lin.node}_rms_channel0"), dtype=np.float32)
    axes = const("axes", np.array([-1], np.int64))
    graph.nodes.append(gs.Node("Slice", f"{lin.node}_rms_slice_main",
                               inputs=[x_r, const("one", np.array([1], np.int64)), const("end", np.array([lin.k], np.int64)), axes],
                               outputs=[x_main]))
    graph.nodes.append(gs.Node("Slice", f"{lin.node}_rms_slice_channel0",
                               inputs=[x_r, const("zero", np.array([0], np.int64)), const("one_end", np.array([1], np.int64)), axes],
                               outputs=[x0]))
    node.inputs[0] = x_main
    stored_dtype = editor.dtype(lin)
    editor.set_weight(lin, w_r[1:, :])
    return add_branch(graph, index, node, lin, x0, w_r[:1, :].astype(stored_dtype), "rms")
