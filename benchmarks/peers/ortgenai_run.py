"""Time greedy generation with onnxruntime-genai: TTFT and decode tokens/s for one prompt.

Runs in the peer venv (.venvs/ort-genai/bin/python), so it imports only onnxruntime_genai, numpy
and the standard library:

    .venvs/ort-genai/bin/python benchmarks/peers/ortgenai_run.py \\
        --model artifacts/ortgenai-int4 --prompt-file PROMPT.txt --max-new-tokens 64 --json

Per run: a Generator is created (it allocates the KV cache for prompt + max-new-tokens; timed
as ``setup_ms``), then the clock starts. ``append_tokens(prompt)`` runs the prefill and the
first ``generate_next_token()`` picks the first token from its logits: TTFT is the time until
that token is available. Each later ``generate_next_token()`` runs one decode step; decode
tokens/s = (tokens after the first) / (time from the first token to the last). Greedy search
(do_sample False). By default EOS is suppressed (min_length = max_length) so every run decodes
exactly --max-new-tokens tokens; --allow-eos lets it stop early. Warm-up runs are not reported;
the median over --repeats runs is (and the best run, for a machine shared with other work).

Threads: without --threads onnxruntime-genai's own default is kept. With onnxruntime-genai
0.18.0 on the 2-core dev machine that default behaves as ONE intra-op thread (same thread count
and speed as --threads 1; onnxruntime's own default, intra_op_num_threads=0, would start one
pool thread per physical core), so pass --threads 2 to use both cores.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime_genai as og


def load_model(model_dir: str, threads: int | None) -> og.Model:
    config = og.Config(model_dir)
    config.clear_providers()  # CPU execution provider
    if threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    return og.Model(config)


def one_run(model: og.Model, prompt: np.ndarray, max_new: int, allow_eos: bool) -> dict:
    max_length = len(prompt) + max_new
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, num_beams=1, max_length=max_length,
                              min_length=0 if allow_eos else max_length)
    t_setup = time.perf_counter()
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(prompt)
    gen.generate_next_token()
    tokens = [int(gen.get_next_tokens()[0])]
    t_first = time.perf_counter()
    while len(tokens) < max_new and not gen.is_done():
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
    t_end = time.perf_counter()
    decoded = len(tokens) - 1
    del gen
    return {
        "setup_ms": (t0 - t_setup) * 1e3,
        "ttft_ms": (t_first - t0) * 1e3,
        "decode_tok_s": decoded / (t_end - t_first) if decoded else None,
        "new_tokens": len(tokens),
        "total_ms": (t_end - t0) * 1e3,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="folder with genai_config.json and model.onnx")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", help="prompt text, tokenized with the model's tokenizer")
    src.add_argument("--prompt-ids-file", help="JSON list of prompt token ids (skips tokenization)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads (default: onnxruntime-genai's own choice, 1 thread here)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    ap.add_argument("--allow-eos", action="store_true", help="stop at EOS instead of forcing max-new-tokens")
    ap.add_argument("--show-text", action="store_true", help="include the decoded continuation")
    ap.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 2 or args.repeats < 1:
        ap.error("--max-new-tokens must be >= 2 and --repeats >= 1")

    t = time.perf_counter()
    model = load_model(args.model, args.threads)
    load_s = time.perf_counter() - t
    tokenizer = og.Tokenizer(model)
    if args.prompt_ids_file:
        with open(args.prompt_ids_file) as f:
            prompt = np.asarray(json.load(f), dtype=np.int32)
    else:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = np.asarray(tokenizer.encode(f.read()), dtype=np.int32)

    for _ in range(args.warmup):
        one_run(model, prompt, args.max_new_tokens, args.allow_eos)
    runs = [one_run(model, prompt, args.max_new_tokens, args.allow_eos) for _ in range(args.repeats)]

    median = lambda key: statistics.median(r[key] for r in runs if r[key] is not None)  # noqa: E731
    result = {
        "tool": "onnxruntime-genai",
        "onnxruntime_genai_version": og.__version__,
        "onnxruntime_version": importlib.metadata.version("onnxruntime"),
        "model": os.path.abspath(args.model),
        "threads": args.threads,  # None = onnxruntime-genai's default
        "os_threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
        "cpu_count": os.cpu_count(),
        "load_s": round(load_s, 3),
        "prompt_tokens": int(len(prompt)),
        "max_new_tokens": args.max_new_tokens,
        "new_tokens": runs[-1]["new_tokens"],
        "warmup": args.warmup,
        "repeats": args.repeats,
        "ttft_ms": round(median("ttft_ms"), 2),
        "decode_tok_s": round(median("decode_tok_s"), 2),
        "setup_ms": round(median("setup_ms"), 2),
        # best run: robust to other processes sharing the CPU (medians are not)
        "ttft_ms_min": round(min(r["ttft_ms"] for r in runs), 2),
        "decode_tok_s_max": round(max(r["decode_tok_s"] for r in runs if r["decode_tok_s"] is not None), 2),
        "runs": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "tokens"}
                 for r in runs],
        "output_ids": runs[-1]["tokens"],
    }
    if args.show_text:
        result["text"] = tokenizer.decode(np.asarray(runs[-1]["tokens"], dtype=np.int32))
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"onnxruntime-genai {result['onnxruntime_genai_version']}: prompt {result['prompt_tokens']} tokens, "
              f"{result['new_tokens']} new; TTFT {result['ttft_ms']:.1f} ms, "
              f"decode {result['decode_tok_s']:.1f} tok/s (median of {args.repeats})")
        if args.show_text:
            print(result["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
