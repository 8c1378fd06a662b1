"""``edgeq generate``: run a prompt through an exported or compiled decoder and print the text."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path
from typing import Any, cast

from edgeq.argtypes import non_negative_int, positive_int
from edgeq.errors import UserInputError

_DESCRIPTION = """Generate text from a prompt with onnxruntime on CPU (batch 1), streaming it to stdout;
a summary line (prompt tokens, time to first token, decode tokens/s) goes to stderr.

DIR is a folder or a .onnx file. A folder holding prefill.onnx and decode.onnx is a static pair
(edgeq compile --static): the prompt runs through prefill.onnx in prefill-length chunks (the last one
padded), then one token at a time through decode.onnx, the KV cache kept here; generation stops when
the cache's context is full (stopped: context_full) and a prompt of context tokens or more is refused.
Otherwise DIR/model.onnx runs: with a KV cache (edgeq export ... --with-past) the presents of one run
feed the next; without one every step re-runs the whole sequence (slow, the reference).

Text: the tokenizer is --tokenizer DIR if given, else DIR/tokenizer.json. Without --chat the prompt is
encoded as the tokenizer does by default, its special tokens included (SmolLM2: a leading
<|im_start|>, as Hugging Face's tokenizer(prompt) and edgeq eval ppl do); --chat wraps it in the chat
template (chat_template.jinja or tokenizer_config.json) as one user turn with the assistant's turn
opened, special tokens written by the template itself. Generation stops at an end-of-sequence id
(generation_config.json, config.json, tokenizer_config.json: any of them) unless --ignore-eos; the
printed text leaves special tokens out.

Greedy (argmax) by default or with --temperature 0; with --temperature T > 0 tokens are drawn from
softmax(logits / T) cut to the top-p nucleus, with numpy's default_rng(--seed): one seed, one output
(without --seed a fresh seed is drawn and reported by --json)."""

_EPILOG = """examples:
  edgeq generate artifacts/smollm2-past --prompt "The capital of France is" --max-new-tokens 20
  edgeq generate out/static --prompt "Write a haiku about the sea." --chat --temperature 0.7 --top-p 0.9 --seed 1
  edgeq generate out/static --prompt "Hello" --json"""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``generate`` to the top-level subparsers."""
    p = subparsers.add_parser(
        "generate",
        help="generate text from a prompt (static pair, or a model.onnx with or without KV cache)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="DIR", help="folder with prefill.onnx + decode.onnx, or with model.onnx; or a .onnx file")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N",
                   help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sample from softmax(logits / T) (default: greedy; 0 is greedy too)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="with --temperature: keep the smallest set of most likely tokens whose probability "
                        "reaches P, in (0, 1] (default 1.0: all)")
    p.add_argument("--seed", type=non_negative_int, default=None, metavar="S", help="with --temperature: seed of the sampler")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true",
                   help="no streaming: print one JSON object (text, tokens, prompt_tokens, ttft_ms, "
                        "decode_tokens_per_s, mode, stopped, ...)")
    p.add_argument("--tokenizer", metavar="DIR", help="folder with tokenizer.json (default: DIR's)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N", help="onnxruntime intra-op threads")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--provider", choices=("cpu", "qnn-htp"), default="cpu",
                   help="onnxruntime CPU (default) or, for a static pair, Qualcomm's HTP emulated by onnxruntime-qnn "
                        "(`pip install 'edgeq[qnn]'`; CPU fallback disabled; the pair's qnn/*_ctx.onnx when present)")
    p.add_argument("--htp-arch", type=int, metavar="N", help="with --provider qnn-htp: HTP generation (73, 75, 79; default 79)")
    p.set_defaults(func=run_generate)
    return p


def _tokenizer_folder(args: argparse.Namespace, folder: Path) -> Path:
    if args.tokenizer:
        path = Path(args.tokenizer)
        if not path.exists():
            raise UserInputError(f"tokenizer folder not found: {path}")
        return path
    if (folder / "tokenizer.json").is_file():
        return folder
    raise UserInputError(f"no tokenizer.json in {folder}: pass --tokenizer DIR (e.g. the folder of edgeq export)")


class _Stream:
    """Prints the generated text as it grows: the full id list is decoded each time and the new suffix
    printed, so tokens that only make sense together (a UTF-8 character split over byte tokens, a
    leading-space merge) come out right; text ending in an incomplete character waits."""

    def __init__(self, tokenizer: Any, out: Any) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.printed = ""

    def _emit(self, text: str) -> None:
        new = text[len(self.printed):]  # printed text cannot be taken back; the decode only ever grows it
        if new:
            self.out.write(new)
            self.out.flush()
        self.printed = text

    def __call__(self, tokens: list[int]) -> None:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self._emit(text)

    def finish(self, tokens: list[int]) -> None:
        self._emit(self.tokenizer.decode(tokens, skip_special_tokens=True))
        self.out.write("\n")
        self.out.flush()


def run_generate(args: argparse.Namespace) -> int:
    from edgeq.generation import generate
    from edgeq.generation.chat import eos_ids, read_json, render_chat
    from edgeq.generation.decoders import model_folder, open_decoder, resolve_model
    from edgeq.generation.sampling import check_sampling
    from edgeq.textdata import load_tokenizer

    check_sampling(args.temperature, args.top_p)
    resolve_model(args.model)  # a missing DIR or graph is named before anything else
    folder = model_folder(args.model)
    tok_folder = _tokenizer_folder(args, folder)
    tokenizer = load_tokenizer(tok_folder)
    folders = list(dict.fromkeys(p.resolve() for p in (tok_folder if tok_folder.is_dir() else tok_folder.parent, folder)))
    if args.chat:
        with_template = next((f for f in folders if (f / "chat_template.jinja").is_file()
                              or "chat_template" in read_json(f / "tokenizer_config.json")), folders[0])
        prompt_ids = tokenizer.encode(render_chat(with_template, args.prompt), add_special_tokens=False).ids
    else:
        prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=True).ids
    eos = set() if args.ignore_eos else set().union(*(eos_ids(f, tokenizer) for f in folders))

    decoder = open_decoder(args.model, threads=args.threads, provider=args.provider, htp_arch=args.htp_arch,
                           max_length=len(prompt_ids) + args.max_new_tokens)  # (an onnxruntime-genai folder's cache slots)
    sampling = bool(args.temperature)
    seed = (args.seed if args.seed is not None else secrets.randbits(32)) if sampling else None
    stream = None if args.json else _Stream(tokenizer, sys.stdout)
    result = generate(decoder, prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_p=args.top_p, seed=seed, eos=eos, on_token=stream)
    text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    if args.json:
        record = {
            "text": text,
            "tokens": result.tokens,
            "prompt_tokens": result.prompt_tokens,
            "ttft_ms": result.ttft_ms,
            "decode_tokens_per_s": result.decode_tokens_per_s,
            "decode_seconds": result.decode_seconds,
            "mode": result.mode,
            "stopped": result.stopped,
            "context": decoder.context,
            "sampling": {"temperature": args.temperature, "top_p": args.top_p, "seed": seed} if sampling else "greedy",
            "chat": args.chat,
            "model": str(args.model),
        }
        print(json.dumps(record))
        return 0
    cast(_Stream, stream).finish(result.tokens)  # (None only with --json, returned above)
    n = len(result.tokens)
    rate = (f"{n} tokens at {result.decode_tokens_per_s:.1f} tokens/s (decode)" if result.decode_tokens_per_s
            else f"{n} token{'s' if n != 1 else ''} (no decode step)")
    print(f"prompt {result.prompt_tokens} tokens, TTFT {result.ttft_ms:.1f} ms, {rate}; "
          f"{result.mode}, stopped: {result.stopped}", file=sys.stderr)
    return 0
