"""``int8-weights``: 4-bit (and 2-bit) integer weights behind DequantizeLinear become int8 with the
same dequantized values (int4 as is, uint4 shifted by 8 with its zero point). On tiny llama after
gptq (int4 symmetric and uint4 asymmetric, per channel and per group, one with int8 activation
Q/DQ too) and on a hand-built opset-25 graph (all 16 / 4 levels, per tensor / channel / block, a
DequantizeLinear without a zero point, a weight read by two DequantizeLinear nodes, a zero point
shared by two weights, int2 / uint2, a weight also read by a Cast, left alone; and an int4 graph
input, skipped): onnxruntime's outputs are bitwise unchanged, every weight encoding is the old one in
int8, no 4-bit tensor is left, a second run changes nothing, save/load keeps it."""

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from lowering_checks import lower_checked, outputs
from toy import random_feeds

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.passmanager.passbase import Exactness, PassContext
from edgeq.passes.qdq import QDQConfig, QDQPass
from edgeq.passmanager.pipeline import Pipeline, PipelineOptions
from edgeq.quantize.qdq_encodings import collect_encodings
from edgeq.passmanager.registry import get_pass

_NARROW = {TensorProto.INT4, TensorProto.UINT4, TensorProto.INT2, TensorProto.UINT2}
_SHIFT = {"int4": 0, "uint4": 8, "int2": 0, "uint2": 2}


def _ctx(model, tmp_path):
    specs = ir.make_session(model).get_inputs()
    batches = [random_feeds(specs, seed=s, seq=32) for s in range(3)]
    return PassContext(Calibrator(CalibrationSet(batches, "random:int8-weights", "random", 3), cache_dir=tmp_path / "cache"))


def _outputs(model, feeds):
    return outputs(model, feeds)


def _lower(model, feeds, tmp_path):
    """Run the pass verified; outputs bitwise equal; idempotent; save/load. Returns (model, record)."""
    out, record, _, rerun = lower_checked(model, "int8-weights", feeds, tmp_path, exact=True, external_data=False)
    assert rerun["summary"]["skipped"] == record["summary"]["skipped"]
    return out, record


def _narrow_tensors(model):
    return [t.name for t in model.graph.initializer if t.data_type in _NARROW]


def _assert_widened(before, after, skipped=()):
    """Every weight encoding of ``before`` is in ``after`` (by the float tensor the DQ makes) as
    int8, same scale and layout, integers and zero point shifted alike."""
    old = {e["float_name"]: e for e in collect_encodings(before)["weights"].values()}
    new = {e["float_name"]: e for e in collect_encodings(after)["weights"].values()}
    assert set(old) == set(new) and old
    for name, e in old.items():
        n = new[name]
        if name in skipped:
            assert n == e, name
            continue
        shift = _SHIFT[e["dtype"]]
        assert n["dtype"] == "int8" and n["scale"] == e["scale"], name
        for key in ("granularity", "axis", "block_size", "scale_shape", "shape"):
            assert n[key] == e[key], (name, key)
        assert n["zero_point"] == [z - shift for z in e["zero_point"]], name
    inits = {t.name: numpy_helper.to_array(t).astype(np.int64) for t in before.graph.initializer}
    inits.update({t.name: numpy_helper.to_array(t).astype(np.int64) for t in after.graph.initializer})
    q_old = {n.output[0]: n.input[0] for n in before.graph.node if n.op_type == "DequantizeLinear"}
    q_new = {n.output[0]: n.input[0] for n in after.graph.node if n.op_type == "DequantizeLinear"}
    for name, e in old.items():
        if name not in skipped:
            np.testing.assert_array_equal(inits[q_new[name]], inits[q_old[name]] - _SHIFT[e["dtype"]])


def test_is_exact():
    assert get_pass("int8-weights").exactness is Exactness.EXACT


def _gptq(**cfg):
    cls = get_pass("gptq")
    return [cls(cls.Config(**cfg))]


@pytest.mark.parametrize("build,dtype", [
    (lambda: _gptq(weight_granularity="channel"), "int4"),
    (lambda: _gptq(weight_granularity="group", group_size=32), "int4"),
    (lambda: _gptq(weight_dtype="uint4", weight_symmetric=False, weight_granularity="channel"), "uint4"),
    (lambda: _gptq(weight_dtype="uint4", weight_symmetric=False, weight_granularity="group", group_size=32), "uint4"),
    (lambda: _gptq(weight_granularity="group", group_size=32) + [QDQPass(QDQConfig(activation_dtype="int8"))], "int4"),
], ids=["int4-channel", "int4-group", "uint4-asymmetric-channel", "uint4-asymmetric-group", "int4-group-w4a8"])
def test_gptq_weights_bitwise_equal(build, dtype, tiny_models, tmp_path):
    model = ir.load_model(tiny_models["llama"])
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=11)
    quant, _ = Pipeline(build()).run(model, _ctx(model, tmp_path))
    narrow = set(_narrow_tensors(quant))  # weights and their zero points
    readers = [n for n in quant.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in narrow]
    weights = {n.input[0] for n in readers}
    assert len(weights) == 15
    out, record = _lower(quant, feeds, tmp_path)
    assert record["summary"] == {"weights_widened": {f"{dtype}->int8": len(weights)}, "dequantizers_rewritten": len(readers),
                                 "skipped": {}}
    assert not _narrow_tensors(out)
    assert not {e["dtype"] for e in collect_encodings(out)["weights"].values()} - {"int8"}
    _assert_widened(quant, out)
    assert collect_encodings(out)["activations"] == collect_encodings(quant)["activations"]


def _levels(dtype, shape, seed):
    """Every level of ``dtype`` at least once, then random ones."""
    lo, hi = {"int4": (-8, 7), "uint4": (0, 15), "int2": (-2, 1), "uint2": (0, 3)}[dtype]
    size = int(np.prod(shape))
    values = np.concatenate([np.arange(lo, hi + 1), np.random.default_rng(seed).integers(lo, hi + 1, size)])[:size]
    return values.reshape(shape).astype(getattr(ml_dtypes, dtype))


def _hand_model() -> onnx.ModelProto:
    """Opset 25, weights [8, 4]:
    wa int4 read by two DQs (per tensor without zero point; per channel with an int4 zero point);
    wb uint4 per channel without zero point (z = 0: gets -8);
    wc, wd uint4 blocked (axis 0, block 4) sharing one scale and one uint4 zero point;
    wf int2 per tensor (zero point -1), wg uint2 per tensor (zero point 1);
    we int4 also read by a Cast: left alone."""
    f32 = np.float32
    inits = [
        numpy_helper.from_array(_levels("int4", (8, 4), 0), "wa"),
        numpy_helper.from_array(np.array(0.25, f32), "sa"),
        numpy_helper.from_array(np.array([0.5, 0.125, 3.0, 1e-3], f32), "sa2"),
        numpy_helper.from_array(np.array([-8, 0, 7, 3], ml_dtypes.int4), "za"),
        numpy_helper.from_array(_levels("uint4", (8, 4), 1), "wb"),
        numpy_helper.from_array(np.array([0.5, 0.25, 0.3, 7.0], f32), "sb"),
        numpy_helper.from_array(_levels("uint4", (8, 4), 2), "wc"),
        numpy_helper.from_array(_levels("uint4", (8, 4), 3), "wd"),
        numpy_helper.from_array(np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]], f32), "sc"),
        numpy_helper.from_array(np.array([[0, 15, 8, 3], [7, 9, 1, 14]], ml_dtypes.uint4), "zc"),
        numpy_helper.from_array(_levels("int2", (8, 4), 4), "wf"),
        numpy_helper.from_array(np.array(-1, ml_dtypes.int2), "zf"),
        numpy_helper.from_array(_levels("uint2", (8, 4), 5), "wg"),
        numpy_helper.from_array(np.array(1, ml_dtypes.uint2), "zg"),
        numpy_helper.from_array(_levels("int4", (8, 4), 6), "we"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["wa", "sa"], ["a1"], name="a1_DQ"),
        helper.make_node("DequantizeLinear", ["wa", "sa2", "za"], ["a2"], name="a2_DQ", axis=1),
        helper.make_node("MatMul", ["x", "a1"], ["y"], name="matmul"),
        helper.make_node("DequantizeLinear", ["wb", "sb"], ["b"], name="b_DQ", axis=1),
        helper.make_node("DequantizeLinear", ["wc", "sc", "zc"], ["c"], name="c_DQ", axis=0, block_size=4),
        helper.make_node("DequantizeLinear", ["wd", "sc", "zc"], ["d"], name="d_DQ", axis=0, block_size=4),
        helper.make_node("DequantizeLinear", ["wf", "sa", "zf"], ["f"], name="f_DQ"),
        helper.make_node("DequantizeLinear", ["wg", "sa", "zg"], ["g"], name="g_DQ"),
        helper.make_node("DequantizeLinear", ["we", "sa"], ["e"], name="e_DQ"),
        helper.make_node("Cast", ["we"], ["e_cast"], name="e_cast", to=TensorProto.FLOAT),
    ]
    f = TensorProto.FLOAT
    outputs = [helper.make_tensor_value_info("y", f, [2, 4])]
    outputs += [helper.make_tensor_value_info(n, f, [8, 4]) for n in ("a1", "a2", "b", "c", "d", "f", "g", "e", "e_cast")]
    graph = helper.make_graph(nodes, "hand", [helper.make_tensor_value_info("x", f, [2, 8])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)], ir_version=13)


def test_hand_model_layouts_shared_and_skips(tmp_path):
    model = _hand_model()
    onnx.checker.check_model(model)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 8)).astype(np.float32)}
    out, record = _lower(model, feeds, tmp_path)
    assert record["summary"] == {
        "weights_widened": {"int4->int8": 1, "uint4->int8": 3, "int2->int8": 1, "uint2->int8": 1},
        "dequantizers_rewritten": 7, "skipped": {"weight read by Cast": 1}}
    _assert_widened(model, out, skipped={"e"})
    assert _narrow_tensors(out) == ["we"]  # the skipped one: also read as int4 by the Cast
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    nodes = {n.name: n for n in out.graph.node}
    assert nodes["a1_DQ"].input[0] == nodes["a2_DQ"].input[0] and len(nodes["a1_DQ"].input) == 2  # int4: no zero point needed
    assert inits[nodes["a2_DQ"].input[2]].dtype == np.int8 and inits[nodes["a2_DQ"].input[2]].tolist() == [-8, 0, 7, 3]
    assert inits[nodes["b_DQ"].input[2]].tolist() == [-8] * 4  # uint4 z = 0 made explicit
    assert nodes["c_DQ"].input[2] == nodes["d_DQ"].input[2] and nodes["c_DQ"].input[1] == "sc"  # shared zero point, same scale
    assert inits[nodes["c_DQ"].input[2]].tolist() == [[-8, 7, 0, -5], [-1, 1, -7, 6]]
    assert int(inits[nodes["f_DQ"].input[2]]) == -1 and int(inits[nodes["g_DQ"].input[2]]) == -1
    assert {a.name: a.i for a in nodes["c_DQ"].attribute} == {"axis": 0, "block_size": 4}
    assert nodes["e_DQ"].input[0] == "we"


def test_int4_graph_input_is_left_alone():
    """A DequantizeLinear of an int4 graph input (integers fed at run time) is not a weight to
    widen: skipped, and the model is unchanged (onnxruntime takes no int4 feeds from numpy, so
    only the verified session is built)."""
    dq = helper.make_node("DequantizeLinear", ["x4", "s"], ["h"], name="h_DQ")
    graph = helper.make_graph([dq], "input", [helper.make_tensor_value_info("x4", TensorProto.INT4, [8, 4])],
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, [8, 4])],
                              [numpy_helper.from_array(np.array(0.5, np.float32), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    out, records = Pipeline([get_pass("int8-weights")()], PipelineOptions(verify=True)).run(model, PassContext())
    assert records[0]["modified"] is False and records[0]["verified"]
    why = "no 4-bit/2-bit weight can be widened (1 left as they are: see skipped)"
    assert records[0]["not_applicable"] == {"reason": "no-sites", "detail": why}
    assert records[0]["summary"] == {"not_applicable": why, "weights_widened": {}, "dequantizers_rewritten": 0,
                                     "skipped": {"weight is a graph input": 1}}
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.INT4 and list(out.graph.node[0].input) == ["x4", "s"]


def test_widened_int4_weights_get_a_finer_power_of_two_grid(tiny_models, tmp_path):
    """pow2-scales after int8-weights: a symmetric weight using only [-8, 8] of int8 gets the
    smallest power of two holding its values, so the power-of-two grid is finer than its 4-bit one
    and the requantization error far below what ceil(s) on the 4-bit grid costs."""
    model = ir.load_model(tiny_models["llama"])
    quant, _ = Pipeline(_gptq(weight_granularity="channel")).run(model, _ctx(model, tmp_path))
    pow2 = get_pass("pow2-scales")
    _, direct = Pipeline([pow2()]).run(quant, PassContext())  # 4-bit grid, scale rounded up
    widened, records = Pipeline([get_pass("int8-weights")(), pow2()]).run(quant, PassContext())
    before = {k: np.asarray(e["scale"]) for k, e in collect_encodings(quant)["weights"].items()}
    after = list(collect_encodings(widened)["weights"].values())
    assert all(e["dtype"] == "int8" for e in after)
    for e in after:
        scale = np.asarray(e["scale"], np.float64)
        assert np.all(np.frexp(scale)[0] == 0.5)  # powers of two
    assert max(np.asarray(e["scale"]).max() for e in after) < min(s.min() for s in before.values())
    assert records[1]["summary"]["weight_rel_rms_error"] < 0.1 * direct[0]["summary"]["weight_rel_rms_error"]
