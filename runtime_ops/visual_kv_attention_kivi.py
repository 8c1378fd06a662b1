"""``edgeq::VisualKVAttentionKIVI``: ``VisualKVAttention`` with KIVI's per-token values (a comparator).

KIVI quantizes keys per channel and values per token. This op is ``edgeq::VisualKVAttention``
(module ``visual_kv_attention``, whose docstring is the spec of everything not said here: inputs,
bit packing, GQA, the mask, the attributes ``bits`` in {1, 2, 4, 8}, ``tau1``, ``tau2``,
``calibrate``, post-scaled keys, the logit calibration, the softmax) with one difference, the
visual values:

- ``v_codes`` uint8 [B, KVH, Nv, D * b / 8], codes per token (``quantize_pertoken``: min/max over
  the D channels of each visual token, packed along D as the keys);
- ``v_alpha``, ``v_scale`` float32 [B, KVH, Nv, 1]: one (alpha, scale) per visual token;
- the visual part of the output, without forming the dequantized values:
  ``y_vis = (p_vis * v_scale^T) . c_v + p_vis . v_alpha``, i.e. for each (b, head, s)
  ``sum_n p_vis[n] * v_scale[n] * c_v[n, :] + sum_n p_vis[n] * v_alpha[n]``, and
  ``y = y_vis + p_txt . v_text`` (= attention over the values c_v[n] * v_scale[n] + v_alpha[n]).

The keys (k_codes, k_alpha, k_scale [B, KVH, 1, D], channel-wise, post-scaled) are exactly
VisualKVAttention's. The function body is VisualKVAttention's (``attention_function``) with the
value nodes replaced: ``Transpose`` of v_scale to [B, KVH, 1, Nv], ``Mul`` with the grouped
p_vis, ``MatMul`` with the float codes, and ``MatMul`` of p_vis with v_alpha ([.., Nv] x [Nv, 1],
broadcast over D by the final ``Sum``). The numpy reference ``visual_kv_attention_kivi_reference``
(defined in ``visual_kv_attention`` on the shared core ``attend``) runs in
float64 with a float32 output and VisualKVAttention's validation, v_alpha / v_scale required
[B, KVH, Nv, 1].
"""

from __future__ import annotations

import onnx
from onnx import helper

from edgeq.runtime_ops.visual_kv_attention import MIN_OPSET as VK_MIN_OPSET, OP_TYPE_KIVI, attention_function

OP_TYPE = OP_TYPE_KIVI
MIN_OPSET = VK_MIN_OPSET  # VisualKVAttention's function body (``schema`` reads it here)


def pertoken_value_nodes() -> list[onnx.NodeProto]:
    """KIVI's visual values over the grouped ``p_vis_g`` [B, KVH, rep * S, Nv]: ``o_scaled =
    (p_vis * v_scale^T) . c_v`` [.., D] and ``o_alpha = p_vis . v_alpha`` [.., 1]."""
    n = helper.make_node
    return [
        n("Transpose", ["v_scale"], ["v_scale_t"], perm=[0, 1, 3, 2]),  # [B, KVH, 1, Nv]
        n("Mul", ["p_vis_g", "v_scale_t"], ["p_vis_scaled"]),
        n("MatMul", ["p_vis_scaled", "v_codes_f"], ["o_scaled"]),
        n("MatMul", ["p_vis_g", "v_alpha"], ["o_alpha"]),
    ]


def visual_kv_attention_kivi_function(opset: int) -> onnx.FunctionProto:
    """The function body at default-domain ``opset`` (valid from ``MIN_OPSET`` = 18 on)."""
    return attention_function(OP_TYPE, opset, pertoken_value_nodes(), __doc__.split("\n\n")[0])
