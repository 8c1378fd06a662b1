"""ResQ on SmolLM2 (issue: ResQ mixed precision): perplexity of resq-w4a4 against fp32 and two
baselines at the same quantizer settings, the rank sweep, the static NPU recipe, and onnxruntime
CPU latency; one run, side by side.

1. perplexity on the first 40 windows of test (calibration: each recipe's 64 windows of valid):
   fp32; ``resq-w4a4`` (PCA subspaces, r = d/8); the baselines ``quarot`` (``resq`` basis
   "hadamard": randomized Hadamard everywhere, every activation, weight and K/V at 4 bits: 4.0
   bits) and ``linf`` (basis "linf": the d/8 channels of largest |x| max at 8 bits, rotated inside
   each group: the paper's Table 4 baseline, 4.5 bits); the rank sweep r = d/16, d/4; and
   ``resq-w4a8`` (static per-tensor 8-bit activations, NPU);
2. onnxruntime CPU latency of one 512-token pass, batch 1, median of 10 runs interleaved:
   fp32, ``resq-w4a8``, ``mquant-w8a8``.

Usage: python benchmarks/resq.py --model-dir artifacts/smollm2 --out artifacts/bench-resq.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from foundation import bench_parser, latency_results, save_results
from weight_quant import ablation_recipe

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"

RECIPES = ("resq-w4a4", "resq-w4a8")
# variants: (name, base recipe, pass, settings replaced in that pass)
VARIANTS = (
    ("resq-w4a4-quarot", "resq-w4a4", "resq", {"basis": '"hadamard"'}),
    ("resq-w4a4-linf", "resq-w4a4", "resq", {"basis": '"linf"'}),
    ("resq-w4a4-r16", "resq-w4a4", "resq", {"rank_divisor": "16"}),
    ("resq-w4a4-r4", "resq-w4a4", "resq", {"rank_divisor": "4"}),
)
LATENCY = ("resq-w4a8", "mquant-w8a8")


def main(argv=None) -> int:
    parser = bench_parser(__doc__, "bench-resq", ",".join(RECIPES))
    parser.add_argument("--latency-only", action="store_true", help="re-time the graphs compiled by an earlier run")
    parser.add_argument("--resume", action="store_true", help="keep the rows of an earlier --out whose model exists")
    parser.add_argument("--variants", default=",".join(v[0] for v in VARIANTS), help="comma-separated variants to run")
    a = parser.parse_args(argv)

    from edgeq.evaluate.ppl import perplexity

    fp32 = a.model_dir / "model.onnx"
    env = {**os.environ, "EDGEQ_PROGRESS": "0"}
    a.work.mkdir(parents=True, exist_ok=True)
    results: dict = {"eval_windows": a.eval_windows}
    if a.resume and a.out.is_file():
        results = json.loads(a.out.read_text())
    variants = {name: (base, p, ch) for name, base, p, ch in VARIANTS}
    names = [r for r in a.recipes.split(",") if r] + [v for v in a.variants.split(",") if v]
    if not a.latency_only:
        if "fp32" not in results:
            results["fp32"] = round(perplexity(fp32, DATA / "test.txt", a.model_dir, windows=a.eval_windows)["ppl"], 3)
        for name in names:
            if name in results and (a.work / name / "model.onnx").is_file():
                continue
            recipe = name
            if name in variants:
                recipe = a.work / f"{name}.toml"
                recipe.write_text(ablation_recipe(*variants[name]))
            out = a.work / name
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "edgeq", "compile", str(fp32), "--recipe", str(recipe),
                            "--calib", str(DATA / "valid.txt"), "-o", str(out)], check=True, env=env, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t
            report = json.loads((out / "report.json").read_text())
            summary = {p["name"]: p["summary"] for p in report["passes"]}
            ppl = perplexity(out / "model.onnx", DATA / "test.txt", a.model_dir, windows=a.eval_windows)["ppl"]
            quant = summary.get("resq-qdq", {})
            results[name] = {"ppl": round(ppl, 3), "x_fp32": round(ppl / results["fp32"], 4), "compile_seconds": round(wall, 1),
                             "mean_weight_bits": quant.get("mean_weight_bits"), "mean_activation_bits": quant.get("mean_activation_bits"),
                             "high_energy_fraction": summary.get("resq", {}).get("high_energy_fraction")}
            print(name, json.dumps(results[name]), flush=True)
            save_results(a.out, results)
    for name in LATENCY:
        if not (a.work / name / "model.onnx").is_file():
            subprocess.run([sys.executable, "-m", "edgeq", "compile", str(fp32), "--recipe", name,
                            "--calib", str(DATA / "valid.txt"), "-o", str(a.work / name)], check=True, env=env, stdout=subprocess.DEVNULL)
    paths = {"fp32": fp32, **{r: a.work / r / "model.onnx" for r in LATENCY}}
    save_results(a.out, latency_results(results, paths, a.out, a.latency_only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
