"""Torch references for MUXQ's INT8 GEMM in Concat form: ``Y = (A @ B) * s_a * s_w (+ bias)``.

A = Concat([Body, Aux], axis=-1) is int8 ``[M, K + k]`` (k outlier channels repeated as Aux, see
``edgeq.passes.muxq``), B the stacked int8 weight ``[W ; (2^e - 1) W[C, :]]`` of shape
``[K + k, N]``. The products are summed exactly (int32 on an integer GEMM engine), then scaled by
the activation scale s_a (per tensor; per token allowed) and the weight scale s_w (per tensor or
per output channel), plus an optional bias, and rounded once to fp16.

Torch only (no triton), so the CPU test suite can import it and the GPU tests can trust it: the
accumulation runs in float64, which holds every int8 dot product exactly while
``K * 128 * 128 < 2^53`` (K < 5.4e11), on CPU and CUDA alike (torch has no int32 matmul on CUDA
outside ``torch._int_mm``, which refuses small M and unaligned K).
"""

from __future__ import annotations

import torch

# A sum of K products of int8 values lies in [-K * 16256, K * 16384] (16384 = (-128)^2), so an
# int32 accumulator cannot overflow while K * 2^14 <= 2^31 - 1: K <= 131071, far above every
# hidden size MUXQ meets.
MAX_EXACT_INT32_K = ((1 << 31) - 1) // (1 << 14)


def muxq_concat(body: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """A = Concat([Body, Aux], axis=-1): the one activation operand of the uniform INT8 GEMM.

    Both int8 with the same leading shape; the result is ``[..., K + k]``. This is the tensor the
    ONNX graph of ``muxq`` (form "concat") materializes; the split kernel entry reads Body and Aux
    in place instead."""
    if body.dtype != torch.int8 or aux.dtype != torch.int8:
        raise TypeError(f"muxq_concat: body and aux must be int8, got {body.dtype} and {aux.dtype}")
    if body.shape[:-1] != aux.shape[:-1]:
        raise ValueError(f"muxq_concat: leading shapes differ, body {tuple(body.shape)} aux {tuple(aux.shape)}")
    return torch.cat([body, aux], dim=-1)


def muxq_stack_weight(w: torch.Tensor, w_aux: torch.Tensor) -> torch.Tensor:
    """B = [W ; W_aux] stacked along K (``[K, N]`` over ``[k, N]``), matching ``muxq_concat``."""
    if w.dim() != 2 or w_aux.dim() != 2 or w.shape[1] != w_aux.shape[1]:
        raise ValueError(f"muxq_stack_weight: need [K, N] and [k, N], got {tuple(w.shape)} and {tuple(w_aux.shape)}")
    return torch.cat([w, w_aux], dim=0)


def int8_matmul_int32_ref(a_int8: torch.Tensor, b_int8: torch.Tensor) -> torch.Tensor:
    """The exact int32 accumulator ``A @ B`` for int8 A ``[..., K]`` and B ``[K, N]``.

    Summed in float64 (exact, see the module docstring) and converted to int32 (exact while
    K <= ``MAX_EXACT_INT32_K``, which is checked)."""
    _check_int8_operands(a_int8, b_int8)
    if a_int8.shape[-1] > MAX_EXACT_INT32_K:
        raise ValueError(f"K={a_int8.shape[-1]} could overflow an int32 accumulator (max {MAX_EXACT_INT32_K})")
    return (a_int8.to(torch.float64) @ b_int8.to(torch.float64)).to(torch.int32)


def int8_gemm_ref(
    a_int8: torch.Tensor,
    b_int8: torch.Tensor,
    scale_a,
    scale_b,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp16 ``(A @ B) * scale_a * scale_b (+ bias)``, every step in float64, one rounding to fp16.

    ``scale_a``: a number or a tensor of one element (per tensor) or of M elements (per token, M =
    the rows of A). ``scale_b``: a number or a tensor of one element (per tensor) or N elements (per
    output channel). ``bias``: None or N elements. A kernel that scales its exact int32 sum in
    float32 differs from this by at most one fp16 rounding step (the float32 error is ~1e-7
    relative, far under half an fp16 ulp, 2^-11)."""
    _check_int8_operands(a_int8, b_int8)
    acc = a_int8.to(torch.float64) @ b_int8.to(torch.float64)  # exact integers
    rows = acc.reshape(-1, acc.shape[-1]).shape[0]
    n = b_int8.shape[1]
    sa = _as_f64(scale_a, acc.device)
    sw = _as_f64(scale_b, acc.device)
    if sa.numel() not in (1, rows):
        raise ValueError(f"scale_a must have 1 or M={rows} elements, got {sa.numel()}")
    if sw.numel() not in (1, n):
        raise ValueError(f"scale_b must have 1 or N={n} elements, got {sw.numel()}")
    y = acc.reshape(rows, n) * sa.reshape(-1, 1) * sw.reshape(1, -1)
    if bias is not None:
        if bias.numel() != n:
            raise ValueError(f"bias must have N={n} elements, got {bias.numel()}")
        y = y + bias.to(device=acc.device, dtype=torch.float64).reshape(1, n)
    return y.reshape(acc.shape).to(torch.float16)


def _as_f64(scale, device) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=torch.float64).reshape(-1)
    return torch.tensor([float(scale)], dtype=torch.float64, device=device)


def _check_int8_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8 GEMM reference: a and b must be int8, got {a.dtype} and {b.dtype}")
    if b.dim() != 2 or a.dim() < 1 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"int8 GEMM reference: need a [..., K] and b [K, N], got {tuple(a.shape)}, {tuple(b.shape)}")
