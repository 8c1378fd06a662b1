"""``qdq``: static quantization of every linear: activation Q/DQ from calibration, weight DQ.

The rewrite itself (the pattern onnxruntime fuses into integer kernels, shared QuantizeLinear and
per-linear DequantizeLinear, per-channel/group/tensor weights, per-token studies) is
``edgeq.passes.methods.static_qdq``, which ``msq`` builds on too.
"""

from __future__ import annotations

from edgeq.passes.methods.static_qdq import QDQConfig, StaticQDQ

__all__ = ["QDQConfig", "QDQPass"]


class QDQPass(StaticQDQ, name="qdq", per_block=True):
    """Static QDQ; everything but the name is ``StaticQDQ``'s."""
