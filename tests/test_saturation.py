"""onnxruntime's uint8 x int8 kernels on CPUs without VNNI: the numpy VPMADDUBSW model, the
pair-bounded int8 grid, the ``u8s8-safe-weights`` guard, the check rule and the compile report.

The model is checked against the machine the tests run on: on x86 without VNNI / AMX (AVX2,
AVX-512 without VNNI) onnxruntime's result must equal the model's saturated one; elsewhere it
must equal the exact product. Either way the model itself must predict the saturation, so a VNNI
machine still catches a regression in the grid (``is_saturation_free`` on every compiled weight).
"""

import json

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeq.graph import ir
from edgeq.cli import main
from edgeq.evaluate.machine import machine_info, saturating_cpu
from edgeq.passmanager.passbase import PassContext
from edgeq.passmanager.pipeline import Pipeline
from edgeq.quantize.quant import QuantSpec, quantize_weight
from edgeq.targets import check_model, load_target
from edgeq.targets.saturation import (PAIR_LIMIT, fix_pairs, is_saturation_free, pair_bounded_scale, quantize_pair_bounded,
                                      simulate_linear, vpmaddubsw_matmul, worst_pair)
from edgeq.targets.u8s8_sites import find_u8s8_sites, static_risk

SATURATING = saturating_cpu()


def _weights():
    rng = np.random.default_rng(0)
    gauss = rng.standard_normal((96, 40)).astype(np.float32)
    heavy = rng.standard_t(2, (97, 33)).astype(np.float32)  # odd K, heavy tails
    equal = np.full((64, 8), 0.5, np.float32)  # every pair at the maximum: the 7-bit worst case
    zeros = gauss.copy()
    zeros[:, 3] = 0.0
    return {"gauss": gauss, "heavy": heavy, "equal": equal, "zero-channel": zeros}


@pytest.mark.parametrize("name", ["gauss", "heavy", "equal", "zero-channel"])
def test_pair_bounded_grid_cannot_saturate_and_sits_between_7_and_8_bits(name):
    w = _weights()[name]
    q, scale = quantize_pair_bounded(w)
    assert is_saturation_free(q) and worst_pair(q).max() <= PAIR_LIMIT
    assert np.abs(q).max() <= 127
    err = np.linalg.norm(q * scale - w)
    amax = np.abs(w).max(axis=0)
    safe = np.where(amax > 0, amax, 1.0)
    q8 = np.clip(np.round(w / (safe / 127)), -127, 127) * (safe / 127)
    q7 = np.clip(np.round(w / (safe / 63)), -63, 63) * (safe / 63)
    assert np.linalg.norm(q8 - w) <= err * (1 + 1e-6)
    assert err <= np.linalg.norm(q7 - w) * (1 + 1e-6)


def test_fix_pairs_takes_the_excess_off_the_element_rounded_up_most():
    q = np.array([[127, 100, -90, 127], [127, 100, -60, -127]])
    target = np.array([[126.6, 99.9, -89.9, 127.0], [127.0, 99.6, -59.9, -127.0]])
    fixed, changed = fix_pairs(q, target)
    assert changed == 3  # the opposite-sign pair (127, -127) cannot saturate and stays
    np.testing.assert_array_equal(fixed[:, 3], [127, -127])
    np.testing.assert_array_equal(fixed[:, 0], [1, 127])  # 126.6 -> 127 went up most
    np.testing.assert_array_equal(fixed[:, 1], [100, 28])
    np.testing.assert_array_equal(fixed[:, 2], [-90, -38])
    assert is_saturation_free(fixed)


def test_quantize_weight_pair_axis_in_both_layouts():
    w = _weights()["heavy"]  # [K, N]
    q_kn, s_kn, _ = quantize_weight(w, QuantSpec("int8", axis=1, pair_axis=0))
    q_nk, s_nk, _ = quantize_weight(np.ascontiguousarray(w.T), QuantSpec("int8", axis=0, pair_axis=1))
    np.testing.assert_array_equal(q_kn, q_nk.T)
    np.testing.assert_array_equal(s_kn, s_nk)
    np.testing.assert_allclose(s_kn, pair_bounded_scale(w), rtol=0)
    plain, _, _ = quantize_weight(w, QuantSpec("int8", axis=1))
    assert not is_saturation_free(plain)  # the full grid saturates on these weights
    narrow, _, _ = quantize_weight(w, QuantSpec("int8", axis=1, pair_axis=0, value_bits=7))
    assert np.abs(narrow).max() <= 64  # narrowed weights keep their own grid


def _matmul_integer(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, list(a.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)], [numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return ir.make_session(model, optimize=True).run(None, {"a": a})[0]


@pytest.mark.parametrize("rows", [1, 7, 64])  # GEMV and GEMM paths
def test_vpmaddubsw_model_agrees_with_this_cpu(rows):
    rng = np.random.default_rng(rows)
    a = rng.integers(100, 256, (rows, 96), dtype=np.uint8)  # symmetric-uint8-like codes around 128+
    b = rng.integers(-127, 128, (96, 24), dtype=np.int8)
    model, saturated, _ = vpmaddubsw_matmul(a, b)
    exact = a.astype(np.int64) @ b.astype(np.int64)
    assert saturated > 0 and not np.array_equal(model, exact)  # the model must see the saturation
    got = _matmul_integer(a, b).astype(np.int64)
    info = machine_info()
    if SATURATING:
        np.testing.assert_array_equal(got, model, err_msg=f"VPMADDUBSW model vs {info['u8s8_kernel']}")
    else:
        np.testing.assert_array_equal(got, exact, err_msg=f"exact product vs {info['u8s8_kernel']}")
    safe_b, _ = quantize_pair_bounded(b.astype(np.float32))
    model_safe, sat_safe, _ = vpmaddubsw_matmul(a, safe_b)
    assert sat_safe == 0
    np.testing.assert_array_equal(_matmul_integer(a, safe_b.astype(np.int8)).astype(np.int64), model_safe)


def test_simulate_linear_rates():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (16, 64), dtype=np.uint8)
    full = rng.integers(-127, 128, (64, 12))
    stats = simulate_linear(a, 128, full)
    assert stats.pair_rate > 0 and stats.output_rate > 0 and stats.rel_error > 0
    safe, _ = quantize_pair_bounded(full.astype(np.float32))
    assert simulate_linear(a, 128, safe).to_dict() == {"pair_rate": 0.0, "output_rate": 0.0, "rel_error": 0.0}
    # int8 activations are shifted to uint8 by onnxruntime on x86: the same arithmetic
    signed = (a.astype(np.int16) - 128).astype(np.int8)
    assert simulate_linear(signed, 0, full) == stats


def test_simulate_linear_in_column_blocks_counts_the_same(monkeypatch):
    """A vocabulary head is simulated a few columns at a time: the rates do not depend on the split."""
    import edgeq.quantize.quant

    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (8, 40), dtype=np.uint8)
    full = rng.integers(-127, 128, (40, 33))
    w_zero_point = rng.integers(-3, 4, 33)
    whole = simulate_linear(a, 120, full, w_zero_point)
    monkeypatch.setattr(edgeq.quantize.quant, "COLUMN_BLOCK_ELEMENTS", 40 * 4)  # 9 blocks, the last one short
    split = simulate_linear(a, 120, full, w_zero_point)
    assert whole.pair_rate > 0
    assert split.pair_rate == whole.pair_rate and split.output_rate == whole.output_rate
    assert split.rel_error == pytest.approx(whole.rel_error, rel=1e-12)


def _calib_npz(model_path, path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (2, 1, 32))
    np.savez(path, input_ids=ids, attention_mask=np.ones_like(ids), position_ids=np.broadcast_to(np.arange(32), ids.shape))
    return path


@pytest.fixture(scope="module")
def tiny_compiled(tiny_models, tmp_path_factory):
    """tiny llama compiled with w8a8: default (u8s8-safe) and --target ort-cpu-vnni (full grid)."""
    tmp = tmp_path_factory.mktemp("sat")
    model = tiny_models["llama"]
    calib = _calib_npz(model, tmp / "calib.npz")
    outs = {}
    for name, extra in (("safe", []), ("full", ["--target", "ort-cpu-vnni"]), ("pow2", ["--target", "pow2-int"])):
        out = tmp / name
        assert main(["compile", str(model), "--recipe", "w8a8", "--calib", str(calib), "-o", str(out), *extra]) == 0
        outs[name] = out
    return outs


def test_compile_default_is_saturation_free_and_reports_rates(tiny_compiled):
    report = json.loads((tiny_compiled["safe"] / "report.json").read_text())
    u8s8 = report["u8s8"]
    assert u8s8["int8_weight_range"] == "u8s8-safe" and u8s8["guard"]["name"] == "u8s8-safe-weights"
    assert u8s8["linears"] > 0 and u8s8["saturation_free"] and u8s8["linears_at_risk"] == 0
    assert u8s8["max_pair_rate"] == 0.0 and u8s8["worst_pair"] <= PAIR_LIMIT
    assert set(next(iter(u8s8["per_linear"].values()))) == {"worst_pair", "pair_rate", "output_rate", "rel_error"}
    full = json.loads((tiny_compiled["full"] / "report.json").read_text())["u8s8"]
    assert full["int8_weight_range"] == "full-vnni-only" and full["guard"] is None
    assert full["linears_at_risk"] == full["linears"] and full["max_pair_rate"] > 0


def test_check_flags_full_range_weights_for_ort_cpu_only(tiny_compiled, capsys):
    full = tiny_compiled["full"] / "model.onnx"
    assert main(["check", str(full), "--target", "ort-cpu"]) == 3
    out = capsys.readouterr().out
    assert "u8s8-saturation" in out and "VPMADDUBSW" in out
    assert main(["check", str(full), "--target", "ort-cpu-vnni"]) == 0
    assert main(["check", str(tiny_compiled["safe"] / "model.onnx"), "--target", "ort-cpu"]) == 0


def test_guard_pass_repairs_a_full_range_graph(tiny_compiled):
    model = ir.load_model(tiny_compiled["full"] / "model.onnx")
    assert static_risk(find_u8s8_sites(gs.import_onnx(model)))
    pipeline = Pipeline([__import__("edgeq.passmanager.registry", fromlist=["get_pass"]).get_pass("u8s8-safe-weights")()])
    out, records = pipeline.run(model, PassContext())
    summary = records[0]["summary"]
    assert records[0]["modified"] and summary["weights_requantized"] == summary["u8s8_linears"] > 0
    assert 0 < summary["weight_rel_rms_error"] < 0.02
    assert not static_risk(find_u8s8_sites(gs.import_onnx(out)))
    assert check_model(out, load_target("ort-cpu")).clean
    again, rec2 = pipeline.run(out, PassContext())
    assert not rec2[0]["modified"]


def test_pow2_target_keeps_power_of_two_scales_and_is_saturation_free(tiny_compiled):
    model = onnx.load(str(tiny_compiled["pow2"] / "model.onnx"))
    assert check_model(model, load_target("pow2-int")).clean  # pow2 scales kept by the guard
    sites = find_u8s8_sites(gs.import_onnx(model))
    assert sites and not static_risk(sites)


def test_default_and_exact_qdq_agree_on_the_safe_graph(tiny_compiled):
    from edgeq.runtime.ort_session import open_session, session_options
    from toy import random_feeds

    path = tiny_compiled["safe"] / "model.onnx"
    kernels = open_session(path)
    exact = open_session(path, options=session_options(exact_qdq=True))
    feeds = random_feeds(kernels.get_inputs(), seed=3)
    k, e = kernels.run(None, feeds)[0], exact.run(None, feeds)[0]
    np.testing.assert_allclose(k, e, rtol=0, atol=1e-3 * float(np.abs(e).max()))
