"""Model families (issue 20; declared in ``edgeq.families``, issue 35): every family of the table
builds as a tiny model whose structure analysis finds the layers, blocks and traits the table
declares; every decoder family's float rewrites (fuse-norms, ln-to-rms, rotate) keep its outputs
within the FLOAT_EQUIV tolerance, and every representative recipe either compiles it with all its
essential passes applied or exits non-zero with a one-line reason; no recipe exits 0 with an
essential pass skipped. Also: the essential-pass contract (exit 4, ``--allow-partial``,
``essential`` must be a boolean) and ``edgeq export hf`` on each family with tied and untied heads.

What each family exercises (its traits in ``edgeq.families``):
- qwen3: per-head q/k RMSNorms inside attention (not stream norms: left alone);
- gemma2 / gemma3: sandwich norms (post-sublayer norms on the write path, rotated online), ``1 + w``
  RMSNorm, embedding times sqrt(hidden), tied head (gemma2: soft-capped logits; gemma3: q/k norms);
- phi3: fused qkv_proj and gate_up_proj;
- opt: LayerNorm with bias, learned positions, ``[b, s, h] -> [b * s, h]`` Reshapes on the stream;
- phi (Phi-2): parallel attention + MLP reading one LayerNorm, two writers summed into one add.

Adding a family: its ``Family`` entry, then what the tests here ask for it (``STREAM``, and
``REFUSALS`` for any recipe it refuses); ARCHITECTURE.md, "Adding a model family".
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from toy import random_feeds

from edgeq import families
from edgeq.graph import ir
from edgeq.blockwise.partition import LAYER_NAME, NotPartitionable, partition
from edgeq.cli import main
from edgeq.passmanager.passbase import FLOAT_EQUIV_RTOL, PassContext, PassNotApplicable
from edgeq.passes.methods.stream import analyze_stream
from edgeq.passes.methods.weights import is_weightless
from edgeq.passmanager.pipeline import Pipeline
from edgeq.recipes import load_recipe
from edgeq.passmanager.registry import get_pass
from edgeq.structure import analyze

FAMILY = families.BY_NAME
FAMILIES = tuple(f.name for f in families.FAMILIES if f.causal)  # the decoder families
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


# ------------------------------------------------------------------ (0) the table's declarations

def test_the_table_is_data():
    """Importing the table loads neither torch, transformers nor onnx; names and model types are
    unique; every family's tiny config has its layer count."""
    code = ("import sys, edgeq.families; heavy = {'torch', 'transformers', 'onnx', 'onnxruntime'} & set(sys.modules); "
            "sys.exit(', '.join(sorted(heavy)) or None)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr or done.stdout
    table = families.FAMILIES
    assert len({f.name for f in table}) == len({f.model_type for f in table}) == len(table)
    assert all(f.tiny_layers == families.TINY_LAYERS for f in table)


@pytest.mark.parametrize("family", families.TINY_ARCHS)
def test_declared_structure_is_what_analysis_finds(family, tiny_models):
    """The family's tiny export (its config.json names the declared model type) has the declared
    layers under the declared node scope, one attention and one MLP block per layer, and each trait
    of the table as ``analyze`` / ``analyze_stream`` / ``partition`` find it."""
    f = FAMILY[family]
    path = tiny_models[family]
    assert json.loads((path.parent / "config.json").read_text())["model_type"] == f.model_type
    model = ir.load_model(path)
    graph = ir.to_graph(model)
    s = analyze(graph)
    layers = f.tiny_layers
    assert s.num_layers == layers and len(s.attention_blocks) == len(s.mlp_blocks) == layers
    names = [n.name for n in graph.nodes]
    for i in range(layers + 1):
        assert any(name.startswith(f"{f.layer_scope}.{i}/") for name in names) is (i < layers), (f.layer_scope, i)
    assert {n.kind for n in s.norms} == {f.norm}
    assert {b.activation for b in s.mlp_blocks} == {f.activation}
    assert {b.gated for b in s.mlp_blocks} == {f.gated_mlp}
    roles = s.role_counts()
    assert roles.get("qkv", 0) == (layers if f.fused_qkv else 0)
    assert roles.get("gate_up_proj", 0) == (layers if f.fused_gate_up else 0)
    assert roles.get("classifier" if f.task == "image-classification" else "lm_head") == 1
    post_norms = [r for r in s.residual_adds if r.post_norm is not None]
    assert len(post_norms) == (2 * layers if f.sandwich_norms else 0)
    parallel = {r.node for r in s.residual_adds if r.parallel is not None}
    assert len(parallel) == (layers if f.parallel_block else 0)
    if f.parallel_block:
        assert all(a.norm == m.norm for a, m in zip(s.attention_blocks, s.mlp_blocks))
    if f.pre_norm:
        stream = analyze_stream(graph)
        assert len(stream.norms) == layers * (1 if f.parallel_block else 2) + 1  # + the final norm
        assert len(stream.post_norms) == len(post_norms)
        inner = len(s.norms) - len(stream.norms) - len(stream.post_norms)
        assert inner == (2 * layers if f.head_norms else 0)  # q_norm and k_norm per layer
    else:
        with pytest.raises(PassNotApplicable):
            analyze_stream(graph)
    assert _embedding_scales(graph, s) == ([math.sqrt(families.TINY_HIDDEN)] if f.embedding_scale else [])
    proto = ir.load_model(path, load_external=False)
    if f.blockwise:
        assert partition(proto).num_layers == layers
    else:
        with pytest.raises(NotPartitionable):
            partition(proto)


def _embedding_scales(graph, structure) -> list[float]:
    """Scalar constants the token embedding's output is multiplied by (through casts)."""
    index = ir.GraphIndex(graph)
    nodes = {n.name: n for n in graph.nodes}
    scales = []
    for emb in structure.embeddings:
        if emb.rows != families.TINY_VOCAB:
            continue
        todo = [nodes[emb.node].outputs[0]]
        while todo:
            tensor = todo.pop()
            for user in index.consumers(tensor.name):
                if user.op == "Cast":
                    todo.append(user.outputs[0])
                elif user.op == "Mul":
                    values = [index.constant_value(t) for t in user.inputs]
                    scales += [float(np.asarray(v).reshape(())) for v in values if v is not None and np.size(v) == 1]
    return scales


@pytest.mark.parametrize("family", families.TINY_ARCHS)
def test_norm_scale_offset(family, tiny_models):
    """Every norm's scale in the export is ``norm_scale_offset + w`` for one of the torch model's
    norm weights ``w`` (Gemma: ``1 + w``; the others: ``w``)."""
    from edgeq.models.tiny import build_tiny

    f = FAMILY[family]
    weights = [p.detach().numpy() for name, p in build_tiny(family, seed=0).named_parameters()
               if p.ndim == 1 and not name.endswith("bias")]
    graph = ir.to_graph(ir.load_model(tiny_models[family]))
    index = ir.GraphIndex(graph)
    for norm in analyze(graph).norms:
        scale = index.constant_value(index.tensors[norm.scale])
        assert any(w.shape == scale.shape and np.allclose(scale, f.norm_scale_offset + w, rtol=0, atol=1e-6)
                   for w in weights), norm.name


def test_what_reads_the_table():
    """The lists other modules keep are the table's: tiny architectures, ``--with-past`` tiny
    exports, the families ``--target ort-genai`` maps, the layer containers block-wise compile
    splits at; every random preset, real export and measured family is of a declared family."""
    import argparse

    from edgeq.cli import build_parser
    from edgeq.genai import MAPPED_FAMILIES
    from edgeq.measured_accuracy import _table
    from edgeq.models import kv_export, tiny
    from edgeq.models.random_presets import PRESETS

    table = families.FAMILIES
    assert tiny.TINY_ARCHS == tuple(f.name for f in table)
    assert kv_export.TINY_WITH_PAST == tuple(f.name for f in table if f.tiny_with_past)
    assert MAPPED_FAMILIES == {f.model_type for f in table if f.genai}
    for f in table:
        assert LAYER_NAME.search(f"{f.layer_scope}.3/attn/MatMul").group(1) == "3"
    presets = {f"random {name}": config["model_type"] for name, config in PRESETS.items()}
    real = {entry: f.model_type for f in table for entry in f.real}
    assert {k: v for k, v in real.items() if k in presets} == presets
    (export,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    (sources,) = [a for a in export.choices["export"]._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(real) - set(presets) <= set(sources.choices)
    measured = {key for key, value in _table().items() if isinstance(value, dict)}
    assert measured <= {f.model_type for f in table}


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
    if FAMILY[family].norm == "layer":
        assert records[1]["modified"] and ops["LayerNormalization"] == 0  # LayerNorms became RMSNorms


def test_per_head_norms_are_left_alone(tiny_models):
    """Qwen3's and Gemma 3's q/k norms read a projection's output per head: not stream norms, so
    fuse-norms keeps their weights and rotate does not ask for them to be weightless."""
    head_norm_families = [f.name for f in families.FAMILIES if f.head_norms]
    assert head_norm_families
    for family in head_norm_families:
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
