"""``qdq``: static quantization of every linear: activation Q/DQ from calibration, weight DQ.

The rewrite itself (the pattern onnxruntime fuses into integer kernels, shared QuantizeLinear and
per-linear DequantizeLinear, per-channel/group/tensor weights, per-token studies) is
``edgeq.passes.methods.static_qdq``, which ``msq`` builds on too.
"""

from __future__ import annotations

from edgeq.passmanager.passbase import Exactness
from edgeq.passes.methods.static_qdq import QDQConfig, StaticQDQ, static_activations

__all__ = ["QDQConfig", "QDQPass"]


class QDQPass(StaticQDQ, name="qdq", exactness=Exactness.LOSSY, config=QDQConfig, calibrates=static_activations,
              per_block=True, summary="activation QDQ (static per-tensor; per-token for studies) and per-channel/group "
                                      "weight DQ on every linear"):
    """Static QDQ; the rewrite is ``StaticQDQ``'s."""
