"""edgeq.runtime_ops: the ``edgeq`` custom-op domain and the matrices its ops use.

- ``hadamard``: Hadamard matrices of order K * 2^m by construction, randomized Hadamard and
  random orthogonal rotations (numpy, float64).
- ``online_hadamard``: ``edgeq::OnlineHadamard`` (function body, numpy reference, graph helpers).
- ``modality_qdq``: ``edgeq::ModalityQDQ``, MSQ's quantize-dequantize with a visual and a text
  static scale (function body, numpy reference); the msq pass inserts it (``lowering = "custom"``).
- ``w4a8_linear``: ``edgeq::W4A8Linear``, DPQ's fused linear (int4/uint4 group-quantized weight
  requantized to FP8, FP8 static activation, matmul; function body, numpy reference, node helper).
- ``subspace_qdq``: ``edgeq::SubspaceQDQ``, ResQ's mixed-precision quantize-dequantize of one GEMM
  input (first d - r channels at 4 bits, last r at 8, each with its own scale; static per-tensor
  or dynamic per-token; function body, numpy reference, node helper); ``resq-qdq`` inserts it.
- ``visual_kv_attention``: ``edgeq::VisualKVAttention``, CalibQuant's decode attention over a KV
  cache whose visual tokens are packed 1/2/4/8-bit channel-wise codes (values channel-wise or one
  global range per head; post-scaling, logit calibration; function body with bitwise unpacking,
  numpy reference, node helper); ``visual_kv_codes``: its packing and quantization helpers.
- ``visual_kv_attention_kivi``: ``edgeq::VisualKVAttentionKIVI``, the same attention with KIVI's
  per-token values (a comparator; same body but the value part, numpy reference).
- ``schema``: the one table of edgeq ops, ``ensure_functions``, ``reference_evaluator_ops``.

Importing this package imports numpy and onnx only (no graphsurgeon, no torch, no triton).
"""

from edgeq.runtime_ops.domain import DOMAIN, DOMAIN_VERSION
from edgeq.runtime_ops.hadamard import (
    SPEC_BASE_ORDERS,
    Rotation,
    hadamard_factor_matrices,
    hadamard_factors,
    hadamard_matrix,
    is_hadamard_size,
    normalized_hadamard_factors,
    normalized_hadamard_matrix,
    random_orthogonal,
    randomized_hadamard,
)
from edgeq.runtime_ops.online_hadamard import (
    OP_TYPE as ONLINE_HADAMARD,
    hadamard_matrix_for_fold,
    hadamard_times,
    insert_online_hadamard,
    make_online_hadamard_node,
    online_hadamard_constants,
    online_hadamard_reference,
)
from edgeq.runtime_ops.schema import SCHEMAS, OpSchema, ensure_functions, get_schema, reference_evaluator_ops
from edgeq.runtime_ops.subspace_qdq import (
    OP_TYPE as SUBSPACE_QDQ,
    make_subspace_qdq_node,
    subspace_qdq_reference,
)
from edgeq.runtime_ops.visual_kv_attention import (
    OP_TYPE as VISUAL_KV_ATTENTION,
    make_visual_kv_attention_node,
    visual_kv_attention_kivi_reference,
    visual_kv_attention_reference,
)
from edgeq.runtime_ops.visual_kv_attention_kivi import OP_TYPE as VISUAL_KV_ATTENTION_KIVI
from edgeq.runtime_ops.w4a8_linear import (
    OP_TYPE as W4A8_LINEAR,
    make_w4a8_linear_node,
    w4a8_linear_reference,
)

__all__ = [
    "DOMAIN",
    "DOMAIN_VERSION",
    "ONLINE_HADAMARD",
    "SCHEMAS",
    "SPEC_BASE_ORDERS",
    "SUBSPACE_QDQ",
    "VISUAL_KV_ATTENTION",
    "VISUAL_KV_ATTENTION_KIVI",
    "W4A8_LINEAR",
    "OpSchema",
    "Rotation",
    "ensure_functions",
    "get_schema",
    "hadamard_factor_matrices",
    "hadamard_factors",
    "hadamard_matrix",
    "hadamard_matrix_for_fold",
    "hadamard_times",
    "insert_online_hadamard",
    "is_hadamard_size",
    "make_online_hadamard_node",
    "make_subspace_qdq_node",
    "make_visual_kv_attention_node",
    "make_w4a8_linear_node",
    "normalized_hadamard_factors",
    "normalized_hadamard_matrix",
    "online_hadamard_constants",
    "online_hadamard_reference",
    "random_orthogonal",
    "randomized_hadamard",
    "reference_evaluator_ops",
    "subspace_qdq_reference",
    "visual_kv_attention_kivi_reference",
    "visual_kv_attention_reference",
    "w4a8_linear_reference",
]
