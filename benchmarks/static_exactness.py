"""Is the static pair the same model? Greedy tokens of the fp32 static pair against the dynamic graph.

8 prompts x 64 greedy tokens (end-of-sequence ids do not stop generation), the last prompt longer
than the prefill length so it is processed in several chunks; both graphs run with onnxruntime's
optimizations off (the graphs as written) and, as a second figure, with its defaults (what
``edgeq generate`` runs). Also the largest logit difference along the dynamic graph's tokens
(teacher forcing: both decoders fed the same tokens).

    python benchmarks/static_exactness.py --dynamic artifacts/generate-bench/smollm2-past \\
        --pair artifacts/generate-bench/static-fp32-p128-c1024 --out benchmarks/results/static-exactness-DATE.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from edgeq.evaluate.machine import machine_info
from edgeq.generation import generate, open_decoder
from edgeq.textdata import load_tokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
    "Translate to French: I would like a cup of coffee.",
    "A recipe for pancakes: first,",
    "The main difference between a CPU and a GPU is",
]


def long_prompt(min_tokens: int, tokenizer) -> str:
    """WikiText-2 test text cut at a line boundary past ``min_tokens`` tokens."""
    text = ""
    for line in (Path(__file__).resolve().parents[1] / "data" / "wikitext-2" / "test.txt").read_text().splitlines():
        text += line + "\n"
        if len(tokenizer.encode(text).ids) > min_tokens:
            return text
    raise SystemExit("the test text is shorter than the prefill length")


def compare(dynamic_path: Path, pair_path: Path, prompts: list[list[int]], steps: int, optimize: bool) -> list[dict]:
    dynamic = open_decoder(dynamic_path, optimize=optimize)
    static = open_decoder(pair_path, optimize=optimize)
    rows = []
    for ids in prompts:
        ref = generate(dynamic, ids, steps).tokens
        got = generate(static, ids, steps).tokens
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        worst = float(np.max(np.abs(static.prefill(ids) - dynamic.prefill(ids))))
        for token in ref[:-1]:
            worst = max(worst, float(np.max(np.abs(static.step(token) - dynamic.step(token)))))
        rows.append({"prompt_tokens": len(ids), "equal": ref == got, "first_difference": first,
                     "max_abs_logit_diff": worst})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dynamic", type=Path, required=True, help="folder of the fp32 with-past export")
    ap.add_argument("--pair", type=Path, required=True, help="folder of the fp32 static pair (compile --recipe fp32 --static)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.dynamic)
    meta = json.loads((args.pair / "report.json").read_text())["static"]
    texts = PROMPTS + [long_prompt(meta["prefill"], tok)]
    prompts = [tok.encode(t).ids for t in texts]
    result = {"benchmark": "static-exactness", "date": time.strftime("%Y-%m-%d"), "machine": machine_info(),
              "prefill": meta["prefill"], "context": meta["context"], "steps": args.steps}
    for label, optimize in (("optimizations_off", False), ("onnxruntime_defaults", True)):
        rows = compare(args.dynamic, args.pair, prompts, args.steps, optimize)
        result[label] = {"equal_prompts": sum(r["equal"] for r in rows), "prompts": len(rows), "rows": rows}
        print(f"{label}: {result[label]['equal_prompts']}/{len(rows)} prompts give the same {args.steps} tokens; "
              f"max |logit diff| {max(r['max_abs_logit_diff'] for r in rows):.2e}; longest prompt {max(len(p) for p in prompts)} tokens",
              file=sys.stderr)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
