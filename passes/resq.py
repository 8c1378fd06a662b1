"""``resq``: ResQ's projections (paper 002, section 4.3): the bases in which a low-rank,
high-variance subspace can be kept at 8 bits and the rest at 4 (``resq-qdq`` quantizes).

- ``U_A`` (one for the whole residual stream, ``hidden x hidden``): PCA of the inputs of every
  stream reader (the normed activations feeding q/k/v, gate/up and the head), with a seeded
  random rotation inside the low and the high subspace. Folded offline like QuaRot's rotation
  (``rotate_stream``): sources ``E U``, readers ``U^T W``, writers ``W U``.
- ``U_B`` (per layer, per KV head, ``head_dim x head_dim``): PCA of that head's value outputs,
  folded into v_proj's output columns and o_proj's input rows of every query head sharing it.
- ``U_C`` (per layer, ``head_dim x head_dim``): PCA of the post-RoPE keys; RoPE sits between
  k_proj and the cache, so it is applied online, ``q U_C`` and ``k U_C`` (the scores are
  unchanged since U_C is orthogonal).
- ``U_D``: the online Hadamard before down_proj (``rotate``'s op, ``H^T`` folded into the weight).

With eigenvalues ascending, the LAST r channels of every projected tensor are its high-variance
subspace (r = dimension / ``rank_divisor``). ``basis = "linf"`` is the paper's Table 4 baseline
(the r channels of largest calibrated |x| max, rotated inside each group) and ``"hadamard"`` the
QuaRot-like uniform baseline (randomized Hadamard everywhere, no subspaces). Exact at infinite
precision: the fp32 graph keeps its outputs (FLOAT_EQUIV). The layout is recorded in the model
metadata (``edgeq.passes.methods.resq``) for ``resq-qdq``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.passes.methods.attention_tensors import AttentionNotFound, AttentionTensors, find_attention_tensors
from edgeq.calib.observers import HessianObserver, PerChannelAbsMaxObserver
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import Exactness, Pass, PassConfig, PassContext, PassResult
from edgeq.passes.methods.rotation import fold_online_rotations, rotate_post_norms, rotate_stream, set_writer_weights
from edgeq.passes.methods.resq import SubspaceBasis, linf_basis, subspace_basis
from edgeq.runtime_ops.hadamard import randomized_hadamard
from edgeq.passes.methods.stream import analyze_stream, require_weightless_rms
from edgeq.passes.methods.weights import LinearEditor

BASES = ("pca", "linf", "hadamard")


@dataclass(frozen=True)
class ResqConfig(PassConfig):
    basis: str = "pca"  # pca (ResQ) | linf (Table 4 baseline) | hadamard (QuaRot-like, uniform)
    rank_divisor: int = 8  # r = dimension / rank_divisor (the paper: 1/8 of the channels at 8 bits)
    seed: int = 0
    damp: float = 0.01  # fraction of the mean eigenvalue added before the eigendecomposition
    attention: bool = True  # U_B (values) and U_C (keys); off: the stream and U_D only

    def __post_init__(self):
        if self.basis not in BASES:
            raise UserInputError(f"resq: basis must be one of {', '.join(BASES)}, got '{self.basis}'")
        if self.rank_divisor < 2:
            raise UserInputError(f"resq: rank_divisor must be >= 2, got {self.rank_divisor}")
        if not 0.0 <= self.damp < 1.0:
            raise UserInputError(f"resq: damp must be in [0, 1), got {self.damp}")


# marks_when_not_applicable: where resq does not apply, the pipeline leaves its marker with the
# reason (and the basis, ``marker_fields``), so resq-qdq (which requires resq) is skipped with it
class ResqPass(Pass, name="resq", exactness=Exactness.FLOAT_EQUIV, config=ResqConfig,
               requires=("fuse-norms", "ln-to-rms"), establishes=facts.RESQ, marks_when_not_applicable=True,
               calibrates=lambda cfg: cfg.basis != "hadamard",
               summary="ResQ projections: PCA bases (U_A stream, U_B values, U_C keys online) + online Hadamard (U_D)"):
    config: ResqConfig

    def marker_fields(self) -> dict:
        return {"basis": self.config.basis}

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: ResqConfig = self.config
        stream = analyze_stream(graph)  # PassNotApplicable: the pipeline leaves the reason on the marker
        require_weightless_rms(graph, stream, self.name)
        attention: list[AttentionTensors] = []
        skipped = None
        if cfg.attention:
            try:
                attention = find_attention_tensors(graph)
            except AttentionNotFound as exc:
                skipped = str(exc)
        d = stream.hidden
        stats = self._statistics(graph, ctx, stream, attention)
        u_a = self._basis(stats.get("stream"), d, d // cfg.rank_divisor, cfg.seed)
        editor = LinearEditor(graph)
        writers_w = rotate_stream(graph, stream, editor, u_a.u)
        online = fold_online_rotations(graph, stream, editor, writers_w, cfg.seed)
        post_norms = rotate_post_norms(graph, stream, editor, u_a.u, "U_A")
        energies: dict[str, list[float]]
        layers, energies = [], {"U_B": [], "U_C": []}
        readers = {lin.node: lin for lin in stream.readers}
        for att in attention:
            r_h = max(att.head_dim // cfg.rank_divisor, 1)
            u_b = [self._basis(_head_block(stats.get(f"v{att.layer}"), h, att.head_dim), att.head_dim, r_h,
                               cfg.seed + 10 + 4 * att.layer + 2 * h) for h in range(att.kv_heads)]
            self._fold_values(editor, stream, readers[att.v_proj], att, u_b, writers_w)
            u_c = self._basis(stats.get(f"k{att.layer}"), att.head_dim, r_h, cfg.seed + 1000 + att.layer)
            k_site = self._project_online(graph, att, u_c.u)
            layers.append({"layer": att.layer, "k": k_site, "v": att.v, "o_proj": att.o_proj, "heads": att.heads,
                           "u_c_nodes": [f"/resq/layers.{att.layer}/{label}_U_C" for label in ("q", "k")],
                           "kv_heads": att.kv_heads, "head_dim": att.head_dim, "rank": r_h})
            if cfg.basis == "pca":
                energies["U_B"] += [b.high_energy_fraction for b in u_b]
                energies["U_C"].append(u_c.high_energy_fraction)
        set_writer_weights(stream, editor, writers_w)
        rank = 0 if cfg.basis == "hadamard" else d // cfg.rank_divisor
        layout = {"basis": cfg.basis, "rank_divisor": cfg.rank_divisor, "hidden": d, "hidden_rank": rank,
                  "stream_readers": sorted(readers), "layers": layers}
        facts.RESQ.set(graph, layout)
        summary = {"basis": cfg.basis, "hidden": d, "hidden_rank": rank, "attention_layers": len(layers),
                   "online": {"hadamard": sum(v == "hadamard" for v in online.values()),
                              "dense_fallback": sorted(k for k, v in online.items() if v != "hadamard")}}
        if cfg.basis == "pca":
            summary["high_energy_fraction"] = {"U_A": round(u_a.high_energy_fraction, 4),
                                               **{k: round(float(np.mean(v)), 4) for k, v in energies.items() if v}}
        if stream.post_norms:
            summary["post_norms"] = post_norms
        if skipped:
            summary["attention_skipped"] = skipped
        return PassResult(True, summary)

    # -- statistics and bases -----------------------------------------------------------------
    def _statistics(self, graph: gs.Graph, ctx: PassContext, stream, attention: list[AttentionTensors]) -> dict:
        """Second moments (pca: X^T X / n) or channel |x| maxima (linf): ``stream`` pooled over every
        stream reader's input, ``v<layer>`` of the v projection outputs, ``k<layer>`` of the keys."""
        cfg: ResqConfig = self.config
        if cfg.basis == "hadamard":
            return {}
        factory = HessianObserver if cfg.basis == "pca" else PerChannelAbsMaxObserver
        nodes = {n.name: n for n in graph.nodes}
        stream_inputs = sorted({lin.input for lin in stream.readers})
        names = {t: "stream" for t in stream_inputs}
        for att in attention:
            names[_linear_output(graph, nodes[att.v_proj])] = f"v{att.layer}"
            names[att.k] = f"k{att.layer}"
        obs = ctx.require_calibrator(self.name).observe(graph, {t: factory for t in names}, f"resq:{cfg.basis}")
        out: dict[str, np.ndarray] = {}
        for tensor, key in names.items():
            o: Any = obs[tensor]  # a HessianObserver (pca) or a PerChannelAbsMaxObserver (linf)
            value = o.xtx / max(o.count, 1) if cfg.basis == "pca" else o.absmax
            if key == "stream" and key in out:
                out[key] = out[key] + value if cfg.basis == "pca" else np.maximum(out[key], value)
            else:
                out[key] = value
        return out

    def _basis(self, stat: np.ndarray | None, d: int, rank: int, seed: int) -> SubspaceBasis:
        cfg: ResqConfig = self.config
        if cfg.basis == "hadamard" or stat is None:
            return SubspaceBasis(randomized_hadamard(d, seed).matrix, np.ones(d), max(rank, 1))
        if cfg.basis == "linf":
            return linf_basis(stat, rank, seed)
        return subspace_basis(stat, rank, seed, cfg.damp)

    # -- rewrites -------------------------------------------------------------------------------
    @staticmethod
    def _fold_values(editor: LinearEditor, stream, v_lin, att: AttentionTensors, u_b: list[SubspaceBasis],
                     writers_w: dict[str, np.ndarray]) -> None:
        """v_proj columns of KV head h times U_B[h]; o_proj rows of query head j times U_B[j // rep]^T."""
        d = att.head_dim
        block = np.zeros((att.kv_heads * d, att.kv_heads * d))
        for h, b in enumerate(u_b):
            block[h * d:(h + 1) * d, h * d:(h + 1) * d] = b.u
        current = np.asarray(editor.nodes[v_lin.node].inputs[1].values, np.float64)  # U_A^T W, set by rotate_stream
        editor.set_weight(v_lin, current @ block)
        bias = editor.bias(v_lin)
        if bias is not None:
            editor.set_bias(v_lin, bias @ block)
        rep = att.heads // att.kv_heads
        w_o = writers_w.get(att.o_proj)
        if w_o is None:  # o_proj feeds a post-sublayer norm (Gemma): its output is not rotated
            w_o = editor.weight(next(p.writer for p in stream.post_norms if p.writer.node == att.o_proj))
        rows = np.zeros((att.heads * d, att.heads * d))
        for j in range(att.heads):
            rows[j * d:(j + 1) * d, j * d:(j + 1) * d] = u_b[j // rep].u.T
        writers_w[att.o_proj] = rows @ w_o

    @staticmethod
    def _project_online(graph: gs.Graph, att: AttentionTensors, u_c: np.ndarray) -> str:
        """``q -> q U_C`` and ``k -> k U_C`` (MatMuls read by everything that read q and k);
        returns the projected key tensor's name (the K cache quantization site)."""
        index = ir.GraphIndex(graph)
        const = gs.Constant(ir.unique_name(index, f"/resq/layers.{att.layer}/U_C"), u_c.astype(np.float32))
        outputs = {}
        for label, name in (("q", att.q), ("k", att.k)):
            tensor = index.tensors[name]
            consumers = list(index.consumers(name))
            out = gs.Variable(ir.unique_name(index, f"/resq/layers.{att.layer}/{label}_projected"), dtype=np.float32)
            graph.nodes.append(gs.Node("MatMul", f"/resq/layers.{att.layer}/{label}_U_C", inputs=[tensor, const], outputs=[out]))
            facts.KEEP_FLOAT.add(graph, [f"/resq/layers.{att.layer}/{label}_U_C"])  # an online projection, not a layer
            for node in consumers:
                for i, t in enumerate(node.inputs):
                    if t is tensor:
                        node.inputs[i] = out
            outputs[label] = out.name
        return outputs["k"]


def _head_block(stat: np.ndarray | None, h: int, d: int) -> np.ndarray | None:
    """Head ``h``'s block of a statistic over the v projection's outputs (matrix or vector)."""
    if stat is None:
        return None
    sl = slice(h * d, (h + 1) * d)
    return stat[sl, sl] if stat.ndim == 2 else stat[sl]


def _linear_output(graph: gs.Graph, node: gs.Node) -> str:
    """A linear's output after its bias Add, if it has one."""
    out = node.outputs[0]
    for user in graph.nodes:
        if user.op == "Add" and out in user.inputs and any(isinstance(t, gs.Constant) for t in user.inputs):
            return user.outputs[0].name
    return out.name
