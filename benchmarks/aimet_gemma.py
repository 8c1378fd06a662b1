"""AIMET-ONNX on Gemma 3 270M on CPU (``aimet_htp.py --gemma GEMMA_DIR``): its W8A16 and W4A16
(per-channel, LPBQ) settings calibrated on the 16 BOS-led windows edgeq's ``compile --calib-windows 16``
tokenizes for Gemma, AIMET's topology with ``model_type gemma3_text``, scored with ``edgeq eval ppl
--windows 40`` (default session and exact QDQ). Each quantize runs under the memory watchdog."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np

from aimet_bookkeeping import ADAPTER, AIMET_PY, DATA, EDGEQ, REPO, isa_flags, mem_available_kib, versions, watched

GEMMA_SETTINGS = ("w8a16-finite-mask", "w4a16-pcq-finite-mask", "w4a16-lpbq-finite-mask")


def run_gemma(args) -> int:
    from edgeq.textdata import bos_token_id, token_windows, window_convention

    gemma: Path = args.gemma
    work: Path = args.work / "gemma"
    work.mkdir(parents=True, exist_ok=True)
    out: Path = args.gemma_out
    res = json.loads(out.read_text()) if out.is_file() else {}
    model = gemma / "model.onnx"
    calib = work / "calib-16x512.npy"
    bos = bos_token_id(gemma)
    if not calib.is_file():
        ids = token_windows(DATA / "valid.txt", gemma, seq_len=512, windows=args.calib_windows)
        np.save(calib, ids)
    ids = np.load(calib)
    fp32 = json.loads((REPO / "benchmarks" / "results" / "gemma3-w4a16-head8-2026-11-28.json").read_text())["fp32"]
    res.update({
        "benchmark": "peers/aimet-onnx on Gemma 3 270M", "date": "2026-11-28", "model": str(model),
        "script": "benchmarks/aimet_htp.py --gemma " + str(gemma),
        "protocol": {
            "calibration": f"the first {ids.shape[0]} windows of 512 tokens of WikiText-2 valid, each BOS-led "
                           f"(edgeq.textdata.token_windows: BOS id {bos} + 511 text tokens, the ids edgeq compile "
                           f"--calib-windows 16 feeds Gemma; {calib}; every window starts with BOS: "
                           f"{bool(np.all(ids[:, 0] == bos))})",
            "evaluation": "edgeq eval ppl MODEL --text data/wikitext-2/test.txt --tokenizer GEMMA_DIR --windows 40 --json "
                          "(onnxruntime CPU default session) and with --exact-qdq; window convention "
                          f"{window_convention(gemma)}",
            "topology": "analyze_llm_topology(model, gemma3_text) (AIMET finds Gemma 3's blocks by its active norms)",
        },
        "fp32": {"ppl": fp32["ppl"], "windows": fp32["windows"], "window_convention": fp32["window_convention"],
                 "source": "benchmarks/results/gemma3-w4a16-head8-2026-11-28.json (same model, test windows and "
                           "evaluation)"},
        "versions": versions(),
    })
    res.setdefault("rows", [])
    from edgeq.evaluate.machine import machine_info
    res["machine"] = {**machine_info(), "isa_flags_cpuinfo": isa_flags()}

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1) + "\n")

    save()
    specs = {r["setting"]: r for r in json.loads(subprocess.run([str(AIMET_PY), str(ADAPTER), "settings"],
                                                                capture_output=True, text=True, check=True).stdout)}
    for setting in [s for s in args.gemma_settings.split(",") if s]:
        row = next((r for r in res["rows"] if r["setting"] == setting), None)
        if row is None:
            row = {"tool": "aimet-onnx", **specs[setting], "model": "gemma3-270m"}
            res["rows"].append(row)
        qdir = work / f"aimet-{setting}"
        if not (qdir / "model.onnx").is_file() and row.get("error") and not args.gemma_retry:
            continue  # an earlier attempt failed (recorded); --gemma-retry tries again
        if not (qdir / "model.onnx").is_file():
            if row.get("error"):
                row.setdefault("earlier_attempts", []).append({"quantize": row.get("quantize"), "error": row["error"],
                                                               "quantize_command": row.get("quantize_command")})
            free = mem_available_kib() / 1024 / 1024
            print(f"[aimet-gemma] {setting}: MemAvailable {free:.1f} GB before quantize", flush=True)
            cmd = [str(AIMET_PY), str(ADAPTER), "quantize", "--setting", setting, "--model", str(model),
                   "--calib-ids", str(calib), "--out", str(qdir), "--model-type", "gemma3_text",
                   *(["--release-session"] if args.release_session else [])]
            rec = watched(cmd, work / f"quantize-{setting}.log", args.min_available_gb)
            rec["mem_available_gb_before"] = round(free, 1)
            row["path"] = str(qdir)
            row["quantize_command"] = "nice -n 5 /usr/bin/time -v " + rec["command"]
            row["quantize"] = {k: rec[k] for k in ("wall_s", "peak_rss_mib", "exit_status", "sampled_group_peak_rss_mib",
                                                   "min_mem_available_mib", "stopped_by_watchdog",
                                                   "mem_available_gb_before")}
            lines = (work / f"quantize-{setting}.log").read_text().strip().splitlines()
            if rec["exit_status"] == 0 and lines:
                info = json.loads(lines[-1])
                row.update({"version": info["version"], "notes": info["notes"], "timings": info["timings"]})
                row.pop("error", None)
            else:
                row["error"] = (f"stopped by the memory watchdog (MemAvailable under {args.min_available_gb} GB; "
                                f"quantize group RSS {rec['sampled_group_peak_rss_mib']} MiB)" if rec["stopped_by_watchdog"]
                                else (lines[-1] if lines else f"exit {rec['exit_status']}"))
            save()
        if not (qdir / "model.onnx").is_file():
            continue
        for key, extra in (("default", []), ("exact", ["--exact-qdq"])):
            if key not in args.gemma_evals.split(",") or (row.get(key) or {}).get("ppl"):
                continue
            cmd = [str(EDGEQ), "eval", "ppl", str(qdir / "model.onnx"), "--text", str(DATA / "test.txt"), "--tokenizer",
                   str(gemma), "--windows", str(args.gemma_windows), "--json", *extra]
            rec = watched(cmd, work / f"eval-{setting}-{key}.log", args.min_available_gb)
            lines = (work / f"eval-{setting}-{key}.log").read_text().strip().splitlines()
            js = [ln for ln in lines if ln.startswith("{")]
            entry = {"command": "nice -n 5 " + rec["command"], "eval_wall_s": rec["wall_s"],
                     "eval_peak_rss_mib": rec["peak_rss_mib"], "eval_exit_status": rec["exit_status"]}
            if rec["exit_status"] == 0 and js:
                r = json.loads(js[-1])
                entry.update({"ppl": round(r["ppl"], 3), "qdq": r.get("qdq"), "windows": r.get("windows"),
                              "window_convention": r.get("window_convention"),
                              "eval_seconds_reported": round(r["seconds"], 1),
                              "x_fp32": round(r["ppl"] / fp32["ppl"], 4)})
            else:
                entry["error"] = lines[-1] if lines else f"exit {rec['exit_status']}"
            row[key] = entry
            save()
    return 0
