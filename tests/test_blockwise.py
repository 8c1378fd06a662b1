"""Block-wise compile (``edgeq.blockwise``): the same model as the in-memory path, one block at a time.

Tiny random models check the structure and the exactness of the stitching (every block's nodes,
the carried calibration states, weights streamed to the external data file); SmolLM2's figures
(peak RSS, perplexity against the in-memory path) are in ``benchmarks/scale.py``.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgeq import blockwise
from edgeq.graph import ir
from edgeq.blockwise import assemble, block  # noqa: F401  (the modules whose limits the tests lower)
from edgeq.cli import main
from edgeq.passmanager.passbase import Combine
from edgeq.passmanager.registry import get_pass

RECIPES = ("mquant-w8a8", "gptq-w4a16", "w8a8", "quarot-w8a8", "mquant-w4a16")


def _calib_for(model, folder):
    """Three 24-token samples with exactly the model's inputs (Gemma takes no position_ids)."""
    names = {i.name for i in onnx.load(str(model), load_external_data=False).graph.input}
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 256, (3, 24)), "attention_mask": np.ones((3, 24), np.int64),
             "position_ids": np.tile(np.arange(24), (3, 1))}
    path = folder / "calib.npz"
    np.savez(path, **{k: v for k, v in feeds.items() if k in names})
    return path


@pytest.fixture(scope="module")
def calib(tmp_path_factory, tiny_models):
    return _calib_for(tiny_models["llama"], tmp_path_factory.mktemp("calib"))


def _compile(capsys, model, out, recipe, calib, mode):
    code = main(["compile", str(model), "--recipe", recipe, "--calib", str(calib), "-o", str(out),
                 "--blockwise", mode, "--no-cache"])
    err = capsys.readouterr().err
    assert code == 0, err
    return json.loads((out / "report.json").read_text()), err


def _logits(model_dir, calib):
    data = np.load(calib)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(model_dir / "model.onnx"), so, providers=["CPUExecutionProvider"])
    return session.run(["logits"], {k: data[k] for k in data.files})[0]


def test_partition_of_a_tiny_llama(tiny_models):
    part = blockwise.partition(onnx.load(str(tiny_models["llama"]), load_external_data=False))
    assert part.num_layers == 2
    assert part.stream[0].endswith("embed_tokens/Gather_output_0")
    assert part.stream[1].startswith("/model/layers.0/") and part.stream[2].startswith("/model/layers.1/")
    # the rotary tables layer 0 computes and layer 1 reads stay layer 0's
    assert all(name.startswith("/model/layers.0/") for name in part.exported_support[0])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "qwen3"])
def test_blockwise_equals_in_memory(tiny_models, tmp_path, capsys, monkeypatch, arch, recipe):
    """Same logits and the same encodings (scales, zero points) as the in-memory compile (its
    calibration sessions built from a file, as large blocks' are), with every
    initializer above 1 KB streamed to the external data file (the spill threshold lowered here)."""
    monkeypatch.setattr(blockwise.assemble, "SPILL_BYTES", 1024)  # as ir.save_model: shape tensors stay inline
    monkeypatch.setenv("EDGEQ_PROGRESS", "1")  # CI turns progress off; the block lines are checked here
    # the vocabulary tables (256 x 64) get stand-ins as a real vocabulary's would: the first block
    # reads the real embedding and a stand-in head, the last the real head and a stand-in embedding
    monkeypatch.setattr(blockwise.block, "STUB_ELEMENTS", 1000)
    monkeypatch.setattr(blockwise.block, "STUB_ROWS", 8)
    calib = _calib_for(tiny_models[arch], tmp_path)
    mem, _ = _compile(capsys, tiny_models[arch], tmp_path / "mem", recipe, calib, "off")
    monkeypatch.setattr(ir, "CONSUME_VIA_FILE_BYTES", 0)  # calibration sessions through a file, as for large blocks
    blk, err = _compile(capsys, tiny_models[arch], tmp_path / "blk", recipe, calib, "on")
    assert mem["compile_path"]["blockwise"] is False and blk["compile_path"]["blockwise"] is True
    assert blk["compile_path"]["blocks"] == 2
    assert "block 2/2" in err and "ETA" in err
    a, b = _logits(tmp_path / "mem", calib), _logits(tmp_path / "blk", calib)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * float(np.abs(a).max()))
    enc_a = json.loads((tmp_path / "mem" / "encodings.json").read_text())
    enc_b = json.loads((tmp_path / "blk" / "encodings.json").read_text())
    assert enc_a["activations"] == enc_b["activations"]
    assert enc_a["weights"] == enc_b["weights"]
    # the facts passes leave for later compiles and tools are the same (a name set joined over the blocks)
    meta_a, meta_b = ({p.key: p.value for p in onnx.load(str(tmp_path / d / "model.onnx"), load_external_data=False)
                       .metadata_props} for d in ("mem", "blk"))
    assert meta_a == meta_b
    # the weights live in the external data file, written block by block
    out = onnx.load(str(tmp_path / "blk" / "model.onnx"), load_external_data=False)
    assert sum(t.data_location == onnx.TensorProto.EXTERNAL for t in out.graph.initializer) > 10
    assert [p["name"] for p in mem["passes"]] == [p["name"] for p in blk["passes"]]
    for whole, merged in zip(mem["passes"], blk["passes"]):
        # a figure each block reports alike (combine=FIRST: rotate's hidden size) is the model's, not summed
        for key, rule in get_pass(whole["name"]).summary_combine.items():
            if rule is Combine.FIRST and key in whole["summary"]:
                assert merged["summary"][key] == whole["summary"][key], (whole["name"], key)
        # a pass that changed some blocks is not also reported as not applicable
        assert not (merged["modified"] and "not_applicable" in merged["summary"]), merged
    assert all("peak_rss_mb" in p and "seconds" in p for p in blk["passes"])
    # the u8s8 probe, taken block by block on the compiled blocks' hidden states, is the whole-model probe's
    for key in ("linears", "worst_pair", "saturation_free", "linears_at_risk", "rows_probed", "int8_weight_range"):
        assert blk["u8s8"].get(key) == mem["u8s8"].get(key), key
    assert set(blk["u8s8"].get("per_linear", {})) == set(mem["u8s8"].get("per_linear", {}))
    for name, record in mem["u8s8"].get("per_linear", {}).items():
        assert blk["u8s8"]["per_linear"][name] == pytest.approx(record, rel=1e-5, abs=1e-7), name
    if recipe not in ("gptq-w4a16", "mquant-w4a16"):  # (weight-only, 16-bit activations: no uint8 x int8 linear)
        assert mem["u8s8"]["linears"] > 0 and "max_pair_rate" in blk["u8s8"]


def test_auto_keeps_small_models_in_memory(tiny_models, calib, tmp_path, capsys):
    report, _ = _compile(capsys, tiny_models["llama"], tmp_path / "out", "w8a8", calib, "auto")
    assert report["compile_path"]["blockwise"] is False
    assert "in memory" in report["compile_path"]["reason"]


def test_forced_blockwise_refuses_what_it_cannot_do(tiny_models, calib, tmp_path, capsys):
    """--blockwise on with a pass that needs the whole graph, or a graph without decoder blocks:
    one line, exit 2, nothing written."""
    for model, recipe, needle in ((tiny_models["llama"], "resq-w4a8", "cannot compile block by block"),
                                  (tiny_models["bert"], "w8a8", "does not split into decoder blocks")):
        out = tmp_path / "out"
        code = main(["compile", str(model), "--recipe", recipe, "--calib", str(calib), "-o", str(out), "--blockwise", "on"])
        err = capsys.readouterr().err.strip()
        assert code == 2, err
        assert len(err.splitlines()) == 1 and needle in err, err
        assert not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def _rec(fields: dict):
    """A pass record as the pipeline makes one (``PassRecord``), from report.json's keys."""
    from edgeq.passmanager.records import PassRecord

    return PassRecord(**{"exactness": "exact", "config": {}, **fields})


def test_merge_records_sums_numbers_and_joins_lists():
    recs = [[_rec({"name": "qdq", "seconds": 1.0, "peak_rss_mb": 10.0, "modified": True, "summary": {"n": 2, "roles": ["a"]},
              "ops_added": {"QuantizeLinear": 3}, "ops_removed": {}})],
            [_rec({"name": "qdq", "seconds": 2.0, "peak_rss_mb": 30.0, "modified": False, "summary": {"n": 1, "roles": ["b"]},
              "ops_added": {"QuantizeLinear": 1}, "ops_removed": {}})]]
    merged = blockwise.merge_records(recs)[0]
    assert merged["seconds"] == 3.0 and merged["peak_rss_mb"] == 30.0 and merged["blocks_modified"] == 1
    assert merged["summary"] == {"n": 3, "roles": ["a", "b"]}
    assert merged["ops_added"] == {"QuantizeLinear": 4}


def test_merge_records_follows_the_declared_rules():
    """rotate declares its hidden size the same in every block (combine=FIRST): SmolLM2's 576 was
    reported as 17280, summed over 30 blocks; a pass applied in one block and not in the other is
    modified, with the blocks it skipped counted apart from its summary."""
    rotate = [_rec({"name": "rotate", "seconds": 1.0, "peak_rss_mb": 1.0, "modified": True, "ops_added": {}, "ops_removed": {},
               "summary": {"hidden": 576, "stream_sources": ["embedding"], "readers": 6}}) for _ in range(3)]
    merged = blockwise.merge_records([[r] for r in rotate])[0]["summary"]
    assert merged == {"hidden": 576, "stream_sources": ["embedding"], "readers": 18}
    rms = [_rec({"name": "rms", "seconds": 1.0, "peak_rss_mb": 1.0, "modified": True, "ops_added": {}, "ops_removed": {},
            "summary": {"split": 1}}),
           _rec({"name": "rms", "seconds": 1.0, "peak_rss_mb": 1.0, "modified": False, "ops_added": {}, "ops_removed": {},
            "summary": {"split": 0, "not_applicable": "no channel 0 to split off"},
            "not_applicable": {"reason": "no-sites", "detail": "no channel 0 to split off"}})]
    record = blockwise.merge_records([[r] for r in rms])[0]
    assert record["modified"] and record["summary"] == {"split": 1} and record["blocks_not_applicable"] == 1
    assert "not_applicable" not in record


def test_combine_declarations_are_checked():
    from edgeq.passmanager.passbase import Exactness, Pass

    with pytest.raises(TypeError, match="combine="):
        class _Bad(Pass, name="bad-combine", exactness=Exactness.EXACT, combine={"hidden": "first"}):
            def run(self, graph, ctx):
                raise NotImplementedError


def test_merge_records_keeps_extremes_and_means_as_such():
    """A figure named as a maximum, minimum or mean is not summed over the blocks (fp16-safe-norms'
    max_sum_of_squares_after read 119022 on Gemma 3, 18 blocks' maxima summed, each under 8192)."""
    summaries = [{"max_sum_of_squares_after": 6000.0, "relative_step_max": 0.5, "min_scale": 0.25,
                  "relative_step_mean": 0.1, "nested": {"table_rel_rms_error_max": 0.2}, "norms": 7},
                 {"max_sum_of_squares_after": 8000.0, "relative_step_max": 0.25, "min_scale": 0.5,
                  "relative_step_mean": 0.3, "nested": {"table_rel_rms_error_max": 0.1}, "norms": 7}]
    recs = [[_rec({"name": "fp16-safe-norms", "seconds": 1.0, "peak_rss_mb": 1.0, "modified": True, "summary": s,
              "ops_added": {}, "ops_removed": {}})] for s in summaries]
    merged = blockwise.merge_records(recs)[0]["summary"]
    assert merged == {"max_sum_of_squares_after": 8000.0, "relative_step_max": 0.5, "min_scale": 0.25,
                      "relative_step_mean": 0.2, "nested": {"table_rel_rms_error_max": 0.2}, "norms": 14}


def test_column_blocks_give_the_same_numbers(monkeypatch):
    """The per-channel work that runs in column blocks for vocabulary-sized tables (pair-bounded
    int8 grid, rotation, norm folding) gives bitwise the numbers of the one-piece computation."""
    from edgeq.quantize import quant
    from edgeq.passes.methods.rotation import rotate_columns, rotate_rows
    from edgeq.passes.methods.weights import scale_rows

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 300)).astype(np.float32)
    q = np.linalg.qr(rng.standard_normal((64, 64)))[0]
    gamma = rng.standard_normal(64)
    whole = (quant.quantize_pair_bounded(w), quant.pair_bounded_scale(w), quant.worst_pair(np.round(w * 40)),
             rotate_rows(w, q), rotate_columns(w.T.copy(), q), scale_rows(w, gamma))
    monkeypatch.setattr(quant, "COLUMN_BLOCK_ELEMENTS", 64 * 7)  # 7 columns per block, the last one partial
    assert len(quant.column_blocks(w)) == 43
    blocks = (quant.quantize_pair_bounded(w), quant.pair_bounded_scale(w), quant.worst_pair(np.round(w * 40)),
              rotate_rows(w, q), rotate_columns(w.T.copy(), q), scale_rows(w, gamma))
    np.testing.assert_array_equal(blocks[0][0], whole[0][0])
    np.testing.assert_array_equal(blocks[0][1], whole[0][1])
    for a, b in zip(blocks[1:], whole[1:]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(rotate_rows(w, q), (q.T @ w.astype(np.float64)).astype(np.float32))


def test_block_models_use_stand_ins_for_the_vocabulary_tables(tiny_models, monkeypatch, tmp_path):
    """Between the first and the last block the embedding and head tables are small stand-ins; the
    first block keeps the real embedding, the last the real head (tiny tables count as large here)."""
    monkeypatch.setattr(blockwise.block, "STUB_ELEMENTS", 1000)  # the tiny vocabulary tables: 256 x 64
    monkeypatch.setattr(blockwise.block, "STUB_ROWS", 8)
    path = tiny_models["llama"]
    skeleton = onnx.load(str(path), load_external_data=False)
    part = blockwise.partition(skeleton)
    shapes = []
    for i in range(part.num_layers):
        _, values = blockwise.block_model(skeleton, part, i, path.parent)
        shapes.append(sorted(v.shape for v in values.values() if v.ndim == 2 and 256 in v.shape or 8 in v.shape))
    embedding, head = (256, 64), (64, 256)
    assert embedding in shapes[0] and head not in shapes[0]  # first block: the real embedding only
    assert head in shapes[-1] and embedding not in shapes[-1]  # last block: the real head only


def test_partition_of_a_kv_cache_graph(tiny_past):
    """A with-past graph splits too: each layer's present.{i}.* are that layer's graph outputs, and
    the block model of layer i computes its own cache entries and no other layer's."""
    skeleton = onnx.load(str(tiny_past / "model" / "model.onnx"), load_external_data=False)
    part = blockwise.partition(skeleton)
    assert part.layer_outputs == [[f"present.{i}.key", f"present.{i}.value"] for i in range(part.num_layers)]
    model, _ = block.block_model(skeleton, part, 1, tiny_past / "model")
    assert [o.name for o in model.graph.output] == ["logits", "present.1.key", "present.1.value"]


@pytest.mark.parametrize("recipe", ["mquant-w8a8", "mquant-w4a16"])
def test_static_qnn_pair_blockwise_equals_in_memory(tiny_past, tmp_path, capsys, recipe):
    """``--static ... --target qnn-htp`` block by block (every lowering pass per block, the pair
    specialized with the weights left in the streamed file): the same encodings, weights and
    outputs, bit for bit, as the in-memory route."""
    outs = {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        code = main(["compile", str(tiny_past / "model" / "model.onnx"), "--recipe", recipe,
                     "--calib", str(tiny_past / "calib.txt"), "--seq-len", "32", "--calib-windows", "2",
                     "--static", "prefill=8,context=48", "--target", "qnn-htp", "--blockwise", mode, "-o", str(out)])
        err = capsys.readouterr().err
        assert code == 0, err
        report = json.loads((out / "report.json").read_text())
        assert report["compile_path"]["blockwise"] is (mode == "on")
        assert report["target"]["check"]["prefill.onnx"]["clean"] and report["target"]["check"]["decode.onnx"]["clean"]
        outs[mode] = out
    assert (outs["on"] / "encodings.json").read_text() == (outs["off"] / "encodings.json").read_text()
    rng = np.random.default_rng(0)
    for role in ("prefill", "decode"):
        sessions = [ort.InferenceSession(str(outs[m] / f"{role}.onnx"), providers=["CPUExecutionProvider"])
                    for m in ("off", "on")]
        feeds = {}
        for i in sessions[0].get_inputs():
            if i.name == "input_ids":
                feeds[i.name] = rng.integers(0, 50, i.shape).astype(np.int64)
            elif i.name == "attention_mask":
                feeds[i.name] = np.ones(i.shape, np.int64)
            elif i.name == "position_ids":
                feeds[i.name] = np.arange(i.shape[1], dtype=np.int64)[None] + 3
            else:
                feeds[i.name] = (rng.standard_normal(i.shape) * 0.1).astype(np.float32)
        for a, b in zip(*(s.run(None, feeds) for s in sessions)):
            np.testing.assert_array_equal(a, b)
    weights = [{t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(outs[m] / "prefill.onnx")).graph.initializer}
               for m in ("off", "on")]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        np.testing.assert_array_equal(weights[0][name], weights[1][name])
