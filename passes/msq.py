"""``msq``: MQuant's Modality-Specific Static Quantization (section 3.1, appendix A.10).

Why: visual and text tokens of a vision-language model reach the linears with different activation
ranges, so one static per-tensor scale either clips one modality or wastes the other's levels.
MSQ keeps static per-tensor quantization (no per-token scale computed at run time) but gives every
activation site two scales: one calibrated on visual tokens, one on text tokens. Everything else is
the ``qdq`` pass (weights, role overrides, bit widths, observers): ``msq`` is ``qdq`` with
modality-split calibration and a two-scale activation quantizer.

Which tokens are visual: after ``aifs`` (the recommended order), rows ``[0, visual_count[b])`` of
every batch row (the count AIFS computes in the graph); without AIFS, the tokens of the visual span
plus left padding, wherever they sit (the interleaved fallback). Calibration splits every site's
statistics with the same in-graph mask.

How the two scales are applied (``lowering``):

- ``integer`` (default; any layout): ``x * g -> QuantizeLinear(s_t) -> DequantizeLinear -> MatMul
  -> * 1/g`` with ``g = s_t / s_v`` on visual rows and 1 on text rows. The integers are those of
  quantizing visual rows with ``s_v`` and text rows with ``s_t`` (``round(x g / s_t) = round(x /
  s_v)``), and onnxruntime still fuses the Q/DQ/MatMul into its integer kernel; the price is two
  row-broadcast multiplies per linear. Needs symmetric activations (one shared zero point).
- ``custom``: ``edgeq::ModalityQDQ(x, visual_count, s_v, zp_v, s_t, zp_t)``, the NPU hand-off form
  (a native kernel quantizes the two contiguous slices); needs ``aifs``. onnxruntime runs its
  function body (two QDQs and a select) and the linears in float.
- ``select``: ``Where(is_visual, QDQ_v(x), QDQ_t(x))`` in standard ops; works on interleaved
  tokens (what MSQ without AIFS costs a backend that has only per-tensor QDQ); float linears.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.errors import UserInputError
from edgeq.graph.graph_builder import NodeBuilder
from edgeq.modality_mask import prefix_mask, span_input_names, visual_block_mask
from edgeq.passmanager.passbase import Exactness, PassContext, PassResult
from edgeq.passes.methods.static_qdq import QDQConfig, StaticQDQ, static_activations
from edgeq.quantize.qdq_nodes import QuantizedTensor, insert_dequantize, insert_quantize
from edgeq.quantize.quant import QuantSpec, scale_zero_point
from edgeq.runtime_ops.domain import DOMAIN

MSQ_KEY = facts.MSQ.key  # the model metadata key msq leaves (tests read it)
LOWERINGS = ("integer", "custom", "select")


@dataclass(frozen=True)
class MsqConfig(QDQConfig):
    lowering: str = "integer"
    # sites whose visual and text scales differ by less than this factor share one scale (the
    # wider range), skipping the per-row rescaling there; 1.0: every site gets two scales (the paper)
    min_scale_ratio: float = 1.0
    mask_input: str = "attention_mask"
    embeds_input: str = "inputs_embeds"

    def __post_init__(self):
        super().__post_init__()
        if self.lowering not in LOWERINGS:
            raise UserInputError(f"msq: lowering must be one of {', '.join(LOWERINGS)}, got '{self.lowering}'")
        if self.activation_granularity != "tensor":
            raise UserInputError("msq: per-modality scales are static per-tensor; activation_granularity must be 'tensor'")
        if not self.min_scale_ratio >= 1.0:
            raise UserInputError(f"msq: min_scale_ratio must be >= 1, got {self.min_scale_ratio}")
        if self.lowering == "integer" and not self.activation_symmetric:
            raise UserInputError("msq: lowering 'integer' needs symmetric activations (one zero point for both scales)")


@dataclass(frozen=True)
class _RescaledSite:
    """An activation quantized with the text scale after a per-row gain; readers undo the gain."""

    quantized: QuantizedTensor
    gain: gs.Variable  # [B, S, 1]: readers divide their output by it


class MsqPass(StaticQDQ, name="msq", exactness=Exactness.LOSSY, config=MsqConfig, establishes=facts.MSQ,
              calibrates=static_activations, needs=("vlm",),
              summary="MQuant MSQ: qdq with a visual and a text static scale per activation site (after aifs: visual-first slices)"):
    config: MsqConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: MsqConfig = self.config
        self._b = NodeBuilder(graph, ir.GraphIndex(graph), "msq")
        self._graph = graph
        self._aifs = facts.AIFS.get(graph) or {}
        self._masks: dict[str, tuple[gs.Tensor, gs.Tensor]] = {}  # order -> (is_visual [B,S], [B,S,1])
        self._count = None
        self._ranges: dict[str, dict] = {}
        if "visual_count" not in self._aifs and cfg.lowering == "custom":
            raise UserInputError("msq: lowering 'custom' (edgeq::ModalityQDQ) needs the visual-first layout: run aifs before msq")
        self._mask("permuted" if "visual_count" in self._aifs else "original")  # fail early on a text-only graph
        result = super().run(graph, ctx)
        if result.modified:
            # visual_mask: the [B, S] is-visual tensor of the original token order, which a static
            # specialization replaces by its fixed visual slice (edgeq.static.vlm)
            original = self._masks.get("original")
            facts.MSQ.set(graph, layout=self._layout(), lowering=cfg.lowering,
                          **({"visual_mask": original[0].name} if original is not None else {}))
        return result

    def _layout(self) -> str:
        return "prefix" if "visual_count" in self._aifs else "interleaved"

    def _order_of(self, site: str) -> str:
        """'permuted' for tensors in AIFS's visual-first order, 'original' otherwise."""
        if "visual_count" not in self._aifs or site in self._aifs.get("original_order", "").split(","):
            return "original"
        return "permuted"

    def _mask(self, order: str) -> tuple[gs.Tensor, gs.Tensor]:
        """(is_visual [B, S] bool, the same as [B, S, 1]) for tensors in ``order``, built once."""
        if order in self._masks:
            return self._masks[order]
        cfg: MsqConfig = self.config
        b, inputs = self._b, {t.name: t for t in self._graph.inputs}
        if cfg.mask_input not in inputs:
            raise UserInputError(f"msq: the model has no '{cfg.mask_input}' input; per-modality scales need a "
                                 "vision-language graph with visual span inputs (use qdq for text-only models)")
        mask = inputs[cfg.mask_input]
        if order == "permuted":
            count = b.index.tensors[self._aifs["visual_count"]]  # [B, 1]
            self._count = b.op("Squeeze", "VisualCount", [count, b.const("axes_1", np.array([1], np.int64))], np.int64)
            is_visual = prefix_mask(b, mask, count)
        else:
            span = span_input_names(ir.graph_metadata(self._graph))
            if len(span) != 2 or not all(n in inputs for n in span) or cfg.embeds_input not in inputs:
                raise UserInputError(f"msq: the model has no visual span inputs ({'/'.join(span)}); per-modality "
                                     "scales need to know which tokens are visual (use qdq for text-only models)")
            is_visual = visual_block_mask(b, inputs[cfg.embeds_input], mask, inputs[span[0]], inputs[span[1]])["first"]
        column = b.op("Unsqueeze", "IsVisualColumn", [is_visual, b.const("axes_last", np.array([2], np.int64))], np.bool_)
        self._masks[order] = (is_visual, column)
        return self._masks[order]

    def _activation_sites(self, graph, index, ctx, site_specs: dict[str, QuantSpec]) -> dict[str, object]:
        sites: dict[str, object] = {}
        groups: dict[tuple, list[str]] = {}
        for name, spec in site_specs.items():
            groups.setdefault((spec, self._order_of(name)), []).append(name)
        for (spec, order), names in sorted(groups.items(), key=lambda kv: (kv[0][0].dtype, kv[0][0].bits, kv[0][1])):
            is_visual, column = self._mask(order)
            for name, obs in self._calibrate(graph, ctx, sorted(names), spec, split_by=is_visual.name).items():
                visual, text = self._modality_ranges(name, obs)
                sites[name] = self._quantize(graph, index, index.tensors[name], visual, text, spec, column, order)
        return sites

    def _modality_ranges(self, name: str, obs) -> tuple[tuple[float, float], tuple[float, float]]:
        """(visual lo/hi, text lo/hi); a modality calibration never saw takes the other's range."""
        seen = [int(n) > 0 for n in obs.tokens]
        if not any(seen):
            raise UserInputError(f"calibration saw no tokens for '{name}'")
        visual = obs.visual.range() if seen[0] else obs.text.range()
        text = obs.text.range() if seen[1] else obs.visual.range()
        self._ranges[name] = {"visual": [float(v) for v in visual], "text": [float(t) for t in text],
                              "tokens": [int(n) for n in obs.tokens],
                              "absmax": [_absmax(o) if n else None for o, n in ((obs.visual, seen[0]), (obs.text, seen[1]))]}
        return visual, text

    def _quantize(self, graph, index, x: gs.Tensor, visual: tuple[float, float], text: tuple[float, float],
                  spec: QuantSpec, vis3: gs.Tensor, order: str):
        cfg: MsqConfig = self.config
        b = self._b
        s_v, _ = scale_zero_point(np.array(visual[0]), np.array(visual[1]), spec)
        s_t, _ = scale_zero_point(np.array(text[0]), np.array(text[1]), spec)
        if max(s_v / s_t, s_t / s_v) < cfg.min_scale_ratio:
            self._ranges[x.name]["shared"] = True
            return insert_quantize(graph, index, x, min(visual[0], text[0]), max(visual[1], text[1]), spec)
        if cfg.lowering == "integer":
            one = np.float32(1.0)
            gain = b.op("Where", f"{x.name}_ModalityGain", [vis3, b.const(f"{x.name}_gain", np.float32(s_t / s_v)), b.const("one", one)], np.float32)
            scaled = b.op("Mul", f"{x.name}_ModalityRescale", [x, gain], np.float32)
            return _RescaledSite(insert_quantize(graph, index, scaled, *text, spec), gain)
        qv = insert_quantize(graph, index, x, *visual, spec)
        qt = insert_quantize(graph, index, x, *text, spec)
        if cfg.lowering == "select" or order == "original":  # ModalityQDQ needs the visual-first rows
            dq_v, dq_t = (insert_dequantize(graph, index, q, f"{x.name}_{m}") for q, m in ((qv, "visual"), (qt, "text")))
            return b.op("Where", f"{x.name}_ModalitySelect", [vis3, dq_v, dq_t], np.float32)
        # custom: drop the two QuantizeLinear nodes, keep their parameters for the op
        for q in (qv, qt):
            graph.nodes.remove(next(n for n in graph.nodes if q.integer in n.outputs))
        out = gs.Variable(ir.unique_name(index, f"{x.name}_modality_qdq"), dtype=np.float32)
        b.add(gs.Node("ModalityQDQ", ir.unique_name(index, f"/msq/{x.name}_ModalityQDQ"),
                      inputs=[x, self._count, qv.scale, qv.zero_point, qt.scale, qt.zero_point], outputs=[out], domain=DOMAIN))
        return out

    def _wire_input(self, graph, index, node: gs.Node, site) -> None:
        if not isinstance(site, _RescaledSite):
            return super()._wire_input(graph, index, node, site)
        node.inputs[0] = insert_dequantize(graph, index, site.quantized, node.name)
        bias = node.inputs.pop(2) if node.op == "Gemm" and len(node.inputs) > 2 else None  # the gain must not scale it
        out = node.outputs[0]
        raw = gs.Variable(ir.unique_name(index, f"{out.name}_rescaled"), dtype=out.dtype)
        node.outputs[0] = raw
        if bias is None:
            self._b.add(gs.Node("Div", ir.unique_name(index, f"/msq/{node.name}_ModalityUnscale"), inputs=[raw, site.gain], outputs=[out]))
            return
        unscaled = self._b.op("Div", f"{node.name}_ModalityUnscale", [raw, site.gain], out.dtype)
        self._b.add(gs.Node("Add", ir.unique_name(index, f"/msq/{node.name}_Bias"), inputs=[unscaled, bias], outputs=[out]))

    def _extra_summary(self) -> dict:
        ratios = [max(abs(v) for v in r["visual"][:2]) / max(max(abs(t) for t in r["text"][:2]), 1e-12) for r in self._ranges.values()]
        return {
            "layout": self._layout() + (" (after aifs: visual rows first)" if self._layout() == "prefix" else " (no aifs: mask per token)"),
            "original_order_sites": sorted(n for n in self._ranges if self._order_of(n) == "original") if self._layout() == "prefix" else "all",
            "lowering": self.config.lowering,
            "two_scale_sites": sum(1 for r in self._ranges.values() if not r.get("shared")),
            "shared_scale_sites": sum(1 for r in self._ranges.values() if r.get("shared")),
            "visual_to_text_range_ratio": {"min": float(np.min(ratios)), "median": float(np.median(ratios)),
                                           "max": float(np.max(ratios))} if ratios else {},
            "modality_ranges": self._ranges,
        }


def _absmax(obs) -> float:
    """The unclipped |x| max an observer saw (its range() may be a clipped one)."""
    lo: Any
    hi: Any
    lo, hi = getattr(obs, "lo", None), getattr(obs, "hi", None)
    if lo is None:
        lo, hi = obs.range()
    return float(max(abs(lo), abs(hi)))
