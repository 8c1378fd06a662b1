"""``edgeq export random``: real-shaped random LLMs built from a 2-layer skeleton, weights streamed.

The layer replication is checked where it can be exact and cheap, on tiny configs of both families
through the same function the presets use: the L-layer graph is node for node the graph optimum
exports for the L-layer config, and with its weights loaded into transformers both compute the same
logits. One preset goes through the CLI with 2 layers (its 151936-row embedding is real: ~0.6 GB).
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgeq.cli import main
from edgeq.errors import UserInputError
from edgeq.models.random_presets import (DATA_FILE, PRESETS, RANDOM_PRESETS, export_random, preset_config,
                                         write_random_decoder)

pytest.importorskip("transformers")
pytest.importorskip("optimum.exporters.onnx")

LAYERS = 3
BATCH, SEQ = 2, 10


def _tiny_config(family: str):
    """A tiny config keeping what the presets have: llama3 rope scaling and a tied head (llama),
    q/k/v biases (qwen2, untied here so the lm_head initializer path is covered too)."""
    import transformers

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, dtype="float32")
    if family == "llama":
        rope = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=32)
        return transformers.LlamaConfig(architectures=["LlamaForCausalLM"], head_dim=16, rope_theta=500000.0,
                                        rope_scaling=rope, tie_word_embeddings=True, **common)
    return transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], rope_theta=1000000.0, rms_norm_eps=1e-6,
                                    use_sliding_window=False, tie_word_embeddings=False, **common)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_random(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(f"random-{request.param}")
    write_random_decoder(_tiny_config(request.param), out, seed=5)
    return request.param, out


def _feeds(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    mask = np.ones((BATCH, SEQ), dtype=np.int64)
    mask[1, :3] = 0  # left padding on one row
    return {"input_ids": rng.integers(0, vocab, (BATCH, SEQ), dtype=np.int64), "attention_mask": mask,
            "position_ids": np.tile(np.arange(SEQ, dtype=np.int64), (BATCH, 1))}


def _state_dict(model: onnx.ModelProto) -> dict:
    """The transformers state dict held by an optimum-style graph: named initializers as they
    are, each linear's [in, out] MatMul weight transposed back under its module's name."""
    import torch

    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    state = {name: torch.from_numpy(a.copy()) for name, a in arrays.items() if not name.startswith("onnx::")}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in arrays:
            module = node.name.strip("/").removesuffix("/MatMul").replace("/", ".")
            state[f"{module}.weight"] = torch.from_numpy(arrays[node.input[1]].T.copy())
    return state


def test_replicated_graph_computes_what_transformers_computes(tiny_random):
    import torch
    import transformers

    _, out = tiny_random
    path = out / "model.onnx"
    onnx.checker.check_model(str(path))  # path form: checks the external data references too
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.num_hidden_layers == LAYERS
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    state = _state_dict(onnx.load(str(path)))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    reference.load_state_dict(state, strict=True)

    feeds = _feeds(config.vocab_size)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], feeds)[0]
    with torch.no_grad():
        expected = reference(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
    assert logits.shape == (BATCH, SEQ, config.vocab_size)
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits, expected, atol=2e-5, rtol=0)


def _signature(model: onnx.ModelProto) -> dict:
    """What must agree with optimum's own export: the op sequence, every named node and
    initializer (anonymous ``Constant_12``/``onnx::MatMul_34`` only by count and shape), the I/O."""
    anonymous = re.compile(r"^(onnx::)?[A-Za-z]+_\d+$")
    graph = model.graph
    return {
        "ops": [n.op_type for n in graph.node],
        "node names": sorted(n.name for n in graph.node if not anonymous.match(n.name)),
        "initializers": sorted(("<anonymous>" if anonymous.match(t.name) else t.name, tuple(t.dims))
                               for t in graph.initializer),
        "io": [(v.name, str(v.type)) for v in (*graph.input, *graph.output)],
        "opsets": [(o.domain, o.version) for o in model.opset_import],
    }


def test_replicated_graph_is_the_graph_optimum_exports(tiny_random, tmp_path):
    import transformers

    from edgeq.models.hf_export import export_to
    from edgeq.models.tiny import _perturb_defaults

    _, out = tiny_random
    config = transformers.AutoConfig.from_pretrained(out)
    direct = transformers.AutoModelForCausalLM.from_config(config).eval()
    _perturb_defaults(direct)  # else torch folds equal norm scales into Identity nodes
    direct.save_pretrained(tmp_path / "hf")
    (tmp_path / "onnx").mkdir()
    export_to(tmp_path / "hf", tmp_path / "onnx", "text-generation")

    ours = onnx.load(str(out / "model.onnx"), load_external_data=False)
    theirs = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False)
    assert _signature(ours) == _signature(theirs)
    names = [n.name for n in ours.graph.node] + [o for n in ours.graph.node for o in n.output]
    assert len(names) == len(set(names)), "copied layers must not reuse names"


def test_weights_are_streamed_page_aligned_into_one_file(tiny_random):
    _, out = tiny_random
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    spans = []
    for tensor in model.graph.initializer:
        assert tensor.data_location == onnx.TensorProto.EXTERNAL, tensor.name
        info = {e.key: e.value for e in tensor.external_data}
        assert info["location"] == DATA_FILE
        offset, length = int(info["offset"]), int(info["length"])
        assert offset % 4096 == 0 and length == 4 * int(np.prod(tensor.dims))
        spans.append((offset, offset + length))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] == (out / DATA_FILE).stat().st_size
    metadata = {p.key: p.value for p in model.metadata_props}
    assert "never accuracy" in metadata["edgeq.random_weights"]


def test_weights_follow_the_seed(tmp_path):
    config = _tiny_config("llama")
    config.num_hidden_layers = 1
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        (tmp_path / name).mkdir()
        write_random_decoder(config, tmp_path / name, seed=seed)
    data = {name: (tmp_path / name / DATA_FILE).read_bytes() for name in "abc"}
    assert data["a"] == data["b"] and data["a"] != data["c"]
    model = onnx.load(str(tmp_path / "a" / "model.onnx"))
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert abs(arrays["model.norm.weight"].mean() - 1.0) < 0.1  # norm scales around 1
    assert abs(arrays["model.embed_tokens.weight"].std() - 0.02) < 0.002  # transformers' init range


def test_presets_are_the_released_configs():
    """The preset names are an interface; their configs are those of the released checkpoints."""
    assert RANDOM_PRESETS == ("llama-3.2-1b", "llama-3.2-3b", "qwen2.5-0.5b", "qwen2.5-1.5b")
    shapes = {name: (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                     c["num_key_value_heads"], c["vocab_size"]) for name, c in PRESETS.items()}
    assert shapes == {"llama-3.2-1b": (16, 2048, 8192, 32, 8, 128256), "llama-3.2-3b": (28, 3072, 8192, 24, 8, 128256),
                      "qwen2.5-0.5b": (24, 896, 4864, 14, 2, 151936), "qwen2.5-1.5b": (28, 1536, 8960, 12, 2, 151936)}
    config = preset_config("llama-3.2-3b")
    assert config.num_hidden_layers == 28 and config.head_dim == 128 and config.tie_word_embeddings
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 32.0
    assert preset_config("qwen2.5-1.5b", layers=3).num_hidden_layers == 3


def test_cli_exports_a_preset_with_fewer_layers(tmp_path, capsys):
    out = tmp_path / "q"
    code = main(["export", "random", "qwen2.5-0.5b", "--layers", "2", "--seed", "1", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() == str(out.resolve())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "edgeq-export.json", "model.onnx", DATA_FILE]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["num_hidden_layers"] == 2
    assert config["vocab_size"] == 151936 and config["hidden_size"] == 896

    from edgeq.graph import ir

    model = ir.load_model(out / "model.onnx", load_external=False)  # edgeq's loader accepts the layout
    onnx.checker.check_model(str(out / "model.onnx"))
    layers = {m.group(1) for n in model.graph.node if (m := re.search(r"/layers\.(\d+)/", n.name))}
    assert layers == {"0", "1"}
    weights = {t.name for t in model.graph.initializer}
    linears = collections.Counter(n.op_type for n in model.graph.node if n.input[1:2] and n.input[1] in weights)
    assert linears["MatMul"] == 2 * 7  # q, k, v, o, gate, up, down per layer; the tied head reads a Transpose
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], _feeds(config["vocab_size"]))[0]
    assert logits.shape == (BATCH, SEQ, 151936) and np.isfinite(logits).all()


def _user_error(capsys, argv) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    err = _user_error(capsys, ["export", "random", "llama-9b", "-o", str(tmp_path / "x")])
    assert "llama-9b" in err and "qwen2.5-0.5b" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = _user_error(capsys, ["export", "random", "qwen2.5-0.5b", "--layers", "1", "-o", str(blocker / "out")])
    assert "not a folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing half-written
    err = _user_error(capsys, ["export", "random", "qwen2.5-0.5b", "--layers", "0", "-o", str(tmp_path / "x")])
    assert "--layers" in err
    with pytest.raises(UserInputError, match="unknown random preset"):
        export_random("gpt-5", tmp_path / "y")


def test_with_past_graph_is_optimums_and_computes_the_same_logits(tiny_random, tmp_path):
    """``--with-past``: layer 1's cache entries (past_key_values.1.* in, present.1.* out) replicated
    per layer give the graph optimum exports with a KV cache, node for node; with an empty cache
    it computes the no-cache graph's logits (same seed, same weights), and its present entries
    hold the keys and values of every position."""
    import transformers

    from edgeq.models.hf_export import export_to
    from edgeq.models.kv_export import WITH_PAST_TASK
    from edgeq.models.tiny import _perturb_defaults

    family, plain = tiny_random
    config = _tiny_config(family)
    out = tmp_path / "past"
    out.mkdir()
    write_random_decoder(config, out, seed=5, with_past=True)
    direct = transformers.AutoModelForCausalLM.from_config(config).eval()
    _perturb_defaults(direct)
    direct.save_pretrained(tmp_path / "hf")
    (tmp_path / "onnx").mkdir()
    export_to(tmp_path / "hf", tmp_path / "onnx", WITH_PAST_TASK)
    ours = onnx.load(str(out / "model.onnx"), load_external_data=False)
    theirs = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False)
    assert _signature(ours) == _signature(theirs)
    assert [o.name for o in ours.graph.output] == ["logits"] + [f"present.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]

    feeds = _feeds(config.vocab_size)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    empty = np.zeros((BATCH, kv_heads, 0, head_dim), np.float32)
    past = {i.name: empty for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    logits, *present = session.run(None, {**feeds, **past})
    expected = ort.InferenceSession(str(plain / "model.onnx"), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
    assert all(p.shape == (BATCH, kv_heads, SEQ, head_dim) for p in present)
