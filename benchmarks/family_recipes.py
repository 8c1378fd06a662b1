"""Every recipe on a real model of another family (issue 32): Gemma 3 270M, perplexity ratio to
fp32 with onnxruntime's defaults and with exact QDQ, beside SmolLM2's figures.

Protocol: WikiText-2 test, first ``--windows`` windows of 512 tokens, each led by BOS (the Gemma
tokenizer adds it: ``edgeq.textdata.window_convention``); calibration on WikiText-2 valid with each
recipe's own window count (BOS-led too), or ``--calib-windows N`` for every recipe (the peers' 16, to
stand beside AIMET-ONNX on the same windows). One recipe at a time, resumable: a recipe already in
``--out`` is skipped. Each compile's wall time and peak RSS come from GNU time (``measure.py``). The
machine is stamped into the file.

Usage: python benchmarks/family_recipes.py --model-dir artifacts/gemma3 --out F [--recipes a,b] [--windows 40]
                                           [--calib-windows N]
       python benchmarks/family_recipes.py --out F --table   (the docs/model-families.md table: F beside SmolLM2's
       ratios in edgeq/accuracy/measured.toml)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from foundation import save_results
from measure import run_measured

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"


def _edgeq(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "edgeq", *args], check=True, capture_output=True, text=True).stdout


def _ppl(model: Path, tokenizer: Path, windows: int, exact: bool) -> dict:
    out = _edgeq("eval", "ppl", str(model), "--text", str(DATA / "test.txt"), "--tokenizer", str(tokenizer),
                 "--windows", str(windows), "--json", *(["--exact-qdq"] if exact else []))
    r = json.loads(out.strip().splitlines()[-1])
    return {"ppl": r["ppl"], "windows": r["windows"], "window_convention": r["window_convention"]}


def weight_bytes(model: Path) -> int:
    """Bytes of every initializer the compiled graph stores (int4 packed two to a byte, scales and
    zero points included), read from the graph's tensor records without loading external data."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    total = 0
    for graph in [proto.graph, *(a.g for n in proto.graph.node for a in n.attribute if a.g.node)]:
        for t in graph.initializer:
            location = {e.key: e.value for e in t.external_data}
            total += int(location["length"]) if "length" in location else len(t.raw_data) or onnx.numpy_helper.to_array(t).nbytes
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=REPO / "artifacts" / "gemma3")
    ap.add_argument("--work", type=Path, default=REPO / "artifacts" / "family-recipes")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipes", default="mquant-w8a8,w8a8,w8a16")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--calib-windows", type=int, default=None,
                    help="calibration windows for every recipe (default: each recipe's own)")
    ap.add_argument("--target", default=None,
                    help="compile every recipe for this target (a row named RECIPE@TARGET); ort-genai: "
                    "--model-dir is the --with-past export and the folder is evaluated through onnxruntime-genai")
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out and stop")
    args = ap.parse_args()
    if args.table:
        print(markdown_table(json.loads(args.out.read_text())))
        return
    results = json.loads(args.out.read_text()) if args.out.exists() else {
        "model": args.model_dir.name,
        "protocol": f"WikiText-2 test, first {args.windows} windows of 512 tokens (BOS-led where the tokenizer adds BOS), "
                    "onnxruntime CPU defaults and --exact-qdq; calibration: WikiText-2 valid, each recipe's own windows",
        "recipes": {}}
    command = " ".join(["python", "benchmarks/family_recipes.py", *sys.argv[1:]])
    results.setdefault("commands", [results.pop("command")] if "command" in results else [])
    if command not in results["commands"]:
        results["commands"].append(command)
    model = args.model_dir / "model.onnx"
    if "fp32" not in results:
        results["fp32"] = {**_ppl(model, args.model_dir, args.windows, exact=False), "weight_bytes": weight_bytes(model)}
        save_results(args.out, results)
    for recipe_arg in args.recipes.split(","):
        recipe = Path(recipe_arg).stem if recipe_arg.endswith(".toml") else recipe_arg  # a recipe file: its name
        if args.target:
            recipe = f"{recipe}@{args.target}"
        if recipe in results["recipes"]:
            continue
        out = args.work / recipe.replace("@", "-at-")
        windows = ["--calib-windows", str(args.calib_windows)] if args.calib_windows else []
        target = ["--target", args.target] if args.target else []
        step = run_measured([sys.executable, "-m", "edgeq", "compile", str(model), "--recipe", recipe_arg, "--calib",
                             str(DATA / "valid.txt"), *windows, *target, "-o", str(out), "--force"])
        if step["code"] != 0:
            results["recipes"][recipe] = {"exit": step["code"], "error": step["stderr"].strip().splitlines()[-1:]}
            save_results(args.out, results)
            continue
        genai = args.target == "ort-genai"  # the folder, run by onnxruntime-genai (which has no exact-QDQ switch)
        compiled = out if genai else out / "model.onnx"
        row = {"compile_seconds": step["seconds"], "compile_peak_rss_mb": step["peak_rss_mb"],
               "calib_windows": args.calib_windows or "the recipe's",
               "weight_bytes": weight_bytes(out / "model.onnx"), **({"runtime": "onnxruntime-genai"} if genai else {})}
        for mode, exact in (("default", False),) + (() if genai else (("exact_qdq", True),)):
            row[mode] = _ppl(compiled, args.model_dir, args.windows, exact)
            row[f"{mode}_x_fp32"] = row[mode]["ppl"] / results["fp32"]["ppl"]
        results["recipes"][recipe] = row
        save_results(args.out, results)


def markdown_table(results: dict) -> str:
    """Every recipe of ``results`` (ratio default / exact QDQ) beside SmolLM2's measured ratio."""
    import tomllib

    smol = tomllib.loads((REPO / "edgeq" / "accuracy" / "measured.toml").read_text())["llama"]["ratios"]
    name = {"gemma3": "Gemma 3", "qwen25": "Qwen2.5-0.5B"}.get(results["model"], results["model"])
    rows = [f"| recipe | {name} ppl (default / exact) | {name} x fp32 (default / exact) | SmolLM2 x fp32 (its results file) |",
            "| --- | --- | --- | --- |",
            f"| fp32 | {results['fp32']['ppl']:.2f} | 1.000 | 1.000 |"]
    for recipe, row in results["recipes"].items():
        base = recipe.split("@")[0]
        other = f"{smol[base]['x_fp32']:.3f} (`{Path(smol[base]['results']).name}`)" if base in smol else "not measured"
        if "default" not in row:
            rows.append(f"| `{recipe}` | exit {row['exit']}: {' '.join(row['error'])} | | {other} |")
            continue
        if "exact_qdq" not in row:  # (onnxruntime-genai: no exact-QDQ switch; weight-only rows need none)
            rows.append(f"| `{recipe}` ({row.get('runtime', 'onnxruntime')}) | {row['default']['ppl']:.2f} | "
                        f"{row['default_x_fp32']:.3f} | {other} |")
            continue
        rows.append(f"| `{recipe}` | {row['default']['ppl']:.2f} / {row['exact_qdq']['ppl']:.2f} | "
                    f"{row['default_x_fp32']:.3f} / {row['exact_qdq_x_fp32']:.3f} | {other} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
