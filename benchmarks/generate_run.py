"""Time greedy generation with edgeq's runtime on one model: TTFT and decode tokens/s.

The edgeq counterpart of ``benchmarks/peers/ortgenai_run.py`` (same fields, same definitions), run
by ``benchmarks/generate.py`` in a process of its own so that its peak RSS is read from outside:

    python benchmarks/generate_run.py --model DIR --prompt-ids-file IDS.json --max-new-tokens 64 --json

DIR is a static pair (``compile --static``) or a folder/file with ``model.onnx`` (dynamic, with or
without a KV cache). Sessions use onnxruntime's default optimizations (what a deployment runs).
Every run generates exactly --max-new-tokens tokens (end-of-sequence ids are not stop tokens), so
runs compare token for token; TTFT = prefill to the first token's logits, decode tokens/s =
(tokens - 1) / time after them (``edgeq.generation.generate``). Warm-up runs are not reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from edgeq.generation import generate, open_decoder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids-file", required=True, help="JSON list of prompt token ids")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    decoder = open_decoder(args.model, threads=args.threads)
    load_s = time.perf_counter() - start
    prompt = json.loads(Path(args.prompt_ids_file).read_text())
    for _ in range(args.warmup):
        generate(decoder, prompt, args.max_new_tokens)
    runs = [generate(decoder, prompt, args.max_new_tokens) for _ in range(args.repeats)]
    result = {
        "tool": "edgeq", "model": str(Path(args.model).resolve()), "mode": runs[0].mode, "load_s": round(load_s, 3),
        "prompt_tokens": len(prompt), "new_tokens": len(runs[-1].tokens), "repeats": args.repeats,
        "ttft_ms": round(statistics.median(r.ttft_ms for r in runs), 2),
        "decode_tok_s": round(statistics.median(r.decode_tokens_per_s for r in runs), 2),
        "ttft_ms_min": round(min(r.ttft_ms for r in runs), 2),
        "decode_tok_s_max": round(max(r.decode_tokens_per_s for r in runs), 2),
        "output_ids": runs[-1].tokens,
    }
    print(json.dumps(result) if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
