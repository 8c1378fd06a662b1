"""The GPTQ rewrite (the body of the ``gptq`` pass, and the base ``dpq`` builds on): GPTQ weight quantization (int4/int8, per channel or per group) from calibration Hessians.

Why: at 4 bits, round-to-nearest weights lose a third of SmolLM2's perplexity; GPTQ
(``edgeq.passes.methods.gptq``) quantizes each weight column and compensates its rounding error on the columns
not yet quantized, weighted by the layer input's Hessian ``H = 2 X^T X / n``, so the layer output
moves far less. The Hessians are streamed over the calibration data (float64, K^2 per linear
input, independent of the number of tokens; linears reading the same tensor share one).
``sink_weight`` counts each sequence's first token (the attention sink) that many times in the
Hessians of ``sink_roles`` (see ``HessianObserver``); ``order = "gar"`` is DPQ's group-aware
reordering, which needs no runtime permutation.

Output: the integer weight and its scales behind a DequantizeLinear (per channel: axis over the
outputs; per group: opset 21 ``block_size`` along K), the form onnxruntime turns into
``MatMulNBits`` itself (weight-only, W4A16) or, once ``qdq`` adds activation Q/DQ, an integer
kernel; ``lowering = "matmulnbits"`` writes onnxruntime's ``com.microsoft::MatMulNBits`` directly.
The linears are recorded in the model metadata so a later ``qdq`` quantizes their activations
while keeping these weights. The ``dpq`` pass subclasses this one (other grid, FP8 levels).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.calib.observers import HessianObserver, PlainHessianObserver
from edgeq.errors import UserInputError
from edgeq.passes.methods.gptq import ORDERS, ColumnQuantizer, GptqResult, IntColumns, gptq_quantize
from edgeq.passmanager.passbase import Pass, PassConfig, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.quantize.qdq_nodes import check_weights_finite, ensure_opset, insert_weight_dequantize
from edgeq.quantize.quant import QuantSpec, dequantize_weight, quantize_weight
from edgeq.structure import find_linears
from edgeq.structure.linears import Linear

_DTYPES = ("int4", "int8", "uint4", "uint8")
ATTENTION_ROLES = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class GptqConfig(PassConfig):
    weight_dtype: str = "int4"
    weight_symmetric: bool = True
    weight_granularity: str = "group"  # channel | group
    group_size: int = 128
    block_size: int = 128  # columns per lazy-update block
    damp: float = 0.01  # fraction of the mean Hessian diagonal added to it
    order: str = "natural"  # natural | act_order | gar
    mse: bool = False  # search a shrunk range per channel/group minimizing the rounding MSE
    # symmetric: map the largest-magnitude value to -2^(b-1) (all 16 int4 levels, signed scales,
    # like onnxruntime's MatMulNBits quantizer) instead of +-(2^(b-1) - 1)
    full_range: bool = False
    # with full_range: keep every scale positive (scale = max(-min / 2^(b-1), max / (2^(b-1) - 1))):
    # Qualcomm's HTP computes negative weight scales wrongly (passes/positive_weight_scales.py)
    positive_scales: bool = False
    # with weight_granularity "group": a linear whose K is not a multiple of group_size is quantized
    # per output channel instead of ending in a partial block. Qualcomm's HTP takes a partial last
    # block and computes it wrongly (onnxruntime-qnn 2.7.0: relative error ~180 at K = 1535 in
    # blocks of 64, exact at K = 1536); RMS's Eq. 9 split leaves K = 1535 on 4 of SmolLM2's linears.
    whole_blocks: bool = False
    sink_weight: float = 1.0  # times each sequence's first token counts in the Hessian
    sink_roles: tuple[str, ...] = ATTENTION_ROLES  # linears whose Hessians weight the sink
    skip_roles: tuple[str, ...] = ()
    lowering: str = "qdq"  # qdq (DequantizeLinear + MatMul) | matmulnbits (onnxruntime contrib op)

    def __post_init__(self):
        if self.weight_dtype not in _DTYPES:
            raise UserInputError(f"{self.pass_name}: weight_dtype must be one of {', '.join(_DTYPES)}, got '{self.weight_dtype}'")
        if self.weight_granularity not in ("channel", "group"):
            raise UserInputError(f"{self.pass_name}: weight_granularity must be channel or group, got '{self.weight_granularity}'")
        if self.weight_granularity == "group" and self.group_size not in (32, 64, 128):
            raise UserInputError(f"{self.pass_name}: group_size must be 32, 64 or 128, got {self.group_size}")
        if self.block_size < 1 or (self.weight_granularity == "group" and self.block_size % self.group_size):
            raise UserInputError(f"{self.pass_name}: block_size must be a positive multiple of group_size")
        if self.order not in ORDERS:
            raise UserInputError(f"{self.pass_name}: order must be one of {', '.join(ORDERS)}, got '{self.order}'")
        if self.order == "gar" and self.weight_granularity != "group":
            raise UserInputError(f"{self.pass_name}: order 'gar' reorders groups; it needs weight_granularity = 'group'")
        if self.full_range and (not self.weight_symmetric or self.weight_dtype.startswith("u")):
            raise UserInputError(f"{self.pass_name}: full_range needs symmetric signed weights")
        if self.whole_blocks and (self.weight_granularity != "group" or self.lowering != "qdq" or self.pass_name != "gptq"):
            raise UserInputError(f"{self.pass_name}: whole_blocks refines weight_granularity = 'group' with lowering 'qdq' "
                                 "(gptq only: its per-channel fallback is a DequantizeLinear)")
        if self.positive_scales and not self.full_range:
            raise UserInputError(f"{self.pass_name}: positive_scales refines full_range (without it every scale is positive already)")
        if not 0.0 <= self.damp < 1.0:
            raise UserInputError(f"{self.pass_name}: damp must be in [0, 1), got {self.damp}")
        if not self.sink_weight >= 1.0:
            raise UserInputError(f"{self.pass_name}: sink_weight must be >= 1, got {self.sink_weight}")
        if self.lowering not in self.lowerings:
            raise UserInputError(f"{self.pass_name}: lowering must be one of {', '.join(self.lowerings)}, got '{self.lowering}'")
        if self.lowering == "matmulnbits" and (self.weight_dtype not in ("int4", "uint4") or self.weight_granularity != "group"):
            raise UserInputError(f"{self.pass_name}: lowering 'matmulnbits' needs 4-bit weights in groups")

    pass_name = "gptq"  # class attributes (not fields): what a subclass's errors say and allow
    lowerings = ("qdq", "matmulnbits")


class GptqRewrite(Pass):
    """Not registered and declares nothing: ``edgeq.passes.gptq`` (``gptq``) and ``edgeq.passes.dpq``
    (``dpq``) subclass it, each declaring itself in its class line (config: a ``GptqConfig``)."""

    config: GptqConfig

    def spec(self, stored_nk: bool, k: int | None = None) -> QuantSpec:
        """The weight's quantization; ``k`` (its K) decides the per-channel fallback of
        ``whole_blocks`` (None: the pass's own form)."""
        cfg: GptqConfig = self.config
        n_axis, k_axis = (0, 1) if stored_nk else (1, 0)
        if cfg.weight_granularity == "group" and not self.partial_block(k):
            return QuantSpec(cfg.weight_dtype, cfg.weight_symmetric, axis=k_axis, block_size=cfg.group_size)
        return QuantSpec(cfg.weight_dtype, cfg.weight_symmetric, axis=n_axis)

    def partial_block(self, k: int | None) -> bool:
        """``whole_blocks`` and a K that blocks of ``group_size`` do not divide: per channel instead."""
        cfg: GptqConfig = self.config
        return bool(k and cfg.whole_blocks and cfg.weight_granularity == "group" and k % cfg.group_size)

    # -- hooks the dpq pass overrides -------------------------------------------------------
    def columns(self, w_kn: np.ndarray) -> ColumnQuantizer:
        cfg: GptqConfig = self.config
        return IntColumns(self.spec(False, w_kn.shape[0]), cfg.mse, cfg.full_range, cfg.positive_scales)

    def write_weight(self, graph: gs.Graph, index: ir.GraphIndex, lin: Linear, w_kn: np.ndarray,
                     res: GptqResult, stored_nk: bool) -> gs.Variable:
        """The float weight the linear reads (here: the DequantizeLinear of the integers)."""
        q, scale, zp = res.q, res.scale, res.zero_point
        if stored_nk:
            q, scale, zp = q.T, scale.T if scale.ndim == 2 else scale, zp.T if zp.ndim == 2 else zp
        stored = w_kn.T if stored_nk else w_kn
        return insert_weight_dequantize(graph, index, stored, self.spec(stored_nk, w_kn.shape[0]), lin.weight, (q, scale, zp))

    def finish(self, graph: gs.Graph, index: ir.GraphIndex, linears: list[Linear], ctx: PassContext) -> dict:
        """After every weight is written (dpq: activation FP8 Q/DQ); returns summary entries."""
        facts.WEIGHTS_QUANTIZED_FIRST.add(graph, [lin.node for lin in linears])
        return {}

    # ---------------------------------------------------------------------------------------
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: GptqConfig = self.config
        keep_float = facts.KEEP_FLOAT.names(graph)
        index = ir.GraphIndex(graph)
        linears = [lin for lin in find_linears(graph) if lin.role not in cfg.skip_roles and lin.node not in keep_float]
        group = cfg.group_size if cfg.weight_granularity == "group" else 0
        if not linears:
            raise PassNotApplicable(Reason.NO_SITES, "no float linear left to quantize (every linear is already "
                                    "quantized, kept float or in skip_roles)", linears_quantized=0)
        check_weights_finite(index, linears)
        if cfg.lowering == "matmulnbits" and any(lin.op != "MatMul" for lin in linears):
            raise UserInputError(f"{self.name}: lowering 'matmulnbits' handles MatMul linears only; this model has Gemm linears")
        sites = sorted({lin.input for lin in linears})
        # the first-token term only where a sink-weighted linear reads the input
        sink_sites = {lin.input for lin in linears if lin.role in cfg.sink_roles} if cfg.sink_weight != 1.0 else set()
        hessians = cast("dict[str, HessianObserver]", ctx.require_calibrator(self.name).observe(
            graph, {s: HessianObserver if s in sink_sites else PlainHessianObserver for s in sites},
            "gptq:hessian+sink"))
        readers_left = {s: sum(lin.input == s for lin in linears) for s in sites}
        hessian_tokens = int(next(iter(hessians.values())).count)
        nodes = {n.name: n for n in graph.nodes}
        ensure_opset(graph, self.spec(False))
        start = time.perf_counter()
        done: dict[tuple[str, bool], gs.Variable] = {}
        results: dict[str, GptqResult] = {}
        ratios, per_channel = [], []
        for lin in linears:
            key = (lin.weight, lin.weight_transposed)
            if key not in done:
                w = np.asarray(index.constant_value(index.tensors[lin.weight]), np.float32)
                stored_nk = lin.op == "Gemm" and lin.weight_transposed
                w_kn = w.T if lin.weight_transposed else w  # the math's [K, N]
                # (the input's last reader takes the observer's own array: a K x K float64 less)
                h = hessians[lin.input].hessian_with_sink(cfg.sink_weight if lin.role in cfg.sink_roles else 1.0,
                                                          consume=readers_left[lin.input] == 1)
                spec = self.spec(False, w_kn.shape[0])
                if self.partial_block(w_kn.shape[0]):  # per channel: any column order is free at run time
                    per_channel.append(lin.node)
                    res = gptq_quantize(w_kn, h, spec, 0, cfg.block_size, cfg.damp,
                                        order="natural" if cfg.order == "natural" else "act_order", columns=self.columns(w_kn))
                else:
                    res = gptq_quantize(w_kn, h, spec, group, cfg.block_size, cfg.damp,
                                        order=cfg.order, columns=self.columns(w_kn))
                ratios.append(_output_error(w_kn, res.dequantized, h) / max(_output_error(w_kn, _rtn(w_kn, spec), h), 1e-30))
                del h
                done[key] = self.write_weight(graph, index, lin, w_kn, res, stored_nk)
                if cfg.lowering == "matmulnbits":  # (the integers, small; not the float weight)
                    results[lin.node] = dataclasses.replace(  # dequantized: freed, the lowering reads the integers
                        res, q=res.q.astype(np.int8), dequantized=None)  # type: ignore[arg-type]
                del res, w, w_kn
            readers_left[lin.input] -= 1
            if not readers_left[lin.input]:
                del hessians[lin.input]  # a K x K float64 per input: freed once its last linear is done
            node = nodes[lin.node]
            node.inputs[1] = done[key]
            if lin.op == "Gemm":
                node.attrs["transB"] = int(lin.weight_transposed)  # the DQ'd weight keeps the stored layout
        seconds = time.perf_counter() - start
        extra = self.finish(graph, index, linears, ctx)
        if cfg.lowering == "matmulnbits":
            from edgeq.passes.methods.gptq_lowering import lower_to_matmulnbits

            extra["matmulnbits"] = lower_to_matmulnbits(graph, index, linears, nodes, results, group,
                                                        signed=cfg.weight_dtype == "int4")
        return PassResult(True, {
            "linears_quantized": len(linears),
            "weights_quantized": len(done),
            "weight": f"{cfg.weight_dtype} {'symmetric' if cfg.weight_symmetric else 'asymmetric'} "
                      + (f"per-group ({cfg.group_size})" if group else "per-channel")
                      + (f", order {cfg.order}" if cfg.order != "natural" else "") + (", mse range" if cfg.mse else ""),
            "hessian_tokens": hessian_tokens,
            "sink_weight": cfg.sink_weight,
            "seconds": round(seconds, 1),
            "output_error_vs_rtn": {"median": float(np.median(ratios)), "max": float(np.max(ratios))},
            **({"per_channel_partial_k": per_channel} if cfg.whole_blocks else {}),
            **extra,
        })


def _rtn(w_kn: np.ndarray, spec: QuantSpec) -> np.ndarray:
    return dequantize_weight(*quantize_weight(w_kn, spec), spec)


def _output_error(w: np.ndarray, w_hat: np.ndarray, h: np.ndarray) -> float:
    """tr(E^T H E) with E = W - W_hat: the layer's output error over the calibration inputs."""
    e = np.asarray(w, np.float64) - np.asarray(w_hat, np.float64)
    return float(np.sum(e * (h @ e)))
