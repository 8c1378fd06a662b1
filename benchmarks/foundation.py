"""Foundation benchmark on SmolLM2: edgeq w8a8 against onnxruntime's quantize_static, one run.

Everything is measured side by side in this one process tree on the same machine:
1. perplexity (WikiText-2 test, first N windows of 512): fp32, onnxruntime static, edgeq recipes;
2. compile time: edgeq compile vs quantize_static, both from a cold start in a subprocess, both
   calibrating on the same 16 windows of valid (edgeq's calibration cache disabled);
3. onnxruntime CPU latency of one 512-token forward pass, batch 1, median of 10;
4. peak memory (max RSS of the compile subprocess) against the model's size on disk.

Usage: python benchmarks/foundation.py --model-dir artifacts/smollm2 --out artifacts/bench-foundation.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"


def _timed_subprocess(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "EDGEQ_PROGRESS": "0"})
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the max over all children so far: report it only if this child raised it
    return seconds, max(peak, before) / 1024


def _model_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*")) / 2**20


def latency_ms(model: Path, seq_len: int = 512, repeats: int = 10, threads: int | None = None) -> float:
    """Median latency of one model (``interleaved_latency_ms`` with a single graph)."""
    return interleaved_latency_ms({"model": model}, seq_len, repeats, threads)["model"]


def run_stamp() -> dict:
    """What a reader needs to rerun a results file: the command line, the commit (and whether the
    tree had uncommitted changes), the date, and the versions of the packages the figures depend on."""
    from importlib import metadata

    repo = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    versions = {}
    for dist in ("edgeq", "onnx", "onnxruntime", "onnxruntime-qnn", "onnxruntime-genai", "onnx-graphsurgeon", "numpy",
                 "torch", "transformers", "optimum-onnx"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    script = Path(sys.argv[0]).resolve()
    argv = [str(script.relative_to(repo)) if script.is_relative_to(repo) else sys.argv[0], *sys.argv[1:]]
    return {"command": " ".join(["python", *[a if a else "''" for a in argv]]), "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": versions}


# what ran: the stamp as the benchmark started (a run of an hour must not be credited to a commit
# made while it ran, nor called dirty for an edit made after it had read its code)
STARTED = run_stamp()


def save_results(path: Path, results: dict) -> None:
    """Write the JSON results file (creating its folder) and print it, stamped with the machine
    (CPU model, ISA flags, the u8s8 kernel they select, onnxruntime version) and the run as it
    started (``STARTED``), with the time of this write (``saved``). A file an earlier run began
    keeps that run's stamp and lists each later run that added to it under ``resumed`` (its
    stamp and machine): rows a resumed run adds are that run's."""
    from edgeq.evaluate.machine import machine_info

    results.setdefault("machine", machine_info())
    run = results.setdefault("run", dict(STARTED))
    if run.get("date") != STARTED["date"]:  # a file an earlier run began: this run's stamp and machine beside it
        resumed = results.setdefault("resumed", [])
        if not any(r.get("date") == STARTED["date"] for r in resumed):
            resumed.append({**STARTED, "machine": machine_info()})
    run["saved"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


def latency_results(results: dict, paths: dict[str, Path], out: Path, latency_only: bool) -> dict:
    """Add one 512-token latency table (interleaved, median of 10), its ratios to ``fp32`` and the
    ops onnxruntime fused to ``results``; with ``latency_only``, into the rows of an earlier ``out``."""
    timing = {"latency_ms_512": {k: round(v, 1) for k, v in interleaved_latency_ms(paths, repeats=10).items()}}
    timing["latency_x_fp32"] = {k: round(v / timing["latency_ms_512"]["fp32"], 3) for k, v in timing["latency_ms_512"].items()}
    timing["fused_ops"] = {name: fused_ops(path) for name, path in paths.items()}
    base = json.loads(out.read_text()) if latency_only and out.is_file() else results
    return {**base, **timing}


def interleaved_latency_ms(models: dict[str, Path], seq_len: int = 512, repeats: int = 10,
                           threads: int | None = None, feeds: dict | None = None) -> dict[str, float]:
    """Median latency of each model, runs interleaved (A, B, C, A, B, C, ...) so that load
    drifting on a noisy machine hits every model alike; ratios between them are what to read.
    ``feeds``: the inputs every model gets (default: ``seq_len`` random token ids)."""
    sessions, feed_of = {}, {}
    ids = np.random.default_rng(0).integers(0, 1000, (1, seq_len), dtype=np.int64)
    for name, path in models.items():
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        if feeds is not None:
            f = {k: v for k, v in feeds.items() if k in names}
        else:
            f = {"input_ids": ids}
            if "attention_mask" in names:
                f["attention_mask"] = np.ones_like(ids)
            if "position_ids" in names:
                f["position_ids"] = np.arange(seq_len, dtype=np.int64)[None]
        sessions[name], feed_of[name] = sess, f
        for _ in range(2):
            sess.run(None, f)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, sess in sessions.items():
            t = time.perf_counter()
            sess.run(None, feed_of[name])
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(v) * 1000) for name, v in times.items()}


def fused_ops(model: Path) -> dict[str, int]:
    """Op counts of onnxruntime's optimized graph: shows whether the QDQ fusions fired."""
    import collections
    import tempfile

    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        so.log_severity_level = 3
        ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
        m = onnx.load(so.optimized_model_filepath, load_external_data=False)
    counts = collections.Counter(n.op_type for n in m.graph.node)
    keep = ("MatMul", "MatMulIntegerToFloat", "QLinearMatMul", "MatMulNBits", "DynamicQuantizeMatMul",
            "QuantizeLinear", "DequantizeLinear")
    return {k: counts[k] for k in keep if counts[k]}


def bench_parser(doc: str, work: str, recipes: str) -> argparse.ArgumentParser:
    """The arguments every SmolLM2 benchmark script shares (same protocol, same defaults)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="edgeq export smollm2 output folder")
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    p.add_argument("--work", type=Path, default=REPO / "artifacts" / work)
    p.add_argument("--calib-windows", type=int, default=16)
    p.add_argument("--eval-windows", type=int, default=40)
    p.add_argument("--recipes", default=recipes)
    return p


def main(argv=None) -> int:
    a = bench_parser(__doc__, "bench", "w8a8,w8a8-mse").parse_args(argv)

    from edgeq.evaluate.ppl import perplexity

    fp32 = a.model_dir / "model.onnx"
    edgeq_bin = [sys.executable, "-m", "edgeq"]
    results: dict = {"model": str(fp32), "model_mb": round(_model_mb(fp32), 1), "calib_windows": a.calib_windows,
                     "eval_windows": a.eval_windows, "cpu_threads": os.cpu_count()}
    compiled = {}
    ort_out = a.work / "ort-static" / "model.onnx"
    secs, rss = _timed_subprocess([sys.executable, str(REPO / "benchmarks" / "ort_baseline.py"), str(fp32), "-o", str(ort_out),
                                   "--calib", str(DATA / "valid.txt"), "--tokenizer", str(a.model_dir),
                                   "--windows", str(a.calib_windows)])
    results["ort_static"] = {"compile_s": round(secs, 1), "peak_rss_mb": round(rss, 0)}
    compiled["ort_static"] = ort_out
    for recipe in a.recipes.split(","):
        out = a.work / f"edgeq-{recipe}"
        secs, rss = _timed_subprocess(edgeq_bin + ["compile", str(fp32), "--recipe", recipe, "--calib", str(DATA / "valid.txt"),
                                                   "--calib-windows", str(a.calib_windows), "--no-cache", "-o", str(out)])
        report = json.loads((out / "report.json").read_text())
        results[recipe] = {"compile_s": round(secs, 1), "peak_rss_mb_in_process": report["peak_rss_mb"]}
        compiled[recipe] = out / "model.onnx"
    results["compile_time_ratio_edgeq_over_ort"] = {
        r: round(results[r]["compile_s"] / results["ort_static"]["compile_s"], 3) for r in a.recipes.split(",")}
    results["peak_memory_over_model_size"] = {
        r: round(results[r]["peak_rss_mb_in_process"] / results["model_mb"], 2) for r in a.recipes.split(",")}

    for name, path in [("fp32", fp32), *compiled.items()]:
        res = perplexity(path, DATA / "test.txt", a.model_dir, windows=a.eval_windows)
        results.setdefault(name, {})["ppl"] = round(res["ppl"], 3)
        if name != "fp32":  # the exact-QDQ reference beside onnxruntime's integer kernels
            exact = perplexity(path, DATA / "test.txt", a.model_dir, windows=a.eval_windows, exact_qdq=True)
            results[name]["ppl_exact_qdq"] = round(exact["ppl"], 3)
        print(f"{name}: ppl {res['ppl']:.3f} (exact QDQ {results[name].get('ppl_exact_qdq', res['ppl']):.3f})", flush=True)
    for name, path in [("fp32", fp32), *compiled.items()]:
        results[name]["latency_ms_512"] = round(latency_ms(path), 1)
        results[name]["fused_ops"] = fused_ops(path)
        print(f"{name}: latency {results[name]['latency_ms_512']:.1f} ms  {results[name]['fused_ops']}", flush=True)
    for r in compiled:
        results[r]["speedup_vs_fp32"] = round(results["fp32"]["latency_ms_512"] / results[r]["latency_ms_512"], 2)
    save_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
