"""Model families beyond Llama (issue 20): every tiny family's structure is recognised from data
flow, the float rewrites (fuse-norms, ln-to-rms, rotate) keep its outputs within the FLOAT_EQUIV
tolerance, and every representative recipe either compiles it with all its essential passes
applied or exits non-zero with a one-line reason; no recipe exits 0 with an essential pass
skipped. Also: the essential-pass contract (exit 4, ``--allow-partial``, ``essential`` must be a
boolean) and ``edgeq export hf`` on each family with tied and untied heads.

What each family exercises:
- qwen3: per-head q/k RMSNorms inside attention (not stream norms: left alone);
- gemma2 / gemma3: sandwich norms (post-sublayer norms on the write path, rotated online), ``1 + w``
  RMSNorm, embedding times sqrt(hidden), tied head (gemma2: soft-capped logits; gemma3: q/k norms);
- phi3: fused qkv_proj and gate_up_proj;
- opt: LayerNorm with bias, learned positions, ``[b, s, h] -> [b * s, h]`` Reshapes on the stream;
- phi (Phi-2): parallel attention + MLP reading one LayerNorm, two writers summed into one add.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from toy import random_feeds

from edgeq import ir
from edgeq.cli import main
from edgeq.passbase import FLOAT_EQUIV_RTOL, PassContext
from edgeq.passes.methods.stream import analyze_stream
from edgeq.passes.methods.weights import is_weightless
from edgeq.pipeline import Pipeline
from edgeq.recipes import load_recipe
from edgeq.registry import get_pass
from edgeq.structure import analyze

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2", "opt", "phi")
CHAIN = ["fuse-norms", "ln-to-rms", "rotate"]

# family -> (stream readers, stream writers, post-sublayer norms, norms outside the stream)
STREAM = {
    "llama": (11, 4, 0, 0), "qwen2": (11, 4, 0, 0),
    "qwen3": (11, 4, 0, 4),  # q_norm, k_norm per layer
    "gemma2": (11, 0, 4, 0),  # o_proj and down_proj feed post norms: no direct writer
    "gemma3": (11, 0, 4, 4),
    "phi3": (5, 4, 0, 0),  # qkv, gate_up per layer + head
    "gpt2": (5, 4, 0, 0), "opt": (9, 4, 0, 0),
    "phi": (9, 4, 0, 0),  # q, k, v, fc1 read one norm per layer
}


def _close(reference, got):
    for ref, new in zip(reference, got):
        scale = max(float(np.abs(ref).max()), 1.0)
        np.testing.assert_allclose(new, ref, rtol=0, atol=FLOAT_EQUIV_RTOL * scale)


# ------------------------------------------------------------------ (a) structure and exactness

@pytest.mark.parametrize("family", FAMILIES)
def test_float_rewrites_are_exact(family, tiny_models):
    """fuse-norms + ln-to-rms + rotate equal the fp32 model within FLOAT_EQUIV (graph
    optimizations off), and rotate applied with the stream this family has."""
    model = ir.load_model(tiny_models[family])
    graph = ir.to_graph(model)
    stream = analyze_stream(graph)
    readers, writers, post_norms, inner = STREAM[family]
    assert (len(stream.readers), len(stream.writers), len(stream.post_norms)) == (readers, writers, post_norms)
    assert len(analyze(graph).norms) - len(stream.norms) - len(stream.post_norms) == inner
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=11, batch=2, seq=7)
    reference = ir.make_session(model).run(None, feeds)
    out, records = Pipeline([get_pass(name)() for name in CHAIN]).run(model, PassContext())
    _close(reference, ir.make_session(out).run(None, feeds))
    rotate = records[-1]
    assert rotate["modified"], rotate["summary"]
    assert rotate["summary"]["rotation"] == "randomized-hadamard"
    assert rotate["summary"].get("post_norms", {"hadamard": 0})["hadamard"] == post_norms
    rotated = ir.to_graph(out)
    again = analyze_stream(rotated)  # still recognised after the rewrite
    index = ir.GraphIndex(rotated)
    assert all(n.kind == "rms" and is_weightless(index, n) for n in again.norms)
    ops = Counter(n.op for n in rotated.nodes)
    assert ops["OnlineHadamard"] == 2 + post_norms  # down_proj/fc2 of each layer, + 2 a layer (Gemma)
    if family in ("opt", "phi", "gpt2"):
        assert records[1]["modified"] and ops["LayerNormalization"] == 0  # LayerNorms became RMSNorms


def test_per_head_norms_are_left_alone(tiny_models):
    """Qwen3's and Gemma 3's q/k norms read a projection's output per head: not stream norms, so
    fuse-norms keeps their weights and rotate does not ask for them to be weightless."""
    for family in ("qwen3", "gemma3"):
        model = ir.load_model(tiny_models[family])
        out, records = Pipeline([get_pass(name)() for name in CHAIN]).run(model, PassContext())
        skipped = records[0]["summary"]["norms_skipped"]
        assert sum("q_norm" in k or "k_norm" in k for k in skipped) == 4
        graph = ir.to_graph(out)
        index = ir.GraphIndex(graph)
        head_norms = [n for n in analyze(graph).norms if "q_norm" in n.name or "k_norm" in n.name]
        assert len(head_norms) == 4 and not any(is_weightless(index, n) for n in head_norms)


def test_residual_structure_of_post_norm_and_parallel_blocks(tiny_models):
    gemma = analyze(ir.to_graph(ir.load_model(tiny_models["gemma2"])))
    assert all(r.post_norm is not None and r.branch == r.post_norm.output for r in gemma.residual_adds)
    assert {b.activation for b in gemma.mlp_blocks} == {"gelu_tanh"}
    assert [lin.role for lin in gemma.linears if lin.block is None] == ["lm_head"]  # through the soft-cap
    phi = analyze(ir.to_graph(ir.load_model(tiny_models["phi"])))
    adds = Counter(r.node for r in phi.residual_adds)
    assert len(adds) == 2 and set(adds.values()) == {2}  # one add per layer, two writers each
    assert all(r.parallel is not None for r in phi.residual_adds)
    attn, mlp = phi.attention_blocks[0], phi.mlp_blocks[0]
    assert attn.norm == mlp.norm  # one LayerNorm read by both blocks
    phi3 = analyze(ir.to_graph(ir.load_model(tiny_models["phi3"])))
    assert phi3.role_counts()["gate_up_proj"] == 2 and all(b.gated for b in phi3.mlp_blocks)


# ------------------------------------------------------------------ (b) family x recipe matrix

RECIPES = ("w8a8", "quarot-w8a8", "mquant-w8a8", "mquant-w4a8", "muxq-w8a8", "resq-w4a8", "gptq-w4a16", "dpq-w4a8")
_GEMM = (2, "lowering 'matmulnbits' handles MatMul linears only")  # Gemm linears (fc1/fc2 after a flatten)
_POST_LN = "structure-not-found: norm /bert/encoder/layer.0/attention/output/LayerNorm"
# (family, recipe) -> (exit code, a piece of the one-line error); every other pair exits 0
REFUSALS = {
    ("gpt2", "gptq-w4a16"): _GEMM,
    ("opt", "gptq-w4a16"): _GEMM,
    ("bert", "quarot-w8a8"): (4, f"needs pass 'rotate', which did not apply to this model ({_POST_LN}"),
    ("bert", "mquant-w8a8"): (4, f"needs pass 'rotate', which did not apply to this model ({_POST_LN}"),
    ("bert", "mquant-w4a8"): (4, f"needs pass 'rotate', which did not apply to this model ({_POST_LN}"),
    ("bert", "resq-w4a8"): (4, f"needs pass 'resq', which did not apply to this model ({_POST_LN}"),
}


@pytest.fixture(scope="module")
def calib_files(tiny_models, tmp_path_factory):
    """family -> a 4 x 16 calibration .npz matching the model's inputs."""
    root = tmp_path_factory.mktemp("calib")
    files = {}
    for family in (*FAMILIES, "bert"):
        model = ir.load_model(tiny_models[family], load_external=False)
        rng = np.random.default_rng(0)
        arrays = {}
        for spec in model.graph.input:
            if spec.name == "input_ids":
                arrays[spec.name] = rng.integers(0, 256, (4, 16)).astype(np.int64)
            elif spec.name == "position_ids":
                arrays[spec.name] = np.tile(np.arange(16, dtype=np.int64), (4, 1))
            else:  # attention_mask, token_type_ids
                arrays[spec.name] = np.full((4, 16), int("mask" in spec.name), np.int64)
        files[family] = root / f"{family}.npz"
        np.savez(files[family], **arrays)
    return files


def _compile(capsys, model, calib, out, *extra):
    code = main([str(a) for a in ("compile", model, "--calib", calib, "--calib-windows", 2, "--seq-len", 16,
                                  "--no-cache", "-o", out, *extra)])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("family", (*FAMILIES, "bert"))
def test_recipe_matrix(family, tiny_models, calib_files, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EDGEQ_PROGRESS", "0")
    for recipe in RECIPES:
        out = tmp_path / recipe
        code, err = _compile(capsys, tiny_models[family], calib_files[family], out, "--recipe", recipe)
        expected = REFUSALS.get((family, recipe))
        if expected is None:
            assert code == 0, f"{family} {recipe}: {err}"
            report = json.loads((out / "report.json").read_text())
            assert "partial" not in report
            applied = {rec["name"]: rec["modified"] for rec in report["passes"]}
            essential = [spec.name for spec in load_recipe(recipe).passes if spec.essential]
            assert essential and all(applied[name] for name in essential), (family, recipe, applied)
        else:
            assert (code, len(err.splitlines())) == (expected[0], 1), f"{family} {recipe}: {err}"
            assert expected[1] in err, err
            assert not out.exists()


# ------------------------------------------------------------------ (c) the essential-pass contract

def test_essential_pass_refusal_and_allow_partial(tiny_models, calib_files, tmp_path, capsys, monkeypatch):
    """quarot-w8a8 on BERT (post-LN: the stream cannot be rotated) exits 4 writing nothing;
    --allow-partial writes it with one warning line and report.json 'partial'."""
    monkeypatch.setenv("EDGEQ_PROGRESS", "0")
    out = tmp_path / "strict"
    code, err = _compile(capsys, tiny_models["bert"], calib_files["bert"], out, "--recipe", "quarot-w8a8")
    assert code == 4 and len(err.splitlines()) == 1 and not out.exists()
    assert err.startswith("edgeq: error: recipe 'quarot-w8a8' needs pass 'rotate'")
    out = tmp_path / "partial"
    code, err = _compile(capsys, tiny_models["bert"], calib_files["bert"], out, "--recipe", "quarot-w8a8", "--allow-partial")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "essential pass 'rotate' did not apply" in warnings[0]
    report = json.loads((out / "report.json").read_text())
    assert [p["pass"] for p in report["partial"]] == ["rotate"]
    assert report["partial"][0]["reason"] == "structure-not-found"
    assert (out / "model.onnx").exists()


def test_essential_must_be_a_boolean(tiny_models, calib_files, tmp_path, capsys):
    recipe = tmp_path / "bad.toml"
    recipe.write_text('[[pass]]\nname = "qdq"\nessential = "yes"\n')
    out = tmp_path / "out"
    code, err = _compile(capsys, tiny_models["llama"], calib_files["llama"], out, "--recipe", recipe)
    assert code == 2 and len(err.splitlines()) == 1 and not out.exists()
    assert "essential must be true or false" in err


# ------------------------------------------------------------------ (d) export hf, tied and untied

@pytest.mark.parametrize("family", FAMILIES)
def test_export_hf_tied_and_untied(family, tmp_path, capsys):
    """``edgeq export hf`` on a saved tiny model of the family, with a tied and an untied head:
    the graph gives the model's logits, the head is (un)tied as saved, and the float rewrites stay
    exact on it (fuse-norms unties a tied head)."""
    import torch

    from edgeq.models.tiny import build_tiny

    ids = np.random.default_rng(0).integers(0, 256, (1, 8))
    for tied in (True, False):
        hf = tmp_path / f"hf-{tied}"
        model = build_tiny(family, seed=1, tie_word_embeddings=tied)
        model.save_pretrained(hf)
        assert main(["export", "hf", str(hf), "-o", str(tmp_path / f"onnx-{tied}")]) == 0, capsys.readouterr().err
        onnx_model = ir.load_model(tmp_path / f"onnx-{tied}" / "model.onnx")
        session = ir.make_session(onnx_model)
        feeds = {i.name: ids if i.name == "input_ids" else np.arange(8)[None] if "position" in i.name
                 else np.ones_like(ids) for i in session.get_inputs()}
        with torch.no_grad():
            expected = model(input_ids=torch.tensor(ids)).logits.numpy()
        (logits,) = session.run(["logits"], feeds)
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)
        (head,) = [lin for lin in analyze(ir.to_graph(onnx_model)).linears if lin.role == "lm_head"]
        assert (head.tied_embedding is not None) is tied
        out, records = Pipeline([get_pass(name)() for name in CHAIN]).run(onnx_model, PassContext())
        assert records[-1]["modified"]
        assert records[0]["summary"]["heads_untied"] == int(tied)
        (got,) = ir.make_session(out).run(["logits"], feeds)
        _close([logits], [got])
