"""``dpq``: DPQ W4A8: INT4 weights computed in FP8, static FP8 activations (paper 003).

Why: an FP8 tensor core with 4-bit weight storage halves weight memory against FP8 W8A8 and runs
up to 3x W4A16 on Gaudi (paper Fig. 4); the cost is two weight roundings (INT4 grid, then FP8),
which DPQ's compensation (``edgeq.passes.methods.dpq.DpqColumns`` inside the GPTQ sweep) sees both of. Group-aware
reordering (``order = "gar"``, the default) quantizes the groups holding the most important inputs
first without any runtime permutation. ``two_level = false`` is the ablation "GPTQ, then cast to
FP8": plain GPTQ INT4 on the real weight, then the same FP8 form.

ONNX form (per linear), ``lowering = "qdq"``:
``DequantizeLinear(INT4 [K, N], real group scale s_g * s8, zero point; axis 0, block_size)`` ->
``QuantizeLinear/DequantizeLinear(float8e4m3fn, s8)`` is the weight; the activation gets a static
per-tensor ``QuantizeLinear/DequantizeLinear(float8e4m3fn, s_x = max|x| / 448)`` from calibration.
Standard ops only, the hand-off form for NPU SDKs. onnxruntime 1.31's CPU provider runs it with
graph optimizations at BASIC or below (FP8 emulated in float32: it rounds exactly like the numpy
reference); at its default level its QDQ selector rewrites DQ(FP8) x DQ(FP8) -> MatMul into
MatMulIntegerToFloat without checking the type and the model fails to load (measured;
``tests/test_w4a8_linear_op.py`` keeps that on record).
``lowering = "custom"`` (the recipe's choice) writes one ``edgeq::W4A8Linear`` node per linear
instead: its function body is the same computation with the FP8 dequantization written as
``Cast * scale``, so onnxruntime loads it at every level, and a native W4A8 kernel (e.g.
``kernels/w4a8_gemm_triton.py``) matches the op by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.calib.observers import MinMaxObserver
from edgeq.passes.methods.dpq import DpqColumns
from edgeq.errors import UserInputError
from edgeq.passes.methods.fp8 import FP8_MAX, power_of_two_scale
from edgeq.passes.methods.gptq import ColumnQuantizer, GptqResult, IntColumns
from edgeq.passmanager.passbase import Exactness, PassContext
from edgeq.quantize.qdq_nodes import insert_fp8_qdq
from edgeq.quantize.quant import QuantSpec
from edgeq.structure.linears import Linear
from edgeq.passes.methods.gptq_rewrite import GptqConfig, GptqRewrite


@dataclass(frozen=True)
class DpqConfig(GptqConfig):
    weight_dtype: str = "uint4"  # the paper's unsigned INT4 with zero points; int4 = symmetric
    weight_symmetric: bool = False
    order: str = "gar"
    two_level: bool = True  # False: the ablation "GPTQ, then cast to FP8"
    lowering: str = "qdq"  # qdq (standard Q/DQ ops) | custom (edgeq::W4A8Linear)

    pass_name = "dpq"
    lowerings = ("qdq", "custom")

    def __post_init__(self):
        if self.weight_granularity != "group":
            raise UserInputError("dpq: INT4 weights are stored in groups; weight_granularity must be 'group'")
        if self.weight_dtype not in ("int4", "uint4"):
            raise UserInputError(f"dpq: weights are 4-bit; weight_dtype must be int4 or uint4, got '{self.weight_dtype}'")
        if (self.weight_dtype == "int4") != self.weight_symmetric:
            raise UserInputError("dpq: uint4 weights are asymmetric (weight_symmetric = false), int4 symmetric (true)")
        if self.full_range or self.mse:
            raise UserInputError("dpq: the INT4 grid is DPQ's own (fitted in the FP8 domain); full_range and mse do not apply")
        super().__post_init__()


class DpqPass(GptqRewrite, name="dpq", exactness=Exactness.LOSSY, config=DpqConfig, calibrates=True,
              summary="DPQ W4A8: INT4 weights dequantized to FP8, static FP8 activations, two-level GPTQ + GAR"):
    config: DpqConfig

    def spec(self, stored_nk: bool, k: int | None = None) -> QuantSpec:
        """Always blocks of ``group_size`` along K: DPQ has no per-channel fallback (``k`` unused;
        ``whole_blocks`` is refused for dpq by its config)."""
        cfg: DpqConfig = self.config
        return QuantSpec(cfg.weight_dtype, cfg.weight_symmetric, axis=1 if stored_nk else 0, block_size=cfg.group_size)

    def columns(self, w_kn: np.ndarray) -> ColumnQuantizer:
        cfg: DpqConfig = self.config
        if cfg.two_level:
            return DpqColumns(w_kn, cfg.group_size, cfg.weight_symmetric)
        return IntColumns(self.spec(False))

    def write_weight(self, graph: gs.Graph, index: ir.GraphIndex, lin: Linear, w_kn: np.ndarray,
                     res: GptqResult, stored_nk: bool) -> gs.Variable:
        s8 = res.fp8_scale if res.fp8_scale is not None else power_of_two_scale(float(np.max(np.abs(res.dequantized))))
        self._weights[lin.weight] = (res, s8, stored_nk)
        int4 = super().write_weight(graph, index, lin, w_kn, res, stored_nk)
        return insert_fp8_qdq(graph, index, int4, s8, lin.weight)

    def run(self, graph: gs.Graph, ctx: PassContext):
        self._weights: dict[str, tuple[GptqResult, float, bool]] = {}
        return super().run(graph, ctx)

    def finish(self, graph: gs.Graph, index: ir.GraphIndex, linears: list[Linear], ctx: PassContext) -> dict:
        cfg: DpqConfig = self.config
        sites = sorted({lin.input for lin in linears})
        ranges = ctx.require_calibrator(self.name).observe(graph, {s: MinMaxObserver for s in sites}, "dpq:absmax")
        scales = {}
        for s in sites:
            lo, hi = ranges[s].range()
            amax = max(abs(float(lo)), abs(float(hi)))
            if not np.isfinite(amax):
                raise UserInputError(f"dpq: calibration saw no finite values for '{s}'")
            scales[s] = amax / FP8_MAX if amax > 0 else 1.0
        if cfg.lowering == "custom":
            from edgeq.passes.methods.dpq_custom import lower_to_w4a8_linear

            lower_to_w4a8_linear(graph, index, linears, self._weights, scales, cfg.group_size, self.spec(False))
        else:
            shared = {s: insert_fp8_qdq(graph, index, index.tensors[s], scales[s], s) for s in sites}
            nodes = {n.name: n for n in graph.nodes}
            for lin in linears:
                nodes[lin.node].inputs[0] = shared[lin.input]
        graph.cleanup()
        return {"activation": "float8e4m3fn static per-tensor (max|x| / 448)",
                "compensation": "two-level (INT4 -> FP8)" if cfg.two_level else "GPTQ then FP8 (ablation)",
                "lowering": cfg.lowering}

