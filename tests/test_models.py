"""Tests of the model builders: exports load and run in onnxruntime and match PyTorch."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgeq.errors import UserInputError
from edgeq.families import BY_NAME, FAMILIES
from edgeq.models.hf_export import export_hf
from edgeq.models.tiny import TINY_ARCHS, build_tiny

BATCH, SEQ = 2, 8


def _session(model: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])


def _feeds(session: ort.InferenceSession, config: dict, rng: np.random.Generator) -> dict:
    """Random inputs of the right dtype and shape for a tiny export, keyed by input name."""
    feeds = {}
    for inp in session.get_inputs():
        if inp.name == "input_ids":
            feeds[inp.name] = rng.integers(0, config["vocab_size"], (BATCH, SEQ), dtype=np.int64)
        elif inp.name == "attention_mask":
            mask = np.ones((BATCH, SEQ), dtype=np.int64)
            mask[1, :2] = 0  # left padding on one row exercises the mask path
            feeds[inp.name] = mask
        elif inp.name == "position_ids":
            feeds[inp.name] = np.tile(np.arange(SEQ, dtype=np.int64), (BATCH, 1))
        elif inp.name == "token_type_ids":
            feeds[inp.name] = np.zeros((BATCH, SEQ), dtype=np.int64)
        elif inp.name == "pixel_values":
            size = config["image_size"]
            shape = (BATCH, config["num_channels"], size, size)
            feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
        else:
            raise AssertionError(f"unexpected input {inp.name} ({inp.type})")
    return feeds


def _config(model: Path) -> dict:
    return json.loads((model.parent / "config.json").read_text())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_export_runs_and_matches_torch(tiny_models, arch):
    import torch

    model_path = tiny_models[arch]
    assert {"model.onnx", "config.json"} <= {p.name for p in model_path.parent.iterdir()}
    session = _session(model_path)
    config = _config(model_path)
    feeds = _feeds(session, config, np.random.default_rng(0))
    (logits,) = session.run(["logits"], feeds)
    width = len(config["id2label"]) if BY_NAME[arch].task == "image-classification" else config["vocab_size"]
    assert logits.shape[-1] == width and logits.shape[0] == BATCH
    assert np.isfinite(logits).all()

    # The same seed must rebuild the exported weights exactly.
    with torch.no_grad():
        reference = build_tiny(arch, seed=0)(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits
    np.testing.assert_allclose(logits, reference.numpy(), rtol=1e-4, atol=1e-4)


# Linears with a constant weight: per layer (q, k, v, o, gate, up, down) for llama/qwen2/qwen3/gemma,
# (qkv, o, gate_up, down) for phi3, the fused (qkv, proj, fc, proj) Conv1D for gpt2, (q, k, v, o,
# in, out) for opt/phi/bert/vit; plus the heads.
_CONST_LINEARS = {"llama": 2 * 7 + 1, "qwen2": 2 * 7 + 1, "qwen3": 2 * 7 + 1, "gemma2": 2 * 7 + 1,
                  "gemma3": 2 * 7 + 1, "phi3": 2 * 4 + 1, "gpt2": 2 * 4 + 1, "opt": 2 * 6 + 1, "phi": 2 * 6 + 1,
                  "bert": 2 * 6 + 2, "vit": 2 * 6 + 1}
_RMS_ARCHS = tuple(f.name for f in FAMILIES if f.norm == "rms")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_export_has_typical_structure(tiny_models, arch):
    model = onnx.load(str(tiny_models[arch]))
    opset = next(i.version for i in model.opset_import if i.domain in ("", "ai.onnx"))
    assert opset >= 14
    ops = Counter(n.op_type for n in model.graph.node)
    weights = {i.name for i in model.graph.initializer}
    # A tied head reads the embedding through a Transpose; it still counts as a constant weight.
    weights |= {n.output[0] for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in weights}
    const_linears = [
        n for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights
    ]
    assert len(const_linears) == _CONST_LINEARS[arch], ops
    if arch in _RMS_ARCHS:
        assert ops["Pow"] and ops["ReduceMean"] and ops["Sqrt"], "RMSNorm should be decomposed"
    else:
        assert ops["LayerNormalization"] or ops["ReduceMean"], "LayerNorm missing"


def test_export_hf_rejects_missing_folder(tmp_path):
    with pytest.raises(UserInputError, match="not found"):
        export_hf(tmp_path / "nope", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_hf_rejects_folder_without_config(tmp_path):
    (tmp_path / "hf").mkdir()
    with pytest.raises(UserInputError, match="config.json"):
        export_hf(tmp_path / "hf", tmp_path / "out")


def test_export_hf_exports_a_local_folder(tmp_path):
    build_tiny("qwen2", seed=1).save_pretrained(tmp_path / "hf")
    out = export_hf(tmp_path / "hf", tmp_path / "out")
    assert {"model.onnx", "config.json"} <= {p.name for p in out.iterdir()}
    names = [i.name for i in _session(out / "model.onnx").get_inputs()]
    assert names == ["input_ids", "attention_mask", "position_ids"]  # auto means no KV cache


def test_cli_exports_tiny(tmp_path, capsys):
    from edgeq.models.cli import register

    parser = argparse.ArgumentParser(prog="edgeq")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["export", "tiny", "gpt2", "-o", str(tmp_path / "g"), "--seed", "3"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str((tmp_path / "g").resolve())
    assert (tmp_path / "g" / "model.onnx").is_file()
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "tiny", "mamba", "-o", str(tmp_path / "x")])


@pytest.mark.slow
def test_smollm2_greedy_decodes_paris(smollm2_dir):
    from transformers import AutoTokenizer

    assert {"model.onnx", "config.json", "tokenizer.json"} <= {p.name for p in smollm2_dir.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    session = _session(smollm2_dir / "model.onnx")
    # the GGUF says add_bos_token = false and the export keeps its word (transformers then adds none);
    # edgeq's protocol (the tokenizers post-processor, one stream) still leads the file with one BOS
    from edgeq.textdata import load_tokenizer, window_convention

    assert window_convention(smollm2_dir) == "one-stream"
    assert load_tokenizer(smollm2_dir).encode("The capital").ids[0] == tokenizer.bos_token_id
    ids = [tokenizer.bos_token_id] + tokenizer("The capital of France is")["input_ids"]
    prompt_len = len(ids)
    for _ in range(3):
        batch = np.array([ids], dtype=np.int64)
        feeds = {
            "input_ids": batch,
            "attention_mask": np.ones_like(batch),
            "position_ids": np.arange(batch.shape[1], dtype=np.int64)[None],
        }
        (logits,) = session.run(["logits"], feeds)
        ids.append(int(logits[0, -1].argmax()))
    assert tokenizer.decode(ids[prompt_len:]).startswith(" Paris")
