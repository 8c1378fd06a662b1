"""Benchmark of the Triton fast Hadamard transform against a dense torch matmul by the same H.

For each n and dtype: x of shape [rows, n] (standard normal), y = x @ H / sqrt(n).

- ``triton``: ``hadamard_transform`` (this package's kernel);
- ``dense``: ``x @ H_dense`` in x's dtype (cuBLAS), the cost of inserting H as a plain MatMul;
- ``torch_kron``: ``H_K^T (X H_P)`` with two torch matmuls in x's dtype, the structured form
  without a custom kernel (what onnxruntime runs from the op's function body, on GPU);
- ``copy``: ``y.copy_(x)``, the memory-bound floor (read x once, write y once).

Errors are measured against the float64 reference (``hadamard_ref``); ``rel_err`` is the max
absolute error divided by max |y|. Times are ``triton.testing.do_bench`` medians, in ms. Prints a
table and writes JSON (``--out``).

Usage: python benchmarks/kernels/bench_hadamard.py --out $OUT/hadamard.json [--rows 4096] [--sizes ...]
"""

from __future__ import annotations

import sys

import torch

from bench_timing import bench_eager, bench_parser, device_meta, no_cuda, warm_up, write_json


def _bench(fn) -> float:
    return bench_eager(fn, warmup_ms=10, rep_ms=50)


def run(sizes, rows: int, dtypes, with_variants: bool = False) -> list[dict]:
    from edgeq.kernels.hadamard_ref import dense_hadamard, hadamard_factors_torch, hadamard_ref
    from edgeq.kernels.hadamard_triton import hadamard_transform, supported_by_kernel
    from edgeq.runtime_ops.hadamard import hadamard_factors

    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    warm_up()
    for n in sizes:
        factors = hadamard_factors(n)
        if factors is None:
            results.append({"n": n, "skipped": "no Hadamard construction for this n"})
            continue
        K, P = factors
        x32 = torch.randn(rows, n, device="cuda", generator=gen)
        ref = hadamard_ref(x32)  # float64
        for dtype in dtypes:
            x = x32.to(dtype)
            ref_d = hadamard_ref(x)  # reference on the rounded input, so only the transform is measured
            y, info = hadamard_transform(x, return_info=True)
            torch.cuda.synchronize()
            err = (y.double() - ref_d).abs().max().item()
            scale = ref_d.abs().max().item()
            h = dense_hadamard(n, device="cuda", dtype=dtype)
            hk, hp = hadamard_factors_torch(n, device="cuda", dtype=dtype)
            hkt = (hk.T / K**0.5).contiguous()
            hpn = hp / P**0.5
            dense_err = ((x @ h).double() - ref_d).abs().max().item()
            t_triton = _bench(lambda: hadamard_transform(x))
            variants = {}
            if with_variants and info["used_triton"]:
                knobs = [{"tile": t, "num_warps": w} for t in (4096, 8192, 16384) for w in (4, 8)]
                if dtype == torch.float32 and K > 1:
                    knobs += [{"fp32_mode": "tf32x3"}]
                for kn in knobs:
                    yv = hadamard_transform(x, **kn)
                    verr = (yv.double() - ref_d).abs().max().item() / scale
                    name = "_".join(f"{k}={v}" for k, v in kn.items())
                    variants[name] = {"ms": _bench(lambda kn=kn: hadamard_transform(x, **kn)), "rel_err": verr}
            t_dense = _bench(lambda h=h: x @ h)
            t_kron = _bench(lambda: (hkt @ (x.view(rows, K, P) @ hpn)).view(rows, n))
            y_copy = torch.empty_like(x)
            t_copy = _bench(lambda: y_copy.copy_(x))  # the memory-bound floor: read x, write y
            bytes_moved = 2 * x.numel() * x.element_size()
            results.append(
                {
                    "n": n, "K": K, "P": P, "rows": rows, "dtype": str(dtype).replace("torch.", ""),
                    "triton_ms": t_triton, "dense_ms": t_dense, "torch_kron_ms": t_kron, "copy_ms": t_copy,
                    "speedup_vs_dense": t_dense / t_triton, "speedup_vs_torch_kron": t_kron / t_triton,
                    "triton_GBps": bytes_moved / t_triton / 1e6,
                    "max_abs_err": err, "rel_err": err / scale, "dense_rel_err": dense_err / scale,
                    "used_triton": info["used_triton"], "kernel_supported": supported_by_kernel(n),
                    "config": {k: v for k, v in info.items() if k not in ("used_triton", "K", "P")},
                    "variants": variants,
                    "input_rounding_rel": ((x.double() - x32.double()).abs().max() / x32.abs().max()).item(),
                    "fp64_vs_fp32_input_rel": ((ref_d - ref).abs().max() / scale).item(),
                }
            )
            del h
            torch.cuda.empty_cache()
    return results


def table(results: list[dict]) -> str:
    head = f"{'n':>6} {'K':>4} {'P':>5} {'dtype':>8} {'triton ms':>10} {'dense ms':>9} {'kron ms':>8} " \
           f"{'copy ms':>8} {'x dense':>8} {'x kron':>7} {'GB/s':>7} {'rel err':>9} {'dense rel':>9}"
    lines = [head]
    for r in results:
        if "skipped" in r:
            lines.append(f"{r['n']:>6} skipped: {r['skipped']}")
            continue
        lines.append(
            f"{r['n']:>6} {r['K']:>4} {r['P']:>5} {r['dtype']:>8} {r['triton_ms']:>10.4f} {r['dense_ms']:>9.4f} "
            f"{r['torch_kron_ms']:>8.4f} {r['copy_ms']:>8.4f} {r['speedup_vs_dense']:>8.1f} {r['speedup_vs_torch_kron']:>7.2f} "
            f"{r['triton_GBps']:>7.0f} {r['rel_err']:>9.2e} {r['dense_rel_err']:>9.2e}"
        )
        for name, v in r.get("variants", {}).items():
            lines.append(f"{'':>6} {'':>4} {'':>5} {'':>8} {v['ms']:>10.4f}  {name} (rel err {v['rel_err']:.1e})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1536, 4096, 11008, 14336])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    ap.add_argument("--variants", action="store_true", help="also time other tile sizes, warps, fp32 modes")
    args = ap.parse_args(argv)
    if no_cuda("bench_hadamard"):
        return 2
    dtypes = [getattr(torch, d) for d in args.dtypes]
    results = run(args.sizes, args.rows, dtypes, with_variants=args.variants)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, rows {args.rows}")
    print(table(results))
    write_json(args.out, device_meta(rows=args.rows), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
