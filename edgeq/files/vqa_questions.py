"""The questions file of ``edgeq eval vqa`` (``vqa_eval.npz``): questions with their images as pixels.

The VLM exports (``edgeq export trained-vlm``) write it beside ``vision.onnx`` so that evaluation
starts from pixels, as a device deployment does, and not from the visual tokens baked into
``eval.npz``. The writer and the reader live here together, so the form is stated once:

    pixels          float32 [images, S, S, 3]: RGB in [0, 1] at the model's image size S (what
                    ``vision.onnx`` takes: resized already, never resized by the evaluation)
    image_index     int64 [images]: the image's id in its dataset (easy-VQA test split)
    question_image  int64 [N]: the row of ``pixels`` each question asks about
    prompt_ids      int64 [N, P]: the prompt's token ids, ``VISUAL_ID`` (-1) at the visual span (one
                    contiguous run, as many as vision.onnx gives tokens), ``PAD_ID`` (-100) after
                    the prompt's end; the prompt ends where the answer starts (chat template
                    included: ``...<|im_start|>assistant\\n``)
    prompt_len      int64 [N]
    answer_ids      int64 [N, A]: the gold answer's tokens followed by ``end_id``, ``PAD_ID`` after
    answer_len      int64 [N]
    end_id          int64 []: the token that closes an answer (``<|im_end|>``)
    question, answer, qtype  unicode [N]: the texts and the question type (yes/no, shape, color)
    question_index  int64 [N]: the question's index in its dataset split

Any ``.npz`` of this form is a valid ``--questions`` file; ``load_questions`` refuses anything else
in one line (``UserInputError``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

import numpy as np

from edgeq.errors import UserInputError
from edgeq.files.npzfile import read_user_npz
from edgeq.files.vlm_folder import QUESTIONS_FILE

VISUAL_ID = -1
PAD_ID = -100

_INT_KEYS = ("image_index", "question_image", "prompt_ids", "prompt_len", "answer_ids", "answer_len",
             "question_index", "end_id")
_TEXT_KEYS = ("question", "answer", "qtype")
KEYS = ("pixels", *_INT_KEYS, *_TEXT_KEYS)


@dataclass(frozen=True)
class VqaQuestions:
    """A validated questions file (see the module docstring for the arrays)."""

    pixels: np.ndarray
    image_index: np.ndarray
    question_image: np.ndarray
    prompt_ids: np.ndarray
    prompt_len: np.ndarray
    answer_ids: np.ndarray
    answer_len: np.ndarray
    end_id: int
    question: np.ndarray
    answer: np.ndarray
    qtype: np.ndarray
    question_index: np.ndarray

    def __len__(self) -> int:
        return int(self.prompt_len.shape[0])

    @property
    def image_size(self) -> int:
        return int(self.pixels.shape[1])

    def prompt(self, i: int) -> np.ndarray:
        return self.prompt_ids[i, :int(self.prompt_len[i])]

    def gold(self, i: int) -> np.ndarray:
        """The gold answer's tokens and the end token."""
        return self.answer_ids[i, :int(self.answer_len[i])]

    def visual_span(self, i: int) -> tuple[int, int]:
        """(start, length) of the visual span in prompt ``i``."""
        where = np.flatnonzero(self.prompt(i) == VISUAL_ID)
        return int(where[0]), int(where.size)


def _padded(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    out = np.full((len(rows), width), PAD_ID, np.int64)
    for k, row in enumerate(rows):
        out[k, :len(row)] = row
    return out, np.asarray([len(r) for r in rows], np.int64)


def write_questions(path: str | os.PathLike, pixels: np.ndarray, image_index: Sequence[int],
                    question_image: Sequence[int], prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                    end_id: int, question: Sequence[str], answer: Sequence[str], qtype: Sequence[str],
                    question_index: Sequence[int]) -> Path:
    """Write a questions file (compressed: the images are most of it). ``prompts`` and ``answers``
    are token lists (answers with ``end_id`` last); the file is checked by ``load_questions``."""
    prompt_ids, prompt_len = _padded(prompts)
    answer_ids, answer_len = _padded(answers)
    path = Path(path)
    np.savez_compressed(
        path, pixels=np.asarray(pixels, np.float32), image_index=np.asarray(image_index, np.int64),
        question_image=np.asarray(question_image, np.int64), prompt_ids=prompt_ids, prompt_len=prompt_len,
        answer_ids=answer_ids, answer_len=answer_len, end_id=np.asarray(end_id, np.int64),
        question=np.asarray(question, str), answer=np.asarray(answer, str), qtype=np.asarray(qtype, str),
        question_index=np.asarray(question_index, np.int64))
    load_questions(path)
    return path


def load_questions(path: str | os.PathLike) -> VqaQuestions:
    """The questions file at ``path``, checked; ``UserInputError`` (one line) for anything else."""
    path = Path(path)
    arrays = read_user_npz(path, "a VQA questions file")
    missing = [k for k in KEYS if k not in arrays]
    if missing:
        raise UserInputError(f"{path} is not a VQA questions file: no {', '.join(missing)} "
                             f"(the form edgeq export trained-vlm writes as {QUESTIONS_FILE})")

    def bad(why: str) -> UserInputError:
        return UserInputError(f"{path}: {why}")

    pixels = arrays["pixels"]
    if pixels.ndim != 4 or pixels.shape[3] != 3 or pixels.shape[1] != pixels.shape[2] or not len(pixels):
        raise bad(f"pixels must be [images, S, S, 3], got {list(pixels.shape)}")
    if pixels.dtype.kind == "u":  # 8-bit images: scaled to [0, 1] like the exports' float pixels
        pixels = pixels.astype(np.float32) / np.float32(np.iinfo(pixels.dtype).max)
    elif pixels.dtype.kind != "f":
        raise bad(f"pixels must be float (RGB in [0, 1]) or uint8, got {pixels.dtype}")
    pixels = pixels.astype(np.float32, copy=False)
    if not np.isfinite(pixels).all():
        raise bad("pixels hold NaN or infinite values")
    for key in _INT_KEYS:
        if arrays[key].dtype.kind not in "iu":
            raise bad(f"{key} must be integers, got {arrays[key].dtype}")
    for key in _TEXT_KEYS:
        if arrays[key].dtype.kind != "U":
            raise bad(f"{key} must be text (a unicode array), got {arrays[key].dtype}")
    n = arrays["prompt_len"].shape[0] if arrays["prompt_len"].ndim == 1 else -1
    if n < 1:
        raise bad("prompt_len must be a non-empty vector")
    shapes = {"question_image": 1, "prompt_ids": 2, "answer_ids": 2, "answer_len": 1, "question_index": 1,
              "question": 1, "answer": 1, "qtype": 1}
    for key, ndim in shapes.items():
        if arrays[key].ndim != ndim or arrays[key].shape[0] != n:
            raise bad(f"{key} must have {n} rows (one per question), shape {list(arrays[key].shape)}")
    if arrays["image_index"].shape != (len(pixels),):
        raise bad(f"image_index must have one entry per image ({len(pixels)}), shape {list(arrays['image_index'].shape)}")
    if arrays["end_id"].ndim != 0:
        raise bad("end_id must be one integer")
    rows = arrays["question_image"]
    if (rows < 0).any() or (rows >= len(pixels)).any():
        raise bad(f"question_image must index the {len(pixels)} images")
    q = VqaQuestions(pixels=pixels, **{k: arrays[k].astype(np.int64) for k in _INT_KEYS if k != "end_id"},
                     end_id=int(arrays["end_id"]), **{k: arrays[k] for k in _TEXT_KEYS})
    for lengths, ids, what in ((q.prompt_len, q.prompt_ids, "prompt"), (q.answer_len, q.answer_ids, "answer")):
        if (lengths < 1).any() or (lengths > ids.shape[1]).any():
            raise bad(f"{what}_len must be in [1, {ids.shape[1]}]")
    for i in range(len(q)):
        prompt = q.prompt(i)
        visual = np.flatnonzero(prompt == VISUAL_ID)
        if not visual.size or visual[-1] - visual[0] + 1 != visual.size:
            raise bad(f"question {i}: the prompt needs one contiguous visual span (ids {VISUAL_ID})")
        if (np.delete(prompt, visual) < 0).any() or (q.gold(i) < 0).any():
            raise bad(f"question {i}: negative token ids outside the visual span")
        if q.gold(i)[-1] != q.end_id:
            raise bad(f"question {i}: the answer tokens must end with end_id {q.end_id}")
    return q
