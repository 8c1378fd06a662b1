"""Weight quantization on SmolLM2 (issue: GPTQ, DPQ, GAR, W4A8): perplexity, ablations, quantization
time (measured, and projected to a 7B model), onnxruntime CPU latency; one run, side by side.

1. perplexity on the first 40 windows of test (calibration: 64 windows of valid): fp32 and the
   recipes gptq-w4a16, dpq-w4a8, mquant-w4a8, plus the ablations DPQ vs "GPTQ then FP8"
   (dpq two_level = false) and GAR vs the stored order (gptq and dpq with order = "natural");
2. quantization time: each compile's calibration and GPTQ/DPQ sweep seconds (from its report);
   the 7B projection times the sweep on random weights of Llama-2-7B's three linear shapes
   (4096x4096, 4096->11008, 11008->4096) with their Hessians and sums 32 layers (q, k, v, o,
   gate, up, down);
3. onnxruntime CPU latency of one 512-token pass, batch 1, median of 10 runs interleaved, for
   fp32, the shipped W4 graphs and gptq-w4a16's DequantizeLinear form (the SmolLM2 export has no KV cache, so no 1-token pass);
   onnxruntime's optimized-graph op counts show which kernels ran (MatMulNBits or not).

Usage: python benchmarks/weight_quant.py --model-dir artifacts/smollm2 --out artifacts/bench-wq.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from foundation import bench_parser, latency_results, save_results

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"

RECIPES = ("gptq-w4a16", "dpq-w4a8", "mquant-w4a8")
# ablations: (name, base recipe, pass, settings replaced in that pass)
ABLATIONS = (
    ("dpq-w4a8-gptq-then-fp8", "dpq-w4a8", "dpq", {"two_level": "false"}),
    ("dpq-w4a8-no-gar", "dpq-w4a8", "dpq", {"order": '"natural"'}),
    ("gptq-w4a16-no-gar", "gptq-w4a16", "gptq", {"order": '"natural"'}),
    ("gptq-w4a16-no-sink", "gptq-w4a16", "gptq", {"sink_weight": "1.0"}),
    # the DequantizeLinear + MatMul form, which onnxruntime fuses into MatMulNBits at accuracy level 4
    ("gptq-w4a16-dq-form", "gptq-w4a16", "gptq", {"lowering": '"qdq"'}),
)
LATENCY_EXTRA = ("gptq-w4a16-dq-form",)
LLAMA7B = {"layers": 32, "shapes": {"qkvo": (4096, 4096, 4), "gate_up": (4096, 11008, 2), "down": (11008, 4096, 1)}}


def ablation_recipe(base: str, pass_name: str, changes: dict[str, str]) -> str:
    """The recipe file ``base`` with ``key = value`` lines of ``pass_name`` replaced."""
    lines, in_pass = [], False
    for line in (REPO / "edgeq" / "recipes" / f"{base}.toml").read_text().splitlines():
        stripped = line.split("#")[0].strip()
        if stripped.startswith("name ="):
            in_pass = stripped == f'name = "{pass_name}"'
        key = stripped.split("=")[0].strip()
        if in_pass and key in changes:
            line = f"{key} = {changes[key]}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def sweep_seconds_7b(group_size: int = 128) -> dict:
    """Seconds of one GPTQ sweep per Llama-2-7B linear shape (random weight, random SPD Hessian),
    and the sum over the 7 linears of 32 layers."""
    from edgeq.passes.methods.gptq import gptq_quantize
    from edgeq.quantize.quant import QuantSpec

    rng = np.random.default_rng(0)
    spec = QuantSpec("int4", True, axis=0, block_size=group_size)
    per_shape, total = {}, 0.0
    for name, (k, n, count) in LLAMA7B["shapes"].items():
        x = rng.standard_normal((2 * k, k)).astype(np.float32)
        h = (2.0 * (x.T @ x) / len(x)).astype(np.float64)
        w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        t = time.perf_counter()
        gptq_quantize(w, h, spec, group_size=group_size, order="gar", full_range=True)
        per_shape[name] = round(time.perf_counter() - t, 1)
        total += per_shape[name] * count * LLAMA7B["layers"]
    return {"per_linear_seconds": per_shape, "sweep_seconds_7b": round(total, 0)}


def main(argv=None) -> int:
    parser = bench_parser(__doc__, "bench-wq", ",".join(RECIPES))
    parser.set_defaults(calib_windows=64)
    parser.add_argument("--skip-7b", action="store_true", help="skip the 7B sweep-time projection (minutes)")
    parser.add_argument("--latency-only", action="store_true", help="re-time the graphs compiled by an earlier run")
    parser.add_argument("--resume", action="store_true", help="keep the rows of an earlier --out whose model exists")
    a = parser.parse_args(argv)

    from edgeq.evaluate.ppl import perplexity

    fp32 = a.model_dir / "model.onnx"
    env = {**os.environ, "EDGEQ_PROGRESS": "0"}
    a.work.mkdir(parents=True, exist_ok=True)
    results: dict = {"calib_windows": a.calib_windows, "eval_windows": a.eval_windows}
    if a.resume and a.out.is_file():
        results = json.loads(a.out.read_text())
    names = [r for r in a.recipes.split(",") if r] + [name for name, *_ in ABLATIONS]
    if not a.latency_only:
        if "fp32" not in results:
            results["fp32"] = round(perplexity(fp32, DATA / "test.txt", a.model_dir, windows=a.eval_windows)["ppl"], 3)
        abl = {name: (base, p, ch) for name, base, p, ch in ABLATIONS}
        for name in names:
            if name in results and (a.work / name / "model.onnx").is_file():
                continue
            recipe = name
            if name in abl:
                recipe = a.work / f"{name}.toml"
                recipe.write_text(ablation_recipe(*abl[name]))
            out = a.work / name
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "edgeq", "compile", str(fp32), "--recipe", str(recipe),
                            "--calib", str(DATA / "valid.txt"), "--calib-windows", str(a.calib_windows), "-o", str(out)],
                           check=True, env=env, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t
            report = json.loads((out / "report.json").read_text())
            sweep = sum(p["summary"].get("seconds", 0.0) for p in report["passes"] if p["name"] in ("gptq", "dpq"))
            ppl = perplexity(out / "model.onnx", DATA / "test.txt", a.model_dir, windows=a.eval_windows)["ppl"]
            results[name] = {"ppl": round(ppl, 3), "x_fp32": round(ppl / results["fp32"], 4),
                             "compile_seconds": round(wall, 1), "sweep_seconds": round(sweep, 1),
                             "calibration_seconds": report["calibration"]["seconds"]}
            print(name, json.dumps(results[name]), flush=True)
            save_results(a.out, results)
        if not a.skip_7b and "projection_7b" not in results:
            results["projection_7b"] = sweep_seconds_7b()
    paths = {"fp32": fp32, **{r: a.work / r / "model.onnx" for r in [*a.recipes.split(","), *LATENCY_EXTRA] if r}}
    save_results(a.out, latency_results(results, paths, a.out, a.latency_only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
