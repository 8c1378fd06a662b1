"""``edgeq eval vqa`` and what it reads, on the tiny random VLM (``tiny_vlm_dir``, seconds to build):

- ``vision.onnx`` gives, from the eval images' pixels, the visual tokens ``eval.npz`` was built from;
- ``vqa_eval.npz`` holds the same questions as ``eval.npz`` (prompt and answer tokens);
- greedy decoding from pixels takes the teacher-forced argmax on ``eval.npz`` as its first token and
  scores questions exactly as ``vqa_correct`` does;
- the command's JSON, a ``--questions`` file, and bad input (one line, exit 2, nothing on stdout).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgeq.cli import main
from edgeq.evaluate.vqa import answer_greedy, evaluate_vqa, visual_tokens
from edgeq.files.vqa_questions import PAD_ID, load_questions
from edgeq.files.vlm_folder import PIXELS_INPUT, QUESTIONS_FILE, VISION_FILE, VISUAL_OUTPUT
from edgeq.runtime.ort_session import open_session


def _eval_npz(folder: Path) -> tuple[dict, dict]:
    from edgeq.models.trained_vlm import load_eval

    return load_eval(folder)


def test_vision_onnx_gives_the_visual_tokens_eval_npz_was_built_from(tiny_vlm_dir):
    q = load_questions(tiny_vlm_dir / QUESTIONS_FILE)
    session = open_session(tiny_vlm_dir / VISION_FILE)
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, out.name) == (PIXELS_INPUT, VISUAL_OUTPUT)
    assert inp.shape[1:] == [q.image_size, q.image_size, 3], inp.shape  # the image size is fixed
    inputs, meta = _eval_npz(tiny_vlm_dir)
    tokens = visual_tokens(session, q.pixels)
    for i in range(len(q)):
        start, length = int(inputs["visual_start"][i]), int(inputs["visual_len"][i])
        want = inputs["inputs_embeds"][i, start:start + length]
        got = tokens[q.question_image[i]]
        assert int(meta["image_index"][i]) == int(q.image_index[q.question_image[i]])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


def test_vqa_eval_npz_holds_the_questions_of_eval_npz(tiny_vlm_dir):
    q = load_questions(tiny_vlm_dir / QUESTIONS_FILE)
    _, meta = _eval_npz(tiny_vlm_dir)
    assert len(q) == len(meta["labels"])
    assert q.question_index.tolist() == meta["question_index"].tolist()
    for i in range(len(q)):
        pad = int(meta["pad_len"][i])
        ids, labels = meta["text_ids"][i, pad:], meta["labels"][i, pad:]
        prompt, gold = q.prompt(i), q.gold(i)
        assert np.array_equal(np.concatenate([prompt, gold]), ids)  # -1 at the visual span in both
        assert (labels[:len(prompt)] == PAD_ID).all() and np.array_equal(labels[len(prompt):], gold)
        start, length = q.visual_span(i)
        assert meta["is_visual"][i, pad + start:pad + start + length].all()


def test_greedy_from_pixels_agrees_with_the_teacher_forced_eval_npz(tiny_vlm_dir):
    """The first greedy token is the teacher-forced argmax where the answer starts, and a question is
    correct from pixels exactly when ``vqa_correct`` says so on eval.npz."""
    from edgeq.models.trained_vlm import vqa_accuracy

    q = load_questions(tiny_vlm_dir / QUESTIONS_FILE)
    inputs, meta = _eval_npz(tiny_vlm_dir)
    language = open_session(tiny_vlm_dir / "model.onnx")
    table = np.load(tiny_vlm_dir / "embed_tokens.npy")
    tokens = visual_tokens(open_session(tiny_vlm_dir / VISION_FILE), q.pixels)
    result = evaluate_vqa(tiny_vlm_dir)
    teacher = vqa_accuracy(language, inputs, meta)
    assert result["correct"] == teacher["correct"]
    assert result["accuracy"] == teacher["accuracy"] and result["per_type"] == teacher["per_type"]
    firsts = []
    for i in range(len(q)):
        greedy = answer_greedy(language, q, i, tokens[q.question_image[i]], table, steps=2)
        (logits,) = language.run(["logits"], {k: v[i:i + 1] for k, v in inputs.items()})
        last_prompt = int(meta["pad_len"][i]) + len(q.prompt(i)) - 1
        assert int(greedy[0]) == int(logits[0, last_prompt].argmax()), i
        firsts.append(int(greedy[0]))
    assert len(set(firsts)) > 1, "the tiny model answers every question alike: the test would prove little"


def test_cli_json(tiny_vlm_dir, capfd):
    assert main(["eval", "vqa", str(tiny_vlm_dir), "--samples", "3", "--json"]) == 0
    out, err = capfd.readouterr()
    result = json.loads(out)
    assert {"accuracy", "samples", "answers", "per_type", "model", "provider", "seconds"} <= set(result)
    assert result["samples"] == 3 and len(result["answers"]) == 3 and result["provider"] == "cpu"
    assert result["question_rows"] == [0, 4, 7]  # spread over the 8 questions, in order
    assert all(isinstance(a, str) for a in result["answers"])
    assert main(["eval", "vqa", str(tiny_vlm_dir), "--samples", "3"]) == 0
    line = capfd.readouterr().out
    assert line.startswith(f"vqa accuracy {result['accuracy']:.4f} on 3 questions")


def _rewrite(src: Path, dst: Path, **changes) -> Path:
    with np.load(src) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays.update(changes)
    np.savez(dst, **arrays)
    return dst


def test_a_questions_file_is_scored_by_exact_match(tiny_vlm_dir, tmp_path, capfd):
    """Gold answers of one token, the end token the model's first answer token to question 0: a
    question is correct exactly when the model's first token is that one."""
    q = load_questions(tiny_vlm_dir / QUESTIONS_FILE)
    first = evaluate_vqa(tiny_vlm_dir)
    language = open_session(tiny_vlm_dir / "model.onnx")
    table = np.load(tiny_vlm_dir / "embed_tokens.npy")
    tokens = visual_tokens(open_session(tiny_vlm_dir / VISION_FILE), q.pixels)
    firsts = [int(answer_greedy(language, q, i, tokens[q.question_image[i]], table, 1)[0]) for i in range(len(q))]
    end = firsts[0]
    path = _rewrite(tiny_vlm_dir / QUESTIONS_FILE, tmp_path / "own.npz", end_id=np.int64(end),
                    answer_ids=np.full((len(q), 1), end, np.int64), answer_len=np.ones(len(q), np.int64))
    assert main(["eval", "vqa", str(tiny_vlm_dir), "--questions", str(path), "--json"]) == 0
    result = json.loads(capfd.readouterr().out)
    assert result["correct"] == [f == end for f in firsts]
    assert result["accuracy"] == round(float(np.mean(result["correct"])), 4) and 0 < result["accuracy"] < 1
    assert result["answers"][0] == ""  # the answer ends at the end token
    assert first["samples"] == len(q)


@pytest.fixture
def bad_inputs(tiny_vlm_dir, tmp_path) -> dict:
    without_vision = tmp_path / "no-vision"
    without_vision.mkdir()
    for item in tiny_vlm_dir.iterdir():
        if not item.name.startswith(VISION_FILE):
            (without_vision / item.name).symlink_to(item)
    (tmp_path / "wrong.npz").write_bytes(b"")
    np.savez(tmp_path / "form.npz", x=np.zeros(3))
    with np.load(tiny_vlm_dir / QUESTIONS_FILE) as npz:
        pixels = npz["pixels"]
    bigger = np.repeat(np.repeat(pixels, 2, axis=1), 2, axis=2)
    _rewrite(tiny_vlm_dir / QUESTIONS_FILE, tmp_path / "size.npz", pixels=bigger)
    _rewrite(tiny_vlm_dir / QUESTIONS_FILE, tmp_path / "span.npz", prompt_ids=np.where(
        np.load(tiny_vlm_dir / QUESTIONS_FILE)["prompt_ids"] == -1, 5, np.load(tiny_vlm_dir / QUESTIONS_FILE)["prompt_ids"]))
    model = str(tiny_vlm_dir)
    return {
        "missing folder": (["eval", "vqa", str(tmp_path / "absent")], "not found"),
        "no vision.onnx": (["eval", "vqa", str(without_vision)], "vision.onnx not found"),
        "questions not an npz": (["eval", "vqa", model, "--questions", str(tmp_path / "wrong.npz")], "as a VQA questions file"),
        "questions of another form": (["eval", "vqa", model, "--questions", str(tmp_path / "form.npz")], "no pixels"),
        "questions missing": (["eval", "vqa", model, "--questions", str(tmp_path / "none.npz")], "not found"),
        "images of another size": (["eval", "vqa", model, "--questions", str(tmp_path / "size.npz")], "64x64"),
        "no visual span": (["eval", "vqa", model, "--questions", str(tmp_path / "span.npz")], "visual span"),
        "samples 0": (["eval", "vqa", model, "--samples", "0"], "--samples"),
        "provider qnn-htp": (["eval", "vqa", model, "--provider", "qnn-htp"], "static"),
    }


@pytest.mark.parametrize("case", ["missing folder", "no vision.onnx", "questions not an npz", "questions of another form",
                                  "questions missing", "images of another size", "no visual span", "samples 0",
                                  "provider qnn-htp"])
def test_bad_input_is_one_line_and_exit_2(case, bad_inputs, capfd):
    argv, needle = bad_inputs[case]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capfd.readouterr()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and needle in err, err
    assert out == ""
