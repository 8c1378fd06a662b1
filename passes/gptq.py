"""``gptq``: GPTQ weight quantization (int4/int8, per channel or per group) from calibration Hessians.

The rewrite (Hessians streamed over the calibration data, attention-sink weighting, act-order /
group-aware orders, DequantizeLinear or MatMulNBits output) is ``edgeq.passes.methods.gptq_rewrite``
over the sweep in ``edgeq.passes.methods.gptq``; ``dpq`` builds on the same rewrite.
"""

from __future__ import annotations

from edgeq.passmanager.passbase import Combine, Exactness
from edgeq.passes.methods.gptq_rewrite import GptqConfig, GptqRewrite

__all__ = ["GptqConfig", "GptqPass"]


class GptqPass(GptqRewrite, name="gptq", exactness=Exactness.LOSSY, config=GptqConfig, calibrates=True, per_block=True,
               summary="GPTQ weights (int4/int8, per channel or group) with Hessian error compensation",
               # every block sees the same calibration tokens; the error ratio is the worst block's
               combine={"hessian_tokens": Combine.FIRST, "sink_weight": Combine.FIRST,
                        "output_error_vs_rtn": Combine.MAX}):
    """GPTQ weights; the rewrite is ``GptqRewrite``'s."""
