"""edgeq.kernels: GPU reference kernels for the edgeq custom ops (never imported by the compiler).

- ``hadamard_ref``: torch references (no triton), importable on CPU.
- ``hadamard_triton``: the Triton fast Hadamard transform; imports triton, so import it
  explicitly (``from edgeq.kernels.hadamard_triton import hadamard_transform``) on a GPU machine.

This package imports nothing at import time: the CPU test suite must never import triton.
"""
