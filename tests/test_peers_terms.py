"""The peers benchmark reads each row's terms (lm_head / embedding bits, group size, accuracy level)
off the written graph, not from what a tool says it did: check that reading on small hand-built
graphs of each form the tools write, and the accuracy-level copy used for edgeq's level-4 rows."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import peers  # noqa: E402
import peers_scoring  # noqa: E402

VOCAB, HIDDEN = 16, 8


def _save(tmp_path: Path, nodes, inits, name="m") -> Path:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], initializer=inits)
    folder = tmp_path / name
    folder.mkdir()
    onnx.save(helper.make_model(graph), str(folder / "model.onnx"))
    return folder


def _float(name, shape):
    return numpy_helper.from_array(np.zeros(shape, np.float32), name)


def test_float_head_and_embedding(tmp_path):
    folder = _save(tmp_path, [helper.make_node("Gather", ["table", "input_ids"], ["h"]),
                              helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
                              helper.make_node("MatMul", ["h", "table_t"], ["logits"])],
                   [_float("table", [VOCAB, HIDDEN])])
    assert peers_scoring.weight_policy(folder) == {"lm_head_bits": 32, "embedding_bits": 32, "group_size": None,
                                           "accuracy_level": None}


def test_qdq_int8_head_behind_transpose(tmp_path):
    q = numpy_helper.from_array(np.zeros([VOCAB, HIDDEN], np.int8), "table_q")
    folder = _save(tmp_path, [helper.make_node("Gather", ["table", "input_ids"], ["h"]),
                              helper.make_node("DequantizeLinear", ["table_q", "s"], ["table_dq"], axis=0),
                              helper.make_node("Transpose", ["table_dq"], ["w"], perm=[1, 0]),
                              helper.make_node("MatMul", ["h", "w"], ["logits"])],
                   [_float("table", [VOCAB, HIDDEN]), q, numpy_helper.from_array(np.ones([VOCAB], np.float32), "s")])
    terms = peers_scoring.weight_policy(folder)
    assert (terms["lm_head_bits"], terms["embedding_bits"]) == (8, 32)


def test_matmulnbits_and_quantized_embedding(tmp_path):
    blocks = HIDDEN // 4
    nodes = [helper.make_node("GatherBlockQuantized", ["table_q", "input_ids", "es"], ["h"], domain="com.microsoft",
                              bits=4, block_size=4, gather_axis=0, quantize_axis=1),
             helper.make_node("MatMulNBits", ["h", "wq", "ws"], ["logits"], domain="com.microsoft", K=HIDDEN, N=VOCAB,
                              bits=8, block_size=4, accuracy_level=4)]
    inits = [numpy_helper.from_array(np.zeros([VOCAB, HIDDEN // 2], np.uint8), "table_q"),
             numpy_helper.from_array(np.ones([VOCAB, blocks], np.float32), "es"),
             numpy_helper.from_array(np.zeros([VOCAB, blocks, 4], np.uint8), "wq"),
             numpy_helper.from_array(np.ones([VOCAB * blocks], np.float32), "ws")]
    folder = _save(tmp_path, nodes, inits)
    assert peers_scoring.weight_policy(folder) == {"lm_head_bits": 8, "embedding_bits": 4, "group_size": 4, "accuracy_level": 4}

    copy = peers.with_accuracy_level(folder, tmp_path / "level0", 0)
    assert peers_scoring.weight_policy(copy)["accuracy_level"] == 0
    assert peers_scoring.weight_policy(folder)["accuracy_level"] == 4  # the source is left as it was


@pytest.mark.parametrize("spec", peers.EDGEQ_SETTINGS, ids=lambda s: s["setting"])
def test_edgeq_rows_state_their_terms(spec, tmp_path):
    """Every edgeq setting names its calibration windows; a head-4 setting's recipe really drops lm_head
    from skip_roles (a recipe change that moved that line would otherwise compile a float head)."""
    assert spec["calib_windows"] in peers.CALIB_WINDOWS
    recipe = peers._recipe_file(spec, tmp_path)
    if spec.get("lm_head_4bit"):
        assert "skip_roles = []" in Path(recipe).read_text()
    else:
        assert recipe == spec["recipe"]


def test_static_pair_terms_are_read_off_its_prefill_graph(tmp_path):
    """edgeq's HTP-form rows are static pairs (prefill.onnx, no model.onnx): their terms come from the
    prefill graph, and they are scored through it (not timed as a 512-token forward pass)."""
    folder = _save(tmp_path, [helper.make_node("Gather", ["table", "input_ids"], ["h"]),
                              helper.make_node("MatMul", ["h", "head"], ["logits"])],
                   [_float("table", (VOCAB, HIDDEN)), numpy_helper.from_array(np.zeros((HIDDEN, VOCAB), np.int8), "head")])
    (folder / "model.onnx").rename(folder / "prefill.onnx")
    assert peers_scoring.graph_file(folder) == folder / "prefill.onnx"
    assert peers_scoring.weight_policy(folder)["lm_head_bits"] == 8
    htp_rows = [s for s in peers.EDGEQ_SETTINGS if s.get("static")]
    assert {s["recipe"] for s in htp_rows} == {"w8a16", "mquant-w4a16"}
    assert all(s["setting"].endswith("-qnn-htp") and s["activation_bits"] == 16 for s in htp_rows)


def test_readme_table_settings_exist():
    """``--tables`` (make peers PEERS_MODEL=qwen25) names settings by TOOL/SETTING: each must be one
    that edgeq's list or the peer's adapter offers, or the run would silently drop that row."""
    import json
    import subprocess

    offered = {f"edgeq/{s['setting']}" for s in peers.EDGEQ_SETTINGS}
    for peer, adapter in peers.ADAPTER_FILES.items():
        listed = subprocess.run([sys.executable, str(peers.PEERS_DIR / "adapters" / adapter), "settings"],
                                capture_output=True, text=True, check=True)
        offered |= {f"{peer}/{s['setting']}" for s in json.loads(listed.stdout)}
    named = [name for table in peers.README_TABLES.values() for name in table]
    assert named and set(named) <= offered, set(named) - offered
