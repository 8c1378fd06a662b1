"""``gptq``: GPTQ weight quantization (int4/int8, per channel or per group) from calibration Hessians.

The rewrite (Hessians streamed over the calibration data, attention-sink weighting, act-order /
group-aware orders, DequantizeLinear or MatMulNBits output) is ``edgeq.passes.methods.gptq_rewrite``
over the sweep in ``edgeq.passes.methods.gptq``; ``dpq`` builds on the same rewrite.
"""

from __future__ import annotations

from edgeq.passes.methods.gptq_rewrite import GptqConfig, GptqRewrite

__all__ = ["GptqConfig", "GptqPass"]


class GptqPass(GptqRewrite, name="gptq", per_block=True):
    """GPTQ weights; everything but the name is ``GptqRewrite``'s."""
