"""edgeq's ``--target ort-genai`` folders beside onnxruntime-genai's own int4 build of SmolLM2 (issue 33).

Every model is a folder onnxruntime-genai opens, and every figure comes from onnxruntime-genai running
it, measured the same way for all:

* perplexity: WikiText-2 test, the first ``--windows`` windows of 512 tokens (the project's protocol,
  SmolLM2's one-stream convention), scored from the logits genai returns when each window is appended
  to a Generator (``edgeq eval ppl FOLDER``; the same tokenizer, ``artifacts/smollm2-past``, for all);
* speed: ``benchmarks/peers/ortgenai_run.py`` (genai's own generation loop, greedy, EOS suppressed):
  TTFT and decode tokens/s for a 100- and a 500-token prompt (WikiText-2 test text), 128 new tokens,
  2 intra-op threads, 1 warm-up and ``--repeats`` timed runs, median; runs interleaved (A, B, C, A,
  B, C, ...) so that a drifting machine hits every model alike;
* peak RSS of each timed process from outside (GNU time).

Models (built when absent): genai's own build (``benchmarks/peers/build_ortgenai.py``: RTN int4, block
32, accuracy level 4, lm_head int4, embedding int4 shared with it), and edgeq's, each compiled with
``edgeq compile artifacts/smollm2-past/model.onnx --recipe R --target ort-genai`` (GPTQ on 64 calibration
windows of WikiText-2 valid, group 128, lm_head as int8 MatMulNBits in blocks of 128): ``gptq-w4a16``, ``quarot-gptq-w4a16``
and ``fp32`` (lm_head float, the reference). Level 0 variants are the same folders with every
MatMulNBits ``accuracy_level`` set to 0 (the weights are identical; only the op's activation precision
changes), written by this script.

    python benchmarks/genai.py --out benchmarks/results/genai-2026-11-27.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"
PAST = REPO / "artifacts" / "smollm2-past"
ART = REPO / "artifacts" / "genai-bench"

from foundation import save_results  # noqa: E402  (benchmarks/ is this script's folder)
from peers import run_measured  # noqa: E402

EDGEQ_RECIPES = {"edgeq gptq-w4a16": "gptq-w4a16", "edgeq quarot-gptq-w4a16": "quarot-gptq-w4a16",
                 "edgeq fp32": "fp32"}


def _compile(recipe: str, out: Path, log: Path) -> dict:
    """Compile ``recipe`` into ``out`` unless an earlier run left it there (then its report's figures)."""
    cmd = [sys.executable, "-m", "edgeq", "compile", str(PAST / "model.onnx"), "--recipe", recipe,
           "--calib", str(DATA / "valid.txt"), "--target", "ort-genai", "-o", str(out)]
    if recipe == "fp32":
        cmd += ["--lm-head-bits", "32"]
    command = "edgeq " + " ".join(str(Path(c).relative_to(REPO)) if c.startswith(str(REPO)) else c for c in cmd[3:])
    if (out / "report.json").is_file():
        report = json.loads((out / "report.json").read_text())
        return {"command": command, "seconds": report["seconds_total"], "peak_rss_mb_in_process": report["peak_rss_mb"],
                "reused": True}
    step = run_measured(cmd, log)
    if step["code"] != 0:
        raise SystemExit(f"compile {recipe} failed: see {log}")
    return {"command": command, "seconds": step["seconds"], "peak_rss_mb": step["peak_rss_mb"]}


def with_accuracy_level(src: Path, dst: Path, level: int) -> Path:
    """A copy of the genai folder ``src`` whose MatMulNBits nodes all run at ``level``."""
    import onnx

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    model = onnx.load(str(dst / "model.onnx"), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = level
    onnx.save(model, str(dst / "model.onnx"))
    return dst


def prompt_ids(tokens: int, path: Path) -> Path:
    """The first ``tokens`` tokens of WikiText-2 test (SmolLM2's tokenizer), as a JSON list."""
    from edgeq.textdata import load_tokenizer

    text = (DATA / "test.txt").read_text(encoding="utf-8")[:20000]
    ids = load_tokenizer(PAST).encode(text, add_special_tokens=False).ids[:tokens]
    path.write_text(json.dumps(ids))
    return path


def perplexity(folder: Path, windows: int, log: Path) -> dict:
    cmd = [sys.executable, "-m", "edgeq", "eval", "ppl", str(folder), "--text", str(DATA / "test.txt"),
           "--tokenizer", str(PAST), "--windows", str(windows), "--threads", "2", "--json"]
    step = run_measured(cmd, log)
    if step["code"] != 0:
        return {"error": log.read_text()[-400:]}
    result = json.loads(step["last_line"])
    return {"ppl": round(result["ppl"], 3), "windows": result["windows"], "mode": result["mode"],
            "window_convention": result["window_convention"], "seconds": result["seconds"],
            "peak_rss_mb": step["peak_rss_mb"]}


def speed(folder: Path, prompt: Path, new_tokens: int, repeats: int, log: Path) -> dict:
    cmd = [sys.executable, str(REPO / "benchmarks" / "peers" / "ortgenai_run.py"), "--model", str(folder),
           "--prompt-ids-file", str(prompt), "--max-new-tokens", str(new_tokens), "--threads", "2",
           "--warmup", "1", "--repeats", str(repeats), "--json"]
    step = run_measured(cmd, log)
    if step["code"] != 0:
        return {"error": log.read_text()[-400:]}
    r = json.loads(step["last_line"])
    return {"decode_tok_s": r["decode_tok_s"], "ttft_ms": r["ttft_ms"], "decode_tok_s_max": r["decode_tok_s_max"],
            "load_s": r["load_s"], "peak_rss_mb": step["peak_rss_mb"], "output_ids": r["output_ids"][:16]}


def table(path: Path) -> str:
    """The markdown table of a results file (README, docs/ort-genai.md)."""
    data = json.loads(path.read_text())
    lines = ["| model (all run by onnxruntime-genai) | lm_head | perplexity | x fp32 | decode tok/s, 100 / 500-token prompt "
             "| x genai's own | TTFT ms, 100 / 500 | peak RSS MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in data["rows"].items():
        ppl = row["perplexity"].get("ppl")
        head = (row.get("genai") or {}).get("linears", {}).get("lm_head", "int4 (block 32)")
        p100, p500 = row["prompt_100"], row["prompt_500"]
        ratio = row["decode_x_own_build"]
        rss = max(v for v in (p100["peak_rss_mb"], p500["peak_rss_mb"]) if v is not None)
        lines.append(f"| {name} | {head} | {ppl:.3f} | {row['ppl_x_fp32']:.3f} | {p100['decode_tok_s']:.1f} / "
                     f"{p500['decode_tok_s']:.1f} | {ratio['100']:.3f} / {ratio['500']:.3f} | {p100['ttft_ms']:.1f} / "
                     f"{p500['ttft_ms']:.1f} | {rss:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out and stop")
    ap.add_argument("--only", default=None, metavar="A,B",
                    help="time only these rows (names as in the results file, comma-separated)")
    ap.add_argument("--reuse-perplexity", type=Path, metavar="RESULTS",
                    help="take each model's perplexity from an earlier results file (same folders) and time only")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per model and prompt (after 1 warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the speed runs")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.out))
        return 0

    sys.path.insert(0, str(REPO / "benchmarks" / "peers"))
    from build_ortgenai import build

    ART.mkdir(parents=True, exist_ok=True)
    logs = ART / "logs"
    logs.mkdir(exist_ok=True)
    builds, models = {}, {}
    own = build()
    if own is None:
        raise SystemExit("onnxruntime-genai's own build could not be made (its venv did not install)")
    models["genai int4 rtn b32 (own build)"] = own
    builds["genai int4 rtn b32 (own build)"] = json.loads((own / "edgeq-build.json").read_text())
    for name, recipe in EDGEQ_RECIPES.items():
        folder = ART / recipe
        builds[name] = _compile(recipe, folder, logs / f"compile-{recipe}.log")
        models[f"{name} L4"] = folder
        if recipe != "fp32":
            models[f"{name} L0"] = with_accuracy_level(folder, ART / f"{recipe}-level0", 0)

    if args.only:
        keep = set(args.only.split(","))
        models = {name: path for name, path in models.items() if name in keep}
    rows = {name: {"folder": str(path.relative_to(REPO))} for name, path in models.items()}
    for name, path in models.items():
        report = path / "report.json"
        if report.is_file():
            rows[name]["genai"] = json.loads(report.read_text()).get("genai")
        if args.reuse_perplexity is not None:
            earlier = json.loads(args.reuse_perplexity.read_text())["rows"][name]["perplexity"]
            rows[name]["perplexity"] = {**earlier, "from": str(args.reuse_perplexity)}
            continue
        print(f"[genai] perplexity: {name}", file=sys.stderr)
        rows[name]["perplexity"] = perplexity(path, args.windows, logs / f"ppl-{path.name}.log")

    with tempfile.TemporaryDirectory() as tmp:
        prompts = {n: prompt_ids(n, Path(tmp) / f"prompt{n}.json") for n in (100, 500)}
        runs = {(name, n): [] for name in models for n in prompts}
        for r in range(args.rounds):
            for n, prompt in prompts.items():
                for name, path in models.items():
                    print(f"[genai] round {r + 1}: {name}, {n}-token prompt", file=sys.stderr)
                    runs[name, n].append(speed(path, prompt, args.new_tokens, args.repeats,
                                               logs / f"speed-{path.name}-{n}.log"))
    for (name, n), results in runs.items():
        ok = [x for x in results if "error" not in x]
        rows[name][f"prompt_{n}"] = {
            "decode_tok_s": round(statistics.median(x["decode_tok_s"] for x in ok), 1) if ok else None,
            "ttft_ms": round(statistics.median(x["ttft_ms"] for x in ok), 1) if ok else None,
            "peak_rss_mb": max(x["peak_rss_mb"] for x in ok) if ok else None,
            "rounds": results}
    fp32 = (rows.get("edgeq fp32 L4") or json.loads(args.reuse_perplexity.read_text())["rows"]["edgeq fp32 L4"])["perplexity"].get("ppl")
    for row in rows.values():
        ppl = row["perplexity"].get("ppl")
        row["ppl_x_fp32"] = round(ppl / fp32, 4) if ppl and fp32 else None
    own_speed = {n: rows["genai int4 rtn b32 (own build)"][f"prompt_{n}"]["decode_tok_s"] for n in (100, 500)}
    for row in rows.values():
        row["decode_x_own_build"] = {n: round(row[f"prompt_{n}"]["decode_tok_s"] / own_speed[n], 3)
                                     if row[f"prompt_{n}"]["decode_tok_s"] and own_speed[n] else None for n in (100, 500)}
    import onnxruntime_genai as og

    save_results(args.out, {
        "what": "edgeq --target ort-genai folders beside onnxruntime-genai's own int4 build of SmolLM2-135M, all run by onnxruntime-genai",
        "onnxruntime_genai_version": og.__version__,
        "protocol": {"perplexity": f"WikiText-2 test, first {args.windows} windows of 512 tokens, logits returned by onnxruntime-genai",
                     "speed": f"greedy, {args.new_tokens} new tokens, EOS suppressed, 2 threads, 1 warm-up + {args.repeats} runs, "
                              f"median over {args.rounds} interleaved rounds", "prompts": "first 100 / 500 tokens of WikiText-2 test"},
        "builds": builds,
        "rows": rows,
        "command": "python benchmarks/genai.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        "date": time.strftime("%Y-%m-%d"),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
