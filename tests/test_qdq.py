"""The qdq pass: equal to the numpy fake-quant reference, onnxruntime fuses it into integer
kernels, and its other settings (int4 groups, int16 activations, skipped roles) do what they say."""

import collections
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from toy import random_feeds, toy_lm

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.passmanager.passbase import PassContext
from edgeq.passmanager.pipeline import Pipeline
from edgeq.quantize.qdq_encodings import collect_encodings
from edgeq.quantize.quant import QuantSpec, dequantize_weight
from edgeq.quantize.sqnr import sqnr_db
from references import fake_quant
from edgeq.structure import find_linears
from edgeq.passes.qdq import QDQConfig, QDQPass


def _ctx(model, seeds=(0, 1, 2)):
    specs = ir.make_session(model).get_inputs()
    batches = [random_feeds(specs, seed=s) for s in seeds]
    return PassContext(Calibrator(CalibrationSet(batches, f"random:{seeds}", "random", len(batches)), use_cache=False))


def _compile(model, **cfg):
    out, records = Pipeline([QDQPass(QDQConfig(**cfg))]).run(model, _ctx(model))
    return out, records[0]


def test_matches_numpy_fake_quant_reference():
    model = toy_lm()
    out, _ = _compile(model, activation_dtype="int8")
    enc = collect_encodings(out)
    ids = np.random.default_rng(5).integers(0, 64, (1, 12))
    (got,) = ir.make_session(out).run(None, {"input_ids": ids})

    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    spec_a = QuantSpec("int8")

    def act(x, name):
        e = enc["activations"][name]
        return fake_quant(x, np.float32(e["scale"][0]), np.int8(e["zero_point"][0]), spec_a)

    def weight(name):
        (e,) = [e for k, e in enc["weights"].items() if k.startswith(name + "_")]
        q = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}[
            [k for k in enc["weights"] if k.startswith(name + "_")][0]]
        return dequantize_weight(q, np.array(e["scale"], np.float32), np.array(e["zero_point"], np.int8),
                                 QuantSpec("int8", axis=1))

    h0 = w["embed"][ids]
    h2 = np.maximum(act(h0, "h0") @ weight("w1"), 0)
    expect = act(h2, "h2") @ weight("w2")
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)
    assert sqnr_db(ir.make_session(model).run(None, {"input_ids": ids})[0], got) > 25


def _optimized_op_counts(model):
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        so.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)


def test_onnxruntime_fuses_every_linear_into_an_integer_kernel(tiny_models):
    """The recipe's pattern (uint8 symmetric activations) must become MatMulIntegerToFloat for
    every MatMul linear, q/k/v sharing one QuantizeLinear included (int8 activations would not:
    onnxruntime on x86 only fuses those where the Q has a single consumer)."""
    model = ir.load_model(tiny_models["llama"])
    n_linears = len(find_linears(ir.to_graph(model)))
    out, rec = _compile(model, activation_dtype="uint8")
    assert rec["summary"]["linears_quantized"] == n_linears
    counts = _optimized_op_counts(out)
    assert counts["MatMulIntegerToFloat"] == n_linears
    assert counts["DequantizeLinear"] == 0


def test_int4_groups_raise_opset_and_run(tiny_models):
    model = ir.load_model(tiny_models["llama"])
    out, rec = _compile(model, weight_dtype="int4", weight_granularity="group", group_size=16)
    assert ir.default_opset(out) == 21
    enc = collect_encodings(out)
    assert all(e["bits"] == 4 and e["granularity"] == "block" and e["block_size"] == 16 for e in enc["weights"].values())
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=7)
    ref = ir.make_session(model).run(None, feeds)[0]
    got = ir.make_session(out).run(None, feeds)[0]
    assert np.all(np.isfinite(got)) and sqnr_db(ref, got) > 5


def test_int16_activations(tiny_models):
    model = ir.load_model(tiny_models["qwen2"])
    out8, _ = _compile(model)
    out16, _ = _compile(model, activation_dtype="int16")
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=3)
    ref = ir.make_session(model).run(None, feeds)[0]
    err8 = sqnr_db(ref, ir.make_session(out8).run(None, feeds)[0])
    err16 = sqnr_db(ref, ir.make_session(out16).run(None, feeds)[0])
    assert err16 > err8  # 16-bit activations must be closer to float


def test_skip_roles_leaves_lm_head_float(tiny_models):
    model = ir.load_model(tiny_models["llama"])
    out, rec = _compile(model, skip_roles=("lm_head",))
    roles = rec["summary"]["roles"]
    assert "lm_head" not in roles and sum(roles.values()) == rec["summary"]["linears_quantized"]
    remaining = find_linears(ir.to_graph(out))
    assert [lin.role for lin in remaining] == ["lm_head"]


def test_bad_config_is_user_error():
    from edgeq.errors import UserInputError

    with pytest.raises(UserInputError, match="group_size"):
        QDQConfig(weight_granularity="group", group_size=24)


def test_role_activation_dtype_override(tiny_models):
    model = ir.load_model(tiny_models["llama"])
    out, rec = _compile(model, activation_dtype="uint8", role_activation_dtypes=("down_proj=int16",))
    enc = collect_encodings(out)
    down_inputs = {lin.input for lin in find_linears(ir.to_graph(model)) if lin.role == "down_proj"}
    assert set(down_inputs) <= set(enc["activations"])
    for name, e in enc["activations"].items():
        assert e["dtype"] == ("int16" if name in down_inputs else "uint8")
    assert ir.default_opset(out) == 21


def test_role_weight_dtype_override(tiny_models):
    """``role_weight_dtypes = ["lm_head=int8"]``: the head int8 per output channel, every other
    linear int4 in blocks of 64 along K (mquant-w4a16's form)."""
    model = ir.load_model(tiny_models["llama"])
    out, rec = _compile(model, activation_dtype="int16", weight_dtype="int4", weight_granularity="group", group_size=16,
                        role_weight_dtypes=("lm_head=int8",))
    graph = ir.to_graph(out)
    heads = {lin.node for lin in find_linears(ir.to_graph(model)) if lin.role == "lm_head"}
    assert heads
    seen = collections.Counter()
    for node in graph.nodes:
        if node.op == "DequantizeLinear" and isinstance(node.inputs[0], ir.gs.Constant) and node.inputs[0].values.ndim == 2:
            reader = node.outputs[0].outputs[0].name
            dtype = str(node.inputs[0].values.dtype)
            block = node.attrs.get("block_size", 0)
            seen["head" if reader in heads else "other"] += 1
            if reader in heads:
                assert dtype == "int8" and not block and node.inputs[1].values.ndim == 1, (dtype, block)
            else:
                assert block == 16, (reader, dtype, block)
    assert seen["head"] == len(heads) and seen["other"] > 0
    assert "per channel for {'lm_head': 'int8'}" in rec["summary"]["weight"]
    from edgeq.errors import UserInputError

    with pytest.raises(UserInputError, match="role=dtype"):
        QDQConfig(role_weight_dtypes=("lm_head=int16",))


def test_role_override_syntax_checked():
    from edgeq.errors import UserInputError

    with pytest.raises(UserInputError, match="role=dtype"):
        QDQConfig(role_activation_dtypes=("down_proj:int16",))


def test_narrow_bit_widths_match_the_numpy_reference():
    """6-bit activations and 5-bit weights inside int8 storage: the graph clips to the narrow
    range and equals the numpy fake-quant reference built from the same spec."""
    model = toy_lm()
    out, rec = _compile(model, activation_dtype="int8", activation_bits=6, weight_bits=5)
    assert "6-bit values" in rec["summary"]["activation"] and "5-bit values" in rec["summary"]["weight"]
    ids = np.random.default_rng(5).integers(0, 64, (1, 12))
    (got,) = ir.make_session(out).run(None, {"input_ids": ids})
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    enc = collect_encodings(out)
    spec_a = QuantSpec("int8", value_bits=6)
    assert (spec_a.qmin, spec_a.qmax) == (-32, 31)

    def act(x, name):
        e = enc["activations"][name]
        return fake_quant(x, np.float32(e["scale"][0]), np.int8(e["zero_point"][0]), spec_a)

    def weight(name):
        key = [k for k in enc["weights"] if k.startswith(name + "_")][0]
        q, e = inits[key], enc["weights"][key]
        assert np.abs(q).max() <= 15  # 5-bit symmetric values
        return dequantize_weight(q, np.array(e["scale"], np.float32), np.array(e["zero_point"], np.int8), QuantSpec("int8", axis=1))

    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    h0 = w["embed"][ids]
    h2 = np.maximum(act(h0, "h0") @ weight("w1"), 0)
    np.testing.assert_allclose(got, act(h2, "h2") @ weight("w2"), rtol=1e-5, atol=1e-5)
    # one Clip per activation site saturates at the 6-bit bounds (QuantizeLinear alone would at int8's)
    clip_nodes = [n for n in out.graph.node if n.op_type == "Clip"]
    assert len(clip_nodes) == 2


def test_per_token_dynamic_activations_match_the_numpy_reference():
    model = toy_lm()
    out, rec = _compile(model, activation_granularity="token", activation_bits=7)
    assert rec["summary"]["activation"].startswith("7-bit symmetric per-token dynamic")
    assert not QDQPass(QDQConfig(activation_granularity="token")).needs_calibration
    ids = np.random.default_rng(6).integers(0, 64, (2, 10))
    (got,) = ir.make_session(out).run(None, {"input_ids": ids})
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    enc = collect_encodings(out)
    assert not enc["activations"]  # no static activation parameters

    def act(x):
        s = np.maximum(np.abs(x).max(-1, keepdims=True) / 63.0, np.finfo(np.float32).tiny).astype(np.float32)
        return (np.clip(np.round(x / s), -63, 63) * s).astype(np.float32)

    def weight(name):
        key = [k for k in enc["weights"] if k.startswith(name + "_")][0]
        e = enc["weights"][key]
        return dequantize_weight(inits[key], np.array(e["scale"], np.float32), np.array(e["zero_point"], np.int8), QuantSpec("int8", axis=1))

    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    h2 = np.maximum(act(w["embed"][ids]) @ weight("w1"), 0)
    np.testing.assert_allclose(got, act(h2) @ weight("w2"), rtol=1e-5, atol=1e-5)


def test_narrow_bits_must_fit_the_storage_type():
    from edgeq.errors import UserInputError

    with pytest.raises(UserInputError):
        QDQConfig(activation_dtype="int8", activation_bits=9)
    with pytest.raises(UserInputError):
        QDQConfig(weight_dtype="int4", weight_bits=5)
    assert (QuantSpec("uint8", value_bits=7).qmin, QuantSpec("uint8", value_bits=7).qmax) == (0, 127)
