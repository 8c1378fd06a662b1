"""Hand-built toy models and data for CLI and pipeline tests (no torch needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from edgeq.graph import ir

VOCAB = 64
WORDS = [f"w{i}" for i in range(VOCAB - 1)]


def toy_lm(opset: int = 18, hidden: int = 16, seed: int = 0):
    """input_ids -> Gather -> MatMul -> Relu -> MatMul -> logits: two linears, one vocab head."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((VOCAB, hidden)).astype(np.float32), "embed"),
        numpy_helper.from_array(rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.3, "w1"),
        numpy_helper.from_array(rng.standard_normal((hidden, VOCAB)).astype(np.float32) * 0.3, "w2"),
    ]
    nodes = [
        helper.make_node("Gather", ["embed", "input_ids"], ["h0"], name="embed_gather"),
        helper.make_node("MatMul", ["h0", "w1"], ["h1"], name="fc1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="act"),
        helper.make_node("MatMul", ["h2", "w2"], ["logits"], name="lm_head"),
    ]
    graph = helper.make_graph(
        nodes, "toy", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", VOCAB])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def write_tokenizer(folder: Path) -> Path:
    """A whitespace WordLevel tokenizer over WORDS, saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def write_text(path: Path, n_words: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text(" ".join(rng.choice(WORDS, size=n_words)) + "\n")
    return path


def toy_model_dir(folder: Path, opset: int = 18) -> Path:
    """A model folder as `edgeq export` writes it: model.onnx (+ data) and tokenizer.json."""
    ir.save_model(toy_lm(opset), folder / "model.onnx", size_threshold=0)
    write_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return folder / "model.onnx"


def toy_with_calib(tmp_path: Path) -> tuple[Path, Path]:
    """(TMP/toy/model.onnx as ``toy_model_dir`` writes it, TMP/calib.txt of 400 words)."""
    return toy_model_dir(tmp_path / "toy"), write_text(tmp_path / "calib.txt", 400)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``edgeq.cli.main`` on ``argv`` (each str()-ed): (exit code, stderr stripped, stdout)."""
    from edgeq.cli import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err.strip(), captured.out


def set_external_location(model_path: Path, location: str) -> None:
    """Point every external initializer of the saved model at ``location`` (data not moved)."""
    import onnx

    model = onnx.load_model(str(model_path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save_model(model, str(model_path))


def random_feeds(input_specs, seed: int = 0, batch: int = 1, seq: int = 16) -> dict[str, np.ndarray]:
    """Plausible random inputs from onnxruntime input specs (ids, masks, positions, pixels)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in input_specs:
        if spec.name == "pixel_values":  # tiny ViT exports: 3 channels, 32 x 32 images
            symbolic = [batch, 3, 32, 32]
        else:
            symbolic = [batch] + [seq] * (len(spec.shape) - 1)
        shape = [d if isinstance(d, int) else symbolic[i] for i, d in enumerate(spec.shape)]
        if "int" in spec.type:
            dtype = np.int64 if "int64" in spec.type else np.int32
            if "mask" in spec.name:
                value = np.ones(shape, dtype)
            elif "position" in spec.name:
                value = np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
            elif "token_type" in spec.name:
                value = np.zeros(shape, dtype)
            else:
                value = rng.integers(0, 32, shape).astype(dtype)
        else:
            value = rng.standard_normal(shape).astype(np.float32)
        feeds[spec.name] = value
    return feeds


def single_linear(k: int, n: int, seed: int = 0):
    """x [b, t, k] -> MatMul (node 'lin', random weight 'w' [k, n]) -> y; returns (model, w)."""
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="lin")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "t", n])],
                          [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9), w


def qwen_vl_feeds(rows, seed: int = 0, visual_gain: float = 1.0) -> dict[str, np.ndarray]:
    """Left-padded "text, image, text" rows ``(prefix, (h, w), suffix)`` with Qwen2-VL M-RoPE ids;
    pads get ``position_ids`` 1 (``generate``'s convention) and ``attention_mask`` 0.
    ``visual_gain`` scales four channels of the visual embeddings (a modality with outlier channels,
    so a wider range even after RMSNorm, for MSQ)."""
    from edgeq.models.tiny_qwen2vl import HIDDEN, mrope_position_ids

    rng = np.random.default_rng(seed)
    lengths = [p + g[0] * g[1] + q for p, g, q in rows]
    batch, seq = len(rows), max(lengths)
    feeds = {
        "inputs_embeds": rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32),
        "attention_mask": np.zeros((batch, seq), np.int64),
        "position_ids": np.ones((3, batch, seq), np.int64),
        "visual_start": np.zeros(batch, np.int64),
        "visual_len": np.zeros(batch, np.int64),
    }
    for r, ((prefix, grid, suffix), length) in enumerate(zip(rows, lengths)):
        pad = seq - length
        feeds["attention_mask"][r, pad:] = 1
        feeds["position_ids"][:, r, pad:] = mrope_position_ids(prefix, grid, suffix)
        feeds["visual_start"][r] = pad + prefix
        feeds["visual_len"][r] = grid[0] * grid[1]
        feeds["inputs_embeds"][r, pad + prefix:pad + prefix + grid[0] * grid[1], :4] *= visual_gain
    return feeds
