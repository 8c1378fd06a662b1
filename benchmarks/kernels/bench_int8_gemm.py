"""Benchmark of the Triton INT8 GEMM (MUXQ Concat form) against fp16 and torch's int8 GEMM.

For each M (decode 16, prefill 512 and 4096) and k outlier channels (0, 64, 256): A int8
``[M, K + k]`` (K = 4096), B int8 ``[K + k, N]`` (N = 4096), uniform random over the int8 range,
per-tensor activation scale and per-output-channel weight scale:

- ``triton``: ``int8_gemm`` with B row-major ``[K + k, N]``, fused dequant epilogue to fp16;
- ``triton_kmajor``: the same with B the transpose view of an ``[N, K + k]`` weight (K-major, the
  layout int8 wgmma wants; what a deployment would store);
- ``triton_split``: ``int8_gemm_split`` reading Body ``[M, K]`` and Aux ``[M, k]`` in place (no
  Concat), K-major B;
- ``fp16_matmul``: ``torch.matmul`` of the same values in fp16 (cuBLAS), the unquantized layer;
- ``int_mm`` / ``int_mm_kmajor``: ``torch._int_mm`` (cuBLASLt int8 -> int32, no epilogue) with each
  B layout, "unsupported" with torch's message where it refuses (M <= 16, K not a multiple of 8);
- ``int_mm_dequant``: ``_int_mm`` then the same dequantization in torch ops, the unfused
  equivalent of ``triton``.

Timing (median ms per call): ``<op>_ms`` replays a CUDA graph of the op over several operand sets
in turn (``--sets``; together larger than L2, so weights stream from HBM): GPU time without the
host's launch cost, which at M = 16 is larger than the kernel. ``<op>_eager_ms`` is
``triton.testing.do_bench`` (cold L2, host launch cost included where it dominates). TOPS counts
2 M N (K + k) operations. Errors: the fp16 output against the float64 reference
(``int8_gemm_ref``), max absolute and relative to max |ref|; ``int32_exact`` checks the raw
accumulator for equality, ``int_mm_exact`` cuBLASLt's against the same reference.

Usage: python benchmarks/kernels/bench_int8_gemm.py --out $OUT/int8-gemm.json [--m 16 512 4096] [--outliers 0 64 256]
"""

from __future__ import annotations

import sys

import torch

from bench_timing import device_meta, gemm_parser, no_cuda, time_ops, write_json
from bench_timing import fmt_ms as _fmt
from bench_timing import warm_up as _warm_up


def _tops(m: int, n: int, k: int, ms) -> float | None:
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12 if isinstance(ms, float) else None


def _operand_set(m: int, n: int, k_base: int, outliers: int, gen) -> dict:
    from edgeq.kernels.int8_gemm_triton import to_k_major

    k = k_base + outliers
    a = torch.randint(-128, 128, (m, k), device="cuda", dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (k, n), device="cuda", dtype=torch.int8, generator=gen)
    return {
        "a": a, "b": b, "b_kmajor": to_k_major(b),  # same values, stored [N, K + k]
        "body": a[:, :k_base].contiguous(), "aux": a[:, k_base:].contiguous(),
        "a16": a.half(), "b16": b.half(),
        "sa": torch.tensor([0.013], device="cuda"), "sw": 2e-4 + 1e-3 * torch.rand(n, device="cuda", generator=gen),
    }


def _ops(outliers: int) -> dict:
    """name -> function of one operand set; the names are the JSON keys (``<name>_ms``)."""
    from edgeq.kernels.int8_gemm_triton import int8_gemm, int8_gemm_split

    ops = {
        "triton": lambda s: int8_gemm(s["a"], s["b"], s["sa"], s["sw"]),
        "triton_kmajor": lambda s: int8_gemm(s["a"], s["b_kmajor"], s["sa"], s["sw"]),
        "fp16_matmul": lambda s: torch.matmul(s["a16"], s["b16"]),
        "int_mm": lambda s: torch._int_mm(s["a"], s["b"]),
        "int_mm_kmajor": lambda s: torch._int_mm(s["a"], s["b_kmajor"]),
        "int_mm_dequant": lambda s: (torch._int_mm(s["a"], s["b_kmajor"]).float() * s["sa"] * s["sw"]).half(),
    }
    if outliers:
        ops["triton_split"] = lambda s: int8_gemm_split(s["body"], s["aux"], s["b_kmajor"], s["sa"], s["sw"])
    return ops


def _check(s: dict) -> dict:
    """Errors of the fp16 output against the float64 reference, exactness of the int32 sums, and
    whether both B layouts, the split entry and torch._int_mm (where it runs) agree bit for bit."""
    from edgeq.kernels.int8_gemm_ref import int8_gemm_ref, int8_matmul_int32_ref
    from edgeq.kernels.int8_gemm_triton import int8_gemm, int8_gemm_split, int8_matmul_int32, last_tuned_config

    y = int8_gemm(s["a"], s["b"], s["sa"], s["sw"])
    cfg_row = last_tuned_config()
    y_k = int8_gemm(s["a"], s["b_kmajor"], s["sa"], s["sw"])
    cfg_k = last_tuned_config()
    ref = int8_gemm_ref(s["a"], s["b"], s["sa"], s["sw"])
    err = (y.double() - ref.double()).abs().max().item()
    acc_ref = int8_matmul_int32_ref(s["a"], s["b"])
    exact = torch.equal(int8_matmul_int32(s["a"], s["b_kmajor"]), acc_ref)
    same = torch.equal(y, y_k)
    if s["aux"].shape[1]:
        same &= torch.equal(int8_gemm_split(s["body"], s["aux"], s["b_kmajor"], s["sa"], s["sw"]), y)
    try:
        int_mm_exact = torch.equal(torch._int_mm(s["a"], s["b_kmajor"]), acc_ref)
    except RuntimeError:
        int_mm_exact = None
    return {
        "max_abs_err": err, "rel_err": err / max(ref.abs().max().item(), 1e-30),
        "int32_exact": bool(exact), "layouts_and_split_identical": bool(same), "int_mm_exact": int_mm_exact,
        "config_rowmajor": cfg_row, "config_kmajor": cfg_k,
    }


def run_case(m: int, n: int, k_base: int, outliers: int, gen, *, n_sets: int, warmup_ms: int, rep_ms: int) -> dict:
    k = k_base + outliers
    sets = [_operand_set(m, n, k_base, outliers, gen) for _ in range(n_sets)]
    row = {"M": m, "N": n, "K": k_base, "k_outliers": outliers, "K_total": k, "operand_sets": n_sets}
    row.update(_check(sets[0]))
    time_ops(row, _ops(outliers), sets, warmup_ms, rep_ms)  # torch._int_mm refuses M <= 16 and K % 8 != 0
    for name in ("triton", "triton_kmajor", "triton_split", "int_mm_kmajor", "fp16_matmul"):
        row[f"{name}_TOPS"] = _tops(m, n, k, row.get(f"{name}_ms"))
    best = min(row["triton_ms"], row["triton_kmajor_ms"])
    row["speedup_vs_fp16"] = row["fp16_matmul_ms"] / best
    if isinstance(row["int_mm_dequant_ms"], float):
        row["speedup_vs_int_mm_dequant"] = row["int_mm_dequant_ms"] / best
    return row


def table(results: list[dict]) -> str:
    head = (f"{'M':>5} {'k':>4} {'K+k':>5} {'triton':>8} {'tri-kmaj':>8} {'split':>8} {'fp16':>8} {'int_mm':>8} "
            f"{'int_mm_k':>8} {'imm+deq':>8} {'TOPS':>6} {'TOPS-k':>6} {'x fp16':>6} {'eager-k':>8} {'max err':>9} "
            f"{'exact':>5}")
    lines = [head]
    for r in results:
        ok = r["int32_exact"] and r["layouts_and_split_identical"] and r["int_mm_exact"] is not False
        lines.append(
            f"{r['M']:>5} {r['k_outliers']:>4} {r['K_total']:>5} {_fmt(r['triton_ms'])} {_fmt(r['triton_kmajor_ms'])} "
            f"{_fmt(r.get('triton_split_ms'))} {_fmt(r['fp16_matmul_ms'])} {_fmt(r['int_mm_ms'])} "
            f"{_fmt(r['int_mm_kmajor_ms'])} {_fmt(r['int_mm_dequant_ms'])} {r['triton_TOPS']:>6.0f} "
            f"{r['triton_kmajor_TOPS']:>6.0f} {r['speedup_vs_fp16']:>6.2f} {_fmt(r['triton_kmajor_eager_ms'])} "
            f"{r['max_abs_err']:>9.2e} {'yes' if ok else 'NO':>5}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = gemm_parser(__doc__, m=[16, 512, 4096], sets=6, sets_note="6 x 17 MB > L2", rep_ms=50)
    ap.add_argument("--k-base", type=int, default=4096)
    ap.add_argument("--outliers", type=int, nargs="+", default=[0, 64, 256])
    args = ap.parse_args(argv)
    if no_cuda("bench_int8_gemm"):
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    _warm_up()
    results = []
    for m in args.m:
        for k in args.outliers:
            results.append(run_case(m, args.n, args.k_base, k, gen, n_sets=args.sets,
                                    warmup_ms=args.warmup_ms, rep_ms=args.rep_ms))
            torch.cuda.empty_cache()
            print(f"done M={m} k={k}", file=sys.stderr, flush=True)
    meta = device_meta(timing="ms columns: CUDA-graph replay, operand sets rotated; *_eager_ms: do_bench, cold L2")
    print(f"device: {meta['device']}, torch {meta['torch']}, triton {meta.get('triton')}; median ms per call, "
          f"CUDA graphs over {args.sets} rotating operand sets (eager-k: do_bench, host launch included)")
    print(table(results))
    write_json(args.out, meta, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
