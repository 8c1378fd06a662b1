"""A real-shaped random LLM compiled for the HTP in parts (issue 44 item 2 for Llama-3.2-1B; issue 52
item 5 for Qwen2.5-1.5B): random weights, so memory and time only, never accuracy.

One run: ``edgeq export random PRESET --with-past`` (skipped when --model-dir holds it), then
``edgeq compile ... --static prefill=128,context=1024 --target qnn-htp --context-binary
--max-context-mb MB`` under GNU time (peak RSS of the compile and its children, from outside), and
the results file from the compile's own report.json: every part's weight bytes, blocks, context
binary bytes and prepare/load seconds, whether the HTP took each part whole, the block-wise path and
its per-block seconds, output bytes, peak RSS over the fp32 weights. Written whole by this script.

Usage: python benchmarks/htp_parts.py --preset qwen2.5-1.5b --max-context-mb 800 --out F
       [--recipe mquant-w4a16] [--work artifacts/htp-parts] [--calib-windows 2] [--model-dir DIR]
       [--prepare-split MB ...]

``--prepare-split MB``: where the compile's peak lies when it is Qualcomm's preparation. With the
compile a run without it left in --work, the compiled prefill graph is cut again at each MB
(``edgeq.static.split``, the cut the compile makes) and each part prepared alone as the compile
prepares it (``python -m edgeq.targets.qnn_vendor --context``, one child per part), its peak RSS
from outside (GNU time); the compile's own parts are prepared the same way. Into ``prepare_alone``
of its own --out file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from foundation import save_results
from measure import run_measured

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"


def _bytes(folder: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern) if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="a with-past export to compile instead of the random preset (a real model: "
                         "`edgeq export qwen2.5-coder-0.5b --with-past -o DIR`); its tokenizer is its own")
    ap.add_argument("--recipe", default="mquant-w4a16")
    ap.add_argument("--max-context-mb", type=float, default=800)
    ap.add_argument("--calib-windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--tokenizer", type=Path, default=REPO / "artifacts" / "qwen25",
                    help="a tokenizer folder for the calibration text (random presets carry none)")
    ap.add_argument("--work", type=Path, default=REPO / "artifacts" / "htp-parts")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prepare-split", type=float, nargs="+", metavar="MB", default=None,
                    help="with the compile a run without it left in --work: prepare its parts, and its prefill graph cut at each "
                         "MB, one part at a time, peak RSS of each (no compile)")
    args = ap.parse_args()
    model_dir = args.model_dir or args.work / f"{args.preset}-past"
    name = model_dir.name if args.model_dir else args.preset
    out = args.work / f"{name}-{args.recipe}"
    tokenizer = args.model_dir or args.tokenizer
    if args.prepare_split:  # a results file of its own, from the compile a run without it left in --work
        save_results(args.out, {"issue": "where the peak RSS of a compile in parts lies: Qualcomm's preparation of "
                                "each part alone (random weights: never accuracy)", "compiled": str(out),
                                "recipe": args.recipe, "prepare_alone": prepare_alone(out, args.prepare_split)})
        return
    what = ("a real model compiled for the HTP in parts: memory, time and whether the HTP takes each part whole "
            "(its accuracy: benchmarks/qnn_htp.py)" if args.model_dir else
            "a model compiled for the HTP in parts: memory and time (random weights: never accuracy)")
    results: dict = {"issue": what,
                     "model": str(model_dir) if args.model_dir else f"random {args.preset}", "recipe": args.recipe,
                     "steps": {}}
    if not (model_dir / "model.onnx").is_file():
        step = run_measured([sys.executable, "-m", "edgeq", "export", "random", args.preset, "--with-past",
                             "-o", str(model_dir), "--force"])
        if step["code"] != 0:
            raise SystemExit(step["stderr"])
        results["steps"]["export"] = {k: step[k] for k in ("seconds", "peak_rss_mb")}
    fp32_bytes = _bytes(model_dir, "model.onnx*")
    compile_cmd = [sys.executable, "-m", "edgeq", "compile", str(model_dir / "model.onnx"), "--recipe", args.recipe,
                   "--calib", str(DATA / "valid.txt"), "--tokenizer", str(tokenizer),
                   "--calib-windows", str(args.calib_windows), "--seq-len", str(args.seq_len),
                   "--static", "prefill=128,context=1024", "--target", "qnn-htp", "--context-binary",
                   "--max-context-mb", str(args.max_context_mb), "-o", str(out), "--force"]
    step = run_measured(compile_cmd, env={**__import__("os").environ, "EDGEQ_PROGRESS": "1"})
    results["compile_command"] = " ".join(["edgeq", *compile_cmd[3:]])
    if step["code"] != 0:
        results["compile"] = {"exit": step["code"], "error": step["stderr"].strip().splitlines()[-3:]}
        save_results(args.out, results)
        raise SystemExit(1)
    blocks = [float(m.group(1)) for m in re.finditer(r"block \d+/\d+: ([\d.]+) s", step["stderr"])]
    results["fp32_bytes_on_disk"] = fp32_bytes
    results["compile"] = {"seconds": step["seconds"], "peak_rss_mb": step["peak_rss_mb"],
                          "peak_rss_over_fp32": round(step["peak_rss_mb"] * 2**20 / fp32_bytes, 3),
                          "peak_rss_note": "GNU time's maximum resident set size of the compile process and its "
                                           "children (the QNN preparation runs in child processes)",
                          "block_seconds": blocks}
    save_results(args.out, results)  # (the measured compile first: what follows only reads its output)
    results.update(summarize(out))
    results["max_context_mb"] = args.max_context_mb
    save_results(args.out, results)


def prepare_alone(out: Path, budgets_mb: list[float]) -> dict:
    """Each part of the compiled pair's prefill graph (the compile's own, then cut again at each of
    ``budgets_mb``) prepared alone for the HTP in a measured child: weight bytes, blocks, peak RSS,
    seconds. The cut parts are written beside the pair (over its weights file) and removed after."""
    import onnx

    from edgeq.static.split import split_graph

    report = json.loads((out / "report.json").read_text())
    arch = str(report.get("qnn_context", {}).get("htp_arch", 79))
    own = [(p["file"], p["weight_bytes"], p["blocks"]) for p in report["static"]["parts"]["prefill"]]
    prefill = onnx.load(str(out / "prefill.onnx"), load_external_data=False)
    runs: dict = {"the compile's parts": own}
    for mb in budgets_mb:
        parts = split_graph(prefill, int(mb * 2**20), "prefill")
        runs[f"cut at {mb:g} MB"] = []
        for k, part in enumerate(parts):
            name = f"prepare-alone_{mb:g}mb_{k + 1}of{len(parts)}.onnx"
            onnx.save_model(part.model, str(out / name))
            runs[f"cut at {mb:g} MB"].append((name, part.weight_bytes, part.blocks))
    measured: dict = {"htp_arch": int(arch), "how": "python -m edgeq.targets.qnn_vendor --context PART CTX ARCH "
                      "under GNU time, one part at a time (what the compile runs for each part)", "runs": {}}
    with __import__("tempfile").TemporaryDirectory() as tmp:
        for label, files in runs.items():
            rows = []
            for file, weight_bytes, blocks in files:
                step = run_measured([sys.executable, "-m", "edgeq.targets.qnn_vendor", "--context", str(out / file),
                                     str(Path(tmp) / f"{Path(file).stem}_ctx.onnx"), arch])
                answer = json.loads(step["stdout"].strip().splitlines()[-1]) if step["stdout"].strip() else {}
                rows.append({"file": file, "weight_bytes": weight_bytes, "blocks": blocks, "ok": answer.get("ok"),
                             "peak_rss_mb": step["peak_rss_mb"], "seconds": step["seconds"]})
                print(f"{label}: {file} {weight_bytes / 2**20:.0f} MiB blocks {blocks}: {step['peak_rss_mb']:.0f} MB",
                      file=sys.stderr)
                for ctx in Path(tmp).iterdir():
                    ctx.unlink()
            measured["runs"][label] = rows
    for files in list(runs.values())[1:]:
        for file, _, _ in files:
            (out / file).unlink()
    return measured


def summarize(out: Path) -> dict:
    """What the compile's own report.json and output folder say: the path, each part (weight
    bytes, blocks, context binary bytes, prepare and load seconds, taken whole or not), bytes."""
    import onnx

    report = json.loads((out / "report.json").read_text())
    parts = report.get("static", {}).get("parts", {})
    graphs = report.get("qnn_context", {}).get("graphs", {})

    def whole(graph: dict) -> bool:
        """The HTP took the graph whole: its context model is one EPContext node (CPU fallback is off)."""
        ctx = out / graph["files"][0]
        return [n.op_type for n in onnx.load(str(ctx), load_external_data=False).graph.node] == ["EPContext"]

    summary: dict = {"compile_path": report.get("compile_path"), "boundaries": parts.get("boundaries"),
                     "parts": {role: [{"file": p["file"], "weight_bytes": p["weight_bytes"], "blocks": p["blocks"],
                                       "context_binary_bytes": graphs[p["file"]]["bytes"],
                                       "prepare_seconds": graphs[p["file"]]["prepare_seconds"],
                                       "load_seconds": graphs[p["file"]]["load_seconds"],
                                       "taken_whole": whole(graphs[p["file"]])}
                                      for p in parts[role]] for role in ("prefill", "decode") if role in parts}}
    summary["every_part_taken_whole"] = bool(summary["parts"]) and all(
        p["taken_whole"] for plist in summary["parts"].values() for p in plist)
    summary["qnn_context"] = {k: v for k, v in report.get("qnn_context", {}).items() if k != "graphs"}
    summary["output_bytes"] = _bytes(out, "**/*")
    return summary

if __name__ == "__main__":
    main()
