"""``edgeq compile --static``: the static prefill/decode pair (issue 22).

Structure and exactness on the tiny llama with a KV cache (seeded random weights, never accuracy):
every value's shape is static after onnx shape inference, no Shape/Range/ConstantOfShape/NonZero/
If/IsNaN is left, the pair greedily generates the dynamic graph's tokens (including a prompt longer
than the prefill length), both graphs hold one copy of the weights, quantized pairs reach the
QNN-like target, and the int8 KV cache is int8 at the graph boundary. The same token equality on
real SmolLM2 is in ``test_smollm2_static_tokens_equal_dynamic`` (slow).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgeq.cli import main
from edgeq.generation import generate, open_decoder
from edgeq.static.specialize import check_static, describe, parse_static

PREFILL, CONTEXT = 8, 48
REPO = Path(__file__).resolve().parents[1]
ROLES = ("prefill", "decode")


def _compile(tiny_past: Path, out: Path, recipe: str, *extra: str) -> int:
    return main(["compile", str(tiny_past / "model" / "model.onnx"), "--recipe", recipe, "--calib",
                 str(tiny_past / "calib.txt"), "--seq-len", "32", "--calib-windows", "2", "--no-cache",
                 "--static", f"prefill={PREFILL},context={CONTEXT}", "-o", str(out), *extra])


@pytest.fixture(scope="module")
def pairs(tiny_past, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for recipe in ("fp32", "mquant-w8a8", "mquant-w8a8-kv8", "gptq-w4a16"):
        folder = tmp_path_factory.mktemp(f"static-{recipe}")
        assert _compile(tiny_past, folder / "out", recipe) == 0
        out[recipe] = folder / "out"
    return out


def _greedy(path, prompt, steps: int) -> list[int]:
    return generate(open_decoder(path, optimize=False), prompt, max_new_tokens=steps).tokens


@pytest.mark.parametrize("recipe", ["fp32", "mquant-w8a8", "mquant-w8a8-kv8", "gptq-w4a16"])
def test_every_shape_static_and_no_shape_ops(pairs, recipe):
    for role in ROLES:
        model = onnx.load(str(pairs[recipe] / f"{role}.onnx"))
        assert check_static(model) == []
        meta = describe(model)
        assert meta["role"] == role and meta["prefill"] == PREFILL and meta["context"] == CONTEXT
        width = PREFILL if role == "prefill" else 1
        dims = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in (*model.graph.input, *model.graph.output)}
        assert dims["input_ids"] == [1, width] and dims["attention_mask"] == [1, CONTEXT + width]
        heads, dim = meta["kv_heads"], meta["head_dim"]
        assert dims["past_key_values.0.key"] == [1, heads, CONTEXT, dim]
        # grouped-query attention reads the cache per KV head: no repeat_kv Expand of it is left
        # (the tiny llama has 4 query heads over 2 KV heads; the logits tests prove it exact)
        grouped = [n for n in model.graph.node if n.name.endswith("/group_queries")]
        assert len(grouped) == 2 * meta["layers"]
        assert dims["present.0.value"] == [1, heads, width, dim]


def test_matmulnbits_pair_keeps_its_4bit_weights(pairs):
    """gptq-w4a16's com.microsoft MatMulNBits has no onnx shape function: onnxruntime's symbolic
    inference gives its shapes, so the folding still reaches every Shape node."""
    for role in ROLES:
        model = onnx.load(str(pairs["gptq-w4a16"] / f"{role}.onnx"), load_external_data=False)
        assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 7 * describe(model)["layers"]


def test_check_static_flags_a_dynamic_graph(tiny_past):
    lines = check_static(onnx.load(str(tiny_past / "model" / "model.onnx")))
    assert any("Shape is not allowed" in line for line in lines)
    assert any("shape not static" in line for line in lines)


def test_fp32_pair_generates_the_dynamic_graphs_tokens(pairs, tiny_past):
    rng = np.random.default_rng(0)
    for length in (3, PREFILL, 2 * PREFILL + 3):  # shorter than, equal to, and longer than the prefill
        prompt = rng.integers(1, 60, size=length).tolist()
        reference = _greedy(tiny_past / "model" / "model.onnx", prompt, 20)
        assert _greedy(pairs["fp32"], prompt, 20) == reference


def test_pair_logits_match_dynamic_graph_within_fp32_tolerance(pairs, tiny_past):
    prompt = list(range(5, 5 + 2 * PREFILL + 1))
    dynamic = open_decoder(tiny_past / "model" / "model.onnx", optimize=False)
    static = open_decoder(pairs["fp32"], optimize=False)
    np.testing.assert_allclose(static.prefill(prompt), dynamic.prefill(prompt), atol=1e-4, rtol=1e-4)
    for token in (7, 11, 13):
        np.testing.assert_allclose(static.step(token), dynamic.step(token), atol=1e-4, rtol=1e-4)


def test_weights_are_stored_once_for_both_graphs(pairs):
    folder = pairs["mquant-w8a8"]
    assert sorted(p.name for p in folder.glob("*.data")) == ["weights.data"]
    referenced = {}
    for role in ROLES:
        model = onnx.load(str(folder / f"{role}.onnx"), load_external_data=False)
        for t in model.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                info = {e.key: e.value for e in t.external_data}
                assert info["location"] == "weights.data"
                referenced.setdefault(role, set()).add((int(info["offset"]), int(info["length"])))
    shared = referenced["prefill"] & referenced["decode"]
    size = (folder / "weights.data").stat().st_size
    both = sum(length for _, length in referenced["prefill"] | referenced["decode"])
    assert shared and both <= size < both + 4096 * len(referenced["prefill"] | referenced["decode"])
    report = json.loads((folder / "report.json").read_text())
    assert report["static"]["weights"]["shared"] == len(shared)


def test_both_graphs_carry_the_same_quantization(pairs):
    folder = pairs["mquant-w8a8"]
    encodings = json.loads((folder / "encodings.json").read_text())
    assert encodings["weights"] and encodings["activations"]
    from edgeq.quantize.qdq_encodings import collect_encodings

    for role in ROLES:
        model = onnx.load(str(folder / f"{role}.onnx"))
        assert json.loads(json.dumps(collect_encodings(model))) == encodings


def test_int8_kv_cache_is_int8_at_the_boundary(pairs, tiny_past):
    folder = pairs["mquant-w8a8-kv8"]
    for role in ROLES:
        model = onnx.load(str(folder / f"{role}.onnx"), load_external_data=False)
        types = {vi.name: vi.type.tensor_type.elem_type for vi in (*model.graph.input, *model.graph.output)}
        assert types["past_key_values.1.value"] == onnx.TensorProto.INT8
        assert types["present.1.key"] == onnx.TensorProto.INT8
        assert describe(model)["cache_dtype"] == "int8"
    scales = json.loads((folder / "report.json").read_text())["static"]["kv_scales"]
    assert set(scales) == {f"{i}.{kv}" for i in range(2) for kv in ("key", "value")}
    prompt = list(range(3, 3 + PREFILL + 2))
    float_cache = _greedy(pairs["mquant-w8a8"], prompt, 8)
    assert len(_greedy(folder, prompt, 8)) == len(float_cache)


@pytest.mark.parametrize("recipe", ["mquant-w8a8", "w8a16"])
def test_quantized_pairs_reach_the_qnn_like_target(tiny_past, tmp_path, recipe, capsys):
    assert _compile(tiny_past, tmp_path / "out", recipe, "--target", "qnn-htp") == 0
    assert "clean (both graphs)" in capsys.readouterr().out
    for role in ROLES:
        assert main(["check", str(tmp_path / "out" / f"{role}.onnx"), "--target", "qnn-htp"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(report["target"]["check"]) == {"prefill.onnx", "decode.onnx"}


def test_qnn_target_refuses_the_dynamic_graph(tiny_past, capsys):
    assert main(["check", str(tiny_past / "model" / "model.onnx"), "--target", "qnn-htp"]) != 0  # (the vendor, if installed)
    capsys.readouterr()
    assert main(["check", str(tiny_past / "model" / "model.onnx"), "--target", "qnn-htp", "--profile-only"]) != 0
    assert "is not static" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["prefill=128", "prefill=8,context=8", "prefill=x,context=9", "context=9,prefill=2,x=1", ""])
def test_bad_static_option_is_refused(text):
    from edgeq.errors import UserInputError

    with pytest.raises(UserInputError):
        parse_static(text)


def test_static_needs_a_kv_cache_export(tmp_path, tiny_models, capsys):
    code = main(["compile", str(tiny_models["llama"]), "--recipe", "fp32", "--static", "prefill=8,context=48",
                 "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--with-past" in err[0]
    assert not (tmp_path / "out").exists()


def test_bad_static_string_exits_2_before_work(tiny_past, tmp_path, capsys):
    assert _compile(tiny_past, tmp_path / "out", "fp32", "--static", "prefill=64,context=32") == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_static_pair_survives_a_copy_of_its_folder(pairs, tmp_path):
    """The pair references only files inside its folder: moved elsewhere, it still runs."""
    moved = tmp_path / "moved"
    shutil.copytree(pairs["fp32"], moved)
    prompt = [5, 6, 7]
    assert _greedy(moved, prompt, 4) == _greedy(pairs["fp32"], prompt, 4)


@pytest.mark.slow
def test_smollm2_static_tokens_equal_dynamic(smollm2_past_dir, tmp_path):
    """Real weights: 8 prompts x 64 greedy tokens, one prompt longer than the prefill length."""
    from edgeq.textdata import load_tokenizer

    out = tmp_path / "pair"
    assert main(["compile", str(smollm2_past_dir / "model.onnx"), "--recipe", "fp32", "--static",
                 "prefill=32,context=256", "-o", str(out)]) == 0
    tok = load_tokenizer(smollm2_past_dir)
    lines = [line for line in (REPO / "data" / "wikitext-2" / "test.txt").read_text().splitlines()
             if line.strip() and not line.strip().startswith("=")]
    # 7 short prompts and one of about 100 tokens: longer than the prefill (32), within the context
    prompts = [" ".join(line.split()[:12]) for line in lines[:7]] + [" ".join(" ".join(lines[7:12]).split()[:80])]
    dynamic = open_decoder(smollm2_past_dir / "model.onnx", optimize=False)
    static = open_decoder(out, optimize=False)
    for text in prompts:
        ids = tok.encode(text).ids
        assert generate(static, ids, 64).tokens == generate(dynamic, ids, 64).tokens, text
    assert len(tok.encode(prompts[-1]).ids) > 32




@pytest.fixture(scope="module")
def with_past_compiled(tiny_past, tmp_path_factory) -> dict[str, Path]:
    """The with-past graph each quantized pair is specialized from, compiled alone (same recipe, windows)."""
    out = {}
    for recipe in ("mquant-w8a8", "mquant-w8a8-kv8"):
        folder = tmp_path_factory.mktemp(f"past-{recipe}")
        assert main(["compile", str(tiny_past / "model" / "model.onnx"), "--recipe", recipe, "--calib",
                     str(tiny_past / "calib.txt"), "--seq-len", "32", "--calib-windows", "2", "--no-cache",
                     "-o", str(folder / "out")]) == 0
        out[recipe] = folder / "out" / "model.onnx"
    return out


def _logit_error(pair: Path, past: Path) -> float:
    """max |pair - with-past| over a prefill longer than the pair's and three decode steps, in units of
    max |logit|; exact QDQ on both sides (no integer-kernel fusion), so only the pair's own changes show."""
    prompt = list(range(5, 5 + 2 * PREFILL + 1))
    static, dynamic = open_decoder(pair, exact_qdq=True), open_decoder(past, exact_qdq=True)
    pairs = [(static.prefill(prompt), dynamic.prefill(prompt))]
    pairs += [(static.step(t), dynamic.step(t)) for t in (7, 11, 13)]
    return max(float(np.abs(a - b).max()) / float(np.abs(b).max()) for a, b in pairs)


def test_quantized_pair_matches_its_own_with_past_graph(pairs, with_past_compiled):
    """mquant-w8a8: the pair is its with-past graph specialized (same Q/DQ, float cache): equal up to
    float summation order."""
    assert _logit_error(pairs["mquant-w8a8"], with_past_compiled["mquant-w8a8"]) < 1e-4


def test_int8_kv_pair_within_cache_quantization_noise_of_its_graph(pairs, with_past_compiled):
    """mquant-w8a8-kv8: the pair's cache is int8 (per-head scales from calibration), the with-past graph's
    float: the logits differ by the cache's rounding only, measured ~1e-2 of max|logit| here."""
    err = _logit_error(pairs["mquant-w8a8-kv8"], with_past_compiled["mquant-w8a8-kv8"])
    assert 1e-6 < err < 0.05, err


def test_shape_of_a_constant_too_large_to_fold_through_is_folded():
    """A ``Shape`` reading a constant over the folding limit (Llama-3.2-1B's dense 8192 x 8192 online
    Hadamard, 256 MB) becomes the constant shape without the constant being evaluated or copied."""
    from onnx import TensorProto, helper

    from edgeq.static import specialize

    n = 300  # 90,000 elements: over _LARGE_CONSTANT
    assert n * n > specialize._LARGE_CONSTANT
    big = onnx.numpy_helper.from_array(np.ones((n, n), np.float32), "h")
    nodes = [helper.make_node("Shape", ["h"], ["s"], start=1), helper.make_node("Reshape", ["x", "s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [big])
    folded = specialize._fold(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert [node.op for node in folded.nodes] == ["Reshape"]
    assert folded.nodes[0].inputs[1].values.tolist() == [n]


def test_a_kv_cache_graph_without_position_ids_is_named(tiny_past):
    """optimum's Gemma export takes no position_ids (it derives positions from the cache length, which a
    fixed-size cache makes wrong): refused with a line that says so, not "export it with --with-past"."""
    from edgeq.errors import UserInputError
    from edgeq.static.specialize import cache_layout

    model = onnx.load(str(tiny_past / "model" / "model.onnx"), load_external_data=False)
    kept = [vi for vi in model.graph.input if vi.name != "position_ids"]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    with pytest.raises(UserInputError, match=r"needs the token positions as an input \(position_ids\)") as info:
        cache_layout(model, 8, 48)
    assert "\n" not in str(info.value) and "--with-past`" not in str(info.value)


def test_fold_static_drops_the_nan_guards_when_asked(tiny_models):
    """A decoder without a cache at a fixed shape (benchmarks/htp_fixed_graph.py): folded static, the
    exporter's Where(IsNaN(softmax)) guards dropped as the pair drops them; without the option they
    stay and the graph is refused (IsNaN is not an op a static graph may hold)."""
    from edgeq.static.specialize import fold_static

    def fixed():
        model = onnx.load(str(tiny_models["llama"]))
        for vi in model.graph.input:
            for dim, value in zip(vi.type.tensor_type.shape.dim, [1, 16]):
                dim.Clear()
                dim.dim_value = value
        return model

    folded = fold_static(fixed(), drop_nan_guards=True)
    assert not [n for n in folded.graph.node if n.op_type in ("IsNaN", "Shape", "Range")]
    with pytest.raises(RuntimeError, match="IsNaN"):
        fold_static(fixed())


def test_static_stages_are_recorded_dumped_and_verified(tiny_past, tmp_path):
    """The specialization's steps are named stages: each graph's in report.json (time, ops added and
    removed), and under --dump-each / --verify saved and checked like the passes."""
    dumps = tmp_path / "dumps"
    assert _compile(tiny_past, tmp_path / "out", "w8a8", "--verify", "--dump-each", str(dumps)) == 0
    stages = json.loads((tmp_path / "out" / "report.json").read_text())["static"]["stages"]
    assert set(stages) == {"prefill.onnx", "decode.onnx"}
    for graph, records in stages.items():
        names = [r["name"] for r in records]
        assert names == ["fix-shapes-and-fold", "drop-nan-guards", "new-entries-as-outputs", "group-queries"], names
        assert all(r["verified"] for r in records[1:]) and all(r["seconds"] >= 0 for r in records)
        assert records[0]["ops_removed"], graph  # the fold takes the shape machinery out
        role = graph.removesuffix(".onnx")
        assert sorted(p.name for p in dumps.glob(f"static-{role}-*.onnx")) == [
            f"static-{role}-{i:02d}_{name}.onnx" for i, name in enumerate(names[1:], start=2)]
    assert "route_stages" not in json.loads((tmp_path / "out" / "report.json").read_text())  # (no target: none)
