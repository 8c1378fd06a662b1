"""Benchmark of the CalibQuant decode attention (1 / 2-bit packed visual KV) against fp16 SDPA.

Why: decode attention is bound by reading the KV cache; the packed cache is 16x (1 bit) or 8x
(2 bits) smaller than fp16, so the kernels should approach that ratio (issue target: 1 bit at
least 8x faster than fp16 ``scaled_dot_product_attention`` at B=64, H=32, N=8192, D=128).

What it does, on one GPU:

1. ``--sweep`` (each shape): times ``calibquant_qk`` and ``calibquant_pv`` (the PV kernel plus
   the chunk reduction) alone over the tile configs below with the subnormal unpack ("asm-sub"),
   then the best of each with the 1024 form ("asm"), and keeps the fastest for that shape's main
   timings (JSON ``sweep``); ``b*_default_ms`` times ``DEFAULT_CONFIG`` as shipped.
2. Main timings per shape (default B=64, H=32, N=8192, D=128 and B=16, H=32, N=3328, D=128; every
   token visual and quantized; MHA, KVH = H): fp16 SDPA decode (q ``[B, H, 1, D]``, K/V
   ``[B, H, N, D]``, torch's default backend choice) and ``calibquant_decode_attention`` at 1 and
   2 bits with calibration (tau = (0, 3)), median ms per call; speedup = sdpa_ms / ms. Effective
   bandwidth counts the packed codes, alpha / scale, q, out and the fp32 logits written and read
   back (``min_bytes``). Errors against the float64 reference on the first two batch rows.
3. Figure 3 of the paper (``--fig-n``, default 8192 and 3328): for KV budgets of 5..30 GB (1e9
   bytes), the largest batch whose cache fits. Budget model: one layer's K + V bytes per sequence
   times 32 layers, H=32, D=128: fp16 ``2*H*N*D*2``; b bits ``2*H*N*D*b/8`` plus alpha and scale
   (fp32, ``2*2*H*D*4``). Activations, weights and the transient logits are not counted. At that
   batch, one layer's decode attention is timed (random codes; batch capped at ``--max-batch``,
   default 1024, and at what fits in half the free GPU memory for a single layer; the cap is
   recorded) with the shipped defaults, and ``tokens_per_s = batch / (32 * layer_ms / 1000)``:
   decode attention only.

Timing: ``bench_timing.bench_graph`` (CUDA-graph replay; operand sets rotated so the cache streams
from HBM: enough copies to exceed 256 MB) after ``warm_up``. Usage:
``python benchmarks/kernels/bench_calibquant.py --out $OUT/calibquant-h100.json [--sweep] [--fig PNG]``
(``benchmarks/results/calibquant-h100.json`` and ``calibquant-h100-fig3.png``: ``--sweep --rep-ms 60``
on an H100, about 100 s).
"""

from __future__ import annotations

import math
import sys
import time

import torch

from bench_timing import bench_graph, bench_parser, device_meta, no_cuda, warm_up, write_json

LAYERS = 32
TAU = (0.0, 3.0)
# Tile configs timed by --sweep (chosen from the SASS of each: the unpacked planes stay in registers,
# loads are cp.async-pipelined, and no warp duplicates another's MMA tile; the PV dot's output is one
# 16-row tile per 16 byte columns, so the 1-bit PV kernel runs one warp a program). *_per_sm sets
# how finely the token axis is split: several waves of programs keep the last wave's tail short.
QK_SWEEP = {b: [dict(qk_block=blk, qk_warps=w, qk_per_sm=ps) for blk, w in ((128, 2), (256, 4), (128, 1), (256, 2))
                for ps in (8, 64)] for b in (1, 2)}
PV_SWEEP = {1: [dict(pv_block=blk, pv_warps=1, pv_per_sm=ps) for blk in (64, 128, 256) for ps in (16, 64, 128)],
            2: [dict(pv_block=blk, pv_warps=w, pv_per_sm=ps) for blk, w in ((64, 1), (128, 1), (64, 2))
                for ps in (16, 64, 128)]}
UNPACKS = ("asm-sub", "asm")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _n_sets(nbytes: int) -> int:
    """Copies of the operands rotated in a graph so that together they exceed 256 MB (L2 is 50 MB)."""
    return max(1, min(8, math.ceil(256e6 / max(nbytes, 1))))


def _fp16_cache(b, h, n, d, seed):
    g = _gen(seed)
    chan = torch.randn(d, device="cuda", generator=g)
    k = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.float16) + chan.half())
    v = torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.float16)
    q = torch.randn(b, h, d, device="cuda", generator=g, dtype=torch.float16)
    return q, k, v


def _quantize(x, bits, rows=8):
    """``quantize_kv`` in batch slices (the float32 temporaries of a whole B=64 cache are 8.6 GB)."""
    from edgeq.kernels.calibquant_ref import CalibQuantCache, quantize_kv

    parts = [quantize_kv(x[i:i + rows], bits) for i in range(0, x.shape[0], rows)]
    return CalibQuantCache(torch.cat([p.packed for p in parts]), torch.cat([p.alpha for p in parts]),
                           torch.cat([p.scale for p in parts]), bits)


def _random_packed(b, h, n, d, bits, seed):
    """Random codes and ranges (timing only: the kernels' work does not depend on the values)."""
    g = _gen(seed)
    packed = torch.randint(0, 256, (b, h, n, d * bits // 8), device="cuda", dtype=torch.uint8, generator=g)
    alpha = torch.randn(b, h, d, device="cuda", generator=g) - 1
    scale = torch.rand(b, h, d, device="cuda", generator=g) + 0.1
    return packed, alpha, scale


def _args(q, kq, vq, bits):
    """The kernel's arguments; V token-major (``token_major``), the layout its p.V dot reads fastest."""
    from edgeq.kernels.calibquant_triton import token_major

    return (q, kq.packed, kq.alpha, kq.scale, token_major(vq.packed), vq.alpha, vq.scale, bits)


def _clone_set(s: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}


def _time_fused(q, kp, ka, ks, vp, va, vs, bits, unpack, config, rep_ms):
    from edgeq.kernels.calibquant_triton import calibquant_decode_attention

    base = dict(q=q, kp=kp, ka=ka, ks=ks, vp=vp, va=va, vs=vs)
    nbytes = kp.numel() + vp.numel()
    sets = [base] + [_clone_set(base) for _ in range(_n_sets(nbytes) - 1)]

    def fn(s):
        return calibquant_decode_attention(s["q"], s["kp"], s["ka"], s["ks"], s["vp"], s["va"], s["vs"], bits,
                                           *TAU, True, unpack=unpack, config=config)

    fn(sets[0])
    torch.cuda.synchronize()
    return bench_graph(fn, sets, rep_ms)


def _time_sdpa(q, k, v, rep_ms):
    import torch.nn.functional as F

    sets = [dict(q=q[:, :, None], k=k, v=v)]
    nbytes = 2 * k.numel() * k.element_size()
    sets += [_clone_set(sets[0]) for _ in range(_n_sets(nbytes) - 1)]
    fn = lambda s: F.scaled_dot_product_attention(s["q"], s["k"], s["v"])  # noqa: E731
    fn(sets[0])
    torch.cuda.synchronize()
    return bench_graph(fn, sets, rep_ms)


def _min_bytes(b, h, n, d, bits, q_bytes=2):
    """Bytes the three kernels must move: packed K and V, alpha / scale (fp32), q, out, and the
    fp32 logits written by the QK kernel and read back by the PV kernel."""
    return 2 * b * h * n * d * bits // 8 + 4 * b * h * d * 4 + 2 * b * h * d * q_bytes + 2 * 4 * b * h * n


def sweep(q, kq_by_bits, vq_by_bits, rep_ms) -> dict:
    """Times the QK kernel and the PV kernel (+ reduction) alone per config and unpack form."""
    from edgeq.kernels.calibquant_triton import calibquant_pv, calibquant_qk, token_major

    out = {}
    for bits, kq in kq_by_bits.items():
        vq = vq_by_bits[bits]
        rows = []
        for unpack in UNPACKS:
            if unpack != UNPACKS[0]:  # the other form: the best configs of the first only
                qk_cfgs = [min((r for r in rows if r["kernel"] == "qk" and "ms" in r), key=lambda r: r["ms"])["config"]]
                pv_cfgs = [min((r for r in rows if r["kernel"] == "pv" and "ms" in r), key=lambda r: r["ms"])["config"]]
            else:
                qk_cfgs, pv_cfgs = QK_SWEEP[bits], PV_SWEEP[bits]
            for cfg in qk_cfgs:
                fn = lambda s, cfg=cfg, unpack=unpack: calibquant_qk(  # noqa: E731
                    s["q"], s["kp"], s["ka"], s["ks"], bits, unpack=unpack, config=cfg)
                s = dict(q=q, kp=kq.packed, ka=kq.alpha, ks=kq.scale)
                rows.append(_sweep_row("qk", unpack, cfg, fn, s, rep_ms))
            lg, mm = calibquant_qk(q, kq.packed, kq.alpha, kq.scale, bits, unpack=unpack)
            for cfg in pv_cfgs:
                fn = lambda s, cfg=cfg, unpack=unpack: calibquant_pv(  # noqa: E731
                    s["lg"], s["mm"], s["vp"], s["va"], s["vs"], bits, *TAU, True, unpack=unpack, config=cfg)
                s = dict(lg=lg, mm=mm, vp=token_major(vq.packed), va=vq.alpha, vs=vq.scale)
                rows.append(_sweep_row("pv", unpack, cfg, fn, s, rep_ms))
        best = {}
        for unpack in UNPACKS:
            qk = min((r for r in rows if r["kernel"] == "qk" and r["unpack"] == unpack and "ms" in r),
                     key=lambda r: r["ms"], default=None)
            pv = min((r for r in rows if r["kernel"] == "pv" and r["unpack"] == unpack and "ms" in r),
                     key=lambda r: r["ms"], default=None)
            if qk and pv:
                best[unpack] = {"config": {**qk["config"], **pv["config"]}, "qk_ms": qk["ms"], "pv_ms": pv["ms"]}
        pick = min(best, key=lambda u: best[u]["qk_ms"] + best[u]["pv_ms"]) if best else None
        out[bits] = {"rows": rows, "best_by_unpack": best, "unpack": pick,
                     "config": best[pick]["config"] if pick else None}
        print(f"sweep {bits}-bit: " + "; ".join(f"{u}: qk {v['qk_ms']:.4f} + pv {v['pv_ms']:.4f} ms {v['config']}"
                                              for u, v in best.items()), file=sys.stderr, flush=True)
    return out


def _sweep_row(kernel, unpack, cfg, fn, s, rep_ms) -> dict:
    row = {"kernel": kernel, "unpack": unpack, "config": cfg}
    try:
        fn(s)
        torch.cuda.synchronize()
        sets = [s] + [_clone_set(s) for _ in range(_n_sets(sum(v.numel() for v in s.values())) - 1)]
        row["ms"] = bench_graph(fn, sets, rep_ms)
    except Exception as e:  # a config that does not compile or fit must not end the sweep
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    return row


def _errors(q, kq, vq, bits, out, rows=2) -> dict:
    """max |out - ref| / (|alpha_v| + (2^b - 1)|scale_v|) over the first batch rows, and the
    normwise relative error, against the float64 reference."""
    from edgeq.kernels.calibquant_ref import calibquant_attention_ref

    sl = slice(0, rows)
    ref = calibquant_attention_ref(q[sl], kq.packed[sl], kq.alpha[sl], kq.scale[sl], vq.packed[sl], vq.alpha[sl],
                                   vq.scale[sl], bits, *TAU, True)
    span = vq.alpha[sl].double().abs() + (2**bits - 1) * vq.scale[sl].double().abs()
    err = (out[sl].double() - ref).abs()
    return {"max_err_over_range": (err / span).max().item(),
            "rel_err": ((out[sl].double() - ref).norm() / ref.norm()).item()}


def run_shape(b, h, n, d, tuned: dict, rep_ms: int, do_sweep: bool) -> tuple[dict, dict]:
    from edgeq.kernels.calibquant_triton import DEFAULT_CONFIG, DEFAULT_UNPACK, calibquant_decode_attention

    q, k, v = _fp16_cache(b, h, n, d, seed=b * 7 + n)
    row = {"B": b, "H": h, "KVH": h, "N": n, "D": d, "fp16_kv_bytes": 2 * k.numel() * 2}
    row["sdpa_ms"] = _time_sdpa(q, k, v, rep_ms)
    kq = {bits: _quantize(k, bits) for bits in (1, 2)}
    vq = {bits: _quantize(v, bits) for bits in (1, 2)}
    del k, v
    torch.cuda.empty_cache()
    sw = sweep(q, kq, vq, rep_ms) if do_sweep else {}
    for bits in (1, 2):
        pick = sw.get(bits) or {}
        unpack = pick.get("unpack") or DEFAULT_UNPACK
        cfg = pick.get("config")
        tuned[bits] = {"unpack": unpack, "config": cfg}
        a = _args(q, kq[bits], vq[bits], bits)
        out = calibquant_decode_attention(*a, *TAU, True, unpack=unpack, config=cfg)
        row[f"b{bits}_unpack"], row[f"b{bits}_config"] = unpack, {**DEFAULT_CONFIG[bits], **(cfg or {})}
        row.update({f"b{bits}_{kk}": vv for kk, vv in _errors(q, kq[bits], vq[bits], bits, out).items()})
        row[f"b{bits}_ms"] = _time_fused(*a, unpack, cfg, rep_ms)
        row[f"b{bits}_default_ms"] = _time_fused(*a, DEFAULT_UNPACK, None, rep_ms)
        row[f"b{bits}_speedup"] = row["sdpa_ms"] / row[f"b{bits}_ms"]
        row[f"b{bits}_min_bytes"] = _min_bytes(b, h, n, d, bits)
        row[f"b{bits}_GBps"] = row[f"b{bits}_min_bytes"] / (row[f"b{bits}_ms"] * 1e-3) / 1e9
    row["sdpa_GBps"] = row["fp16_kv_bytes"] / (row["sdpa_ms"] * 1e-3) / 1e9
    if b == 64 and n == 8192:
        row["target"] = "1-bit at least 8x faster than fp16 SDPA"
        row["target_met"] = row["b1_speedup"] >= 8.0
    del kq, vq
    torch.cuda.empty_cache()
    print(f"done B={b} N={n}", file=sys.stderr, flush=True)
    return row, sw


def seq_bytes(n: int, h: int, d: int, bits: int | None, layers: int = LAYERS) -> int:
    """KV bytes of one sequence under the budget model (see the module docstring)."""
    if bits is None:
        return 2 * h * n * d * 2 * layers
    return (2 * h * n * d * bits // 8 + 2 * 2 * h * d * 4) * layers


def figure3(ns, budgets, rep_ms, max_batch, h=32, d=128) -> list[dict]:
    """Max batch per KV budget and the measured decode-attention tokens/s at that batch, with the
    kernels as shipped (``DEFAULT_UNPACK``, ``DEFAULT_CONFIG``)."""
    from edgeq.kernels.calibquant_triton import DEFAULT_UNPACK

    rows = []
    for n in ns:
        for kind in ("fp16", 2, 1):
            bits = None if kind == "fp16" else kind
            per_seq = seq_bytes(n, h, d, bits)
            layer_seq = per_seq // LAYERS
            free = torch.cuda.mem_get_info()[0]
            gpu_cap = max(1, int(0.5 * free // (layer_seq * (3 if bits is None else 2) + 4 * h * n + 1)))
            batches = {gb: int(gb * 1e9 // per_seq) for gb in budgets}
            biggest = min(max(batches.values()), max_batch, gpu_cap)
            if biggest < 1:
                continue
            if bits is None:
                q, k, v = _fp16_cache(biggest, h, n, d, seed=n)
            else:
                kp, ka, ks = _random_packed(biggest, h, n, d, bits, seed=n)
                vp, va, vs = _random_packed(biggest, h, n, d, bits, seed=n + 1)
                vp = vp.transpose(2, 3).contiguous().transpose(2, 3)  # token-major V, as in the main timings
                q = torch.randn(biggest, h, d, device="cuda", dtype=torch.float16, generator=_gen(n + 2))
            timed = {}
            for gb in budgets:
                bsz = batches[gb]
                row = {"N": n, "kv": "fp16" if bits is None else f"{bits}-bit", "budget_GB": gb, "max_batch": bsz,
                       "bytes_per_seq": per_seq}
                if bsz < 1:
                    row["note"] = "not even one sequence fits"
                    rows.append(row)
                    continue
                tb = min(bsz, biggest)
                row["timed_batch"] = tb
                if tb != bsz:
                    row["note"] = f"timed at batch {tb} (cap: --max-batch {max_batch} / GPU memory for one layer)"
                if tb not in timed:
                    if bits is None:
                        timed[tb] = _time_sdpa(q[:tb], k[:tb], v[:tb], rep_ms)
                    else:
                        timed[tb] = _time_fused(q[:tb], kp[:tb], ka[:tb], ks[:tb], vp[:tb], va[:tb], vs[:tb], bits,
                                                DEFAULT_UNPACK, None, rep_ms)
                row["layer_ms"] = timed[tb]
                row["tokens_per_s"] = tb / (LAYERS * timed[tb] * 1e-3)
                rows.append(row)
            del q
            if bits is None:
                del k, v
            else:
                del kp, vp
            torch.cuda.empty_cache()
        print(f"figure 3 N={n} done", file=sys.stderr, flush=True)
    for r in rows:  # speedup over fp16 at the same budget and N
        base = next((x for x in rows if x["N"] == r["N"] and x["kv"] == "fp16" and x["budget_GB"] == r["budget_GB"]
                     and "tokens_per_s" in x), None)
        if base and "tokens_per_s" in r:
            r["tokens_per_s_vs_fp16"] = r["tokens_per_s"] / base["tokens_per_s"]
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r["N"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(ns), figsize=(5.5 * len(ns), 4), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for kind, marker in (("fp16", "s"), ("2-bit", "^"), ("1-bit", "o")):
            pts = [(r["budget_GB"], r["tokens_per_s"]) for r in rows if r["N"] == n and r["kv"] == kind
                   and "tokens_per_s" in r]
            if pts:
                ax.plot(*zip(*pts), marker=marker, label=kind)
        ax.set_title(f"decode attention, N={n}, H=32, D=128, 32 layers")
        ax.set_xlabel("KV cache budget (GB)")
        ax.set_ylabel("tokens / s (attention only)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results, fig_rows) -> str:
    lines = [f"{'B':>3} {'N':>5} {'sdpa ms':>8} {'1b ms':>8} {'1b x':>6} {'1b def':>8} {'2b ms':>8} {'2b x':>6} "
             f"{'2b def':>8} {'1b GB/s':>8} {'2b GB/s':>8} {'1b err':>8} {'2b err':>8}"]
    for r in results:
        lines.append(f"{r['B']:>3} {r['N']:>5} {r['sdpa_ms']:>8.4f} {r['b1_ms']:>8.4f} {r['b1_speedup']:>6.2f} "
                     f"{r['b1_default_ms']:>8.4f} {r['b2_ms']:>8.4f} {r['b2_speedup']:>6.2f} "
                     f"{r['b2_default_ms']:>8.4f} "
                     f"{r['b1_GBps']:>8.0f} {r['b2_GBps']:>8.0f} "
                     f"{r['b1_max_err_over_range']:>8.1e} {r['b2_max_err_over_range']:>8.1e}")
    lines.append(f"{'N':>5} {'kv':>6} {'GB':>3} {'batch':>5} {'timed':>5} {'layer ms':>9} {'tok/s':>9} {'x fp16':>7}")
    for r in fig_rows:
        lines.append(f"{r['N']:>5} {r['kv']:>6} {r['budget_GB']:>3} {r['max_batch']:>5} {r.get('timed_batch', 0):>5} "
                     f"{r.get('layer_ms', float('nan')):>9.4f} {r.get('tokens_per_s', float('nan')):>9.1f} "
                     f"{r.get('tokens_per_s_vs_fp16', float('nan')):>7.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--shapes", nargs="+", default=["64,32,8192,128", "16,32,3328,128"], help="B,H,N,D")
    ap.add_argument("--sweep", action="store_true", help="tune configs / unpack form on the first shape")
    ap.add_argument("--fig-n", type=int, nargs="*", default=[8192, 3328])
    ap.add_argument("--budgets", type=int, nargs="+", default=[5, 10, 15, 20, 25, 30])
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--fig", help="write the Figure 3 style plot here (PNG)")
    ap.add_argument("--rep-ms", type=int, default=100)
    args = ap.parse_args(argv)
    if no_cuda("bench_calibquant"):
        return 2
    t0 = time.time()
    warm_up()
    tuned_by_n: dict = {}
    results, sweeps = [], {}
    for shape in args.shapes:
        b, h, n, d = (int(x) for x in shape.split(","))
        tuned: dict = {}
        row, sw = run_shape(b, h, n, d, tuned, args.rep_ms, args.sweep)
        tuned_by_n.setdefault(n, tuned)
        results.append(row)
        if sw:
            sweeps[shape] = sw
    fig_rows = figure3(args.fig_n, args.budgets, args.rep_ms, args.max_batch) if args.fig_n else []
    meta = device_meta(
        timing="median ms per call, CUDA-graph replay, operand copies rotated (> 256 MB together)",
        calibration={"tau1": TAU[0], "tau2": TAU[1]},
        data="K = N(0,1) + per-channel offset, V = N(0,1), q = N(0,1), fp16; all tokens quantized; KVH = H; "
             "packed K [B, H, N, D*b/8] contiguous, packed V the same shape stored token-major",
        budget_model="per sequence: one layer's K+V bytes x 32 layers, H=32, D=128; fp16 2*H*N*D*2; "
                     "b bits 2*H*N*D*b/8 + fp32 alpha/scale 2*2*H*D*4; GB = 1e9 bytes; weights, "
                     "activations and transient logits not counted",
        tokens_per_s="timed_batch / (32 layers x one layer's decode attention time)",
        tuned={str(n): {str(k): v for k, v in t.items()} for n, t in tuned_by_n.items()}, wall_s=None)
    meta["wall_s"] = time.time() - t0
    print(f"device: {meta['device']}, torch {meta['torch']}, triton {meta.get('triton')}; tuned {meta['tuned']}")
    print(table(results, fig_rows))
    write_json(args.out, meta, results, memory_budget=fig_rows,
               sweep={s: {str(b): v for b, v in sw.items()} for s, sw in sweeps.items()})
    if args.fig and fig_rows:
        plot(fig_rows, args.fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
