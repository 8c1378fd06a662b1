"""Compile memory and time at scale: real-shaped random LLMs (``edgeq export random``), 0.5B to 3B.

Every compile runs in its own process; its peak RSS is read from outside (``os.wait4``: the
kernel's high-water mark of that child), beside the model's fp32 size on disk. Writes one JSON:

- ``runs``: preset, layers, parameters, recipe, compile path, seconds, peak RSS, peak RSS / fp32
  size, seconds per billion parameters, exit code (a run that fails is a row with its error);
- ``fits``: the slopes, by least squares on logs: seconds ~ layers^a (one width, several layer
  counts: ``--layers-sweep``), and seconds and peak RSS ~ parameters^b across presets;
- ``ort_quantize_static``: onnxruntime's own static quantizer on the same model and calibration
  windows, in its own process under the same memory watch (killed at ``--rss-limit-gb``: the
  point where it fails is recorded).

The weights are random: these models measure memory and time, never accuracy.

    python benchmarks/scale.py --presets qwen2.5-0.5b llama-3.2-1b --recipes mquant-w8a8 gptq-w4a16 \\
        --out benchmarks/results/scale-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from edgeq.evaluate.machine import machine_info

REPO = Path(__file__).resolve().parents[1]


def run_measured(cmd: list[str], log: Path, rss_limit_mb: float | None = None, env: dict | None = None) -> dict:
    """Run ``cmd``; returns exit code, seconds and the child's peak RSS (MB) from ``wait4``. With
    ``rss_limit_mb`` the child is killed once its current RSS passes the limit."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        killed = threading.Event()
        if rss_limit_mb:
            threading.Thread(target=_watch, args=(proc.pid, rss_limit_mb, killed), daemon=True).start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return {"exit_code": proc.returncode, "seconds": round(time.perf_counter() - start, 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "killed_at_rss_limit": killed.is_set()}


def _watch(pid: int, limit_mb: float, killed: threading.Event) -> None:
    status = Path(f"/proc/{pid}/status")
    while True:
        try:
            rss = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            return
        if rss / 1024 > limit_mb:
            killed.set()
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.2)


def model_stats(model_dir: Path) -> dict:
    import onnx

    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    params = sum(int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer)
    size = sum(p.stat().st_size for p in model_dir.glob("model.onnx*"))
    config = json.loads((model_dir / "config.json").read_text())
    return {"parameters": params, "fp32_mb": round(size / 2**20, 1), "layers": config.get("num_hidden_layers")}


def export(edgeq: str, preset: str, layers: int | None, models: Path) -> Path:
    name = preset + (f"-L{layers}" if layers else "")
    out = models / name
    if not (out / "model.onnx").is_file():
        cmd = [edgeq, "export", "random", preset, "-o", str(out)] + (["--layers", str(layers)] if layers else [])
        subprocess.run(cmd, check=True)
    return out


def compile_run(edgeq: str, model_dir: Path, recipe: str, args, tag: str) -> dict:
    out = args.work / f"{tag}-{recipe}"
    log = args.work / f"{tag}-{recipe}.log"
    cmd = [edgeq, "compile", str(model_dir / "model.onnx"), "--recipe", recipe, "--calib", str(args.calib),
           "--tokenizer", str(args.tokenizer), "-o", str(out), "--no-cache", "--blockwise", args.blockwise]
    if args.calib_windows:
        cmd += ["--calib-windows", str(args.calib_windows)]
    env = {**os.environ, "EDGEQ_PROGRESS": "1"}
    print(" ".join(cmd), flush=True)
    m = run_measured(cmd, log, args.rss_limit_gb * 1024, env)
    row = {"model": tag, "recipe": recipe, **model_stats(model_dir), **m, "log": str(log)}
    row["rss_over_fp32"] = round(row["peak_rss_mb"] / row["fp32_mb"], 3)
    row["seconds_per_billion_params"] = round(row["seconds"] / (row["parameters"] / 1e9), 1)
    report = out / "report.json"
    if m["exit_code"] == 0 and report.is_file():
        r = json.loads(report.read_text())
        row["compile_path"] = r.get("compile_path")
        row["passes"] = [{k: p.get(k) for k in ("name", "seconds", "peak_rss_mb")} for p in r["passes"]]
        row["calibration_seconds"] = (r.get("calibration") or {}).get("seconds")
        row["output_mb"] = r.get("output_size_mb")
    else:
        row["error"] = Path(log).read_text()[-600:]
    print(json.dumps({k: row[k] for k in ("model", "recipe", "exit_code", "seconds", "peak_rss_mb", "rss_over_fp32")}),
          flush=True)
    if not args.keep_outputs:
        subprocess.run(["rm", "-rf", str(out)])
    return row


def ort_quantize_static(model_dir: Path, args) -> dict:
    """onnxruntime's quantize_static (QDQ, per-tensor activations, per-channel int8 weights, MinMax)
    on the same calibration windows, in its own process under the memory watch."""
    script = args.work / "ort_quantize_static.py"
    script.write_text(_ORT_SCRIPT)
    out = args.work / f"ort-{model_dir.name}"
    out.mkdir(parents=True, exist_ok=True)
    log = args.work / f"ort-{model_dir.name}.log"
    cmd = [sys.executable, str(script), str(model_dir / "model.onnx"), str(out / "model.onnx"), str(args.calib),
           str(args.tokenizer), str(args.calib_windows or 16)]
    print(" ".join(cmd), flush=True)
    m = run_measured(cmd, log, args.rss_limit_gb * 1024)
    row = {"model": model_dir.name, "tool": "onnxruntime.quantization.quantize_static", **model_stats(model_dir), **m}
    row["rss_over_fp32"] = round(row["peak_rss_mb"] / row["fp32_mb"], 3)
    row["log_tail"] = log.read_text()[-800:]
    subprocess.run(["rm", "-rf", str(out)])
    return row


_ORT_SCRIPT = r'''
import sys, time
import numpy as np
import onnxruntime
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from tokenizers import Tokenizer

src, dst, text, tok_dir, windows = sys.argv[1:6]
ids = Tokenizer.from_file(tok_dir + "/tokenizer.json").encode(open(text).read()).ids
seq, n = 512, int(windows)
inputs = {i.name for i in onnxruntime.InferenceSession(src, providers=["CPUExecutionProvider"]).get_inputs()} if False else None

class Reader(CalibrationDataReader):
    def __init__(self):
        self.k = 0
    def get_next(self):
        if self.k >= n:
            return None
        w = np.array(ids[self.k * seq:(self.k + 1) * seq], np.int64)[None]
        self.k += 1
        print(f"calibration window {self.k}/{n}", flush=True)
        return {"input_ids": w, "attention_mask": np.ones_like(w), "position_ids": np.arange(seq, dtype=np.int64)[None]}

t = time.time()
quantize_static(src, dst, Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8, per_channel=True, use_external_data_format=True,
                extra_options={"ActivationSymmetric": False})
print(f"done in {time.time() - t:.1f} s", flush=True)
'''


def fit_power(xs: list[float], ys: list[float]) -> float | None:
    """The exponent a of y ~ x^a (least squares on logs); None with fewer than two points."""
    pts = [(x, y) for x, y in zip(xs, ys) if x and y]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return None
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return round(float(np.polyfit(lx, ly, 1)[0]), 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="*", default=["qwen2.5-0.5b", "llama-3.2-1b"],
                    help="edgeq export random presets to compile (default: qwen2.5-0.5b llama-3.2-1b)")
    ap.add_argument("--recipes", nargs="*", default=["mquant-w8a8"])
    ap.add_argument("--layers-sweep", nargs="*", type=int, default=[],
                    help="also compile the first preset with these layer counts (time vs layers)")
    ap.add_argument("--models", type=Path, default=REPO / "artifacts" / "scale-models", help="where presets are exported")
    ap.add_argument("--work", type=Path, default=REPO / "artifacts" / "scale-runs")
    ap.add_argument("--calib", type=Path, default=REPO / "data" / "wikitext-2" / "valid.txt")
    ap.add_argument("--tokenizer", type=Path, default=REPO / "artifacts" / "smollm2",
                    help="a tokenizer whose ids fit every preset's vocabulary (SmolLM2's 49,152)")
    ap.add_argument("--calib-windows", type=int, default=None)
    ap.add_argument("--blockwise", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--sweep-only", action="store_true", help="run only --layers-sweep (and --ort), adding to --out")
    ap.add_argument("--ort", action="store_true", help="also run onnxruntime's quantize_static on the first preset")
    ap.add_argument("--rss-limit-gb", type=float, default=21.0, help="kill a run whose RSS passes this (default 21)")
    ap.add_argument("--keep-outputs", action="store_true")
    ap.add_argument("--combine", type=Path, nargs="*", default=[],
                    help="compile nothing: gather the runs, sweeps and onnxruntime run of these result files "
                         "into --out and fit the slopes over all of them")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.combine:
        return combine(args.combine, args.out)
    edgeq = str(Path(sys.executable).with_name("edgeq"))
    args.models.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(), "command": " ".join(sys.argv), "note": "random weights: memory and time only",
              "runs": [], "sweep": [], "fits": {}, "ort_quantize_static": None}
    if args.out.is_file():  # add to an earlier run of the same file
        result = {**result, **{k: v for k, v in json.loads(args.out.read_text()).items() if k in ("runs", "sweep")}}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    for preset in [] if args.sweep_only else args.presets:
        model = export(edgeq, preset, None, args.models)
        for recipe in args.recipes:
            result["runs"].append(compile_run(edgeq, model, recipe, args, preset))
            save()
    for layers in args.layers_sweep:
        model = export(edgeq, args.presets[0], layers, args.models)
        result["sweep"].append(compile_run(edgeq, model, args.recipes[0], args, model.name))
        save()
    if args.ort:
        result["ort_quantize_static"] = ort_quantize_static(export(edgeq, args.presets[0], None, args.models), args)
    elif args.out.is_file():
        result["ort_quantize_static"] = json.loads(args.out.read_text()).get("ort_quantize_static")
    fit_slopes(result, args.presets[0])
    save()
    print(json.dumps(result["fits"], indent=1))
    return 0


def combine(files: list[Path], out: Path) -> int:
    """One result from several runs of this script (e.g. the 3B preset run on its own): runs and
    sweeps joined, the slopes fitted over all of them. Each run keeps the machine it came from."""
    result = {"machine": machine_info(), "command": " ".join(sys.argv), "note": "random weights: memory and time only",
              "combined_from": [str(f) for f in files], "runs": [], "sweep": [], "fits": {}, "ort_quantize_static": None}
    for f in files:
        part = json.loads(f.read_text())
        for key in ("runs", "sweep"):
            result[key] += [{**r, "machine": part.get("machine"), "source": f.name} for r in part.get(key, [])]
        result["ort_quantize_static"] = result["ort_quantize_static"] or part.get("ort_quantize_static")
    sweep_model = next((r["model"].rsplit("-L", 1)[0] for r in result["sweep"]), "")
    fit_slopes(result, sweep_model)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["fits"], indent=1))
    return 0


def fit_slopes(result: dict, sweep_preset: str) -> None:
    """Peak RSS and seconds against parameters per recipe (over the presets), and seconds against
    layers over the sweep of one width (its full preset's run included)."""
    ok = [r for r in result["runs"] if r["exit_code"] == 0]
    for recipe in sorted({r["recipe"] for r in ok}):
        rows = [r for r in ok if r["recipe"] == recipe]
        result["fits"][recipe] = {
            "seconds_vs_parameters_exponent": fit_power([r["parameters"] for r in rows], [r["seconds"] for r in rows]),
            "peak_rss_vs_parameters_exponent": fit_power([r["parameters"] for r in rows], [r["peak_rss_mb"] for r in rows]),
        }
    # the sweep: one width, several layer counts (the full preset's run of the same recipe included)
    sweep = [r for r in result["sweep"] if r["exit_code"] == 0]
    sweep += [r for r in ok if r["model"] == sweep_preset and sweep and r["recipe"] == sweep[0]["recipe"]]
    if sweep:
        result["fits"]["sweep"] = [{k: r[k] for k in ("model", "layers", "seconds", "peak_rss_mb")} for r in sweep]
        result["fits"]["seconds_vs_layers_exponent"] = fit_power([r["layers"] for r in sweep], [r["seconds"] for r in sweep])


if __name__ == "__main__":
    raise SystemExit(main())
