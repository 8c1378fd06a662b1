"""``edgeq export trained-vlm``: a small vision-language model trained here, exported for MSQ/AIFS.

No pretrained VLM can be installed on the machines edgeq is built on, and the composed VLM
(``composed_vlm``) only joins real parts through an untrained projector, so it cannot answer
anything. This builds one the way LLaVA is built (``vlm_training``: frozen CRAFT vision encoder,
MLP projector, SmolLM2-135M-Instruct with LoRA; stage 1 on captions, stage 2 on questions) on
easy-VQA (``easy_vqa``), measures its test accuracy against the answer prior, and exports the
language model with the composed-VLM contract so every multimodal pass and benchmark runs on it.

Training runs once per settings: its result (features, stage checkpoints, trained weights,
metrics) is cached under ``$EDGEQ_CACHE_DIR/trained-vlm/<settings hash>/`` (default
``~/.cache/edgeq``), so tests and benchmarks reuse it; an interrupted run resumes from its last
checkpoint there. ``--quick`` trains on a few hundred images for a few minutes (CI).

Output folder::

    model.onnx + model.onnx.data   the LM (LoRA merged) on embeddings: inputs inputs_embeds,
                                   attention_mask, position_ids, visual_start, visual_len; logits
    with-past/                     the same weights with a KV cache (inputs ... past_key_values.*,
                                   outputs logits, present.*) + embed_tokens.npy and copies of the
                                   npz files, config and tokenizer (what benchmarks/kv_fidelity.py reads)
    config.json, tokenizer files   SmolLM2-135M-Instruct's
    calib.npz / calib_meta.npz     train images: image + its questions as one conversation cut to
                                   one length (no padding), for --calib
    eval.npz / eval_meta.npz       test questions, one per sample, prompt and gold answer
                                   teacher-forced, left padded (HF convention: position 1 and
                                   attention_mask 0 at pads); meta: text_ids, is_visual, is_pad,
                                   pad_len, labels (answer tokens, else -100), qtype, question_index,
                                   image_index, pad_embedding
    vision.onnx                    the vision side: pixels [batch, S, S, 3] (RGB in [0, 1], S the
                                   image size, 96 by default) -> visual_tokens [batch, (S/16)^2,
                                   hidden]: CRAFT backbone, features rounded to float16 (as cached
                                   for training), projector; what eval.npz's visual spans hold
    vqa_eval.npz                   the same test questions with their images as pixels, for
                                   evaluation from pixels (``edgeq eval vqa``): pixels (the distinct
                                   images, resized to S), question_image, prompt_ids (-1 at the
                                   visual span), answer_ids (answer + <|im_end|>), texts, qtype;
                                   the form is ``edgeq.files.vqa_questions``
    embed_tokens.npy               the input embedding table [vocab, hidden] (text ids -> inputs_embeds)
    projector.npz                  the trained projector's weights
    metrics.json                   test accuracy (all questions, per type), prior_accuracy, the
                                   training summary, times and the machine
    trained_vlm.json               manifest: sources, settings, layout, versions
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from collections.abc import Sequence

import numpy as np

from edgeq.errors import UserInputError
from edgeq.evaluate.vqa import accuracy_by_type as summarize_correct
from edgeq.files.vqa_questions import write_questions
from edgeq.files.vlm_folder import EMBED_TABLE_FILE, QUESTIONS_FILE, VISION_FILE
from edgeq.files.output_dir import atomic_output_dir
from edgeq.models.easy_vqa import (IGNORE, QUESTION_TYPES, VISUAL, ChatFormat, Question, accuracy_by_type, answer_prior,
                                   image_ids, load_images, load_questions, prior_accuracy, stratified)
from edgeq.models.package_files import dist_version
from edgeq.models.vlm_training import DEFAULT, QUICK, TrainSettings

WITH_PAST_DIR = "with-past"
CALIB_TEXT_TOKENS = 40  # text tokens after the image in each calibration sample
DEFAULT_CALIB_SAMPLES = 32
DEFAULT_EVAL_SAMPLES = 1000
QUICK_EVAL_SAMPLES = 200



def require_training_deps() -> None:
    """One-line errors for every missing piece, before anything slow starts."""
    from edgeq.models.craft_vision import craft_weights_path
    from edgeq.models.easy_vqa import data_dir
    from edgeq.models.hf_export import require_export_deps
    from edgeq.models.smollm2 import gguf_path

    gguf_path()
    craft_weights_path()
    data_dir()
    require_export_deps("gguf", "peft")


def cache_folder(settings: TrainSettings) -> Path:
    """Where a training run with ``settings`` keeps its features, checkpoints and result."""
    from edgeq.textdata import cache_root

    root = cache_root()
    if root is None:
        raise UserInputError("the trained VLM needs a cache folder: EDGEQ_CACHE_DIR is set to an empty string")
    return root / "trained-vlm" / settings.key()


def _load_lm(hf: Path, attn: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation=attn).eval()


def _features(cache: Path, split: str, ids: Sequence[int], settings: TrainSettings, tag: str | None = None) -> np.ndarray:
    """Frozen-encoder features of images ``ids`` of ``split``, cached as ``features-<tag>.npz``
    (``tag`` defaults to the split; rows follow ``ids``)."""
    from edgeq.models.craft_vision import load_vgg_backbone
    from edgeq.models.vlm_training import image_features
    from edgeq.runtime.progress import progress

    path = cache / f"features-{tag or split}.npz"
    if path.is_file():
        with np.load(path) as npz:
            have, feats = npz["ids"], npz["features"]
        where = {int(i): k for k, i in enumerate(have)}
        if all(int(i) in where for i in ids):
            return feats[[where[int(i)] for i in ids]]
    backbone = load_vgg_backbone()
    chunks = []
    step = 256
    for start in progress(range(0, len(ids), step), desc=f"vision encoder ({split})"):
        chunks.append(image_features(load_images(split, ids[start:start + step]), settings.image_size, backbone))
    feats = np.concatenate(chunks)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, ids=np.asarray(ids, np.int64), features=feats)
    os.replace(tmp, path)
    return feats


def prepare(settings: TrainSettings, hf: Path, log=print) -> dict:
    """Train (or resume, or reuse) the model for ``settings`` and measure its test accuracy.

    ``hf``: an fp32 SmolLM2 Hugging Face folder. Returns ``{"cache": folder, "metrics": dict}``;
    the folder holds ``trained.pt`` and ``metrics.json``."""
    import torch

    from edgeq.evaluate.machine import machine_info
    from edgeq.models.vlm_training import VisionLanguageModel, evaluate_questions, merged_language_model, projector_module
    from edgeq.models.vlm_training import train as train_stages

    cache = cache_folder(settings)
    cache.mkdir(parents=True, exist_ok=True)
    metrics_path = cache / "metrics.json"
    if metrics_path.is_file() and (cache / "trained.pt").is_file():
        log(f"trained VLM: cached in {cache}")
        return {"cache": cache, "metrics": json.loads(metrics_path.read_text())}
    (cache / "settings.json").write_text(json.dumps(asdict(settings), indent=1))
    started = time.perf_counter()
    train_q, test_q = load_questions("train"), load_questions("test")
    train_images = image_ids(train_q)
    needed = max(len(train_images) if n is None else min(n, len(train_images))
                 for n in (settings.stage1_images, settings.stage2_images))
    train_images = train_images[:needed]
    eval_rows = stratified(test_q, settings.eval_questions)
    questions = [test_q[i] for i in eval_rows]
    test_images = image_ids(questions)
    t0 = time.perf_counter()
    feats_train = _features(cache, "train", train_images, settings)
    feats_test = _features(cache, "test", test_images, settings)
    seconds = {"vision_features": round(time.perf_counter() - t0, 1)}

    chat = ChatFormat(hf / "tokenizer.json", settings.visual_tokens)
    lm = _load_lm(hf, "sdpa")
    pad_id = int(lm.config.pad_token_id if lm.config.pad_token_id is not None else lm.config.eos_token_id)
    chosen = set(train_images)
    kept = [q for q in train_q if q.image in chosen]
    if not (cache / "trained.pt").is_file():
        log(f"trained VLM: training into {cache} (resumes from its checkpoint if interrupted)")
    stage1_dir = cache.parent / f"stage1-{settings.stage1_key()}"
    summary = train_stages(settings, lm, chat, pad_id, kept, train_images, feats_train, cache, stage1_dir) \
        if not (cache / "trained.pt").is_file() else torch.load(cache / "trained.pt", weights_only=False)["summary"]
    trained = torch.load(cache / "trained.pt", map_location="cpu", weights_only=False)
    merged = merged_language_model(lm, settings, trained["lora"])
    projector = projector_module(merged.config.hidden_size)
    projector.load_state_dict(trained["projector"])
    model = VisionLanguageModel(merged, projector, chat.visual_start, settings.visual_tokens)
    t0 = time.perf_counter()
    correct = evaluate_questions(model, chat, questions, feats_test, {i: k for k, i in enumerate(test_images)}, pad_id)
    seconds["evaluation"] = round(time.perf_counter() - t0, 1)
    seconds["stage1"] = summary["stage1"]["seconds"]
    seconds["stage2"] = summary["stage2"]["seconds"]
    prior = answer_prior(train_q)
    measured = accuracy_by_type(questions, correct)
    baseline = prior_accuracy(prior, questions)
    metrics = {
        "accuracy": measured["accuracy"],
        "prior_accuracy": baseline["accuracy"],
        "questions": measured["questions"],
        "test_questions_total": len(test_q),
        "per_type": {t: {"accuracy": measured["per_type"][t]["accuracy"],
                         "prior_accuracy": baseline["per_type"][t]["accuracy"],
                         "questions": measured["per_type"][t]["questions"]} for t in measured["per_type"]},
        "prior_answers": prior,
        "metric": "exact match of the greedy answer followed by <|im_end|> (teacher-forced argmax, torch, sdpa attention)",
        "training": summary,
        "settings": asdict(settings),
        "seconds": {**seconds, "this_run": round(time.perf_counter() - started, 1)},
        "torch_threads": torch.get_num_threads(),
        "machine": machine_info(),
        "versions": {d: dist_version(d) for d in ("torch", "transformers", "peft", "easy-vqa")},
    }
    metrics_path.write_text(json.dumps(metrics, indent=1))
    log(f"trained VLM: test accuracy {metrics['accuracy']:.4f} (answer prior {metrics['prior_accuracy']:.4f}) "
        f"on {metrics['questions']} questions")
    return {"cache": cache, "metrics": metrics}


# ---------------------------------------------------------------------------------------------
# Samples for the ONNX graphs
# ---------------------------------------------------------------------------------------------


def _visual_tokens(projector, feats: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return projector(torch.from_numpy(feats.astype(np.float32))).numpy()


def _left_padded(rows: Sequence[tuple[list[int], list[int]]], visual: np.ndarray, table: np.ndarray, pad_id: int,
                 visual_start: int) -> tuple[dict, dict]:
    """Model inputs and meta for token rows (``VISUAL`` placeholders) left padded to one length."""
    n, width = len(rows), max(len(ids) for ids, _ in rows)
    v = visual.shape[1]
    hidden = table.shape[1]
    inputs: dict[str, np.ndarray] = {
        "inputs_embeds": np.broadcast_to(table[pad_id], (n, width, hidden)).astype(np.float32),
        "attention_mask": np.zeros((n, width), np.int64),
        "position_ids": np.ones((n, width), np.int64),
        "visual_start": np.zeros(n, np.int64),
        "visual_len": np.full(n, v, np.int64),
    }
    meta = {"text_ids": np.full((n, width), -1, np.int64), "is_visual": np.zeros((n, width), bool),
            "is_pad": np.ones((n, width), bool), "pad_len": np.zeros(n, np.int64),
            "labels": np.full((n, width), IGNORE, np.int64)}
    for r, (ids, labels) in enumerate(rows):
        pad = width - len(ids)
        ids_arr = np.asarray(ids, np.int64)
        text = ids_arr != VISUAL
        emb = np.zeros((len(ids), hidden), np.float32)
        emb[text] = table[ids_arr[text]]
        emb[visual_start:visual_start + v] = visual[r]
        inputs["inputs_embeds"][r, pad:] = emb
        inputs["attention_mask"][r, pad:] = 1
        inputs["position_ids"][r, pad:] = np.arange(len(ids))
        inputs["visual_start"][r] = pad + visual_start
        meta["text_ids"][r, pad:] = np.where(text, ids_arr, -1)
        meta["is_visual"][r, pad + visual_start:pad + visual_start + v] = True
        meta["is_pad"][r, pad:] = False
        meta["pad_len"][r] = pad
        meta["labels"][r, pad:] = labels
    return inputs, meta


def vqa_correct(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per row of a teacher-forced batch: True when every labelled token is the argmax of the
    logits one position earlier (= greedy decoding yields the answer and its ``<|im_end|>``)."""
    target = labels[:, 1:]
    scored = target != IGNORE
    hit = logits[:, :-1].argmax(-1) == target
    return np.where(scored, hit, True).all(axis=1) & scored.any(axis=1)


def vqa_accuracy(session, inputs: dict, meta: dict, batch: int = 8) -> dict:
    """Exact-match accuracy (all and per question type) of an onnxruntime session on eval samples,
    plus the logits at the scored positions (for KL / top-1 against another graph)."""
    names = {i.name for i in session.get_inputs()}
    n = len(meta["labels"])
    correct, scored_logits = [], []
    for start in range(0, n, batch):
        feeds = {k: v[start:start + batch] for k, v in inputs.items() if k in names}
        (logits,) = session.run(["logits"], feeds)
        labels = meta["labels"][start:start + batch]
        correct.extend(vqa_correct(logits, labels).tolist())
        scored_logits.append(logits[:, :-1][labels[:, 1:] != IGNORE])
    out = summarize_correct(correct, [QUESTION_TYPES[int(t)] for t in meta["qtype"]], order=QUESTION_TYPES)
    return {**out, "correct": correct, "logits": np.concatenate(scored_logits)}


def _calibration_rows(chat: ChatFormat, train_q: Sequence[Question], images: Sequence[int]) -> list:
    by_image: dict[int, list[tuple[str, str]]] = {}
    for q in train_q:
        by_image.setdefault(q.image, []).append((q.text, q.answer))
    length = chat.visual_start + chat.visual_tokens + CALIB_TEXT_TOKENS
    rows = []
    for image in images:
        ids, labels = chat.conversation(by_image[image])
        if len(ids) < length:
            raise UserInputError(f"train image {image} has too few questions for a {length}-token calibration sample")
        rows.append((ids[:length], labels[:length]))
    return rows


def _split_prompt(ids: Sequence[int], labels: Sequence[int]) -> tuple[list[int], list[int]]:
    """A one-question conversation cut where its answer starts: (prompt, answer + <|im_end|>)."""
    first = next(p for p, label in enumerate(labels) if label != IGNORE)
    return list(ids[:first]), list(ids[first:])


def write_vqa_questions(path: Path, chat: ChatFormat, questions: Sequence[Question], question_index: Sequence[int],
                        image_size: int) -> Path:
    """``vqa_eval.npz``: ``questions`` of the test split with their images as pixels at ``image_size``
    (the pixels vision.onnx takes) and the prompts / answers eval.npz teacher-forces."""
    from edgeq.models.vlm_training import resize_images

    images = image_ids(questions)
    row_of = {i: k for k, i in enumerate(images)}
    cut = [_split_prompt(*chat.conversation([(q.text, q.answer)])) for q in questions]
    return write_questions(
        path, resize_images(load_images("test", images), image_size), images, [row_of[q.image] for q in questions],
        [p for p, _ in cut], [a for _, a in cut], chat.end[0], [q.text for q in questions],
        [q.answer for q in questions], [q.qtype for q in questions], question_index)


def write_samples(tmp: Path, chat: ChatFormat, projector, table: np.ndarray, pad_id: int, image_size: int,
                  features, calib_samples: int, eval_samples: int) -> dict:
    """calib.npz / eval.npz and their meta files (the composed-VLM contract) and vqa_eval.npz into
    ``tmp``. ``features(split, ids, tag)``: the frozen encoder's features of images ``ids`` of
    ``split`` (the training cache's, or computed)."""
    train_q, test_q = load_questions("train"), load_questions("test")
    all_train = image_ids(train_q)
    # calibration from the far end of the train images (stage 2 of --quick never saw them)
    calib_images = [all_train[i] for i in np.linspace(len(all_train) - 1, len(all_train) // 2, calib_samples).round().astype(int)]
    feats = features("train", calib_images, "calib")
    rows = _calibration_rows(chat, train_q, calib_images)
    inputs, meta = _left_padded(rows, _visual_tokens(projector, feats), table, pad_id, chat.visual_start)
    meta["image_index"] = np.asarray(calib_images, np.int64)
    meta["pad_embedding"] = table[pad_id].copy()
    del meta["labels"], meta["pad_len"]
    calib_len = int(inputs["inputs_embeds"].shape[1])
    np.savez(tmp / "calib.npz", **inputs)
    np.savez(tmp / "calib_meta.npz", **meta)

    picked = stratified(test_q, eval_samples)
    questions = [test_q[i] for i in picked]
    images = image_ids(questions)
    feats = features("test", images, None)
    row_of = {i: k for k, i in enumerate(images)}
    visual = _visual_tokens(projector, feats)[[row_of[q.image] for q in questions]]
    rows = [chat.conversation([(q.text, q.answer)]) for q in questions]
    inputs, meta = _left_padded(rows, visual, table, pad_id, chat.visual_start)
    meta["qtype"] = np.asarray([QUESTION_TYPES.index(q.qtype) for q in questions], np.int64)
    meta["question_index"] = np.asarray(picked, np.int64)
    meta["image_index"] = np.asarray([q.image for q in questions], np.int64)
    meta["pad_embedding"] = table[pad_id].copy()
    np.savez(tmp / "eval.npz", **inputs)
    np.savez(tmp / "eval_meta.npz", **meta)
    write_vqa_questions(tmp / QUESTIONS_FILE, chat, questions, picked, image_size)
    return {"calib": {"samples": calib_samples, "source": "train images (second half), questions as one conversation",
                      "seq_len": calib_len},
            "eval": {"samples": eval_samples, "source": "test questions spread evenly over the split",
                     "seq_len": int(inputs["inputs_embeds"].shape[1]),
                     "questions_per_type": {t: int((meta["qtype"] == k).sum()) for k, t in enumerate(QUESTION_TYPES)}}}


def write_with_past(tmp: Path, decoder, lm_head, table: np.ndarray) -> Path:
    """``tmp/with-past/``: the language model with a KV cache, and beside it what a compile of that
    graph and an evaluation read from its folder (copies of the embedding table, config, tokenizer,
    the npz files and the projector's weights when ``tmp`` has them). ``vision.onnx`` and
    ``vqa_eval.npz`` stay in ``tmp`` (``compile --static`` of a VLM finds them one folder up)."""
    from edgeq.models.kv_export import export_embeds_lm_with_past

    past = tmp / WITH_PAST_DIR
    past.mkdir()
    export_embeds_lm_with_past(decoder, lm_head, past)
    np.save(past / EMBED_TABLE_FILE, table)
    for name in ("config.json", "calib.npz", "calib_meta.npz", "eval.npz", "eval_meta.npz", "projector.npz",
                 *[p.name for p in tmp.iterdir() if p.is_file() and p.name.startswith(("tokenizer", "special_tokens"))]):
        if (tmp / name).is_file():
            shutil.copy2(tmp / name, past / name)
    return past


def load_eval(model_dir: str | os.PathLike) -> tuple[dict, dict]:
    """``(inputs, meta)`` of a trained-VLM folder's eval split."""
    from edgeq.models.composed_vlm import load_split

    inputs, meta = load_split(model_dir, "eval")
    if "labels" not in meta:
        raise UserInputError(f"{model_dir} is not a trained-VLM folder (no labels in eval_meta.npz): "
                             f"edgeq export trained-vlm -o {model_dir}")
    return inputs, meta


# ---------------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------------


def export_trained_vlm(out_dir: str | os.PathLike, quick: bool = False, seed: int = 0,
                       calib_samples: int = DEFAULT_CALIB_SAMPLES, eval_samples: int | None = None,
                       log=print, force: bool = False) -> Path:
    """Train (or reuse the cached training of) the VLM and write the folder; atomic."""
    from dataclasses import replace

    require_training_deps()
    if calib_samples < 1 or (eval_samples is not None and eval_samples < 1):
        raise UserInputError("--calib-samples and --eval-samples must be >= 1")
    settings = replace(QUICK if quick else DEFAULT, seed=seed)
    cache_folder(settings)  # a disabled cache fails here, before any output exists
    eval_samples = eval_samples or (QUICK_EVAL_SAMPLES if quick else DEFAULT_EVAL_SAMPLES)

    import torch

    from edgeq.models.craft_vision import load_vgg_backbone
    from edgeq.models.embeds_export import MODEL_FILE, MODEL_INPUTS, export_embeds_lm, ort_session
    from edgeq.models.hf_export import copy_sidecar_files
    from edgeq.models.smollm2 import save_hf_folder
    from edgeq.models.vision_export import export_vision
    from edgeq.models.vlm_training import merged_language_model, projector_module

    marker = {"export": "trained-vlm", "quick": quick, "seed": seed}
    with atomic_output_dir(out_dir, force=force, marker=marker) as tmp, \
            tempfile.TemporaryDirectory(prefix="edgeq-trained-vlm-") as hf_dir:
        hf = Path(hf_dir)
        save_hf_folder(hf)
        prepared = prepare(settings, hf, log=log)
        cache, metrics = prepared["cache"], prepared["metrics"]
        trained = torch.load(cache / "trained.pt", map_location="cpu", weights_only=False)
        lm = merged_language_model(_load_lm(hf, "eager"), settings, trained["lora"])
        projector = projector_module(lm.config.hidden_size)
        projector.load_state_dict(trained["projector"])
        projector.eval()
        chat = ChatFormat(hf / "tokenizer.json", settings.visual_tokens)
        table = lm.get_input_embeddings().weight.detach().numpy().astype(np.float32)
        pad_id = int(lm.config.pad_token_id if lm.config.pad_token_id is not None else lm.config.eos_token_id)
        shutil.copy2(hf / "config.json", tmp / "config.json")
        copy_sidecar_files(hf, tmp)
        log("trained VLM: writing calibration and evaluation samples")
        samples = write_samples(tmp, chat, projector, table, pad_id, settings.image_size,
                                lambda split, ids, tag: _features(cache, split, ids, settings, tag),
                                calib_samples, eval_samples)
        np.savez(tmp / "projector.npz", **{k: v.numpy() for k, v in trained["projector"].items()})
        log("trained VLM: exporting the vision side (vision.onnx)")
        export_vision(load_vgg_backbone(), projector, settings.image_size, tmp, round_to_float16=True)
        np.save(tmp / EMBED_TABLE_FILE, table)
        log("trained VLM: exporting ONNX (no cache, then with a KV cache)")
        export_embeds_lm(lm.model, lm.lm_head, tmp, lm.config.hidden_size)
        write_with_past(tmp, lm.model, lm.lm_head, table)

        # The exported graph against the torch model: accuracy on eval.npz through onnxruntime.
        inputs, meta = load_eval(tmp)
        onnx_acc = vqa_accuracy(ort_session(tmp / MODEL_FILE), inputs, meta)
        metrics = {**metrics, "onnx_eval_subset": {k: onnx_acc[k] for k in ("accuracy", "questions", "per_type")}}
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=1))
        manifest = {
            "format": 1,
            "description": "LLaVA-style VLM trained on easy-VQA: frozen CRAFT VGG16-BN features -> MLP projector -> "
                           "SmolLM2-135M-Instruct with merged LoRA adapters",
            "settings": asdict(settings), "cache": str(cache),
            "vision": {"encoder": "CRAFT VGG16-BN backbone (craft_mlt_25k.pth), frozen, slice4 output before ReLU",
                       "image_size": settings.image_size, "visual_tokens": settings.visual_tokens,
                       "grid": [settings.image_size // 16] * 2, "token_order": "row-major"},
            "chat_format": "<|im_start|>user\\n[visual]\\n{question}<|im_end|>\\n<|im_start|>assistant\\n{answer}<|im_end|>",
            "visual_start_unpadded": chat.visual_start,
            "samples": samples,
            "onnx": {"file": MODEL_FILE, "inputs": list(MODEL_INPUTS), "outputs": ["logits"],
                     "with_past": f"{WITH_PAST_DIR}/{MODEL_FILE}", "vision": VISION_FILE,
                     "embed_table": EMBED_TABLE_FILE},
            "vqa_questions": QUESTIONS_FILE,
            "accuracy": metrics["accuracy"], "prior_accuracy": metrics["prior_accuracy"],
            "versions": {d: dist_version(d) for d in ("torch", "transformers", "peft", "easy-vqa", "onnx", "onnxruntime")},
        }
        (tmp / "trained_vlm.json").write_text(json.dumps(manifest, indent=1))
        log(f"trained VLM: onnx accuracy on the {onnx_acc['questions']} eval samples {onnx_acc['accuracy']:.4f}")
    return Path(out_dir).resolve()

