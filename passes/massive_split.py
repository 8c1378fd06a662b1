"""``massive-split``: route massive-activation channels of a linear's input through a GEMV branch.

A few tokens (the first position, some delimiters) carry "massive activations": on SmolLM2 the
input of layer 11's down_proj reaches 3110 in channel 1229 while the median channel peaks at 1.5.
The online Hadamard before down_proj spreads such a spike over every channel of that token, so a
static per-tensor activation scale must either cover it (every other token gets a handful of
levels) or clip it (the attention sink it feeds breaks). Measured on SmolLM2 after ``rotate``:
keeping the 30 down_proj inputs in float recovers almost all the W8A8 loss.

The pass finds, in calibration, the input channels whose absolute maximum exceeds ``ratio`` times
the median channel's, and splits them off *before* the online Hadamard::

    y = H(x * m) @ W_r  +  x[:, C] @ (H @ W_r)[C, :]        (m: 1 except 0 on channels C)

which is exact before quantization (``H(x) @ W_r == x @ (H @ W_r)``). The main GEMM and its static
per-tensor scale no longer see the spikes; the branch is a GEMV over |C| channels (|C| <= a few),
by default W8A8 with its own static per-tensor scale (``w8a16``, the A16W8 mode NPUs run, and
``float`` are options). On a
linear without an online Hadamard the same split is applied to its input directly. This extends
MQuant's RMS (a GEMV branch for what the online Hadamard makes hard) from weight outliers to
activation outliers; it is edgeq's addition, not in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.calib.observers import PerChannelAbsMaxObserver
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import Exactness, PassConfig, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.runtime_ops.online_hadamard import OP_TYPE, hadamard_times
from edgeq.passes.methods.side_branch import SideBranchPass, add_branch, check_branch, quantize_branches
from edgeq.structure import analyze
from edgeq.passes.methods.weights import LinearEditor



@dataclass(frozen=True)
class MassiveSplitConfig(PassConfig):
    ratio: float = 20.0  # a channel is massive when its calibrated |x| max exceeds ratio x the median channel's
    max_channels: int = 8  # per linear, largest first
    roles: tuple[str, ...] = ("down_proj", "fc2")  # linear roles examined
    branch: str = "w8a8"  # float | w8a16 | w8a8 | w4a8

    def __post_init__(self):
        if not self.ratio > 1.0:
            raise UserInputError(f"massive-split: ratio must be > 1, got {self.ratio}")
        if self.max_channels < 1:
            raise UserInputError(f"massive-split: max_channels must be >= 1, got {self.max_channels}")
        check_branch("massive-split", self.branch)
        if not self.roles:
            raise UserInputError("massive-split: roles must name at least one linear role")


def massive_channels(absmax: np.ndarray, ratio: float, max_channels: int) -> np.ndarray:
    """Channels whose |x| max exceeds ``ratio`` x the median channel's, largest first, at most
    ``max_channels``."""
    absmax = np.asarray(absmax, np.float64)
    limit = ratio * float(np.median(absmax))
    order = np.argsort(-absmax, kind="stable")
    return order[absmax[order] > limit][:max_channels]


class MassiveSplitPass(SideBranchPass, name="massive-split", per_block=True, exactness=Exactness.FLOAT_EQUIV,
                       config=MassiveSplitConfig, establishes=facts.MASSIVE_SPLIT,
                       calibrates=True,  # the massive channels are found in calibration, whatever the branch's precision
                       summary="split massive-activation input channels (before any online Hadamard) into a GEMV branch"):
    config: MassiveSplitConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: MassiveSplitConfig = self.config
        editor = LinearEditor(graph)
        index = editor.index
        nodes = {n.name: n for n in graph.nodes}
        sites = {}  # linear node -> (tensor whose channels are split, online Hadamard node or None)
        for lin in analyze(graph).linears:
            if lin.quantized or lin.role not in cfg.roles:
                continue
            producer = index.producer(lin.input)
            if producer is not None and producer.op == OP_TYPE:
                if len(index.consumers(lin.input)) != 1:
                    continue  # masking the Hadamard's input would change its other readers
                sites[lin.node] = (lin, producer.inputs[0], producer)
            else:
                sites[lin.node] = (lin, nodes[lin.node].inputs[0], None)
        if not sites:
            raise PassNotApplicable(Reason.NO_SITES, f"no float linear in roles {', '.join(cfg.roles)} to split",
                                    linears=0, roles=list(cfg.roles))
        observers = cast("dict[str, PerChannelAbsMaxObserver]", ctx.require_calibrator(self.name).observe(
            graph, {t.name: PerChannelAbsMaxObserver for _, t, _ in sites.values()}, "massive-split:channel-absmax"))
        branches, ranges, report = [], {}, {}
        for name, (lin, site, hadamard) in sites.items():
            absmax = cast(np.ndarray, observers[site.name].absmax)  # observed
            chans = massive_channels(absmax, cfg.ratio, cfg.max_channels)
            if not len(chans):
                continue
            w = editor.weight(lin).astype(np.float64)
            w_eff = hadamard_times(w) if hadamard is not None else w
            b = _split(graph, index, nodes[name], lin, site, hadamard, chans,
                       w_eff[chans].astype(editor.dtype(lin)))
            branches.append(b)
            peak = float(absmax[chans].max())
            ranges[b["x"].name] = (-peak, peak)
            report[name] = {"channels": chans.tolist(), "absmax": np.round(absmax[chans], 2).tolist(),
                            "median_channel_absmax": round(float(np.median(absmax)), 3)}
        if branches:
            quantize_branches(graph, index, branches, ranges, cfg.branch, ctx.u8s8_safe)
        facts.MASSIVE_SPLIT.set(graph, ratio=cfg.ratio, branch=cfg.branch)
        summary = {
            "linears": len(sites),
            "split": len(branches),
            "channels": sum(len(r["channels"]) for r in report.values()),
            "branch": cfg.branch,
            "per_linear": report,
        }
        if not branches:  # the graph is unchanged but for the marker: a later run is already-applied
            raise PassNotApplicable(Reason.NO_SITES, f"no massive-activation channel (|x| max over {cfg.ratio:g}x the "
                                    f"median channel's) in the inputs of the {len(sites)} float linear(s) in roles "
                                    f"{', '.join(cfg.roles)}", **summary)
        return PassResult(True, summary)


def _split(graph, index, node: gs.Node, lin, site: gs.Tensor, hadamard: gs.Node | None,
           chans: np.ndarray, w_rows: np.ndarray) -> dict:
    """Zero channels ``chans`` of ``site`` for the main path; branch = site[..., chans] @ w_rows."""
    mask = np.ones(lin.k, np.float32)  # the online Hadamard keeps the width
    mask[chans] = 0.0
    masked = gs.Variable(ir.unique_name(index, f"{lin.node}_massive_masked"), dtype=np.float32)
    graph.nodes.append(gs.Node("Mul", f"{lin.node}_massive_mask",
                               inputs=[site, gs.Constant(ir.unique_name(index, f"{lin.node}_massive_mask_value"), mask)],
                               outputs=[masked]))
    if hadamard is not None:
        hadamard.inputs[0] = masked
    else:
        node.inputs[0] = masked
    x_c = gs.Variable(ir.unique_name(index, f"{lin.node}_massive_channels"), dtype=np.float32)
    graph.nodes.append(gs.Node("Gather", f"{lin.node}_massive_gather", attrs={"axis": -1},
                               inputs=[site, gs.Constant(ir.unique_name(index, f"{lin.node}_massive_index"), chans.astype(np.int64))],
                               outputs=[x_c]))
    return add_branch(graph, index, node, lin, x_c, w_rows, "massive")
