"""edgeq side by side with the tools users would pick instead, in one run, on SmolLM2-135M.

The same fp32 ONNX model (``artifacts/smollm2/model.onnx``), the same 16 calibration windows of
WikiText-2 valid and the same 40 evaluation windows of test (512 tokens each, the project
protocol), for every tool in two categories: static W8A8 with per-tensor activations (the NPU
form) and 4-bit weights with float activations. Each peer runs its own recommended settings
(cited in ``benchmarks/peers/pins.toml`` and in each adapter's ``settings``) inside its own
virtual environment (``benchmarks/peers/venvs.py``, versions pinned in ``pins.toml``), through an
adapter with one contract (``benchmarks/peers/adapters/<peer>.py``: ``settings``, ``quantize``,
and ``evaluate`` for OpenVINO outputs). onnxruntime-genai's model builder is the fourth peer
(int4 only), built by ``benchmarks/peers/build_ortgenai.py``.

Per row: the quantize or compile step in its own process, wall time and peak RSS read from outside
(GNU time, which starts the step); then, here in edgeq's venv, perplexity on the 40 windows with onnxruntime's
defaults and with exact QDQ (no integer-kernel fusion: ``session.disable_quant_qdq``), and CPU
latency of one 512-token forward pass at batch 1, as interleaved medians over all ONNX models
(every model timed once per round). The exact-QDQ perplexity is measured for the W8A8 rows, where
onnxruntime's integer kernels replace the Q/DQ arithmetic (4-bit rows run MatMulNBits either way).
OpenVINO outputs are evaluated by their adapter with the
OpenVINO runtime (perplexity and latency; no exact-QDQ figure exists there). A peer that cannot be
installed or fails on a setting is a row with its error, never a missing row; a machine where no
peer installs still gets the edgeq rows and exit 0.

    python benchmarks/peers.py --out benchmarks/results/peers-DATE.json     (or: make peers)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PEERS_DIR = REPO / "benchmarks" / "peers"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(PEERS_DIR))

from edgeq.evaluate.machine import isa_label, machine_info  # noqa: E402

ADAPTER_PEERS = ("ort-quant", "quark", "nncf")
ADAPTER_FILES = {"ort-quant": "ort_quant.py", "quark": "quark.py", "nncf": "nncf.py"}
# edgeq's closest recipes per category (mquant-w8a8 is the default recipe)
EDGEQ_SETTINGS = [
    {"setting": "mquant-w8a8", "category": "w8a8", "weight_bits": 8, "activation_bits": 8},
    {"setting": "w8a8", "category": "w8a8", "weight_bits": 8, "activation_bits": 8},
    {"setting": "gptq-w4a16", "category": "w4", "weight_bits": 4, "activation_bits": 32},
    {"setting": "gptq-w4a16-g32", "category": "w4", "weight_bits": 4, "activation_bits": 32},
]
GPTQ_SETTINGS = ("gptq-w4a16", "gptq-w4a16-g32")  # calibrate on 64 windows, as their recipes say
DATA = REPO / "data" / "wikitext-2"


def run_measured(cmd: list[str], log: Path, env: dict | None = None, timeout_s: float | None = None) -> dict:
    """Run ``cmd`` to completion (killed after ``timeout_s``), its stderr into ``log``; exit code,
    wall seconds, its peak RSS (MiB, GNU time), its last stdout line, and whether it timed out."""
    start = time.perf_counter()
    timed_out = False
    # peak RSS from GNU time, a small process that starts the command: os.wait4 on a child of this
    # (by then large) process reports at least this process's own size, since the child's
    # high-water mark starts from the parent's image it was forked from
    rss_file = Path(tempfile.mkstemp(prefix="peers-rss-")[1])
    cmd = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *cmd]
    with open(log, "w") as err, tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, env=env, start_new_session=True)
        while True:
            pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if timeout_s is not None and time.perf_counter() - start > timeout_s and not timed_out:
                timed_out = True
                os.killpg(proc.pid, 9)
            time.sleep(0.5)
        out.seek(0)
        lines = out.read().decode(errors="replace").strip().splitlines()
    try:
        peak_kb = float(rss_file.read_text().split()[-1])
    except (OSError, ValueError, IndexError):  # killed before GNU time wrote it
        peak_kb = float("nan")
    rss_file.unlink(missing_ok=True)
    return {"code": os.waitstatus_to_exitcode(status), "seconds": round(time.perf_counter() - start, 1),
            "peak_rss_mb": round(peak_kb / 1024, 1), "last_line": lines[-1] if lines else "",
            "timed_out": timed_out}


def _last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:400] if lines else "no output"


def data_files(work: Path, tokenizer: Path) -> tuple[Path, Path]:
    from edgeq.textdata import token_windows

    calib, evaluation = work / "calib-16x512.npy", work / "eval-40x512.npy"
    if not calib.is_file():
        np.save(calib, token_windows(DATA / "valid.txt", tokenizer, 512, 16))
    if not evaluation.is_file():
        np.save(evaluation, token_windows(DATA / "test.txt", tokenizer, 512, 40))
    return calib, evaluation


def peer_rows(peer: str, model: Path, calib: Path, evaluation: Path, work: Path, timeout_s: float) -> list[dict]:
    """One row per setting of an adapter peer: quantized (timed) and, for OpenVINO outputs, evaluated."""
    from venvs import ensure_venv

    python = ensure_venv(peer)
    if python is None:
        return [{"tool": peer, "setting": None, "error": f"{peer} could not be installed (see .venvs/{peer}.install.log)"}]
    adapter = str(PEERS_DIR / "adapters" / ADAPTER_FILES[peer])
    listed = subprocess.run([str(python), adapter, "settings"], capture_output=True, text=True, cwd=REPO)
    if listed.returncode != 0:
        return [{"tool": peer, "setting": None, "error": f"settings failed: {listed.stderr.strip()[-300:]}"}]
    rows = []
    for spec in json.loads(listed.stdout):
        row = {"tool": peer, **spec, "error": None}
        out = work / peer / spec["setting"]
        out.parent.mkdir(parents=True, exist_ok=True)
        log = work / peer / f"{spec['setting']}.log"
        print(f"[peers] {peer} {spec['setting']}: quantizing", file=sys.stderr)
        run = run_measured([str(python), adapter, "quantize", "--setting", spec["setting"], "--model", str(model),
                            "--calib-ids", str(calib), "--out", str(out)], log, timeout_s=timeout_s)
        row.update(compile_s=run["seconds"], peak_rss_mb=run["peak_rss_mb"])
        if run["timed_out"]:
            row["error"] = f"did not finish within the benchmark's limit of {timeout_s / 60:.0f} min (--timeout-min)"
        elif run["code"] != 0:
            row["error"] = _last_error(log)
            rows.append(row)
            continue
        try:
            info = json.loads(run["last_line"])
        except json.JSONDecodeError:
            info = {}
        row.update(version=info.get("version"), notes=info.get("notes"), path=str(out))
        if spec.get("format") == "openvino":
            done = subprocess.run([str(python), adapter, "evaluate", "--model", str(out), "--eval-ids", str(evaluation),
                                   "--latency-tokens", "512", "--repeats", "7"], capture_output=True, text=True, cwd=REPO)
            if done.returncode != 0:
                row["error"] = f"evaluate failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
            else:
                result = json.loads(done.stdout.strip().splitlines()[-1])
                row.update(ppl=result.get("ppl"), runtime_latency_ms=result.get("latency_ms"), runtime=result.get("runtime"),
                           runtime_defaults=result.get("runtime_defaults"))
        rows.append(row)
    return rows


def genai_rows(work: Path) -> list[dict]:
    """onnxruntime-genai's model builder: int4 only (it has no static W8A8 path)."""
    from build_ortgenai import BUILD_INFO, EXTRA_OPTIONS, build
    from venvs import pins

    spec = {"tool": "ort-genai", "category": "w4", "weight_bits": 4, "activation_bits": 32, "format": "onnx",
            "setting": "int4-rtn-block32-acc4", "description": "model builder -p int4 -e cpu, RTN, "
            + ", ".join(f"{k}={v}" for k, v in EXTRA_OPTIONS.items()) + " (int8 activations inside MatMulNBits)",
            "error": None}
    w8a8 = {**spec, "category": "w8a8", "weight_bits": 8, "activation_bits": 8, "setting": None,
            "error": "not offered: the model builder writes int4/fp16/fp32 decoders, no static W8A8"}
    out = build(force=False)
    if out is None:
        return [{**spec, "error": "onnxruntime-genai could not be installed or its builder failed"}, w8a8]
    info = json.loads((out / BUILD_INFO).read_text())
    version = next((p.split("==")[1] for p in pins("ort-genai")["packages"] if p.startswith("onnxruntime-genai==")), None)
    return [{**spec, "version": version, "path": str(out), "compile_s": info["builder_wall_s"],
             "peak_rss_mb": round(info["builder_peak_rss_bytes"] / 2**20, 1),
             "notes": "timed by build_ortgenai.py when it built (not rebuilt in this run if up to date)"}, w8a8]


def edgeq_rows(model: Path, work: Path) -> list[dict]:
    import edgeq

    rows = []
    for spec in EDGEQ_SETTINGS:
        out = work / "edgeq" / spec["setting"]
        log = work / "edgeq" / f"{spec['setting']}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[peers] edgeq {spec['setting']}: compiling", file=sys.stderr)
        run = run_measured([sys.executable, "-m", "edgeq", "compile", str(model), "--recipe", spec["setting"],
                            "--calib", str(DATA / "valid.txt"), "--calib-windows", "64" if spec["setting"] in GPTQ_SETTINGS else "16",
                            "--no-cache", "-o", str(out)], log, env={**os.environ, "EDGEQ_PROGRESS": "0"})
        row = {"tool": "edgeq", "version": edgeq.__version__, **spec, "format": "onnx", "compile_s": run["seconds"],
               "peak_rss_mb": run["peak_rss_mb"], "error": None if run["code"] == 0 else _last_error(log),
               "path": str(out), "docs": "docs/recipes.md"}
        if spec["setting"] in GPTQ_SETTINGS:
            row["notes"] = "GPTQ fits a K x K Hessian per linear: the recipe calibrates on 64 windows (16 over-fit)"
        rows.append(row)
    return rows


def _session(path: Path, exact_qdq: bool):
    from edgeq.ort_session import open_session, session_options

    return open_session(path, options=session_options(optimize=True, exact_qdq=exact_qdq))


def _feeds(session, ids: np.ndarray, folder: Path) -> dict:
    """input_ids / attention_mask / position_ids for one window, and an empty cache for a graph
    with one (the genai build: head size from its genai_config.json)."""
    feeds = {}
    config = folder / "genai_config.json"
    decoder = json.loads(config.read_text())["model"]["decoder"] if config.is_file() else {}
    for inp in session.get_inputs():
        if inp.name == "input_ids":
            feeds[inp.name] = ids[None]
        elif inp.name == "attention_mask":
            feeds[inp.name] = np.ones((1, ids.size), np.int64)
        elif inp.name == "position_ids":
            feeds[inp.name] = np.arange(ids.size, dtype=np.int64)[None]
        elif inp.name.startswith("past_key_values."):
            heads = inp.shape[1] if isinstance(inp.shape[1], int) else decoder["num_key_value_heads"]
            dim = inp.shape[3] if isinstance(inp.shape[3], int) else decoder["head_size"]
            feeds[inp.name] = np.zeros((1, heads, 0, dim), np.float32)
    return feeds


def onnx_perplexity(path: Path, windows: np.ndarray, exact_qdq: bool) -> float:
    from edgeq.nll import window_nll

    model = path / "model.onnx"
    session = _session(model, exact_qdq)
    logits_name = "logits" if "logits" in [o.name for o in session.get_outputs()] else session.get_outputs()[0].name
    nll = tokens = 0.0
    for ids in windows:
        logits = session.run([logits_name], _feeds(session, ids, path))[0][0].astype(np.float32)
        nll += window_nll(logits, ids)
        tokens += ids.size - 1
    return round(float(np.exp(nll / tokens)), 3)


def add_perplexities(rows: list[dict], windows: np.ndarray) -> None:
    """Perplexity of every ONNX row that ran (and its exact-QDQ value for W8A8 rows), in place."""
    for row in rows:
        if row.get("error") or row.get("format") != "onnx" or not row.get("path"):
            continue
        print(f"[peers] perplexity: {row['tool']} {row['setting']}", file=sys.stderr)
        try:
            row["ppl"] = onnx_perplexity(Path(row["path"]), windows, exact_qdq=False)
            if row["category"] == "w8a8":  # where onnxruntime fuses Q/DQ into integer kernels
                row["ppl_exact"] = onnx_perplexity(Path(row["path"]), windows, exact_qdq=True)
        except Exception as exc:  # noqa: BLE001 (a model that does not run is a row with its error)
            row["error"] = f"evaluation failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


def latencies(rows: list[dict], ids: np.ndarray, repeats: int) -> None:
    """512-token forward pass, batch 1: every ONNX model once per round, interleaved; medians."""
    timed = [r for r in rows if r.get("path") and r.get("format") == "onnx" and not r.get("error")]
    sessions = {id(r): _session(Path(r["path"]) / "model.onnx", exact_qdq=False) for r in timed}
    feeds = {id(r): _feeds(sessions[id(r)], ids, Path(r["path"])) for r in timed}
    samples: dict[int, list[float]] = {id(r): [] for r in timed}
    for round_ in range(repeats + 2):
        for r in timed:
            start = time.perf_counter()
            sessions[id(r)].run(None, feeds[id(r)])
            if round_ >= 2:  # two warm-up rounds
                samples[id(r)].append((time.perf_counter() - start) * 1e3)
    for r in timed:
        r["latency_ms"] = round(statistics.median(samples[id(r)]), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"peers-{time.strftime('%Y-%m-%d')}.json")
    ap.add_argument("--work", type=Path, default=REPO / "artifacts" / "peers")
    ap.add_argument("--model-dir", type=Path, default=REPO / "artifacts" / "smollm2")
    ap.add_argument("--peers", nargs="+", default=["edgeq", "ort-genai", "nncf", "quark", "ort-quant"])
    ap.add_argument("--windows", type=int, default=40, help="evaluation windows (of the 40 prepared)")
    ap.add_argument("--latency-repeats", type=int, default=7)
    ap.add_argument("--plot", type=Path, default=None, help="PNG (default: beside --out)")
    ap.add_argument("--resume", action="store_true", help="reuse the quantize/compile rows of peers an interrupted "
                    "run finished (artifacts/peers/rows-partial.json); the figures then come from two runs")
    ap.add_argument("--timeout-min", type=float, default=30, help="a peer setting still quantizing after this is a row "
                    "with that error (default 30; edgeq's own compiles are not limited)")
    ap.add_argument("--table", type=Path, metavar="RESULTS", help="print the docs/peers.md table of a results file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown_table(args.table))
        return 0
    model = args.model_dir / "model.onnx"
    if not model.is_file():
        print(f"exporting SmolLM2 to {args.model_dir}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "edgeq", "export", "smollm2", "-o", str(args.model_dir)], check=True, cwd=REPO)
    args.work.mkdir(parents=True, exist_ok=True)
    calib, evaluation = data_files(args.work, args.model_dir)
    windows = np.load(evaluation)[: args.windows]
    info = machine_info()
    fp32 = {"tool": "fp32", "setting": "fp32", "category": "fp32", "weight_bits": 32, "activation_bits": 32,
            "format": "onnx", "path": str(args.model_dir), "error": None}
    add_perplexities([fp32], windows)
    rows: list[dict] = [fp32]
    partial = args.work / "rows-partial.json"  # the quantize/compile rows so far: an interrupted run keeps them
    done = json.loads(partial.read_text()) if args.resume and partial.is_file() else {}
    for peer in args.peers:
        if peer in done:
            print(f"[peers] {peer}: rows from the interrupted run (--resume)", file=sys.stderr)
            rows += [{**r, "resumed": True} for r in done[peer]]
            continue
        if peer in ADAPTER_PEERS:
            got = peer_rows(peer, model, calib, evaluation, args.work, args.timeout_min * 60)
        elif peer == "ort-genai":
            got = genai_rows(args.work)
        elif peer == "edgeq":
            got = edgeq_rows(model, args.work)
        else:
            ap.error(f"unknown peer {peer}")
        add_perplexities(got, windows)
        rows += got
        done[peer] = got
        partial.write_text(json.dumps(done, indent=1))
    fp32 = rows[0]
    print("[peers] latency (interleaved)", file=sys.stderr)
    latencies(rows, windows[0], args.latency_repeats)
    for row in rows:
        row.setdefault("version", None)
        for key in ("ppl", "ppl_exact", "compile_s", "peak_rss_mb", "latency_ms"):
            row.setdefault(key, None)
        row["isa"] = isa_label(info)
        if row.get("ppl") and fp32.get("ppl"):
            row["ppl_ratio"] = round(row["ppl"] / fp32["ppl"], 4)
    result = {"benchmark": "peers", "date": time.strftime("%Y-%m-%d"), "machine": info,
              "protocol": {"calibration": "16 x 512 tokens, WikiText-2 valid", "evaluation": f"{args.windows} x 512 tokens, WikiText-2 test",
                           "latency": f"one 512-token forward pass, batch 1, median of {args.latency_repeats} interleaved rounds"},
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    plot(args.out, args.plot or args.out.with_suffix(".png"))
    return 0


def markdown_table(results: Path) -> str:
    """The docs/peers.md table of a results file (``--table``)."""
    data = json.loads(results.read_text())
    lines = ["| tool | setting | W/A bits | ppl (x fp32) | exact-QDQ ppl | compile s | peak RSS MiB | ORT latency ms | other runtime ms | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["rows"]:
        ratio = f" ({r['ppl_ratio']:.3f})" if r.get("ppl_ratio") else ""
        ppl = f"{r['ppl']:.3f}{ratio}" if r.get("ppl") else "-"
        cells = [r["tool"], r.get("setting") or "-", f"{r.get('weight_bits', '-')}/{r.get('activation_bits', '-')}", ppl,
                 f"{r['ppl_exact']:.3f}" if r.get("ppl_exact") else "-", str(r.get("compile_s") or "-"),
                 str(r.get("peak_rss_mb") or "-"), str(r.get("latency_ms") or "-"),
                 f"{r['runtime_latency_ms']:.0f} ({r.get('runtime', '')})" if r.get("runtime_latency_ms") else "-",
                 (r.get("error") or "")[:160].replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: Path, png: Path) -> None:
    """Perplexity ratio against latency, one marker per tool and setting (matplotlib lives in the
    ``plot`` venv of pins.toml, not in edgeq's)."""
    from venvs import ensure_venv

    python = ensure_venv("plot")
    if python is None:
        print("[peers] no plot: the plot venv could not be installed", file=sys.stderr)
        return
    subprocess.run([str(python), str(PEERS_DIR / "plot.py"), str(results), str(png)], check=False, cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
