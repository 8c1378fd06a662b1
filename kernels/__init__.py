"""edgeq.kernels: GPU reference kernels for the edgeq custom ops (never imported by the compiler).

- ``hadamard_ref``: torch references (no triton), importable on CPU.
- ``hadamard_triton``: the Triton fast Hadamard transform; imports triton, so import it
  explicitly (``from edgeq.kernels.hadamard_triton import hadamard_transform``) on a GPU machine.
- ``int8_gemm_ref``: torch references (no triton) for MUXQ's INT8 GEMM in Concat form, importable
  on CPU; ``int8_gemm_triton``: the Triton kernel (int32 accumulation, fused fp16 dequant
  epilogue; ``int8_gemm``, ``int8_gemm_split``), imported explicitly like ``hadamard_triton``.

This package imports nothing at import time: the CPU test suite must never import triton.
"""
