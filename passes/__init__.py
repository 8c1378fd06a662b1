"""Method passes, one per file. Importing this package registers all of them."""

from edgeq.passes import aifs, dpq, fuse_norms, gptq, kvquant, ln_to_rms, massive_split, msq, muxq, qdq, resq, resq_qdq, rms, rotate  # noqa: F401
from edgeq.passes import expand_functions, int8_activations, int8_weights, matmulnbits_to_qdq, pow2_scales, symmetric_weights, u8s8_safe_weights  # noqa: F401  (target lowering)
