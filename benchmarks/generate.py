"""Deployable generation on this CPU: TTFT, decode tokens/s and peak RSS, edgeq against onnxruntime-genai.

One run measures, on the same SmolLM2-135M weights and the same prompts:

- ``fp32-dynamic``: the fp32 with-past graph (``edgeq export smollm2 --with-past``), cache grown by
  concatenation (what onnxruntime users run today);
- ``fp32-static`` and the quantized static pairs (``edgeq compile --static prefill=P,context=C``
  with recipes fp32, mquant-w8a8, mquant-w8a8-kv8, gptq-w4a16): the NPU-shaped graphs, run on CPU;
- ``ort-genai-int4``: onnxruntime-genai's own int4 build of the same weights (its model builder, in
  its own venv: ``benchmarks/peers/build_ortgenai.py``), run by onnxruntime-genai; skipped with a
  message (a row with its error) when it cannot be installed.

Each (model, prompt) runs in a fresh process (``generate_run.py`` or the genai runner) whose peak
RSS is read from outside (GNU time, benchmarks/measure.py); rounds are interleaved over the models, and the medians
over rounds are reported, so drift of a shared machine spreads over every row. Both runtimes use 2
intra-op threads (onnxruntime-genai's default here is 1). Perplexity: the 40 WikiText-2 test
windows teacher-forced through each model (``edgeq eval ppl``; static pairs ``--through prefill``,
the dynamic graph in one pass; ``--ppl-through decode`` for the token-by-token figure), and for
the genai build through its ONNX graph in onnxruntime when it loads there.

    python benchmarks/generate.py --out benchmarks/results/generate-DATE.json
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

from edgeq.evaluate.machine import machine_info

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))
sys.path.insert(0, str(REPO / "benchmarks"))

from measure import run_measured  # noqa: E402

EDGEQ = [sys.executable, "-m", "edgeq"]
RECIPES = ("fp32", "mquant-w8a8", "mquant-w8a8-kv8", "gptq-w4a16")
DATA = REPO / "data" / "wikitext-2"


def run_child(cmd: list[str], env: dict | None = None) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, peak RSS MiB of the child, read by GNU time: see benchmarks/measure.py)."""
    run = run_measured(cmd, cwd=REPO, env=env)
    return run["code"], run["stdout"], run["stderr"], run["peak_rss_mb"]


def ensure_models(args) -> dict[str, Path]:
    """The with-past export and one static pair per recipe under --work (built when missing)."""
    work = Path(args.work)
    past = work / "smollm2-past"
    if not (past / "model.onnx").is_file():
        print(f"exporting SmolLM2 with a KV cache to {past}", file=sys.stderr)
        subprocess.run(EDGEQ + ["export", "smollm2", "--with-past", "-o", str(past)], check=True, cwd=REPO)
    models = {"fp32-dynamic": past}
    for recipe in args.recipes:
        out = work / f"static-{recipe}-p{args.prefill}-c{args.context}"
        if not (out / "decode.onnx").is_file():
            print(f"compiling {recipe} --static prefill={args.prefill},context={args.context}", file=sys.stderr)
            subprocess.run(EDGEQ + ["compile", str(past / "model.onnx"), "--recipe", recipe, "--calib",
                                    str(DATA / "valid.txt"), "--static", f"prefill={args.prefill},context={args.context}",
                                    "-o", str(out)], check=True, cwd=REPO)
        models[f"{recipe}-static"] = out
    return models


def ensure_genai() -> tuple[Path | None, Path | None, str | None]:
    """(peer python, built model folder, error): onnxruntime-genai's int4 build, or why not."""
    try:
        from build_ortgenai import PEER, build
        from venvs import ensure_venv
    except ImportError as exc:
        return None, None, f"peer scripts missing: {exc}"
    python = ensure_venv(PEER)
    if python is None:
        return None, None, "onnxruntime-genai could not be installed (see .venvs/ort-genai.install.log)"
    try:
        out = build()
    except Exception as exc:  # noqa: BLE001 (a peer failing is a row, not a crash)
        return python, None, f"model builder failed: {exc}"
    if out is None:
        return python, None, "model builder failed (see artifacts/ortgenai-int4.build.log)"
    return python, out, None


def prompts(tokenizer_dir: Path, lengths: list[int]) -> dict[str, list[int]]:
    """Prompts of the given token counts: the start of WikiText-2 test (never the calibration split)."""
    from edgeq.textdata import load_tokenizer

    text = (DATA / "test.txt").read_text()[:20000]
    ids = load_tokenizer(tokenizer_dir).encode(text).ids
    return {f"prompt{n}": ids[:n] for n in lengths}


def measure(name: str, path: Path, prompt_file: Path, args, genai_python: Path | None) -> dict:
    if name == "ort-genai-int4":
        cmd = [str(genai_python), str(REPO / "benchmarks" / "peers" / "ortgenai_run.py"), "--model", str(path),
               "--threads", str(args.threads)]
    else:
        cmd = [sys.executable, str(REPO / "benchmarks" / "generate_run.py"), "--model", str(path),
               "--threads", str(args.threads)]
    cmd += ["--prompt-ids-file", str(prompt_file), "--max-new-tokens", str(args.new_tokens),
            "--repeats", str(args.repeats), "--json"]
    code, out, err, rss = run_child(cmd)
    if code != 0:
        return {"error": (err.strip().splitlines() or [f"exit {code}"])[-1], "peak_rss_mb": round(rss, 1)}
    row = json.loads(out.strip().splitlines()[-1])
    return {"ttft_ms": row["ttft_ms"], "decode_tok_s": row["decode_tok_s"], "peak_rss_mb": round(rss, 1),
            "output_ids": row.get("output_ids")}


def genai_perplexity(path: Path, args) -> dict:
    """Perplexity of onnxruntime-genai's build through its ONNX graph in plain onnxruntime (one
    pass per window, empty cache): its cache inputs declare a symbolic head size, which the
    generic decoders refuse, so the cache shape comes from its genai_config.json."""
    import numpy as np
    import onnxruntime as ort

    from edgeq.runtime.nll import window_nll
    from edgeq.textdata import token_windows

    decoder = json.loads((path / "genai_config.json").read_text())["model"]["decoder"]
    session = ort.InferenceSession(str(path / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    empty = np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]), np.float32)
    nll = tokens = 0
    for ids in token_windows(DATA / "test.txt", args.tokenizer, 512, args.ppl_windows):
        feeds = {"input_ids": ids[None], "attention_mask": np.ones((1, ids.size), np.int64)}
        feeds.update({n: empty for n in names if n.startswith("past_key_values.")})
        logits = session.run(["logits"], feeds)[0][0].astype(np.float32)
        nll += window_nll(logits, ids)
        tokens += ids.size - 1
    return {"ppl": round(float(np.exp(nll / tokens)), 3), "ppl_how": "onnxruntime on the genai model.onnx, one pass per window"}


def perplexity(name: str, path: Path, args) -> dict:
    if name == "ort-genai-int4":
        try:
            return genai_perplexity(path, args)
        except Exception as exc:  # noqa: BLE001 (a peer failing is a row, not a crash)
            return {"ppl": None, "ppl_error": f"{type(exc).__name__}: {exc}"}
    target = path / "model.onnx" if (path / "model.onnx").is_file() else path
    cmd = EDGEQ + ["eval", "ppl", str(target), "--text", str(DATA / "test.txt"), "--tokenizer",
                   str(args.tokenizer), "--windows", str(args.ppl_windows), "--json"]
    if name.endswith("-static"):
        cmd += ["--through", args.ppl_through]
    code, out, err, _ = run_child(cmd, env={**os.environ, "EDGEQ_PROGRESS": "0"})
    if code != 0:
        return {"ppl": None, "ppl_error": (err.strip().splitlines() or [f"exit {code}"])[-1]}
    return {"ppl": round(json.loads(out)["ppl"], 3)}


def update_perplexities(args) -> int:
    result = json.loads(args.ppl_only.read_text())
    reference = None
    for row in result["rows"]:
        if "path" not in row:
            continue
        for key in ("ppl", "ppl_error", "ppl_how"):
            row.pop(key, None)
        row.update(perplexity(row["model"], Path(row["path"]), args))
        if row["model"] == "fp32-dynamic":
            reference = row.get("ppl")
        if reference and row.get("ppl"):
            row["ppl_ratio_to_fp32"] = round(row["ppl"] / reference, 4)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), file=sys.stderr)
    result["settings"]["ppl_windows"], result["settings"]["ppl_through"] = args.ppl_windows, args.ppl_through
    args.out.write_text(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", type=Path, required=True, help="result JSON")
    ap.add_argument("--work", default=str(REPO / "artifacts" / "generate-bench"), help="where models are built")
    ap.add_argument("--tokenizer", type=Path, default=REPO / "artifacts" / "smollm2")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES))
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt-lengths", type=int, nargs="+", default=[100, 500])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per process")
    ap.add_argument("--rounds", type=int, default=3, help="processes per (model, prompt), interleaved")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ppl-windows", type=int, default=40)
    ap.add_argument("--ppl-through", choices=("prefill", "decode"), default="prefill")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--skip-genai", action="store_true")
    ap.add_argument("--ppl-only", type=Path, metavar="RESULTS",
                    help="recompute only the perplexities of an existing results file (written to --out)")
    args = ap.parse_args(argv)
    if args.ppl_only:
        return update_perplexities(args)
    if not (args.tokenizer / "tokenizer.json").is_file():
        ap.error(f"no tokenizer.json in {args.tokenizer}: run `edgeq export smollm2 -o artifacts/smollm2` first")

    models = ensure_models(args)
    genai_python = genai_error = None
    if not args.skip_genai:
        genai_python, genai_dir, genai_error = ensure_genai()
        if genai_dir is not None:
            models["ort-genai-int4"] = genai_dir
        else:
            print(f"ort-genai-int4 skipped: {genai_error}", file=sys.stderr)
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, u8s8 kernel {info['u8s8_kernel']}", file=sys.stderr)
    samples: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for label, ids in prompts(args.tokenizer, args.prompt_lengths).items():
            files[label] = Path(tmp) / f"{label}.json"
            files[label].write_text(json.dumps(ids))
        for r in range(args.rounds):
            for label, prompt_file in files.items():
                for name, path in models.items():
                    got = measure(name, path, prompt_file, args, genai_python)
                    samples.setdefault((name, label), []).append(got)
                    print(f"round {r + 1}/{args.rounds} {label} {name}: "
                          + (got.get("error") or f"TTFT {got['ttft_ms']:.0f} ms, {got['decode_tok_s']:.1f} tok/s, "
                                                  f"{got['peak_rss_mb']:.0f} MiB"), file=sys.stderr)
    rows = []
    for name, path in models.items():
        row = {"model": name, "path": str(path)}
        for label in files:
            runs = [s for s in samples[(name, label)] if "error" not in s]
            if not runs:
                row[label] = {"error": samples[(name, label)][0]["error"]}
                continue
            row[label] = {key: round(statistics.median(s[key] for s in runs), 2)
                          for key in ("ttft_ms", "decode_tok_s", "peak_rss_mb")}
            row[label]["output_ids"] = runs[-1]["output_ids"]
        if not args.skip_ppl:
            row.update(perplexity(name, path, args))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), file=sys.stderr)
    reference = next((r for r in rows if r["model"] == "fp32-dynamic"), None)
    for row in rows:
        for label in files:
            ids = row.get(label, {}).get("output_ids")
            if reference and ids is not None and reference.get(label, {}).get("output_ids") is not None:
                row[label]["same_tokens_as_fp32_dynamic"] = ids == reference[label]["output_ids"]
        if reference and row.get("ppl") and reference.get("ppl"):
            row["ppl_ratio_to_fp32"] = round(row["ppl"] / reference["ppl"], 4)
    if "ort-genai-int4" not in models and not args.skip_genai:
        rows.append({"model": "ort-genai-int4", "error": genai_error})
    result = {"benchmark": "generate", "date": time.strftime("%Y-%m-%d"), "machine": info,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
