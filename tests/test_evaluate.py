"""Perplexity and model comparison on tiny hand-built ONNX graphs with known answers."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeq.errors import UserInputError
from edgeq.evaluate import compare, perplexity
from edgeq.evaluate.cli import register
from edgeq.runtime.nll import window_nll

pytest.importorskip("tokenizers")
cmpmod = importlib.import_module("edgeq.evaluate.compare")  # the module (the package attr is the function)

V = 12  # vocab of the test tokenizer: [UNK]=0, <s>=1, w0..w9 = 2..11


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path / "cache"))


def save(model: onnx.ModelProto, path) -> str:
    onnx.checker.check_model(model)
    onnx.save_model(model, str(path))
    return str(path)


def make_model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])


def lm_model(emb: np.ndarray, token_inputs: bool = False) -> onnx.ModelProto:
    """logits[b, t] = emb[input_ids[b, t]]; with ``token_inputs`` the mask and position ids are
    inputs too and any mask other than ones shifts the logits by -position."""
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", emb.shape[1]])
    inits = [numpy_helper.from_array(emb.astype(np.float32), "emb")]
    if not token_inputs:
        return make_model([helper.make_node("Gather", ["emb", "input_ids"], ["logits"], axis=0)], [ids], [out], inits)
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])
    pos = helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])
    inits += [numpy_helper.from_array(np.array(1.0, np.float32), "one"), numpy_helper.from_array(np.array([-1]), "ax")]
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["g"], axis=0),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["position_ids"], ["p"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["m", "one"], ["m1"]),
        helper.make_node("Mul", ["m1", "p"], ["z"]),
        helper.make_node("Unsqueeze", ["z", "ax"], ["z3"]),
        helper.make_node("Add", ["g", "z3"], ["logits"]),
    ]
    return make_model(nodes, [ids, mask, pos], [out], inits)


def make_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, **{f"w{i}": i + 2 for i in range(10)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture
def corpus(tmp_path):
    """w0 w1 ... w9 w0 ... (53 words, ids 2..11 cycling) and its tokenizer folder."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 10}" for i in range(53)) + "\n", encoding="utf-8")
    return text, make_tokenizer(tmp_path / "tok")


def next_token_emb(strength: float) -> np.ndarray:
    """Each id i >= 2 puts logit ``strength`` on its successor in the cycle 2..11."""
    emb = np.zeros((V, V), np.float32)
    for i in range(2, V):
        emb[i, 2 + (i - 2 + 1) % 10] = strength
    return emb


# --- perplexity -----------------------------------------------------------------------------


def test_uniform_logits_give_vocab_size(tmp_path, corpus):
    text, tok = corpus
    model = save(lm_model(np.zeros((V, V))), tmp_path / "m.onnx")
    r = perplexity(model, text, tok, seq_len=8)
    assert r["windows"] == 6 and r["seq_len"] == 8
    assert r["tokens"] == 6 * 7
    assert r["ppl"] == pytest.approx(V, rel=1e-9)
    assert r["nll"] == pytest.approx(42 * math.log(V), rel=1e-9)
    assert r["seconds"] >= 0


def test_targets_are_the_next_tokens(tmp_path, corpus):
    text, tok = corpus
    strength = 3.0
    model = save(lm_model(next_token_emb(strength)), tmp_path / "m.onnx")
    r = perplexity(model, text, tok, seq_len=8, windows=3, offset=2)
    # every prediction has logit `strength` on the target and 0 on the V - 1 others
    expected = (math.exp(strength) + V - 1) / math.exp(strength)
    assert r["ppl"] == pytest.approx(expected, rel=1e-6)
    assert r["tokens"] == 3 * 7 and r["windows"] == 3 and r["offset"] == 2


def test_batching_and_token_inputs_do_not_change_the_result(tmp_path, corpus):
    text, tok = corpus
    emb = np.random.default_rng(0).standard_normal((V, V)).astype(np.float32)
    plain = save(lm_model(emb), tmp_path / "a.onnx")
    full = save(lm_model(emb, token_inputs=True), tmp_path / "b.onnx")
    ref = perplexity(plain, text, tok, seq_len=8)
    for model, batch in ((plain, 4), (full, 1), (full, 5)):
        r = perplexity(model, text, tok, seq_len=8, batch_size=batch, threads=1)
        assert r["nll"] == pytest.approx(ref["nll"], rel=1e-6)

    # reference NLL from scratch in float64
    ids = np.array([2 + i % 10 for i in range(48)]).reshape(6, 8)
    logits = emb[ids].astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -sum(logp[w, t, ids[w, t + 1]] for w in range(6) for t in range(7))
    assert ref["nll"] == pytest.approx(nll, rel=1e-6)


def test_window_nll_is_stable_for_huge_logits():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((5, 9)) * 3 + 1e4).astype(np.float32)
    ids = rng.integers(0, 9, 5)
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(-1))
    expected = float(sum(lse[t] - x[t, ids[t + 1]] for t in range(4)))
    got = window_nll(logits.copy(), ids)
    assert math.isfinite(got)
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_ppl_errors(tmp_path, corpus):
    text, tok = corpus
    with pytest.raises(UserInputError, match="model file not found"):
        perplexity(tmp_path / "none.onnx", text, tok, seq_len=8)
    small = save(lm_model(np.zeros((V - 2, V - 2))), tmp_path / "small.onnx")  # ids up to 11 do not fit
    with pytest.raises(UserInputError, match="outside the model's vocab"):
        perplexity(small, text, tok, seq_len=8)
    # logits of the last position only: [batch, vocab]
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", V])
    last = make_model(
        [
            helper.make_node("Gather", ["emb", "input_ids"], ["g"], axis=0),
            helper.make_node("ReduceMean", ["g", "axes"], ["logits"], keepdims=0),
        ],
        [ids],
        [out],
        [numpy_helper.from_array(np.zeros((V, V), np.float32), "emb"), numpy_helper.from_array(np.array([1]), "axes")],
    )
    with pytest.raises(UserInputError, match=r"expected \[batch, seq_len, vocab\]"):
        perplexity(save(last, tmp_path / "last.onnx"), text, tok, seq_len=8)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00not onnx")
    with pytest.raises(UserInputError, match="onnxruntime cannot load"):
        perplexity(junk, text, tok, seq_len=8)
    with pytest.raises(UserInputError, match="batch_size"):
        perplexity(small, text, tok, seq_len=8, batch_size=0)


# --- compare --------------------------------------------------------------------------------

W = np.array([[1, -2, 0, 3], [2, 1, -1, 0], [0, 1, 2, -3]], np.float32)


def mlp_model(scale: float = 1.0, t_name: str = "t", y_shape=(1, 4)) -> onnx.ModelProto:
    """x [1,3] -> Mul 2 -> t -> MatMul (W * scale) -> h -> Relu -> y (optionally reshaped)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))
    inits = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(W * scale, "W"),
        numpy_helper.from_array(np.array(y_shape, np.int64), "yshape"),
    ]
    nodes = [
        helper.make_node("Mul", ["x", "two"], [t_name]),
        helper.make_node("MatMul", [t_name, "W"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Reshape", ["r", "yshape"], ["y"]),
    ]
    return make_model(nodes, [x], [y], inits)


def samples(n=3, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.integers(-4, 5, (1, 3)).astype(np.float32)} for _ in range(n)]


def test_compare_outputs_match_the_analytic_sqnr(tmp_path):
    a = save(mlp_model(), tmp_path / "a.onnx")
    b = save(mlp_model(scale=1.5), tmp_path / "b.onnx")  # y_b = 1.5 y_a exactly (integer data)
    feeds = samples()
    r = compare(a, b, feeds)
    assert r["samples"] == 3 and "layers" not in r
    (out,) = r["outputs"]
    ys = np.concatenate([np.maximum(2 * f["x"] @ W, 0) for f in feeds])
    assert out["name"] == "y" and out["shape"] == [1, 4]
    assert out["sqnr_db"] == pytest.approx(20 * math.log10(2), abs=1e-9)  # err = 0.5 y
    assert out["max_abs"] == pytest.approx(0.5 * np.abs(ys).max())
    assert out["mean_abs"] == pytest.approx(0.5 * np.abs(ys).mean())


def test_identical_models_have_infinite_sqnr(tmp_path):
    a = save(mlp_model(), tmp_path / "a.onnx")
    r = compare(a, a, samples(2), per_layer=True)
    assert r["outputs"][0]["sqnr_db"] == math.inf and r["outputs"][0]["max_abs"] == 0
    assert all(row["sqnr_db"] == math.inf for row in r["layers"])


def test_per_layer_reports_shared_tensors_in_order(tmp_path):
    a = save(mlp_model(), tmp_path / "a.onnx")
    b = save(mlp_model(scale=1.5), tmp_path / "b.onnx")
    r = compare(a, b, samples(), per_layer=True)
    names = [row["name"] for row in r["layers"]]
    assert names == ["t", "h"]  # MatMul input (a Mul output) then the MatMul output; y is an output
    t, h = r["layers"]
    assert t["sqnr_db"] == math.inf and t["op"] == "Mul -> MatMul input"
    assert h["op"] == "MatMul" and h["sqnr_db"] == pytest.approx(20 * math.log10(2), abs=1e-9)
    assert r["layers_available"] == 2
    # a tensor B does not have under the same name is skipped
    b2 = save(mlp_model(scale=1.5, t_name="t_renamed"), tmp_path / "b2.onnx")
    r2 = compare(a, b2, samples(), per_layer=True)
    assert [row["name"] for row in r2["layers"]] == ["h"]


def test_max_layers_keeps_evenly_spaced_tensors():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])
    eye = numpy_helper.from_array(np.eye(2, dtype=np.float32), "I")
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", "I"], [f"h{i}"]) for i in range(5)]
    nodes.append(helper.make_node("Identity", ["h4"], ["y"]))
    model = make_model(nodes, [x], [y], [eye])
    chosen, total = cmpmod.select_layers(model, model, max_layers=3)
    assert total == 5
    assert [n for n, _ in chosen] == ["h0", "h2", "h4"]


def test_streamed_statistics_equal_the_direct_ones(monkeypatch):
    rng = np.random.default_rng(2)
    refs = [rng.standard_normal((3, 7)).astype(np.float32) for _ in range(3)]
    tests = [r + rng.standard_normal(r.shape).astype(np.float32) * 0.1 for r in refs]
    monkeypatch.setattr(cmpmod, "_CHUNK", 4)  # several chunks per sample
    st = cmpmod.ErrorStats()
    for r, t in zip(refs, tests):
        st.update(r, t)
    res = st.result()
    ref = np.concatenate(refs).astype(np.float64)
    err = np.concatenate(tests).astype(np.float64) - ref
    assert res["max_abs"] == pytest.approx(np.abs(err).max())
    assert res["mean_abs"] == pytest.approx(np.abs(err).mean())
    assert res["sqnr_db"] == pytest.approx(10 * math.log10((ref**2).sum() / (err**2).sum()))


def test_compare_shape_mismatch_and_renamed_outputs(tmp_path):
    a = save(mlp_model(), tmp_path / "a.onnx")
    b = save(mlp_model(y_shape=(4, 1)), tmp_path / "b.onnx")
    (out,) = compare(a, b, samples(1))["outputs"]
    assert "shape mismatch" in out["problem"] and "sqnr_db" not in out
    renamed = mlp_model()
    renamed.graph.node[-1].output[0] = "z"
    renamed.graph.output[0].name = "z"
    (out,) = compare(a, save(renamed, tmp_path / "z.onnx"), samples(1))["outputs"]
    assert out["name"] == "y" and out["name_b"] == "z" and out["sqnr_db"] == math.inf


def test_compare_input_errors(tmp_path):
    a = save(mlp_model(), tmp_path / "a.onnx")
    with pytest.raises(UserInputError, match="needs input 'x'"):
        compare(a, a, [{"q": np.zeros((1, 3), np.float32)}])
    with pytest.raises(UserInputError, match="at least one input sample"):
        compare(a, a, [])
    with pytest.raises(UserInputError, match="model file not found"):
        compare(a, tmp_path / "nope.onnx", samples(1))


def test_compare_builds_feeds_from_session_specs(tmp_path):
    a = save(mlp_model(), tmp_path / "a.onnx")
    seen = []

    def build(specs):
        seen.append([(s.name, s.type, s.shape) for s in specs])
        return samples(1)

    compare(a, a, build)
    assert seen == [[("x", "tensor(float)", [1, 3])]]


# --- CLI ------------------------------------------------------------------------------------


def run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="edgeq")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr().out


def test_cli_ppl_line_and_json(tmp_path, corpus, capsys):
    text, tok = corpus
    model = save(lm_model(np.zeros((V, V))), tmp_path / "m.onnx")
    base = ["eval", "ppl", model, "--text", str(text), "--tokenizer", str(tok), "--seq-len", "8", "--windows", "2"]
    code, out = run_cli(base, capsys)
    assert code == 0
    assert re.fullmatch(r"ppl 12\.000 over 14 tokens \(2 windows of 8\) in \d+\.\d s\n", out)
    code, out = run_cli(base + ["--json", "--offset", "1"], capsys)
    data = json.loads(out)
    assert data["ppl"] == pytest.approx(V) and data["tokens"] == 14 and data["offset"] == 1


def test_cli_compare_random_text_and_npz(tmp_path, corpus, capsys):
    a = save(mlp_model(), tmp_path / "a.onnx")
    b = save(mlp_model(scale=1.5), tmp_path / "b.onnx")
    code, out = run_cli(["eval", "compare", a, b, "--random", "2", "--layers", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["samples"] == 2
    assert data["outputs"][0]["sqnr_db"] == pytest.approx(20 * math.log10(2), abs=1e-4)
    code, out = run_cli(["eval", "compare", a, a, "--random", "1", "--json"], capsys)
    assert json.loads(out)["outputs"][0]["sqnr_db"] == "inf"  # JSON has no inf
    code, out = run_cli(["eval", "compare", a, b, "--layers"], capsys)
    assert "outputs:" in out and "layers (2 of 2 shared):" in out and "6.02" in out

    npz = tmp_path / "x.npz"
    np.savez(npz, x=np.ones((3, 1, 3), np.float32))
    code, out = run_cli(["eval", "compare", a, b, "--npz", str(npz), "--json"], capsys)
    assert json.loads(out)["samples"] == 3

    text, tok = corpus
    ma = save(lm_model(np.zeros((V, V))), tmp_path / "la.onnx")
    mb = save(lm_model(np.ones((V, V))), tmp_path / "lb.onnx")
    code, out = run_cli(
        ["eval", "compare", ma, mb, "--text", str(text), "--tokenizer", str(tok), "--seq-len", "8", "--windows", "3", "--json"],
        capsys,
    )
    data = json.loads(out)
    assert data["samples"] == 3 and data["outputs"][0]["sqnr_db"] == "-inf"  # zero reference
    assert data["outputs"][0]["max_abs"] == 1.0
    with pytest.raises(UserInputError, match="--text needs --tokenizer"):
        run_cli(["eval", "compare", ma, mb, "--text", str(text)], capsys)


def _qdq_lm(w_codes: np.ndarray) -> onnx.ModelProto:
    """logits = DQ(Q(emb[ids])) @ DQ(W): uint8 activations (zero point 128) x int8 weight codes,
    the pattern onnxruntime's CPU provider fuses into MatMulIntegerToFloat."""
    rng = np.random.default_rng(0)
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", V])
    inits = [numpy_helper.from_array(rng.normal(size=(V, 16)).astype(np.float32), "emb"),
             numpy_helper.from_array(np.array(0.05, np.float32), "xs"), numpy_helper.from_array(np.array(128, np.uint8), "xz"),
             numpy_helper.from_array(w_codes.astype(np.int8), "wq"), numpy_helper.from_array(np.array(0.01, np.float32), "ws"),
             numpy_helper.from_array(np.array(0, np.int8), "wz")]
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["x"], axis=0),
             helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"]),
             helper.make_node("MatMul", ["xd", "wd"], ["logits"], name="head")]
    return make_model(nodes, [ids], [out], inits)


@pytest.mark.parametrize("codes, at_risk", [(np.full((16, V), 100), ["head"]), (np.full((16, V), 64), [])])
def test_cli_kernel_check_names_linears_onnxruntime_runs_at_risk(tmp_path, corpus, capsys, codes, at_risk):
    """--kernel-check asks onnxruntime which linears it fused into uint8 x int8 kernels: adjacent
    same-sign codes 100 + 100 > 128 can saturate VPMADDUBSW's int16, 64 + 64 cannot."""
    text, tok = corpus
    model = save(_qdq_lm(codes), tmp_path / "m.onnx")
    code, out = run_cli(["eval", "ppl", model, "--text", str(text), "--tokenizer", str(tok), "--seq-len", "8",
                         "--windows", "2", "--kernel-check", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["ort_u8s8_linears"] == 1 and data["ort_u8s8_at_risk"] == at_risk
    assert "ppl_exact_qdq" in data
