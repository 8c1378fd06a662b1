"""``edgeq eval``: perplexity of one model, the error of one model against another, or a VLM's VQA accuracy."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from edgeq.argtypes import non_negative_int, positive_int, seq_len_int
from edgeq.errors import UserInputError

# relative perplexity gap between onnxruntime's integer kernels and exact QDQ flagged by --kernel-check
KERNEL_GAP = 0.005

_PROTOCOL = (
    "Protocol: tokenize the whole file with the model's tokenizer in one call (its special tokens "
    "added once, e.g. a leading <|im_start|> for SmolLM2; --no-special-tokens drops them), cut "
    "non-overlapping windows of --seq-len tokens from the start, evaluate windows "
    "[--offset, --offset + --windows); each window predicts tokens 2..seq-len; "
    "perplexity = exp(total NLL / predicted tokens)"
)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``eval ppl``, ``eval compare`` and ``eval vqa`` to the top-level subparsers."""
    ev = subparsers.add_parser(
        "eval",
        help="evaluate models: perplexity on text, error against a reference model, VQA accuracy of a VLM",
        description="Evaluate models with onnxruntime on CPU.",
    )
    sub = ev.add_subparsers(dest="eval_command", metavar="{ppl,compare,vqa}")

    def needs_subcommand(args: argparse.Namespace) -> int:  # help on stdout, the one error line on stderr
        ev.print_help()
        raise UserInputError("eval needs a subcommand: ppl, compare or vqa")

    ev.set_defaults(func=needs_subcommand)

    ppl = sub.add_parser(
        "ppl",
        help="perplexity of a causal LM on a text file",
        description="Perplexity of a causal LM exported to ONNX (inputs input_ids and optionally "
        "attention_mask / position_ids, output logits [batch, seq, vocab]) on a text file. "
        + _PROTOCOL
        + ".",
        epilog="example: edgeq eval ppl out/model.onnx --text data/wikitext-2/test.txt "
        "--tokenizer out/ --windows 40",
    )
    ppl.add_argument(
        "model", metavar="MODEL",
        help="model to evaluate: a .onnx file, or a folder holding a static pair (prefill.onnx + decode.onnx, "
        "edgeq compile --static), a model.onnx, or an onnxruntime-genai folder (compile --target ort-genai: run "
        "through onnxruntime-genai, `pip install 'edgeq[genai]'`, each window appended to a Generator and scored "
        "from the logits genai returns)",
    )
    ppl.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file (e.g. data/wikitext-2/test.txt)")
    ppl.add_argument(
        "--tokenizer", required=True, metavar="DIR", help="folder holding the model's tokenizer.json (or the file)"
    )
    ppl.add_argument("--windows", type=positive_int, default=None, metavar="N", help="windows to evaluate (default: all)")
    ppl.add_argument("--offset", type=non_negative_int, default=0, metavar="K", help="first window (default 0)")
    ppl.add_argument("--seq-len", type=seq_len_int, default=512, metavar="L", help="tokens per window (default 512)")
    ppl.add_argument("--batch-size", type=positive_int, default=1, metavar="B", help="windows per run (default 1)")
    ppl.add_argument(
        "--no-special-tokens", dest="special_tokens", action="store_false",
        help="tokenize without the tokenizer's special tokens (differs from the project's figures)",
    )
    ppl.add_argument("--threads", type=positive_int, default=None, metavar="T", help="onnxruntime intra-op threads")
    qdq = ppl.add_mutually_exclusive_group()
    qdq.add_argument(
        "--exact-qdq", action="store_true",
        help="evaluate Q/DQ exactly as written (onnxruntime's QDQ fusion into integer kernels off, other "
        "optimizations on): the reference a kernel's result should match",
    )
    qdq.add_argument(
        "--no-optimize", action="store_true",
        help="run the graph exactly as written (onnxruntime graph optimizations off): exact QDQ in another "
        "float summation order, to see how much float noise alone moves a fragile graph",
    )
    qdq.add_argument(
        "--kernel-check", action="store_true",
        help="run twice, with onnxruntime's integer kernels (default options) and with exact QDQ, print both "
        f"and flag a gap above {KERNEL_GAP * 100:.1f}%% (the CPU's integer kernels lose accuracy: see docs/cpu-int8-kernels.md, "
        "'Integer kernels and your CPU'); use 8 or more windows: below that, last-bit rounding differences "
        "between integer and float accumulation alone can move perplexity by ~0.5%%",
    )
    ppl.add_argument(
        "--through", choices=("prefill", "decode"), default=None,
        help="teacher-forced through the deployment's graphs, window by window (batch 1): 'prefill' feeds each "
        "window through the prefill graph in prefill-length chunks, 'decode' (the default for a static pair) "
        "its first chunk through the prefill graph and then every next true token one at a time through the "
        "decode graph, as generation does; same windows and NLL, so the figure compares with the model.onnx one. "
        "Also for a model.onnx with a KV cache (decode: the first token as prefill)",
    )
    ppl.add_argument(
        "--provider", choices=("cpu", "qnn-htp"), default="cpu",
        help="where the graphs run: onnxruntime CPU (default) or, for a static pair, Qualcomm's HTP emulated by "
        "onnxruntime-qnn (`pip install 'edgeq[qnn]'`; CPU fallback disabled, float ops in fp16; the pair's "
        "qnn/*_ctx.onnx context binaries when it has them). The emulator is slow: a few windows",
    )
    ppl.add_argument("--htp-arch", type=int, metavar="N", help="with --provider qnn-htp: HTP generation (73, 75, 79; default 79)")
    ppl.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    ppl.set_defaults(func=run_ppl)

    cmp = sub.add_parser(
        "compare",
        help="error of model B against reference model A, per output (and per layer)",
        description="Run reference model A and model B on the same inputs and report, per output, "
        "max |B-A|, mean |B-A| and SQNR = 10 log10(sum A^2 / sum (B-A)^2) in dB. With --layers, "
        "also for intermediate tensors both graphs produce under the same name (MatMul/Gemm "
        "outputs and inputs, norm outputs), in A's order. Inputs: token windows (--text and "
        "--tokenizer), an .npz of named inputs (--npz), or random inputs (--random N, the "
        "default with N=4).",
        epilog="example: edgeq eval compare float/model.onnx int8/model.onnx --text "
        "data/wikitext-2/test.txt --tokenizer float/ --windows 2 --layers",
    )
    cmp.add_argument("model_a", metavar="A.onnx", help="reference model")
    cmp.add_argument("model_b", metavar="B.onnx", help="model under test")
    src = cmp.add_mutually_exclusive_group()
    src.add_argument("--text", metavar="FILE", help="text file to cut token windows from (needs --tokenizer)")
    src.add_argument(
        "--npz",
        metavar="FILE",
        help="inputs as an .npz: one array per model input, named like it, shaped "
        "[num_samples, *input shape] or the input shape with the batch axis as sample axis",
    )
    src.add_argument("--random", type=positive_int, metavar="N", help="N random samples (ids in [0,100), "
                     "masks ones, position ids arange, floats normal)")
    cmp.add_argument("--tokenizer", metavar="DIR", help="folder holding tokenizer.json (with --text)")
    cmp.add_argument("--windows", type=positive_int, default=4, metavar="N", help="windows with --text (default 4)")
    cmp.add_argument("--offset", type=non_negative_int, default=0, metavar="K", help="first window with --text (default 0)")
    cmp.add_argument(
        "--seq-len", type=seq_len_int, default=None, metavar="L",
        help="tokens per window with --text (default 512); dynamic sequence dims with --random (default 32)",
    )
    cmp.add_argument(
        "--no-special-tokens", dest="special_tokens", action="store_false",
        help="with --text: tokenize without the tokenizer's special tokens",
    )
    cmp.add_argument("--seed", type=non_negative_int, default=0, help="seed of --random (default 0)")
    cmp.add_argument("--layers", action="store_true", help="also compare shared intermediate tensors")
    cmp.add_argument(
        "--max-layers", type=positive_int, default=256, metavar="M",
        help="compare at most M intermediate tensors, evenly spaced (default 256)",
    )
    mode = cmp.add_mutually_exclusive_group()
    mode.add_argument(
        "--optimize", action="store_true",
        help="let onnxruntime optimize the graphs, integer kernels included (default: run them as written)",
    )
    mode.add_argument(
        "--exact-qdq", action="store_true",
        help="let onnxruntime optimize the graphs but keep Q/DQ exact (no fusion into integer kernels)",
    )
    cmp.add_argument("--threads", type=positive_int, default=None, metavar="T", help="onnxruntime intra-op threads")
    cmp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    cmp.set_defaults(func=run_compare)

    vqa = sub.add_parser(
        "vqa",
        help="exact-match accuracy of a vision-language model on VQA questions, from pixels",
        description="Exact-match accuracy of a vision-language model on easy-VQA questions, starting from "
        "pixels as a deployment does: each question's image through MODEL/vision.onnx (pixels at the model's "
        "image size -> visual tokens), the visual tokens placed at the prompt's visual span of inputs_embeds "
        "(text tokens through MODEL/embed_tokens.npy), then greedy decoding with MODEL/model.onnx. A question "
        "is correct when the greedy tokens are the gold answer followed by <|im_end|> (the rule the export's "
        "metrics.json uses on eval.npz). onnxruntime on CPU. MODEL may also be a static VLM deployment (edgeq "
        "compile VLM/with-past/model.onnx --static prefill=P,context=C): pixels -> OUT/vision.onnx, the visual "
        "tokens at the prefill's fixed visual rows (rows [0, V) in AIFS order, the recipes with aifs; the prompt's "
        "own image rows [m, m+V) for MSQ without aifs) and the prompt's text at its original positions, "
        "greedy decoding through OUT/decode.onnx (docs/static-vlm-deployment.md).",
        epilog="example: edgeq eval vqa artifacts/trained-vlm --samples 200 --json",
    )
    vqa.add_argument("model", metavar="MODEL",
                     help="an fp32 VLM export folder (edgeq export trained-vlm -o MODEL): vision.onnx, model.onnx, "
                     "embed_tokens.npy, tokenizer.json and vqa_eval.npz; or a static VLM deployment (compile "
                     "--static of its with-past graph): vision.onnx, prefill.onnx, decode.onnx and the same files")
    vqa.add_argument("--questions", metavar="FILE", default=None,
                     help="questions with their images, an .npz of the form MODEL/vqa_eval.npz has (pixels "
                     "[images, S, S, 3] at the model's image size, RGB floats in [0, 1] or uint8; prompt_ids with -1 "
                     "at the visual span; answer_ids ending with end_id; texts; see edgeq.files.vqa_questions); "
                     "default: MODEL/vqa_eval.npz, the export's evaluation split")
    vqa.add_argument("--samples", type=positive_int, default=None, metavar="N",
                     help="evaluate N questions spread evenly over the file (default: all)")
    vqa.add_argument("--provider", choices=("cpu", "qnn-htp"), default="cpu",
                     help="where the graphs run: onnxruntime CPU (default). qnn-htp runs a static VLM deployment on "
                     "Qualcomm's (emulated) HTP, CPU fallback disabled: its context binaries OUT/qnn/*_ctx.onnx "
                     "(compile --target qnn-htp --context-binary), else its graphs; slow in the emulator, use "
                     "--samples. For an fp32 export folder it exits 2")
    vqa.add_argument("--threads", type=positive_int, default=None, metavar="T", help="onnxruntime intra-op threads")
    vqa.add_argument("--json", action="store_true",
                     help="print one JSON object: accuracy, samples, answers (the greedy answer per question, in "
                     "order), per_type, correct, gold, question_rows, model, provider, form (fp32-export or "
                     "static), questions_file, seconds")
    vqa.set_defaults(func=run_vqa)
    return ev


def _ppl_route(args: argparse.Namespace) -> tuple[str | None, str]:
    """(--through to use or None for the plain full-window run, the model file whose kernels run):
    a folder is a static pair (teacher-forced, --through decode by default) or holds model.onnx."""
    from pathlib import Path

    from edgeq.generation.decoders import is_genai, resolve_model
    from edgeq.graph.ir import check_model_file

    path = Path(args.model)
    if not path.exists():  # named before the text is tokenized
        raise UserInputError(f"model file not found: {path}")
    if is_genai(path):  # onnxruntime-genai's own loop and logits (edgeq.generation.genai_decoder)
        if args.kernel_check or args.batch_size != 1:
            raise UserInputError("an onnxruntime-genai folder runs window by window in genai's own session: "
                                 "drop --kernel-check/--batch-size")
        return args.through or "prefill", str(path / "model.onnx")
    family, files = resolve_model(path) if path.is_dir() else ("dynamic", [check_model_file(path)])
    if family == "static-pair":
        through = args.through or "decode"
        return through, str(files[0] if through == "prefill" else files[1])
    return args.through, str(files[0])


def run_ppl(args: argparse.Namespace) -> int:
    from edgeq.evaluate.ppl import perplexity

    through, model_file = _ppl_route(args)
    htp = {}
    if args.provider != "cpu" or args.htp_arch is not None:
        if through is None:
            raise UserInputError("--provider qnn-htp runs a static pair (a folder with prefill.onnx + decode.onnx)")
        if args.kernel_check:
            raise UserInputError("--kernel-check measures onnxruntime CPU's kernels: not with --provider qnn-htp")
        htp = {"provider": args.provider, "htp_arch": args.htp_arch}
    if through is not None and args.batch_size != 1:
        raise UserInputError(f"--through runs one window at a time (batch 1), got --batch-size {args.batch_size}")

    def run(exact_qdq: bool) -> dict:
        common = dict(windows=args.windows, offset=args.offset, seq_len=args.seq_len, threads=args.threads,
                      special_tokens=args.special_tokens, exact_qdq=exact_qdq, optimize=not args.no_optimize)
        if through is not None:
            from edgeq.generation.teacher_forced import perplexity_through

            return perplexity_through(args.model, args.text, args.tokenizer, through=through, **common, **htp)
        return perplexity(model_file, args.text, args.tokenizer, batch_size=args.batch_size, **common)

    result = run(args.exact_qdq)
    if args.kernel_check:
        exact = run(True)
        gap = result["ppl"] / exact["ppl"] - 1.0
        result.update({"ppl_exact_qdq": exact["ppl"], "kernel_gap": gap, "kernel_gap_flagged": abs(gap) > KERNEL_GAP})
        from edgeq.targets.u8s8_sites import ort_fused_u8s8

        fused = ort_fused_u8s8(model_file)  # what this onnxruntime actually runs as uint8 x int8
        result["ort_u8s8_linears"] = len(fused)
        result["ort_u8s8_at_risk"] = sorted(name for name, v in fused.items() if v["saturation_free"] is False)
    if args.json:
        from edgeq.artifacts.encodings import json_safe

        print(json.dumps(json_safe(result)))
        return 0
    mode = " (exact QDQ)" if args.exact_qdq else " (no optimization)" if args.no_optimize else ""
    if through is not None:
        mode += f" (through {through}, {result['mode']}" + (", on QNN HTP" if htp else "") + ")"
    print(
        f"ppl {result['ppl']:.3f}{mode} over {result['tokens']} tokens "
        f"({result['windows']} windows of {result['seq_len']}) in {result['seconds']:.1f} s"
    )
    if args.kernel_check:
        print(f"ppl {result['ppl_exact_qdq']:.3f} with exact QDQ: kernel gap {result['kernel_gap']:+.2%}"
              + (f"  WARNING: above {KERNEL_GAP:.1%}, onnxruntime's integer kernels lose accuracy on this CPU"
                 if result["kernel_gap_flagged"] else ""))
        from edgeq.evaluate.machine import saturating_cpu

        risky = result["ort_u8s8_at_risk"]
        print(f"onnxruntime runs {result['ort_u8s8_linears']} linears as uint8 x int8; "
              + (f"{len(risky)} have int8 weights a VPMADDUBSW kernel (AVX2, AVX-512 without VNNI) can saturate, "
                 f"e.g. {risky[0]}" + ("; this CPU's kernel is one" if saturating_cpu() else "; this CPU's kernel is not")
                 if risky else "none can saturate on any CPU"))
    return 0


def _compare_feeds(args: argparse.Namespace, specs: Any, ids: Any) -> list[dict]:
    """The samples the compare options ask for, built for A's inputs ``specs``."""
    from edgeq.textdata import feeds_for_windows, load_npz_samples, random_feeds

    if ids is not None:
        return [feeds_for_windows(specs, ids[i : i + 1]) for i in range(ids.shape[0])]
    if args.npz:
        return load_npz_samples(args.npz, specs)
    return random_feeds(specs, num_samples=args.random or 4, seq_len=args.seq_len or 32, seed=args.seed)


def _fmt_db(value: float) -> str:
    return f"{value:8.2f}" if math.isfinite(value) else f"{value!s:>8}"


def _table(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        label = row["name"] + (f" ({row['op']})" if "op" in row else "")
        if "problem" in row:
            lines.append(f"  {'-':>8}  {'-':>11}  {'-':>11}  {label}: {row['problem']}")
        else:
            lines.append(
                f"  {_fmt_db(row['sqnr_db'])}  {row['max_abs']:11.4g}  {row['mean_abs']:11.4g}  {label}"
            )
    return lines


def run_compare(args: argparse.Namespace) -> int:
    from edgeq.evaluate.compare import compare

    if args.tokenizer and not args.text:
        raise UserInputError("--tokenizer is only used with --text")
    if args.text and not args.tokenizer:
        raise UserInputError("--text needs --tokenizer DIR")
    ids = None
    if args.text:  # tokenize first: a bad text fails before the models load
        from edgeq.textdata import token_windows

        ids = token_windows(
            args.text, args.tokenizer, seq_len=args.seq_len or 512, windows=args.windows, offset=args.offset,
            special_tokens=args.special_tokens,
        )
    result = compare(
        args.model_a,
        args.model_b,
        lambda specs: _compare_feeds(args, specs, ids),
        per_layer=args.layers,
        max_layers=args.max_layers,
        threads=args.threads,
        optimize=args.optimize or args.exact_qdq,
        exact_qdq=args.exact_qdq,
    )
    if args.json:
        from edgeq.artifacts.encodings import json_safe

        print(json.dumps(json_safe(result)))
        return 0
    header = f"  {'SQNR dB':>8}  {'max |B-A|':>11}  {'mean |B-A|':>11}  tensor"
    print(f"{result['samples']} samples in {result['seconds']:.1f} s")
    print("outputs:")
    print(header)
    print("\n".join(_table(result["outputs"])))
    if "layers" in result:
        shown = len(result["layers"])
        print(f"layers ({shown} of {result['layers_available']} shared):")
        print(header)
        if shown:
            print("\n".join(_table(result["layers"])))
    return 0


def run_vqa(args: argparse.Namespace) -> int:
    from edgeq.evaluate.vqa import evaluate_vqa

    result = evaluate_vqa(args.model, questions=args.questions, samples=args.samples, provider=args.provider,
                          threads=args.threads)
    if args.json:
        print(json.dumps(result))
        return 0
    per_type = ", ".join(f"{t} {a:.4f}" for t, a in result["per_type"].items())
    print(f"vqa accuracy {result['accuracy']:.4f} on {result['samples']} questions ({per_type}) "
          f"in {result['seconds']:.1f} s")
    return 0
