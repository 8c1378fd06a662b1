"""Tile scheduling shared by the Triton GEMMs (``int8_gemm_triton``, ``w4a8_gemm_triton``).

Why one place: both kernels walk their output tiles in the same grouped order, so programs that
run together read the same weight tiles from L2; one definition keeps them alike.
"""

import triton
import triton.language as tl


@triton.jit
def tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program, GROUP_M row tiles at a time (programs resident together
    read the same weight tiles from L2)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n
