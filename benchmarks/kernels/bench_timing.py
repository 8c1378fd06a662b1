"""GPU timing helpers shared by the kernel benchmarks (``benchmarks/kernels/bench_*.py``).

Why one module: every kernel benchmark must time the same way (warm clocks, CUDA-graph replay over
rotating operand sets so weights stream from HBM, medians), or their ratios are not comparable; and
they share one command line prologue and one JSON layout (``{"meta": ..., "results": ...}``).
Triton is imported inside the functions: importing this module needs only torch.
"""

from __future__ import annotations

import argparse
import json
import sys

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


def time_ops(row: dict, ops: dict, sets: list, warmup_ms: int, rep_ms: int) -> None:
    """Times each of ``ops`` (name -> function of one operand set) into ``row``: ``<name>_ms``
    (``bench_graph`` over ``sets``) and ``<name>_eager_ms`` (``bench_eager`` of the first set). An op
    that raises RuntimeError on the first set (cuBLASLt refusing a shape) gets "unsupported" in both
    and the first line of its message in ``<name>_error``."""
    for name, op in ops.items():
        try:
            op(sets[0])
            torch.cuda.synchronize()
        except RuntimeError as e:
            row[f"{name}_ms"] = row[f"{name}_eager_ms"] = "unsupported"
            row[f"{name}_error"] = str(e).strip().splitlines()[0]
            continue
        row[f"{name}_ms"] = bench_graph(op, sets, rep_ms)
        row[f"{name}_eager_ms"] = bench_eager(lambda op=op: op(sets[0]), warmup_ms, rep_ms)


def warm_up(seconds: float = 0.5) -> None:
    """Keep the GPU busy before the first timing: an idle GPU starts at a low clock (the first entry
    of a sweep measured up to 5x slow without this)."""
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


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The command line every kernel benchmark starts from: the first paragraph of its docstring
    ``doc`` as the description, and ``--out`` (where the JSON goes; see ``write_json``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output path")
    return ap


def gemm_parser(doc: str, *, m: list[int], sets: int, sets_note: str, rep_ms: int) -> argparse.ArgumentParser:
    """``bench_parser`` for a GEMM benchmark: the M sweep (``--m``) at one N (``--n``), and what
    ``time_ops`` takes: ``--sets`` operand sets (``sets_note``: why that many exceed L2),
    ``--warmup-ms`` / ``--rep-ms``. The benchmark adds its K arguments."""
    ap = bench_parser(doc)
    ap.add_argument("--m", type=int, nargs="+", default=m)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--sets", type=int, default=sets, help=f"operand sets rotated in the graph timing ({sets_note})")
    ap.add_argument("--warmup-ms", type=int, default=10)
    ap.add_argument("--rep-ms", type=int, default=rep_ms)
    return ap


def no_cuda(name: str) -> bool:
    """True, said on stderr, where there is no CUDA device to time on (the benchmark then exits 2)."""
    if torch.cuda.is_available():
        return False
    print(f"{name}: no CUDA device", file=sys.stderr)
    return True


def device_meta(**extra) -> dict:
    """The JSON ``meta`` of a run: device name, torch version, compute capability, SM count, then
    ``extra`` (what the benchmark adds: its timing method, data...), then the triton version where
    triton imports."""
    props = torch.cuda.get_device_properties(0)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "capability": list(torch.cuda.get_device_capability()), "sms": props.multi_processor_count, **extra}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


def write_json(path: str | None, meta: dict, results: list, **extra) -> None:
    """``{"meta": meta, "results": results, **extra}`` as indented JSON at ``path`` (nothing when None)."""
    if path:
        with open(path, "w") as f:
            json.dump({"meta": meta, "results": results, **extra}, f, indent=2)
