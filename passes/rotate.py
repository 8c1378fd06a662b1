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

Post-sublayer norms (Gemma 2/3's sandwich norms: ``h + norm(o_proj(...))``, the norm on the write
path, before the residual add). ``RMSNorm(y Q) = RMSNorm(y) Q`` still holds, but the norm's scale
does not commute with Q: ``(RMSNorm(y) * g) Q != RMSNorm(y Q) * g``, and the scale cannot move into
the residual add. So the writer feeding the norm (o_proj, down_proj) keeps its output unrotated
and Q is applied after the norm, online. With ``Q = diag(s) H / sqrt(d)`` (``randomized_hadamard``:
seeded signs s, the normalized Hadamard H that ``OnlineHadamard`` computes),

    (RMSNorm(y) * g) @ Q  ==  (RMSNorm(y) * (g * s)) @ (H / sqrt(d))

so the sign vector folds into the norm's scale (and bias, for a LayerNorm) and one
``OnlineHadamard`` after the norm puts the branch into the rotated stream before the add (a dense
``@ Q`` MatMul, kept in float, where no Hadamard of that size exists). Cost: one online Hadamard
(O(d log d) a token) per post-norm, i.e. 2 a layer on Gemma, on top of the one before down_proj.

Sandwich-norm families can instead keep their stream norms' scales (``fuse-norms`` with
``sandwich = "keep"``, what the mquant recipes ask): then the rotation goes where the linears read,
one ``OnlineHadamard`` after each stream norm (signs folded into its scale), the readers absorbing
``Q^T``, the stream and the post-norms untouched (``rotation.rotate_at_norm_outputs``). The same
number of online Hadamards (2 a layer, plus the final norm's), and the norm scales stay out of the
weights: folded, Gemma 3's (0 to 60 within one norm, zeros on the massive-activation channels) made
int8 per-channel weights 15.8x fp32 once rotated; kept, 1.017x (270M, 4 BOS-led test windows).

Other structure the stream analysis accepts (``edgeq.passes.methods.stream``): norms inside a block
(Qwen3's and Gemma 3's per-head q/k norms read a projection's output, not the stream) are left
alone; a scalar Mul on the stream source (Gemma's embedding times sqrt(hidden)) commutes with Q; a
Reshape that keeps the hidden axis last (OPT's ``[b, s, h] -> [b * s, h]``) is position-wise;
parallel blocks (Phi-2: attention and MLP read one norm, their two outputs are summed into one
residual add) are two readers' groups and two writers of the same add.

The pass refuses to guess: if anything other than norms, residual adds, casts and position-wise
reshapes reads the residual stream, or a block output is not written by a linear (or a linear and
a post-sublayer norm), it leaves the graph unchanged and says why in its summary (e.g. BERT's
post-LN stream, where the norm output is itself the stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.passmanager.passbase import Combine, Exactness, Pass, PassConfig, PassContext, PassResult
from edgeq.runtime_ops.hadamard import randomized_hadamard
from edgeq.passes.methods.rotation import (fold_online_rotations, rotate_at_norm_outputs, rotate_post_norms, rotate_stream,
                                           set_writer_weights)
from edgeq.passes.methods.stream import analyze_stream, require_weightless_rms
from edgeq.passes.methods.weights import LinearEditor

@dataclass(frozen=True)
class RotateConfig(PassConfig):
    seed: int = 0
    online_hadamard: bool = True


class RotatePass(Pass, name="rotate", per_block=True, exactness=Exactness.FLOAT_EQUIV, config=RotateConfig,
                 requires=("fuse-norms", "ln-to-rms"), establishes=facts.ROTATED,
                 summary="randomized-Hadamard residual rotation (offline) + online Hadamard before down_proj/fc2",
                 # the stream's width and sources are the model's, the same in every block
                 combine={"hidden": Combine.FIRST, "stream_sources": Combine.FIRST}):
    config: RotateConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: RotateConfig = self.config
        stream = analyze_stream(graph)  # PassNotApplicable (structure-not-found) when the stream does not fit
        d = stream.hidden
        q, is_hadamard = randomized_hadamard(d, seed=cfg.seed)
        at_norm_outputs = bool(stream.post_norms) and is_hadamard and not _weightless(graph, stream)
        if not at_norm_outputs:
            require_weightless_rms(graph, stream, self.name)
        editor = LinearEditor(graph)
        kind = "randomized-hadamard" if is_hadamard else "dense-random-orthogonal"
        if at_norm_outputs:  # fuse-norms kept the sandwich family's norm scales (its sandwich = "keep")
            writers_w: dict = {}
            norm_outputs = rotate_at_norm_outputs(graph, stream, editor, q, "rotate")
        else:
            writers_w = rotate_stream(graph, stream, editor, q)
        online = fold_online_rotations(graph, stream, editor, writers_w, cfg.seed) if cfg.online_hadamard else {}
        post_norms = {} if at_norm_outputs else rotate_post_norms(graph, stream, editor, q, "rotate")
        set_writer_weights(stream, editor, writers_w)
        if at_norm_outputs:
            graph.toposort()  # the Hadamards appended after each norm (the stream placement leaves the order as it was)
        facts.ROTATED.set(graph, seed=cfg.seed, kind=kind)
        summary = {
            "hidden": d, "rotation": kind, "placement": "norm-outputs" if at_norm_outputs else "stream",
            "readers": len(stream.readers), "writers": len(stream.writers),
            "stream_sources": [s["kind"] for s in stream.sources],
            "online": {"hadamard": sum(v == "hadamard" for v in online.values()),
                       "dense_fallback": sorted(k for k, v in online.items() if v != "hadamard")},
        }
        if at_norm_outputs:
            summary["norm_outputs"] = norm_outputs
        elif stream.post_norms:
            summary["post_norms"] = post_norms
        return PassResult(True, summary)


def _weightless(graph: gs.Graph, stream) -> bool:
    from edgeq.graph import ir
    from edgeq.passes.methods.weights import is_weightless

    index = ir.GraphIndex(graph)
    return all(is_weightless(index, norm) and norm.kind == "rms" for norm in stream.norms)
