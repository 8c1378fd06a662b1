"""GPU timing helpers shared by the kernel benchmarks (``kernels/bench_*.py``).

Why one module: every kernel benchmark must time the same way (warm clocks, CUDA-graph replay over
rotating operand sets so weights stream from HBM, medians), or their ratios are not comparable.
Triton is imported inside the functions: importing this module needs only torch.
"""

from __future__ import annotations

import torch


def bench_eager(fn, warmup_ms: int, rep_ms: int) -> float:
    """do_bench median: cold L2 (it clears the cache before every run), but the host's launch
    cost shows where it exceeds the GPU time (the cache clear between runs hides only part of it)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def bench_graph(fn_per_set, sets: list, rep_ms: int) -> float:
    """GPU time of one call: the calls over all ``sets`` captured in a CUDA graph (no host launch
    cost) and replayed; the operand sets rotate so that the weights (more than L2 together) stream
    from HBM rather than L2. Median per call, in ms."""
    import triton.testing

    ms = triton.testing.do_bench_cudagraph(lambda: [fn_per_set(s) for s in sets], rep=rep_ms, return_mode="median")
    return float(ms) / len(sets)


def warm_up(seconds: float = 0.5) -> None:
    """Keep the GPU busy before the first timing: an idle GPU starts at a low clock."""
    import time

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            x @ x
        torch.cuda.synchronize()


def fmt_ms(v, width: int = 8) -> str:
    """A table cell: milliseconds to 4 decimals, '-' when not run, 'unsup' when unsupported."""
    if v is None:
        return f"{'-':>{width}}"
    if isinstance(v, str):
        return f"{'unsup':>{width}}"
    return f"{v:>{width}.4f}"
