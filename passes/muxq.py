"""``muxq``: MUXQ's Body/Aux outlier decomposition (paper 004 section 3; methods.md section 3).

Outlier input channels C of a linear (found in calibration: any |x| above ``threshold``, or a
channel-std z-score rule) are shrunk by 2^-e in the main activation (Body) and repeated as a small
auxiliary matrix (Aux = Body[:, C]) whose weight rows carry the missing (2^e - 1)::

    Y = Body @ W + (2^e - 1) * Aux @ W[C, :]
      = Concat([Body, Aux]) @ [W ; (2^e - 1) W[C, :]]          (the hardware-friendly form)

Exact before quantization; afterwards the whole GEMM is uniform INT8 with one per-tensor scale
that no longer has to cover the outliers. The per-channel 2^-e multiply folds into the
preceding norm's gamma (and beta) when every reader of the norm is decomposed here; elsewhere a
Mul by a constant vector computes Body. ``form = "two-gemm"`` is Eq. 7 as written: Body @ W plus
a separate Aux GEMM (its own activation scale) whose output is multiplied by 2^e - 1, so the Aux
weight rows are W's own rows. The concat form folds 2^e - 1 into the stacked rows instead, which
widens each output channel's weight range by up to 2^e - 1: harmless at 8-bit weights, costly
at 5 and 4 bits (measured in benchmarks/muxq.py).

``exponent_mode = "auto"`` (edgeq's option, not the paper's) raises e per channel until the
channel's calibrated maximum falls to the largest ordinary channel's, so a single massive
activation (thousands, e.g. on the first token) cannot set the per-tensor scale either.

``method = "llm-int8"`` is the ablation comparator: outlier channels go through a float GEMV
branch (kept out of the qdq pass) and are zeroed in the integer path, activations and weight rows.
The ``naive`` comparator is the same quantization without this pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.calib.observers import ChannelStatsObserver
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import Exactness, Pass, PassConfig, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.passes.methods.side_branch import add_branch
from edgeq.structure import Norm, analyze
from edgeq.passes.methods.weights import LinearEditor, norm_weights, position_wise_readers

_MAX_EXPONENT = 16


@dataclass(frozen=True)
class MuxqConfig(PassConfig):
    method: str = "muxq"  # muxq | llm-int8 (comparator)
    rule: str = "abs"  # abs: any |x| > threshold | zscore: channel std z-score > z_threshold
    threshold: float = 6.0
    z_threshold: float = 3.0
    exponent: int = 2
    exponent_mode: str = "fixed"  # fixed | auto (per channel, at least `exponent`)
    max_fraction: float = 0.0625  # at most this share of K per input, largest channels first
    form: str = "concat"  # concat | two-gemm
    roles: tuple[str, ...] = ()  # linear roles decomposed; empty: every linear

    def __post_init__(self):
        checks = [("method", self.method, ("muxq", "llm-int8")), ("rule", self.rule, ("abs", "zscore")),
                  ("exponent_mode", self.exponent_mode, ("fixed", "auto")), ("form", self.form, ("concat", "two-gemm"))]
        for key, value, allowed in checks:
            if value not in allowed:
                raise UserInputError(f"muxq: {key} must be one of {', '.join(allowed)}, got '{value}'")
        if not 1 <= self.exponent <= _MAX_EXPONENT:
            raise UserInputError(f"muxq: exponent must be in 1..{_MAX_EXPONENT}, got {self.exponent}")
        if not self.threshold > 0 or not self.z_threshold > 0:
            raise UserInputError("muxq: threshold and z_threshold must be positive")
        if not 0.0 < self.max_fraction <= 1.0:
            raise UserInputError(f"muxq: max_fraction must be in (0, 1], got {self.max_fraction}")


def outlier_channels(stats: ChannelStatsObserver, cfg: MuxqConfig) -> np.ndarray:
    """Outlier channels by the configured rule, largest |x| first, at most max_fraction of K."""
    absmax = np.asarray(stats.absmax, np.float64)
    if cfg.rule == "abs":
        hit = absmax > cfg.threshold
    else:
        std = stats.std
        spread = float(std.std())
        hit = (std - float(std.mean())) / spread > cfg.z_threshold if spread > 0 else np.zeros_like(std, bool)
    order = np.argsort(-absmax, kind="stable")
    cap = max(1, int(cfg.max_fraction * len(absmax)))
    return order[hit[order]][:cap]


def channel_exponents(absmax: np.ndarray, chans: np.ndarray, cfg: MuxqConfig) -> np.ndarray:
    """e per outlier channel: the configured exponent, or (auto) enough to bring the channel's
    maximum down to the largest ordinary channel's."""
    e = np.full(len(chans), cfg.exponent, np.int64)
    if cfg.exponent_mode == "auto" and len(chans) < len(absmax):
        rest = np.delete(absmax, chans)
        ceiling = max(float(rest.max()), np.finfo(np.float32).tiny)
        need = np.ceil(np.log2(np.maximum(absmax[chans] / ceiling, 1.0))).astype(np.int64)
        e = np.clip(np.maximum(e, need), 1, _MAX_EXPONENT)
    return e


class MuxqPass(Pass, name="muxq", exactness=Exactness.FLOAT_EQUIV, config=MuxqConfig, establishes=facts.MUXQ,
               calibrates=True, summary="MUXQ: outlier input channels into Body/Aux (one uniform INT8 GEMM); llm-int8 comparator"):
    config: MuxqConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: MuxqConfig = self.config
        structure = analyze(graph)
        editor = LinearEditor(graph)
        index = editor.index
        keep_float = facts.KEEP_FLOAT.names(graph)
        sites: dict[str, list] = {}
        for lin in structure.linears:
            if lin.quantized or lin.node in keep_float or (cfg.roles and lin.role not in cfg.roles):
                continue
            sites.setdefault(lin.input, []).append(lin)
        if not sites:
            raise PassNotApplicable(Reason.NO_SITES, "no float linear to split (every linear is quantized, kept "
                                    "float or outside roles)", inputs=0)
        stats = cast("dict[str, ChannelStatsObserver]", ctx.require_calibrator(self.name).observe(
            graph, {name: ChannelStatsObserver for name in sites}, "muxq:channel-stats"))
        norms = {n.output: n for n in structure.norms if n.skip is None}
        report, branches = {}, []
        for site, linears in sites.items():
            chans = outlier_channels(stats[site], cfg)
            if not len(chans):
                continue
            tensor = index.tensors[site]
            absmax = np.asarray(stats[site].absmax, np.float64)
            entry = {"readers": [lin.node for lin in linears], "k": int(linears[0].k), "outliers": len(chans),
                     "channels": chans.tolist(), "absmax_max": round(float(absmax[chans].max()), 2),
                     "ceiling_after": round(float(np.delete(absmax, chans).max()) if len(chans) < len(absmax) else 0.0, 3)}
            if cfg.method == "llm-int8":
                branches += _llm_int8(graph, index, editor, tensor, linears, chans)
            else:
                e = channel_exponents(absmax, chans, cfg)
                scale = np.ones(linears[0].k, np.float64)
                scale[chans] = 2.0 ** -e
                entry["exponents"] = sorted({int(v) for v in e})
                norm = norms.get(site)
                folded = norm is not None and _fold_into_norm(graph, index, norm, linears, scale)
                entry["body_scale"] = "folded into norm" if folded else "Mul"
                body = tensor if folded else _mul(graph, index, tensor, scale, f"{site}_muxq_body")
                _decompose(graph, index, editor, body, linears, chans, e, cfg.form)
            report[site] = entry
        if branches:
            facts.KEEP_FLOAT.add(graph, branches)
        facts.MUXQ.set(graph, method=cfg.method, rule=cfg.rule, form=cfg.form)
        outliers = [r["outliers"] for r in report.values()]
        summary = {
            "method": cfg.method,
            "inputs": len(sites),
            "decomposed": len(report),
            "linears": sum(len(r["readers"]) for r in report.values()),
            "outlier_channels": int(sum(outliers)),
            "extra_k_share": round(sum(outliers) / max(sum(r["k"] for r in report.values()), 1), 4),
            "folded_into_norm": sum(r.get("body_scale") == "folded into norm" for r in report.values()),
            "per_input": report,
        }
        if not report:  # the graph is unchanged but for the marker: a later run is already-applied
            rule = f"|x| > {cfg.threshold:g}" if cfg.rule == "abs" else f"channel std z-score > {cfg.z_threshold:g}"
            raise PassNotApplicable(Reason.NO_SITES, f"no outlier channel ({rule}) in any of the {len(sites)} float linear "
                                    "input(s)", **summary)
        return PassResult(True, summary)


def _const(index, name: str, value) -> gs.Constant:
    return gs.Constant(ir.unique_name(index, name), np.asarray(value))


def _mul(graph, index, tensor: gs.Tensor, vector: np.ndarray, name: str) -> gs.Variable:
    out = gs.Variable(ir.unique_name(index, name), dtype=np.float32)
    graph.nodes.append(gs.Node("Mul", name, inputs=[tensor, _const(index, f"{name}_value", vector.astype(np.float32))],
                               outputs=[out]))
    return out


def _gather(graph, index, tensor: gs.Tensor, chans: np.ndarray, name: str) -> gs.Variable:
    out = gs.Variable(ir.unique_name(index, name), dtype=np.float32)
    graph.nodes.append(gs.Node("Gather", name, {"axis": -1},
                               [tensor, _const(index, f"{name}_index", chans.astype(np.int64))], [out]))
    return out


def _decompose(graph, index, editor: LinearEditor, body: gs.Tensor, linears, chans, e, form: str) -> None:
    nodes = editor.nodes
    if form == "concat":
        aux = _gather(graph, index, body, chans, f"{body.name}_muxq_aux")
        stacked = gs.Variable(ir.unique_name(index, f"{body.name}_muxq_concat"), dtype=np.float32)
        graph.nodes.append(gs.Node("Concat", f"{body.name}_muxq_concat", {"axis": -1}, [body, aux], [stacked]))
        gain = (2.0 ** e - 1.0)[:, None]
        for lin in linears:
            w = editor.weight(lin)
            editor.set_weight(lin, np.concatenate([w, gain * w[chans]], axis=0))
            nodes[lin.node].inputs[0] = stacked
        return
    # two-gemm, Eq. 7: Y = Body @ W + (2^e - 1) * (Aux @ W[C]); one Aux GEMM per distinct e, the
    # factor applied to its output so the Aux weight rows keep W's values
    groups = {int(v): chans[e == v] for v in np.unique(e)}
    auxes = {v: _gather(graph, index, body, c, f"{body.name}_muxq_aux_e{v}") for v, c in groups.items()}
    for lin in linears:
        w = editor.weight(lin)
        node = nodes[lin.node]
        node.inputs[0] = body
        for v, c in groups.items():
            add_branch(graph, index, node, lin, auxes[v], w[c].astype(editor.dtype(lin)), f"muxq_aux_e{v}",
                       gain=float(2 ** v - 1))


def _llm_int8(graph, index, editor: LinearEditor, tensor: gs.Tensor, linears, chans) -> list[str]:
    """Outlier channels through a float GEMV, zeroed (activation and weight rows) in the int path."""
    mask = np.ones(linears[0].k, np.float64)
    mask[chans] = 0.0
    main = _mul(graph, index, tensor, mask, f"{tensor.name}_llmint8_inliers")
    outl = _gather(graph, index, tensor, chans, f"{tensor.name}_llmint8_outliers")
    names = []
    for lin in linears:
        w = editor.weight(lin)
        node = editor.nodes[lin.node]
        zeroed = w.copy()
        zeroed[chans] = 0.0
        editor.set_weight(lin, zeroed)
        node.inputs[0] = main
        names.append(add_branch(graph, index, node, lin, outl, w[chans].astype(editor.dtype(lin)), "llmint8")["matmul"].name)
    return names


def _fold_into_norm(graph, index, norm: Norm, linears, scale: np.ndarray) -> bool:
    """Multiply gamma (and beta) by ``scale`` when the norm has them and only these linears read it."""
    if norm.scale is None:
        return False
    readers = {n.name for n in position_wise_readers(index, norm.output)}
    if readers != {lin.node for lin in linears}:
        return False
    gamma, beta = norm_weights(index, norm)
    if gamma is None or gamma.shape != scale.shape:
        return False
    nodes = {n.name: n for n in graph.nodes}
    targets = [(norm.scale, gamma)] + ([(norm.bias, beta)] if beta is not None else [])
    for name, values in targets:
        consumer = nodes[norm.nodes[-1]] if norm.fused else nodes[norm.scale_node if name == norm.scale else norm.bias_node]
        dtype = np.asarray(index.constant_value(index.tensors[name])).dtype
        new = gs.Constant(ir.unique_name(index, f"{name}_muxq"), (values * scale).astype(dtype))
        for i, t in enumerate(consumer.inputs):
            if t.name == name:
                consumer.inputs[i] = new
    return True
