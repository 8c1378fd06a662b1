"""``gptq``: GPTQ weight quantization (int4/int8, per channel or per group) from calibration Hessians.

Why: at 4 bits, round-to-nearest weights lose a third of SmolLM2's perplexity; GPTQ
(``edgeq.gptq``) quantizes each weight column and compensates its rounding error on the columns
not yet quantized, weighted by the layer input's Hessian ``H = 2 X^T X / n``, so the layer output
moves far less. The Hessians are streamed over the calibration data (float64, K^2 per linear
input, independent of the number of tokens; linears reading the same tensor share one).

Output: the integer weight and its scales behind a DequantizeLinear (per channel: axis over the
outputs; per group: opset 21 ``block_size`` along K), the form onnxruntime turns into
``MatMulNBits`` (weight-only, W4A16) or, once ``qdq`` adds activation Q/DQ, an integer kernel. The
linears are recorded in the model metadata so a later ``qdq`` quantizes their activations while
keeping these weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq import ir
from edgeq.calib.observers import HessianObserver
from edgeq.errors import UserInputError
from edgeq.gptq import gptq_quantize
from edgeq.passbase import Exactness, Pass, PassConfig, PassContext, PassResult
from edgeq.qdq_nodes import ensure_opset, insert_weight_dequantize
from edgeq.quant import QuantSpec, dequantize_weight, quantize_weight
from edgeq.registry import register_pass
from edgeq.structure import find_linears

_DTYPES = ("int4", "int8", "uint4", "uint8")


@dataclass(frozen=True)
class GptqConfig(PassConfig):
    weight_dtype: str = "int4"
    weight_symmetric: bool = True
    weight_granularity: str = "group"  # channel | group
    group_size: int = 128
    block_size: int = 128  # columns per lazy-update block
    damp: float = 0.01  # fraction of the mean Hessian diagonal added to it
    act_order: bool = False  # visit columns by decreasing Hessian diagonal
    mse: bool = False  # search a shrunk range per channel/group minimizing the rounding MSE
    # symmetric: map the largest-magnitude value to -2^(b-1) (all 16 int4 levels, signed scales,
    # like onnxruntime's MatMulNBits quantizer) instead of +-(2^(b-1) - 1)
    full_range: bool = False
    skip_roles: tuple[str, ...] = ()

    def __post_init__(self):
        if self.weight_dtype not in _DTYPES:
            raise UserInputError(f"gptq: weight_dtype must be one of {', '.join(_DTYPES)}, got '{self.weight_dtype}'")
        if self.weight_granularity not in ("channel", "group"):
            raise UserInputError(f"gptq: weight_granularity must be channel or group, got '{self.weight_granularity}'")
        if self.weight_granularity == "group" and self.group_size not in (32, 64, 128):
            raise UserInputError(f"gptq: group_size must be 32, 64 or 128, got {self.group_size}")
        if self.block_size < 1 or (self.weight_granularity == "group" and self.block_size % self.group_size):
            raise UserInputError("gptq: block_size must be a positive multiple of group_size")
        if self.full_range and (not self.weight_symmetric or self.mse or self.weight_dtype.startswith("u")):
            raise UserInputError("gptq: full_range needs symmetric signed weights without mse")
        if not 0.0 <= self.damp < 1.0:
            raise UserInputError(f"gptq: damp must be in [0, 1), got {self.damp}")


@register_pass
class GptqPass(Pass):
    name = "gptq"
    exactness = Exactness.LOSSY
    Config = GptqConfig
    needs_calibration = True
    summary_line = "GPTQ weights (int4/int8, per channel or group) with Hessian error compensation"

    def spec(self, stored_nk: bool) -> QuantSpec:
        cfg: GptqConfig = self.config
        n_axis, k_axis = (0, 1) if stored_nk else (1, 0)
        if cfg.weight_granularity == "group":
            return QuantSpec(cfg.weight_dtype, cfg.weight_symmetric, axis=k_axis, block_size=cfg.group_size)
        return QuantSpec(cfg.weight_dtype, cfg.weight_symmetric, axis=n_axis)

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: GptqConfig = self.config
        keep_float = ir.keep_float_nodes(graph)
        index = ir.GraphIndex(graph)
        linears = [lin for lin in find_linears(graph) if lin.role not in cfg.skip_roles and lin.node not in keep_float]
        group = cfg.group_size if cfg.weight_granularity == "group" else 0
        if not linears:
            return PassResult(False, {"linears_quantized": 0})
        sites = sorted({lin.input for lin in linears})
        hessians = ctx.require_calibrator(self.name).observe(graph, {s: HessianObserver for s in sites}, "gptq:hessian")
        nodes = {n.name: n for n in graph.nodes}
        ensure_opset(graph, self.spec(False))
        start = time.perf_counter()
        done: dict[tuple[str, bool], gs.Variable] = {}
        ratios = []
        for lin in linears:
            key = (lin.weight, lin.weight_transposed)
            if key not in done:
                w = np.asarray(index.constant_value(index.tensors[lin.weight]), np.float32)
                stored_nk = lin.op == "Gemm" and lin.weight_transposed
                w_kn = w.T if lin.weight_transposed else w  # the math's [K, N]
                h = hessians[lin.input].hessian
                res = gptq_quantize(w_kn, h, self.spec(False), group, cfg.block_size, cfg.damp, cfg.act_order, cfg.mse, cfg.full_range)
                ratios.append(_output_error(w_kn, res.dequantized, h) / max(_output_error(w_kn, _rtn(w_kn, self.spec(False)), h), 1e-30))
                q, scale, zp = res.q, res.scale, res.zero_point
                if stored_nk:
                    q, scale, zp = q.T, scale.T if scale.ndim == 2 else scale, zp.T if zp.ndim == 2 else zp
                stored = w_kn.T if stored_nk else w_kn
                done[key] = insert_weight_dequantize(graph, index, stored, self.spec(stored_nk), lin.weight, (q, scale, zp))
            node = nodes[lin.node]
            node.inputs[1] = done[key]
            if lin.op == "Gemm":
                node.attrs["transB"] = int(lin.weight_transposed)  # the DQ'd weight keeps the stored layout
        ir.add_weights_quantized_first(graph, [lin.node for lin in linears])
        return PassResult(True, {
            "linears_quantized": len(linears),
            "weights_quantized": len(done),
            "weight": f"{cfg.weight_dtype} {'symmetric' if cfg.weight_symmetric else 'asymmetric'} "
                      + (f"per-group ({cfg.group_size})" if group else "per-channel")
                      + (", act-order" if cfg.act_order else "") + (", mse range" if cfg.mse else ""),
            "hessian_tokens": int(next(iter(hessians.values())).count),
            "seconds": round(time.perf_counter() - start, 1),
            "output_error_vs_rtn": {"median": float(np.median(ratios)), "max": float(np.max(ratios))},
        })


def _rtn(w_kn: np.ndarray, spec: QuantSpec) -> np.ndarray:
    return dequantize_weight(*quantize_weight(w_kn, spec), spec)


def _output_error(w: np.ndarray, w_hat: np.ndarray, h: np.ndarray) -> float:
    """tr(E^T H E) with E = W - W_hat: the layer's output error over the calibration inputs."""
    e = np.asarray(w, np.float64) - np.asarray(w_hat, np.float64)
    return float(np.sum(e * (h @ e)))
