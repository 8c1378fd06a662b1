"""easy-VQA, the image-question-answer set the trained VLM learns from, and the chat format it reads.

easy-VQA (``pip install easy-vqa``, MIT) ships 4,000 train and 1,000 test images (64x64 RGB PNG,
one coloured shape on a background) with 38,575 / 9,673 questions and 13 one-word answers. Every
answer belongs to one question type, as in VQA's "answer types": ``yes/no`` (74% of questions),
``shape`` (circle, rectangle, triangle) or ``color`` (8 colours). The answer prior, the accuracy of
always answering the most frequent train answer of the question's type, is the floor a model must
clear to show that it looks at the image.

The chat format is SmolLM2-Instruct's own (``<|im_start|>role\\n ... <|im_end|>``) with the image
as a span of visual tokens at the start of the first user turn, the way LLaVA places ``<image>``::

    <|im_start|>user\\n [visual tokens] \\n{question}<|im_end|>\\n<|im_start|>assistant\\n{answer}<|im_end|>

Later turns (training packs all questions of an image into one conversation, as LLaVA's
instruction data does) continue with ``\\n<|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n{answer}<|im_end|>``.
Only answer tokens and their ``<|im_end|>`` are trained on and scored. Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

import numpy as np

from edgeq.errors import UserInputError
from edgeq.models.package_files import package_file

PACKAGE = "easy_vqa"
INSTALL_HINT = "pip install easy-vqa"
SPLITS = ("train", "test")
SHAPES = ("circle", "rectangle", "triangle")
YES_NO = ("yes", "no")
QUESTION_TYPES = ("yes/no", "shape", "color")
VISUAL = -1  # placeholder id of a visual token in a token list
IGNORE = -100  # label of a position that is not scored


@dataclass(frozen=True)
class Question:
    text: str
    answer: str
    image: int

    @property
    def qtype(self) -> str:
        return question_type(self.answer)


def question_type(answer: str) -> str:
    """``yes/no``, ``shape`` or ``color``: easy-VQA's answers are disjoint across the three types."""
    if answer in YES_NO:
        return "yes/no"
    return "shape" if answer in SHAPES else "color"


def data_dir() -> Path:
    """The installed package's ``data`` folder (found without importing the package)."""
    return package_file(PACKAGE, "data/answers.txt", INSTALL_HINT, "the trained VLM").parent


def load_questions(split: str) -> list[Question]:
    """All questions of ``split`` ("train" or "test") in the package's order."""
    if split not in SPLITS:
        raise UserInputError(f"easy-VQA split must be one of {', '.join(SPLITS)}, got '{split}'")
    path = data_dir() / split / "questions.json"
    rows = json.loads(path.read_text())
    return [Question(str(text), str(answer), int(image)) for text, answer, image in rows]


def answers() -> list[str]:
    """The 13 answers, in the package's order."""
    return [a.strip() for a in (data_dir() / "answers.txt").read_text().splitlines() if a.strip()]


def image_ids(questions: Sequence[Question]) -> list[int]:
    """The distinct images the questions ask about, sorted."""
    return sorted({q.image for q in questions})


def load_images(split: str, ids: Sequence[int]) -> np.ndarray:
    """Images ``ids`` of ``split`` as float32 RGB [N, 64, 64, 3] in [0, 1]."""
    from PIL import Image

    folder = data_dir() / split / "images"
    out = []
    for i in ids:
        with Image.open(folder / f"{int(i)}.png") as im:
            out.append(np.asarray(im.convert("RGB"), np.float32) / 255.0)
    return np.stack(out)


def answer_prior(train: Sequence[Question]) -> dict[str, str]:
    """The most frequent train answer of each question type (ties: the answer listed first)."""
    counts: dict[str, Counter] = {t: Counter() for t in QUESTION_TYPES}
    for q in train:
        counts[q.qtype][q.answer] += 1
    return {t: max(sorted(c), key=lambda a: c[a]) for t, c in counts.items() if c}


def accuracy_by_type(questions: Sequence[Question], correct: Sequence[bool]) -> dict:
    """``{"accuracy": all, "per_type": {type: {"accuracy", "questions"}}}``."""
    hits = np.asarray(correct, bool)
    types = np.array([q.qtype for q in questions])
    per_type = {t: {"accuracy": round(float(hits[types == t].mean()), 4), "questions": int((types == t).sum())}
                for t in QUESTION_TYPES if (types == t).any()}
    return {"accuracy": round(float(hits.mean()), 4), "questions": int(len(hits)), "per_type": per_type}


def prior_accuracy(prior: dict[str, str], questions: Sequence[Question]) -> dict:
    """Accuracy of always answering ``prior[type]``."""
    return accuracy_by_type(questions, [prior.get(q.qtype) == q.answer for q in questions])


def captions(questions: Sequence[Question]) -> dict[int, str]:
    """A short caption per image ("a blue rectangle"), read off its shape and colour questions:
    the stage-1 (feature alignment) targets. An image without a colour question gets "a shape"."""
    shape: dict[int, str] = {}
    color: dict[int, str] = {}
    for q in questions:
        if q.qtype == "shape":
            shape[q.image] = q.answer
        elif q.qtype == "color":
            color[q.image] = q.answer
    out = {}
    for image in image_ids(questions):
        words = [w for w in (color.get(image), shape.get(image, "shape")) if w]
        out[image] = "a " + " ".join(words)
    return out


def stratified(questions: Sequence[Question], count: int | None) -> list[int]:
    """Indices of ``count`` questions spread evenly over ``questions`` (all when ``None``)."""
    n = len(questions)
    if count is None or count >= n:
        return list(range(n))
    return [int(i) for i in np.linspace(0, n - 1, count).round().astype(int)]


class ChatFormat:
    """Token ids of the fixed pieces of the chat format, from the language model's tokenizer."""

    CAPTION_INSTRUCTION = "Describe the image briefly."

    def __init__(self, tokenizer_file: str | Path, visual_tokens: int):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.visual_tokens = int(visual_tokens)
        self.user_open = self.encode("<|im_start|>user\n")
        self.turn_close = self.encode("<|im_end|>\n<|im_start|>assistant\n")
        self.end = self.encode("<|im_end|>")
        self.next_turn = self.encode("\n<|im_start|>user\n")
        self.newline = self.encode("\n")
        if len(self.end) != 1:
            raise UserInputError("the tokenizer has no single <|im_end|> token: not a SmolLM2-style chat tokenizer")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    @property
    def visual_start(self) -> int:
        return len(self.user_open)

    def conversation(self, turns: Sequence[tuple[str, str]]) -> tuple[list[int], list[int]]:
        """``(ids, labels)`` of an image followed by ``turns`` of (question, answer): ``VISUAL``
        at the visual positions, labels ``IGNORE`` except where an answer token (or the
        ``<|im_end|>`` closing it) is the next token to predict (labels are aligned with ids:
        ``labels[p]`` is the token at ``p``, predicted from position ``p - 1``)."""
        ids = self.user_open + [VISUAL] * self.visual_tokens + self.newline
        labels = [IGNORE] * len(ids)
        for k, (question, answer) in enumerate(turns):
            if k:
                ids += self.next_turn
                labels += [IGNORE] * len(self.next_turn)
            prompt = self.encode(question) + self.turn_close
            target = self.encode(answer) + self.end
            ids += prompt + target
            labels += [IGNORE] * len(prompt) + target
        return ids, labels
