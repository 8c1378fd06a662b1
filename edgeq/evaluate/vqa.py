"""``edgeq eval vqa``: exact-match accuracy of a vision-language model on VQA questions, from pixels.

The trained VLM's accuracy was so far measured from ``eval.npz``, whose visual tokens were
computed in torch at export. A deployment starts from pixels, so this runs what a device runs:

    pixels -> vision.onnx -> visual tokens, placed at the prompt's visual span of inputs_embeds
    (text tokens through the folder's embedding table) -> the language graph (model.onnx),
    greedy decoding (``edgeq.evaluate.generate.greedy_decode``) -> the answer

A question counts as correct when the greedy tokens are the gold answer's tokens followed by the
end token (``<|im_end|>``): the same rule as the teacher-forced argmax on ``eval.npz``
(``edgeq.models.trained_vlm.vqa_correct``), which greedy decoding reproduces token for token.
The questions (``vqa_eval.npz``, ``edgeq.files.vqa_questions``) default to the export's
evaluation split.

A static deployment (``edgeq compile VLM/with-past/model.onnx --static ...``: ``vision.onnx``,
``prefill.onnx``, ``decode.onnx``, the embedding table and the questions file) runs the same way
through its own contract (``edgeq.generation.vlm_pair``): the visual tokens at the prefill's
fixed slice, the prompt's text after them at their original positions, greedy decoding through
``decode.onnx``; on onnxruntime CPU, or (``--provider qnn-htp``) its context binaries
(``qnn/*_ctx.onnx``, ``--context-binary``) on Qualcomm's emulated HTP. The fp32 export folder
runs on CPU only (the HTP takes static graphs).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import numpy as np

from edgeq.errors import UserInputError
from edgeq.evaluate.generate import GreedyResult, greedy_decode
from edgeq.files.vqa_questions import VqaQuestions, load_questions
from edgeq.files.vlm_folder import EMBED_TABLE_FILE, PIXELS_INPUT, QUESTIONS_FILE, VISION_FILE, VISUAL_OUTPUT
from edgeq.files.npzfile import NumpyFileError, read_npy

PROVIDERS = ("cpu", "qnn-htp")
LANGUAGE_FILE = "model.onnx"
VISION_BATCH = 16


def spread_rows(n: int, samples: int | None) -> np.ndarray:
    """``samples`` row indices spread evenly over ``n`` rows (all of them when ``None`` or more):
    a subset keeps the split's mix of question types, which its first rows need not."""
    if samples is None or samples >= n:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, samples).round().astype(np.int64))


def accuracy_by_type(correct: Sequence[bool] | np.ndarray, types: Sequence[str], order: Sequence[str] = ()) -> dict:
    """``{"accuracy", "questions", "per_type": {type: accuracy}}`` (4 decimals), types in ``order``
    then in order of appearance: the one summary of exact-match answers, from pixels or from
    ``eval.npz``."""
    correct = np.asarray(correct, bool)
    types = [str(t) for t in types]
    per_type = {}
    for t in [*order, *dict.fromkeys(types)]:
        rows = [c for c, q in zip(correct, types) if q == t]
        if rows and t not in per_type:
            per_type[t] = round(float(np.mean(rows)), 4)
    return {"accuracy": round(float(correct.mean()), 4) if correct.size else 0.0, "questions": int(correct.size),
            "per_type": per_type}


def _folder(model_dir: str | os.PathLike, static: bool = False) -> dict[str, Path]:
    """The files an fp32 VLM export folder (or, ``static``, a static deployment beyond its graphs)
    must hold; a one-line error naming the first missing."""
    folder = Path(model_dir)
    if not folder.exists():
        raise UserInputError(f"model folder not found: {folder}")
    if not folder.is_dir():
        raise UserInputError(f"{folder} is not a folder: edgeq eval vqa takes a VLM export folder "
                             "(edgeq export trained-vlm -o DIR) or a static VLM deployment (edgeq compile --static)")
    files = {"vision": folder / VISION_FILE, "embed": folder / EMBED_TABLE_FILE, "tokenizer": folder / "tokenizer.json"}
    if not static:
        files["language"] = folder / LANGUAGE_FILE
    for role, path in files.items():
        if not path.is_file():
            hint = "a VLM export written before vision.onnx existed: export it again" if role == "vision" else \
                "not a VLM export folder (edgeq export trained-vlm -o DIR)"
            raise UserInputError(f"{path} not found: {hint}")
    return files


def _static_image_size(session) -> int | None:
    shape = session.get_inputs()[0].shape
    return shape[1] if len(shape) == 4 and isinstance(shape[1], int) else None


def visual_tokens(session, pixels: np.ndarray, batch: int = VISION_BATCH) -> np.ndarray:
    """``vision.onnx`` on ``pixels`` [N, S, S, 3]: the visual tokens [N, tokens, hidden] (in
    batches of ``batch``, or of the graph's own batch where it is fixed: a static deployment's is 1)."""
    fixed = session.get_inputs()[0].shape[0]
    batch = fixed if isinstance(fixed, int) else batch
    chunks = [session.run([VISUAL_OUTPUT], {PIXELS_INPUT: pixels[i:i + batch]})[0] for i in range(0, len(pixels), batch)]
    return np.concatenate(chunks).astype(np.float32, copy=False)


def prompt_embeds(prompt: np.ndarray, visual: np.ndarray, table: np.ndarray, start: int) -> np.ndarray:
    """inputs_embeds [1, len, hidden] of one prompt: text ids through ``table``, ``visual`` at
    ``start`` (the prompt's visual span)."""
    embeds = table[np.where(prompt < 0, 0, prompt)].astype(np.float32)
    embeds[start:start + len(visual)] = visual
    return embeds[None]


def answer_greedy(session, questions: VqaQuestions, i: int, visual: np.ndarray, table: np.ndarray,
                  steps: int) -> np.ndarray:
    """The greedy tokens (``steps`` of them) of the language graph on question ``i`` with its
    image's ``visual`` tokens [tokens, hidden] at the visual span."""
    return answer_decode(session, questions, i, visual, table, steps).tokens


def answer_decode(session, questions: VqaQuestions, i: int, visual: np.ndarray, table: np.ndarray,
                  steps: int, force_tokens: np.ndarray | None = None) -> GreedyResult:
    """``answer_greedy`` with each step's logits; ``force_tokens``: fed back instead of the argmax."""
    start, length = questions.visual_span(i)
    if length != len(visual):
        raise UserInputError(f"question {i}: its prompt has a visual span of {length} tokens, vision.onnx gives "
                             f"{len(visual)}")
    embeds = prompt_embeds(questions.prompt(i), visual, table, start)
    seq = embeds.shape[1]
    names = {inp.name for inp in session.get_inputs()}
    feeds = {"inputs_embeds": embeds, "attention_mask": np.ones((1, seq), np.int64),
             "position_ids": np.arange(seq, dtype=np.int64)[None],
             "visual_start": np.array([start], np.int64), "visual_len": np.array([length], np.int64)}
    return greedy_decode(session, {k: v for k, v in feeds.items() if k in names}, steps, table, force_tokens)


def static_greedy(decoder, prompt: np.ndarray, start: int, visual: np.ndarray, steps: int,
                  force_tokens: np.ndarray | None = None) -> GreedyResult:
    """Greedy decoding of ``steps`` tokens on a static VLM deployment (``edgeq.generation.vlm_pair``)
    from a prompt with its image's ``visual`` tokens at ``[start, start + V)``; what
    ``greedy_decode`` gives on the dynamic graph (tokens and each step's logits; ``force_tokens``:
    fed back instead of the argmax, as there)."""
    decoder.reset()
    logits = [decoder.prefill_image(prompt, start, visual)]
    for t in range(steps - 1):
        logits.append(decoder.step(int(logits[-1].argmax() if force_tokens is None else force_tokens[t])))
    stacked = np.stack(logits).astype(np.float32)
    return GreedyResult(stacked.argmax(-1).astype(np.int64), stacked)


@dataclass
class _Run:
    """What evaluating a VLM folder on some questions needs, opened once (``_open_run``)."""

    folder: Path
    static: bool
    questions_path: Path
    q: VqaQuestions
    table: np.ndarray
    tokenizer: Any  # a tokenizers.Tokenizer (load_tokenizer)
    rows: np.ndarray
    visual: dict  # image row -> visual tokens [V, hidden]
    language: object  # the fp32 export's model.onnx session, or None
    decoder: object  # the static deployment's decoder, or None
    started: float

    def run(self, i: int, steps: int, force_tokens: np.ndarray | None = None) -> GreedyResult:
        """Question ``i``: ``steps`` greedy tokens (and each step's logits)."""
        image = self.visual[int(self.q.question_image[i])]
        if self.decoder is None:
            return answer_decode(self.language, self.q, i, image, self.table, steps, force_tokens)
        return static_greedy(self.decoder, self.q.prompt(i), self.q.visual_span(i)[0], image, steps, force_tokens)


def _open_run(model_dir: str | os.PathLike, questions: str | os.PathLike | None, samples: int | None,
              provider: str, threads: int | None) -> _Run:
    from edgeq.runtime.ort_session import open_session
    from edgeq.textdata import load_tokenizer

    if samples is not None and samples < 1:
        raise UserInputError(f"--samples must be >= 1, got {samples}")
    if provider not in PROVIDERS:
        raise UserInputError(f"--provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
    from edgeq.generation.vlm_pair import is_static_vlm, open_static_vlm

    from edgeq.files.folder_kind import recorded_kind

    folder = Path(model_dir)
    kind = recorded_kind(folder)  # a compile's output: what its report says; an export folder by its files
    static = kind == "static-vlm" if kind is not None else is_static_vlm(folder)
    files = _folder(folder, static)
    if provider != "cpu" and not static:
        raise UserInputError(f"{folder} is an fp32 VLM export folder, not a static deployment: --provider qnn-htp "
                             "runs static VLM deployments (edgeq compile VLM/with-past/model.onnx --static "
                             "prefill=P,context=C --target qnn-htp --context-binary); use --provider cpu")
    questions_path = Path(questions) if questions is not None else folder / QUESTIONS_FILE
    q = load_questions(questions_path)
    try:
        table = read_npy(files["embed"])
    except NumpyFileError as exc:
        raise UserInputError(f"{files['embed']}: {exc}") from None
    if table.ndim != 2:
        raise UserInputError(f"{files['embed']} must be the embedding table [vocab, hidden], shape {list(table.shape)}")
    tokenizer = load_tokenizer(folder)
    started = time.perf_counter()
    decoder = None
    if static:
        vision, decoder = open_static_vlm(folder, table, provider, threads)
    else:
        vision = open_session(files["vision"], threads=threads)
    size = _static_image_size(vision)
    if size is not None and size != q.image_size:
        raise UserInputError(f"{questions_path}: images are {q.image_size}x{q.image_size}, {files['vision']} takes "
                             f"{size}x{size} (pixels at the model's image size)")
    rows = spread_rows(len(q), samples)
    if int(max(q.prompt_ids[rows].max(), q.answer_ids[rows].max())) >= table.shape[0]:
        raise UserInputError(f"{questions_path}: token ids beyond the model's vocabulary of {table.shape[0]}")
    images = np.unique(q.question_image[rows])
    visual = dict(zip(images.tolist(), visual_tokens(vision, q.pixels[images])))
    del vision
    language = open_session(files["language"], threads=threads) if decoder is None else None
    return _Run(folder, static, questions_path, q, table, tokenizer, rows, visual, language, decoder, started)


def evaluate_vqa(model_dir: str | os.PathLike, questions: str | os.PathLike | None = None, samples: int | None = None,
                 provider: str = "cpu", threads: int | None = None) -> dict:
    """Exact-match accuracy of the VLM export folder ``model_dir`` on ``questions`` (default: its
    ``vqa_eval.npz``), ``samples`` of them spread over the file (default all); see the module
    docstring. Returns ``accuracy``, ``per_type``, ``samples``, ``answers`` (the greedy answer's text
    per question, in order, up to the end token), ``correct``, ``gold``, ``question_rows``, and
    ``model``, ``provider``, ``questions_file``, ``seconds``. Bad input: ``UserInputError``."""
    r = _open_run(model_dir, questions, samples, provider, threads)
    q, rows = r.q, r.rows
    steps = int(q.answer_len[rows].max())
    answers, correct, gold = [], [], []
    for i in rows.tolist():
        tokens = r.run(i, steps).tokens
        want = q.gold(i)
        correct.append(bool(np.array_equal(tokens[:len(want)], want)))
        ended = np.flatnonzero(tokens == q.end_id)
        answers.append(r.tokenizer.decode(tokens[:ended[0] if ended.size else len(tokens)].tolist()).strip())
        gold.append(str(q.answer[i]))
    summary = accuracy_by_type(correct, q.qtype[rows])
    return {"model": str(r.folder), "provider": provider, "form": "static" if r.static else "fp32-export",
            "questions_file": str(r.questions_path),
            "samples": summary["questions"], "accuracy": summary["accuracy"], "per_type": summary["per_type"],
            "answers": answers, "correct": correct, "gold": gold, "question_rows": rows.tolist(),
            "image_size": q.image_size, "seconds": round(time.perf_counter() - r.started, 2)}


def answer_logits(model_dir: str | os.PathLike, questions: str | os.PathLike | None = None,
                  samples: int | None = None, provider: str = "cpu", threads: int | None = None) -> dict:
    """Teacher-forced next-token logits at the answer positions of ``samples`` questions (the rows
    ``evaluate_vqa`` takes): per question, the distributions that predict each gold answer token and
    the end token (the gold tokens fed back: the positions the exact-match rule scores, the same
    inputs for every model), from pixels as ``evaluate_vqa`` runs. Returns ``logits`` float32
    [positions, vocab] (questions in order), ``counts`` (positions per question), ``gold`` (the
    token each position should predict), ``question_rows``, ``model``, ``provider``, ``seconds``.
    What a quantized deployment's KL divergence and top-1 agreement against fp32 are computed on
    (``edgeq.evaluate.fidelity.Fidelity``)."""
    r = _open_run(model_dir, questions, samples, provider, threads)
    logits, counts, gold = [], [], []
    for i in r.rows.tolist():
        want = r.q.gold(i)
        logits.append(r.run(i, len(want), want[:-1]).logits)
        counts.append(len(want))
        gold.append(want)
    return {"model": str(r.folder), "provider": provider, "question_rows": r.rows.tolist(),
            "logits": np.concatenate(logits).astype(np.float32), "counts": counts,
            "gold": np.concatenate(gold).astype(np.int64), "seconds": round(time.perf_counter() - r.started, 2)}
