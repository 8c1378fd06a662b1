"""Where a decode step's time goes in onnxruntime-genai: onnxruntime's own profiler, op by op.

For each folder (``--model NAME=FOLDER``, repeatable): a copy of its ``genai_config.json`` with
``enable_profiling`` and 2 intra-op threads (the weights are linked, not copied), a 100-token
WikiText-2 test prompt appended to a Generator, then ``--tokens`` greedy decode steps. From the
profile: the decode steps' ``model_run`` time per token, and each op type's kernel time per token
(the lm_head MatMulNBits on its own line), the prefill left out. The profiler itself costs time:
compare folders within one run, not with the tokens/s of ``benchmarks/genai.py``.

    python benchmarks/genai_profile.py --out benchmarks/results/genai-profile-DATE.json \\
        --model own=artifacts/ortgenai-int4 --model quarot=artifacts/genai-bench/quarot-gptq-w4a16
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "data" / "wikitext-2" / "test.txt"

from foundation import save_results  # noqa: E402  (benchmarks/ is this script's folder)


def profiled_copy(folder: Path, work: Path) -> Path:
    """``folder`` with profiling switched on in its genai_config.json; model files linked."""
    work.mkdir(parents=True)
    for f in folder.iterdir():
        if f.name.startswith("model.onnx"):
            (work / f.name).symlink_to(f.resolve())
        elif f.is_file():
            shutil.copy(f, work / f.name)
    config = json.loads((work / "genai_config.json").read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options["enable_profiling"] = str(work / "profile")
    options["intra_op_num_threads"] = 2
    (work / "genai_config.json").write_text(json.dumps(config, indent=1))
    return work


def run_decode(folder: Path, prompt_tokens: int, tokens: int) -> float:
    """Prefill ``prompt_tokens`` tokens then ``tokens`` decode steps in ``folder``; decode tokens/s.
    Runs in a child process: onnxruntime writes the profile when the session closes, at exit."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    ids = og.Tokenizer(model).encode(TEXT.read_text(encoding="utf-8")[:4000])[:prompt_tokens]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt_tokens + tokens + 8)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    start = time.perf_counter()
    for _ in range(tokens):
        gen.generate_next_token()
    return tokens / (time.perf_counter() - start)


def profile_decode(folder: Path, prompt_tokens: int, tokens: int, work: Path) -> dict:
    copy = profiled_copy(folder, work)
    child = subprocess.run([sys.executable, __file__, "--child", str(copy), "--prompt-tokens", str(prompt_tokens),
                            "--tokens", str(tokens)], capture_output=True, text=True, check=True)
    tok_s = float(child.stdout.strip().splitlines()[-1])
    events = json.loads(next(work.glob("profile*.json")).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    decode = runs[-(tokens - 1):]  # the last runs are decode steps (the first token comes with the prefill)
    first = decode[0]["ts"]
    per_op = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first:
            op = "lm_head MatMulNBits" if e["name"].startswith("/lm_head/") else e["args"].get("op_name")
            per_op[op] += e["dur"]
    steps = len(decode)
    return {"decode_steps": steps, "tok_s_while_profiled": round(tok_s, 1),
            "model_run_us_per_token": round(sum(r["dur"] for r in decode) / steps),
            "kernels_us_per_token": round(sum(per_op.values()) / steps),
            "per_op_us_per_token": {op: round(us / steps) for op, us in per_op.most_common()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", action="append", metavar="NAME=FOLDER")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps profiled")
    args = ap.parse_args(argv)
    if args.child:
        print(run_decode(args.child, args.prompt_tokens, args.tokens))
        return 0
    if not args.out or not args.model:
        ap.error("--out and at least one --model are required")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(args.model):
            name, _, folder = spec.partition("=")
            print(f"[profile] {name}: {folder}", file=sys.stderr)
            rows[name] = {"folder": folder, **profile_decode(Path(folder), args.prompt_tokens, args.tokens,
                                                             Path(tmp) / f"m{i}")}
    save_results(args.out, {
        "what": "onnxruntime profiler: kernel time per decode token by op type, SmolLM2 folders run by onnxruntime-genai",
        "protocol": {"prompt_tokens": args.prompt_tokens, "decode_steps": args.tokens, "threads": 2},
        "rows": rows,
        "command": "python benchmarks/genai_profile.py --out " + str(args.out) + "".join(f" --model {m}" for m in args.model),
        "date": time.strftime("%Y-%m-%d"),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
