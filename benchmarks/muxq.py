"""MUXQ ablation on SmolLM2 (issue: MUXQ Body/Aux split), the paper's Tables 1 and 2 rebuilt.

One run, side by side on one machine; calibration 16 windows of valid, first 40 windows of test:
1. Table 1: activation bits 8, 7, 6 at 8-bit weights; Table 2: weight bits 8, 5, 4 at 8-bit
   activations; each for static per-tensor and per-token dynamic activations, with the methods
   naive (the same quantization, no split), MUXQ (the paper's setting: |x| > 6, e = 2),
   MUXQ-auto (the muxq-w8a8 recipe's settings: per-channel exponent, |x| > 2), MUXQ two-GEMM
   (Eq. 7 with 2^e - 1 applied after the Aux GEMM; A8W8 and the low-bit weight rows) and
   LLM.int8()-style (|x| > 6 outliers in a float GEMV). Every cell uses the same qdq settings as the muxq-w8a8 recipe (symmetric
   activations, MSE-searched static clip, per-channel symmetric weights).
2. the ordering naive > MUXQ >= LLM.int8() checked in every row;
3. the muxq-w8a8 recipe against fp32, and onnxruntime CPU latency of muxq-w8a8 against w8a8
   (one 512-token pass, batch 1, median of 20 runs interleaved across the models).

Usage: python benchmarks/muxq.py --model-dir artifacts/smollm2 --out artifacts/bench-muxq.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from foundation import bench_parser, fused_ops, interleaved_latency_ms, save_results

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"


def _recipe_muxq_settings() -> str:
    """The muxq pass settings of the muxq-w8a8 recipe, as TOML lines (the MUXQ-auto column)."""
    import dataclasses

    from edgeq.recipes import load_recipe

    (spec,) = [p for p in load_recipe("muxq-w8a8").passes if p.name == "muxq"]
    return "\n".join(f"{k} = {json.dumps(list(v) if isinstance(v, tuple) else v)}"
                     for k, v in dataclasses.asdict(spec.config).items())


METHODS = {
    "naive": None,
    "muxq": 'method = "muxq"\nexponent = 2\nexponent_mode = "fixed"\nthreshold = 6.0',  # the paper's setting
    "muxq-auto": _recipe_muxq_settings(),
    "llm-int8": 'method = "llm-int8"\nthreshold = 6.0',
    # Eq. 7 as written (2^e - 1 applied after a separate Aux GEMM): for the low-bit weight rows,
    # where the concat form's stacked weight rows (x 3) widen the per-channel weight range
    "muxq-2gemm": 'method = "muxq"\nexponent = 2\nexponent_mode = "fixed"\nthreshold = 6.0\nform = "two-gemm"',
}
ROWS = [(8, 8), (7, 8), (6, 8), (8, 5), (8, 4)]  # (activation bits, weight bits)
# columns beyond the paper's, and the rows they run in (to bound run time)
EXTRA_ROWS = {"muxq-auto": {(8, 8)}, "muxq-2gemm": {(8, 8), (8, 5), (8, 4)}}


def recipe_text(method: str, granularity: str, a_bits: int, w_bits: int, calib_windows: int) -> str:
    text = f"[calibration]\nwindows = {calib_windows}\nseq_len = 512\n\n"
    if METHODS[method]:
        text += f'[[pass]]\nname = "muxq"\n{METHODS[method]}\n\n'
    text += ('[[pass]]\nname = "qdq"\nactivation_dtype = "uint8"\nactivation_symmetric = true\n'
             'activation_observer = "mse"\nweight_dtype = "int8"\nweight_granularity = "channel"\n'
             f'activation_granularity = "{granularity}"\n')
    if a_bits != 8:
        text += f"activation_bits = {a_bits}\n"
    if w_bits != 8:
        text += f"weight_bits = {w_bits}\n"
    return text


def ordering(row: dict, muxq: str = "muxq") -> str:
    """'ok' when naive > muxq >= llm-int8, otherwise which comparison failed."""
    issues = []
    if not row["naive"] > row[muxq]:
        issues.append(f"naive <= {muxq}")
    if not row[muxq] >= row["llm-int8"]:
        issues.append(f"{muxq} < llm-int8")
    return "ok" if not issues else ", ".join(issues)


def main(argv=None) -> int:
    parser = bench_parser(__doc__, "bench-muxq", "")
    parser.add_argument("--resume", action="store_true", help="keep the finished rows and figures of an earlier --out")
    parser.add_argument("--latency-only", action="store_true",
                        help="re-measure the latency of the w8a8 and muxq-w8a8 graphs compiled by an earlier run (quiet machine)")
    a = parser.parse_args(argv)

    from edgeq.evaluate.ppl import perplexity

    fp32 = a.model_dir / "model.onnx"
    env = {**os.environ, "EDGEQ_PROGRESS": "0"}
    a.work.mkdir(parents=True, exist_ok=True)

    def compile_and_eval(name: str, recipe: str | Path) -> tuple[Path, float]:
        out = a.work / name
        if not isinstance(recipe, Path) and "\n" in recipe:
            path = a.work / f"{name}.toml"
            path.write_text(recipe)
            recipe = path
        subprocess.run([sys.executable, "-m", "edgeq", "compile", str(fp32), "--recipe", str(recipe),
                        "--calib", str(DATA / "valid.txt"), "--calib-windows", str(a.calib_windows), "-o", str(out)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        ppl = perplexity(out / "model.onnx", DATA / "test.txt", a.model_dir, windows=a.eval_windows)["ppl"]
        print(f"{name}: ppl {ppl:.3f}", flush=True)
        return out / "model.onnx", round(ppl, 3)

    earlier = json.loads(a.out.read_text()) if (a.resume or a.latency_only) and a.out.is_file() else {}
    tables = earlier.pop("tables", {})
    results: dict = earlier or {"calib_windows": a.calib_windows, "eval_windows": a.eval_windows}
    if a.latency_only:
        paths = {"fp32": fp32, "w8a8": a.work / "w8a8" / "model.onnx", "muxq-w8a8": a.work / "muxq-w8a8" / "model.onnx"}
        results["latency_ms_512"] = {k: round(v, 1) for k, v in interleaved_latency_ms(paths, repeats=20).items()}
        lat = results["latency_ms_512"]
        results["muxq_latency_overhead_vs_w8a8"] = round(lat["muxq-w8a8"] / lat["w8a8"], 3)
        a.out.write_text(json.dumps({**results, "tables": tables}, indent=1))
        print(json.dumps(lat), results["muxq_latency_overhead_vs_w8a8"])
        return 0
    if "latency_ms_512" not in results:
        results["fp32"] = round(perplexity(fp32, DATA / "test.txt", a.model_dir, windows=a.eval_windows)["ppl"], 3)
        models = {}
        for name in ("w8a8", "muxq-w8a8"):
            models[name], results[name] = compile_and_eval(name, name)
        results["muxq-w8a8_x_fp32"] = round(results["muxq-w8a8"] / results["fp32"], 4)
        paths = {"fp32": fp32, "w8a8": models["w8a8"], "muxq-w8a8": models["muxq-w8a8"]}
        results["latency_ms_512"] = {k: round(v, 1) for k, v in interleaved_latency_ms(paths, repeats=20).items()}
        results["fused_ops"] = {name: fused_ops(path) for name, path in paths.items()}
        lat = results["latency_ms_512"]
        results["muxq_latency_overhead_vs_w8a8"] = round(lat["muxq-w8a8"] / lat["w8a8"], 3)
        print(json.dumps(results["latency_ms_512"]), flush=True)

    for granularity in ("tensor", "token"):
        for a_bits, w_bits in ROWS:
            row = tables.get(granularity, {}).get(f"A{a_bits}W{w_bits}", {})
            for method in METHODS:
                if method in row or (method in EXTRA_ROWS and (a_bits, w_bits) not in EXTRA_ROWS[method]):
                    continue
                tag = f"{granularity}-a{a_bits}w{w_bits}-{method}"
                _, row[method] = compile_and_eval(tag, recipe_text(method, granularity, a_bits, w_bits, a.calib_windows))
                (a.work / tag / "model.onnx.data").unlink(missing_ok=True)  # keep disk use bounded
            row["fp32"] = results["fp32"]
            row["ordering"] = ordering(row)
            if "muxq-2gemm" in row:
                row["ordering_2gemm"] = ordering(row, "muxq-2gemm")
            tables.setdefault(granularity, {})[f"A{a_bits}W{w_bits}"] = row
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps({**results, "tables": tables}, indent=1))
    results["tables"] = tables
    save_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
