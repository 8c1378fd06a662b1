"""A static pair's context binaries run by onnxruntime-genai (``edgeq generate PAIR/qnn``) against
edgeq's own loop over the same binaries (``edgeq generate PAIR --provider qnn-htp``) and against the
CPU pair (issue 44 item 3 for SmolLM2, issue 52 item 4 for Qwen2.5): greedy tokens on each prompt,
and the teacher-forced top-1 agreement of the HTP's logits with the CPU's over the first --tokens
tokens of WikiText-2 test (greedy tokens diverge at fp16 near-ties; teacher forcing does not compound).

Usage: python benchmarks/htp_generate.py PAIR --out F [--new-tokens 16] [--tokens 128] [--prompt P ...]
(PAIR: a folder from ``edgeq compile --static ... --target qnn-htp --context-binary``). Each row
names the compile of the pair it ran on (``pair``, a key of ``pair_sha256``: its files' SHA-256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from foundation import save_results
from qnn_htp import _graph_digests, _windows

REPO = Path(__file__).resolve().parents[1]


PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")


def _generate(folder: Path, prompt: str, new_tokens: int, *extra: str) -> dict:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "edgeq", "generate", str(folder), "--prompt", prompt,
                          "--max-new-tokens", str(new_tokens), "--ignore-eos", "--json", *extra],
                         check=True, capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    return {"tokens": row["tokens"], "text": row["text"], "mode": row["mode"],
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128, help="teacher-forced tokens for the top-1 agreement")
    ap.add_argument("--prompt", action="append", help=f"prompts (default: {len(PROMPTS)} fixed ones)")
    args = ap.parse_args()
    results = json.loads(args.out.read_text()) if args.out.exists() else {"pair": str(args.pair), "prompts": {}}
    # which compile of the pair each row ran on: its graphs' and weights' SHA-256 (a later run may
    # find the pair recompiled, e.g. from a fresh export whose value names differ)
    digests = _graph_digests(args.pair)
    pair_id = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:16]
    results.setdefault("pair_sha256", {})[pair_id] = digests
    for prompt in args.prompt or PROMPTS:
        row = results["prompts"].setdefault(prompt, {})
        for name, folder, extra in (("genai_qnn", args.pair / "qnn", ()), ("edgeq_htp", args.pair, ("--provider", "qnn-htp")),
                                    ("edgeq_cpu", args.pair, ())):
            if name not in row:
                row[name] = {**_generate(folder, prompt, args.new_tokens, *extra), "pair": pair_id}
                save_results(args.out, results)
        row["genai_equals_edgeq_htp"] = row["genai_qnn"]["tokens"] == row["edgeq_htp"]["tokens"]
        row["htp_equals_cpu"] = row["edgeq_htp"]["tokens"] == row["edgeq_cpu"]["tokens"]
    rows = results["prompts"].values()
    results["genai_equals_edgeq_htp"] = f"{sum(r['genai_equals_edgeq_htp'] for r in rows)} / {len(rows)}"
    results["htp_equals_cpu"] = f"{sum(r['htp_equals_cpu'] for r in rows)} / {len(rows)}"
    if "teacher_forced" not in results:
        from edgeq.generation.decoders import open_decoder
        from edgeq.generation.teacher_forced import window_logits

        ids = _windows(args.pair, 1, args.tokens)
        started = time.perf_counter()
        a = window_logits(open_decoder(args.pair), ids[0], "prefill").astype(np.float64)
        cpu_seconds = time.perf_counter() - started
        b = window_logits(open_decoder(args.pair, provider="qnn-htp"), ids[0], "prefill").astype(np.float64)
        results["teacher_forced"] = {
            "tokens": args.tokens, "text": "WikiText-2 test, its first tokens, through the prefill graph",
            "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
            "relative_l2": float(np.linalg.norm(a - b) / np.linalg.norm(a)),
            "seconds": {"cpu": round(cpu_seconds, 1), "qnn-htp": round(time.perf_counter() - started - cpu_seconds, 1)},
            "pair": pair_id}
    save_results(args.out, results)


if __name__ == "__main__":
    main()
