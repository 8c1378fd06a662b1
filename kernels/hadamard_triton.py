"""Triton fast Hadamard transform: ``y = x @ H / sqrt(n)`` over the last axis, n = K * 2^m.

Why: the online Hadamard before down_proj (QuaRot, MQuant) runs on every token. A dense matmul
by H costs 2 n^2 flops per row (as much as down_proj itself); this kernel costs O(n (K + m)) and
is bound by reading x and writing y once.

How, for one row viewed as a ``[K, P]`` matrix X (P = 2^m): ``y = vec(H_K^T X H_P)``.

- ``H_K^T X``: a small matmul on tensor cores (``tl.dot``), A = H_K^T as exact +-1 entries in x's
  dtype (fp16 / bf16 products are exact, fp32 accumulation; for fp32 inputs ``tf32x3``, which
  is exact for the +-1 operand and keeps about fp32 accuracy on x). Each program computes BKO
  output rows of one input row; K is zero-padded to the block size.
- ``. H_P``: a Walsh-Hadamard transform in registers, m radix-2 butterfly stages in Stockham
  form (each stage pairs index j with j + P/2 and writes the pair to 2j, 2j + 1; after m stages the
  order is natural), done with reshape / permute / split / join on fp32 values.
- K == 1 (n a power of two): no matmul; a program transforms BR whole rows.

The normalization 1 / sqrt(n) is applied once, in fp32, before the cast to the output dtype.
H is the matrix of ``edgeq.runtime_ops.hadamard_matrix_for_fold(n)``.

Limits: P <= 2^14 (a whole P-segment lives in registers); K > 1 needs P >= 16 (``tl.dot``'s
minimum), smaller P (n = K, 2K, ..., 8K) goes through the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgeq.runtime_ops.hadamard import hadamard_factor_matrices, hadamard_factors
from kernels_compat import hadamard_ref  # noqa: F401  (replaced below; see _torch_fallback)
