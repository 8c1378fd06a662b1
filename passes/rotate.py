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

import onnx_graphsurgeon as gs

from edgeq import facts
from edgeq.passbase import Exactness, Pass, PassConfig, PassContext, PassResult, Reason
from edgeq.registry import register_pass
from edgeq.runtime_ops.hadamard import randomized_hadamard
from edgeq.passes.methods.rotation import fold_online_rotations, rotate_post_norms, rotate_stream, set_writer_weights
from edgeq.passes.methods.stream import NotApplicable, analyze_stream, require_weightless_rms
from edgeq.passes.methods.weights import LinearEditor

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
    establishes = facts.ROTATED
    summary_line = "randomized-Hadamard residual rotation (offline) + online Hadamard before down_proj/fc2"

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: RotateConfig = self.config
        try:
            stream = analyze_stream(graph)
        except NotApplicable as exc:
            return PassResult.skipped(Reason.STRUCTURE_NOT_FOUND, str(exc))
        require_weightless_rms(graph, stream, self.name)
        editor = LinearEditor(graph)
        d = stream.hidden
        q, is_hadamard = randomized_hadamard(d, seed=cfg.seed)
        kind = "randomized-hadamard" if is_hadamard else "dense-random-orthogonal"
        writers_w = rotate_stream(graph, stream, editor, q)
        online = fold_online_rotations(graph, stream, editor, writers_w, cfg.seed) if cfg.online_hadamard else {}
        post_norms = rotate_post_norms(graph, stream, editor, q, "rotate")
        set_writer_weights(stream, editor, writers_w)
        facts.ROTATED.set(graph, seed=cfg.seed, kind=kind)
        summary = {
            "hidden": d, "rotation": kind, "readers": len(stream.readers), "writers": len(stream.writers),
            "stream_sources": [s["kind"] for s in stream.sources],
            "online": {"hadamard": sum(v == "hadamard" for v in online.values()),
                       "dense_fallback": sorted(k for k, v in online.items() if v != "hadamard")},
        }
        if stream.post_norms:
            summary["post_norms"] = post_norms
        return PassResult(True, summary)
