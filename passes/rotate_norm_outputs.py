"""``rotate-norm-outputs``: a randomized Hadamard at each stream norm's output (online), the
residual stream itself left in its own basis, plus an online Hadamard before each MLP output linear.

``rotate`` puts the whole residual stream in a rotated basis, which needs weightless norms: every
norm scale g is folded into the linears reading it (``fuse-norms``), ``W' = Q^T diag(g) W``. On
Gemma 3 that is what destroys accuracy: its norm scales span 0 to 60 within one norm (zeros where
the massive-activation channels are, so those channels never reach a linear), and after folding a
weight's rows differ by that much, so per-channel int8 weights lose the small rows, and once rotated
the exact zeros of the massive channels turn into rounding noise that every token carrying a
massive activation multiplies (Gemma 3 270M, 4 BOS-led test windows, int8 per-channel weights with
near-float activations: 173.6 fp32, 665 with fuse-norms, 2737 with fuse-norms + rotate).

Here nothing is folded into the weights but the rotation: with ``Q = diag(s) H / sqrt(d)``,
``(RMSNorm(x) * g) @ Q == (RMSNorm(x) * (g * s)) @ (H / sqrt(d))``, so the signs fold into each
stream norm's scale, one ``edgeq.OnlineHadamard`` after the norm rotates what the linears read
(outliers spread across channels, as ``rotate`` gives them), and the readers absorb ``Q^T``.
Post-sublayer norms and the residual adds are untouched (they are never quantized). Cost: one
online Hadamard per stream norm (2 a layer, and the final norm before the head) instead of one
per post-norm. FLOAT_EQUIV; establishes ``rotated`` like ``rotate`` (the linears' inputs are
rotated activations), so the MQuant stages after it apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from edgeq import facts
from edgeq.passbase import Exactness, Pass, PassConfig, PassContext, PassResult, Reason
from edgeq.passes.methods.rotation import (fold_online_rotations, hadamard_signs, rotate_rows, scale_norm_output,
                                           set_writer_weights)
from edgeq.passes.methods.stream import NotApplicable, analyze_stream
from edgeq.passes.methods.weights import LinearEditor
from edgeq.runtime_ops.hadamard import randomized_hadamard
from edgeq.runtime_ops.online_hadamard import insert_online_hadamard


@dataclass(frozen=True)
class RotateNormOutputsConfig(PassConfig):
    seed: int = 0
    online_hadamard: bool = True  # also before each MLP output linear (down_proj / fc2)


class RotateNormOutputsPass(Pass, name="rotate-norm-outputs", per_block=True, exactness=Exactness.FLOAT_EQUIV,
                            config=RotateNormOutputsConfig, establishes=facts.ROTATED,
                            summary="randomized Hadamard after each stream norm (online; norm scales kept) + before down_proj/fc2"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: RotateNormOutputsConfig = self.config
        try:
            stream = analyze_stream(graph)
        except NotApplicable as exc:
            return PassResult.skipped(Reason.STRUCTURE_NOT_FOUND, str(exc))
        d = stream.hidden
        q, _ = randomized_hadamard(d, seed=cfg.seed)
        signs = hadamard_signs(q)
        if signs is None:
            return PassResult.skipped(Reason.STRUCTURE_NOT_FOUND, f"no Hadamard of the hidden size {d}")
        editor = LinearEditor(graph)
        index = editor.index
        nodes = {n.name: n for n in graph.nodes}
        for norm in stream.norms:
            name = f"{norm.name}_rotate_out"
            scale_norm_output(graph, index, nodes, norm, signs, name)
            out = index.tensors[norm.output]
            readers = list(out.outputs)
            rotated = insert_online_hadamard(graph, out, d, f"{name}_online_hadamard")
            for reader in readers:
                for i, t in enumerate(reader.inputs):
                    if t is out:
                        reader.inputs[i] = rotated
        for lin in stream.readers:
            editor.set_weight(lin, rotate_rows(editor.stored(lin), q))
        writers_w: dict = {}
        online = fold_online_rotations(graph, stream, editor, writers_w, cfg.seed) if cfg.online_hadamard else {}
        set_writer_weights(stream, editor, writers_w)
        graph.toposort()
        facts.ROTATED.set(graph, seed=cfg.seed, kind="randomized-hadamard")
        return PassResult(True, {
            "hidden": d, "norms": len(stream.norms), "readers": len(stream.readers),
            "online": {"norm_outputs": len(stream.norms), "hadamard": sum(v == "hadamard" for v in online.values()),
                       "dense_fallback": sorted(k for k, v in online.items() if v != "hadamard")},
        })
