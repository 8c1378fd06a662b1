"""Rotation-family benchmark on SmolLM2 (issue: rotation, RMS and the first close-to-fp32 recipe).

One run, side by side on one machine:
1. perplexity of the rotated fp32 graph (fuse-norms, ln-to-rms, rotate; no quantization) against
   the original: must agree within 0.1%;
2. perplexity of w8a8, quarot-w8a8, mquant-w8a8, mquant-w4a8 and the ablations: mquant-w8a8
   without massive-split, without rms, and mquant-w4a8 without rms;
3. the Eq. 9 table (MQuant Table 2) of SmolLM2;
4. onnxruntime CPU latency of one 512-token pass (batch 1, median of 10): fp32, w8a8, mquant-w8a8.

Usage: python benchmarks/rotation.py --model-dir artifacts/smollm2 --out artifacts/bench-rotation.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from foundation import bench_parser, fused_ops, latency_ms, save_results

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"

ROTATE_FP32 = '[[pass]]\nname = "fuse-norms"\n\n[[pass]]\nname = "ln-to-rms"\n\n[[pass]]\nname = "rotate"\n'


def _without(recipe: str, pass_name: str) -> str:
    """The built-in recipe's TOML with one pass removed (for the ablations)."""
    from importlib import resources

    text = (resources.files("edgeq") / "recipes" / f"{recipe}.toml").read_text()
    blocks = text.split("[[pass]]")
    kept = [b for b in blocks[1:] if f'name = "{pass_name}"' not in b]
    return blocks[0] + "".join("[[pass]]" + b for b in kept)


def main(argv=None) -> int:
    a = bench_parser(__doc__, "bench-rotation", "w8a8,quarot-w8a8,mquant-w8a8,mquant-w4a8").parse_args(argv)

    from edgeq.graph import ir
    from edgeq.passes.methods.eq9 import eq9_table
    from edgeq.evaluate.ppl import perplexity

    fp32 = a.model_dir / "model.onnx"
    results: dict = {"calib_windows": a.calib_windows, "eval_windows": a.eval_windows}
    results["eq9"] = {k: v for k, v in eq9_table(ir.to_graph(ir.load_model(fp32))).items() if k != "rows"}
    tmp = Path(tempfile.mkdtemp(prefix="edgeq-bench-"))
    recipes = {"rotated-fp32": tmp / "rotate.toml", **{r: r for r in a.recipes.split(",")}}
    (tmp / "rotate.toml").write_text(ROTATE_FP32)
    for recipe, dropped in (("mquant-w8a8", "massive-split"), ("mquant-w8a8", "rms"), ("mquant-w4a8", "rms")):
        name = f"{recipe}-no-{dropped}"
        (tmp / f"{name}.toml").write_text(_without(recipe, dropped))
        recipes[name] = tmp / f"{name}.toml"
    models = {"fp32": fp32}
    env = {**os.environ, "EDGEQ_PROGRESS": "0"}
    for name, recipe in recipes.items():
        out = a.work / name
        subprocess.run([sys.executable, "-m", "edgeq", "compile", str(fp32), "--recipe", str(recipe),
                        "--calib", str(DATA / "valid.txt"), "--calib-windows", str(a.calib_windows), "-o", str(out)],
                       check=True, env=env)
        report = json.loads((out / "report.json").read_text())
        results[name] = {"compile_s": report["seconds_total"],
                         "passes": {r["name"]: r["summary"] for r in report["passes"]}}
        models[name] = out / "model.onnx"
    for name, path in models.items():
        res = perplexity(path, DATA / "test.txt", a.model_dir, windows=a.eval_windows)
        results.setdefault(name, {})["ppl"] = round(res["ppl"], 3)
        print(f"{name}: ppl {res['ppl']:.3f}", flush=True)
    base = results["fp32"]["ppl"]
    for name in models:
        results[name]["x_fp32"] = round(results[name]["ppl"] / base, 4)
    results["rotated_fp32_rel_diff"] = round(abs(results["rotated-fp32"]["ppl"] - base) / base, 6)
    for name in ("fp32", "w8a8", "quarot-w8a8", "mquant-w8a8"):
        if name in models:
            results[name]["latency_ms_512"] = round(latency_ms(models[name]), 1)
            results[name]["fused_ops"] = fused_ops(models[name])
            print(f"{name}: latency {results[name]['latency_ms_512']} ms {results[name]['fused_ops']}", flush=True)
    save_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
