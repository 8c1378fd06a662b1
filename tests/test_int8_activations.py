"""``int8-activations``: uint8 / uint16 activations become int8 / int16 with the zero point (and
any Clip bound on the integers) shifted by 128 / 32768. On tiny models quantized with w8a8
(uint8, zero point 128), uint16 symmetric and asymmetric, narrowed 6-bit uint8 (a Clip) and MUXQ
(integer Gather/Concat), and on a hand-built graph (Q/DQ without zero points, ``output_dtype``,
rounding ties and saturation at both ends, an integer graph output that must be left alone):
onnxruntime's outputs are bitwise unchanged, every activation encoding is the old one shifted, no
unsigned activation quantizer remains, a second run changes nothing, save/load keeps it; and
``compile --recipe w8a8 --target pow2-int`` now reaches the profile."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from lowering_checks import lower_checked, outputs
from toy import random_feeds, toy_model_dir, write_text

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.cli import main
from edgeq.passmanager.passbase import Exactness, PassContext
from edgeq.passes.int8_activations import _DATA_SLOTS
from edgeq.passes.muxq import MuxqConfig, MuxqPass
from edgeq.passes.qdq import QDQConfig, QDQPass
from edgeq.passmanager.pipeline import Pipeline, PipelineOptions
from edgeq.quantize.qdq_encodings import _PASS_THROUGH, collect_encodings
from edgeq.recipes import load_recipe
from edgeq.passmanager.registry import get_pass
from edgeq.targets import check_model, load_target

_SHIFT = {"uint8": ("int8", 128), "uint16": ("int16", 32768)}


def _ctx(model, tmp_path):
    specs = ir.make_session(model).get_inputs()
    data = CalibrationSet([random_feeds(specs, seed=s) for s in range(3)], "random:int8-activations", "random", samples=3)
    return PassContext(Calibrator(data, cache_dir=tmp_path / "cache"))


def _outputs(model, feeds):
    return outputs(model, feeds)


def _lower(model, feeds, tmp_path):
    """Run the pass verified; outputs bitwise equal; idempotent; save/load. Returns (model, record)."""
    out, record, _, rerun = lower_checked(model, "int8-activations", feeds, tmp_path, exact=True, external_data=False)
    return out, record


def _quantizer_dtypes(model):
    """Storage type of every QuantizeLinear's output (its zero point's, or output_dtype / uint8)."""
    inits = {t.name: t.data_type for t in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear":
            attrs = {a.name: a.i for a in n.attribute}
            elem = inits[n.input[2]] if len(n.input) > 2 and n.input[2] else attrs.get("output_dtype", TensorProto.UINT8)
            out.append(onnx.helper.tensor_dtype_to_np_dtype(elem).name)
    return out


def _assert_shifted(before, after):
    """Every activation encoding of ``before`` is in ``after``, signed, zero point and range shifted."""
    old, new = collect_encodings(before)["activations"], collect_encodings(after)["activations"]
    assert set(old) == set(new) and old
    for name, e in old.items():
        signed, shift = _SHIFT[e["dtype"]]
        n = new[name]
        assert n["dtype"] == signed and n["bits"] == e["bits"] and n["scale"] == e["scale"], name
        assert n["zero_point"] == [z - shift for z in e["zero_point"]], name
        assert (n["qmin"], n["qmax"]) == (e["qmin"] - shift, e["qmax"] - shift), name
    assert not collect_encodings(after)["unrepresented"]


def test_pass_through_ops_match_encodings():
    """The integer data-movement ops the pass follows are the ones the encodings reader follows."""
    assert set(_DATA_SLOTS) == set(_PASS_THROUGH)
    assert get_pass("int8-activations").exactness is Exactness.EXACT


def _recipe(name):
    return lambda: [spec.build() for spec in load_recipe(name).passes]


def _muxq_uint8():
    return [MuxqPass(MuxqConfig(threshold=0.5, max_fraction=0.25)), QDQPass(QDQConfig(activation_dtype="uint8"))]


@pytest.mark.parametrize("arch,build,dtype,clips", [
    ("llama", _recipe("w8a8"), "uint8", 0),
    ("gpt2", _recipe("w8a8"), "uint8", 0),
    ("llama", lambda: [QDQPass(QDQConfig(activation_dtype="uint16"))], "uint16", 0),
    ("llama", lambda: [QDQPass(QDQConfig(activation_dtype="uint16", activation_symmetric=False))], "uint16", 0),
    ("llama", lambda: [QDQPass(QDQConfig(activation_dtype="uint8", activation_symmetric=False, activation_bits=6))],
     "uint8", 9),
    ("llama", _muxq_uint8, "uint8", 0),  # low threshold: random weights have no real outliers
], ids=["w8a8-llama", "w8a8-gpt2", "uint16-symmetric", "uint16-asymmetric", "uint8-6bit-asymmetric", "muxq-uint8"])
def test_tiny_models_bitwise_equal(arch, build, dtype, clips, tiny_models, tmp_path):
    model = ir.load_model(tiny_models[arch])
    feeds = random_feeds(ir.make_session(model).get_inputs(), seed=11)
    quant, _ = Pipeline(build()).run(model, _ctx(model, tmp_path))
    n_q = len(_quantizer_dtypes(quant))
    assert set(_quantizer_dtypes(quant)) == {dtype}
    if build is _muxq_uint8:
        integers = {n.output[0] for n in quant.graph.node if n.op_type == "QuantizeLinear"}
        assert any(n.op_type == "Gather" and n.input[0] in integers for n in quant.graph.node)  # Gather/Concat on integers
    out, record = _lower(quant, feeds, tmp_path)
    summary = record["summary"]
    signed = _SHIFT[dtype][0]
    n_dq = sum(n.op_type == "DequantizeLinear" and n.input[0] not in {t.name for t in quant.graph.initializer}
               for n in quant.graph.node)
    assert summary == {"activations_shifted": {f"{dtype}->{signed}": n_q}, "quantizers_rewritten": n_q,
                       "dequantizers_rewritten": n_dq, "clips_rewritten": clips, "skipped": {}}
    assert set(_quantizer_dtypes(out)) == {signed}
    _assert_shifted(quant, out)
    weights = collect_encodings(out)["weights"]
    assert weights == collect_encodings(quant)["weights"]  # weights are symmetric-weights' business
    if dtype == "uint8" and clips == 0:
        assert not {k for k in check_model(out, load_target("pow2-int")).counts() if k.startswith("activation-")}


def _hand_model() -> onnx.ModelProto:
    """Opset 21. x -> Q (no zero point: uint8, 0) -> DQ (no zero point);
    x -> Q uint8 z=100 -> Clip [10, 200] -> Gather -> Concat with the clipped integers -> DQ;
    x -> Q (output_dtype uint16, no zero point) -> Reshape -> DQ z=0 (uint16);
    x -> Q uint8 z=128 whose integers are also a graph output (left alone) -> DQ."""
    inits = [
        numpy_helper.from_array(np.array(0.5, np.float32), "s"),
        numpy_helper.from_array(np.array(100, np.uint8), "z100"),
        numpy_helper.from_array(np.array(10, np.uint8), "lo"),
        numpy_helper.from_array(np.array(200, np.uint8), "hi"),
        numpy_helper.from_array(np.array([3, 0, 5], np.int64), "idx"),
        numpy_helper.from_array(np.array(0.001, np.float32), "s16"),
        numpy_helper.from_array(np.array(0, np.uint16), "z16"),
        numpy_helper.from_array(np.array([2, 8], np.int64), "shape"),
        numpy_helper.from_array(np.array(128, np.uint8), "z128"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s"], ["a_q"], name="a_Q"),
        helper.make_node("DequantizeLinear", ["a_q", "s"], ["a"], name="a_DQ"),
        helper.make_node("QuantizeLinear", ["x", "s", "z100"], ["b_q"], name="b_Q"),
        helper.make_node("Clip", ["b_q", "lo", "hi"], ["b_c"], name="b_clip"),
        helper.make_node("Gather", ["b_c", "idx"], ["b_g"], name="b_gather", axis=-1),
        helper.make_node("Concat", ["b_c", "b_g"], ["b_cat"], name="b_concat", axis=-1),
        helper.make_node("DequantizeLinear", ["b_cat", "s", "z100"], ["b"], name="b_DQ"),
        helper.make_node("QuantizeLinear", ["x", "s16"], ["c_q"], name="c_Q", output_dtype=TensorProto.UINT16),
        helper.make_node("Reshape", ["c_q", "shape"], ["c_r"], name="c_reshape"),
        helper.make_node("DequantizeLinear", ["c_r", "s16", "z16"], ["c"], name="c_DQ"),
        helper.make_node("QuantizeLinear", ["x", "s", "z128"], ["d_q"], name="d_Q"),
        helper.make_node("DequantizeLinear", ["d_q", "s", "z128"], ["d"], name="d_DQ"),
    ]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "hand", [helper.make_tensor_value_info("x", f, [2, 8])],
                              [helper.make_tensor_value_info("a", f, [2, 8]), helper.make_tensor_value_info("b", f, [2, 11]),
                               helper.make_tensor_value_info("c", f, [2, 8]), helper.make_tensor_value_info("d", f, [2, 8]),
                               helper.make_tensor_value_info("d_q", TensorProto.UINT8, [2, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_hand_model_defaults_clip_and_skips(tmp_path):
    model = _hand_model()
    onnx.checker.check_model(model)
    rng = np.random.default_rng(0)
    # halves (x / s exact ties, both parities), values far past both ends of every type, random
    grid = np.arange(-300, 300, dtype=np.float32) * 0.25
    feeds = [{"x": grid[i:i + 16].reshape(2, 8)} for i in range(0, grid.size - 16, 16)]
    feeds += [{"x": np.array([[-1e4, -70.0, -64.25, -64.0, 63.5, 63.75, 64.0, 1e4]] * 2, np.float32)}]
    feeds += [{"x": (rng.standard_normal((2, 8)) * 80).astype(np.float32)} for _ in range(8)]
    reference = [_outputs(model, f) for f in feeds]
    out, records = Pipeline([get_pass("int8-activations")()], PipelineOptions(verify=True)).run(model, PassContext())
    summary = records[0]["summary"]
    assert summary == {"activations_shifted": {"uint8->int8": 2, "uint16->int16": 1}, "quantizers_rewritten": 3,
                       "dequantizers_rewritten": 3, "clips_rewritten": 1, "skipped": {"integer graph output": 1}}
    for f, ref in zip(feeds, reference):
        for a, b in zip(ref, _outputs(out, f)):
            np.testing.assert_array_equal(b, a)
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    nodes = {n.name: n for n in out.graph.node}
    assert inits[nodes["a_Q"].input[2]].dtype == np.int8 and int(inits[nodes["a_Q"].input[2]]) == -128
    assert nodes["a_DQ"].input[2] == nodes["a_Q"].input[2]
    assert [int(inits[nodes["b_clip"].input[i]]) for i in (1, 2)] == [-118, 72]
    assert int(inits[nodes["b_Q"].input[2]]) == -28 and nodes["b_DQ"].input[2] == nodes["b_Q"].input[2]
    c_attrs = {a.name: a.i for a in nodes["c_Q"].attribute}
    assert c_attrs["output_dtype"] == TensorProto.INT16 and int(inits[nodes["c_Q"].input[2]]) == -32768
    assert int(inits[nodes["c_DQ"].input[2]]) == -32768 and inits[nodes["c_DQ"].input[2]].dtype == np.int16
    assert nodes["d_Q"].input[2] == "z128" and nodes["d_DQ"].input[2] == "z128"  # an interface: left alone
    again, records2 = Pipeline([get_pass("int8-activations")()]).run(out, PassContext())
    assert records2[0]["modified"] is False and records2[0]["summary"]["skipped"] == {"integer graph output": 1}
    loaded = ir.load_model(ir.save_model(out, tmp_path / "saved" / "model.onnx"))
    for f, ref in zip(feeds, reference):
        for a, b in zip(ref, _outputs(loaded, f)):
            np.testing.assert_array_equal(b, a)


# ---------------------------------------------------------------- the gap it closes

def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def test_compile_w8a8_reaches_pow2_int(tmp_path, capsys):
    model, calib = toy_model_dir(tmp_path / "toy"), write_text(tmp_path / "calib.txt", 400)
    out = tmp_path / "pow2"
    code, _, err = _run(capsys, "compile", model, "--recipe", "w8a8", "--calib", calib, "--seq-len", 16,
                        "--calib-windows", 3, "--no-cache", "-o", out, "--target", "pow2-int")
    assert code == 0, err
    target = json.loads((out / "report.json").read_text())["target"]
    assert target["check"]["clean"]
    lowering = {r["name"]: r for r in target["lowering"]}
    shifted = lowering["int8-activations"]
    assert shifted["modified"] and shifted["summary"]["activations_shifted"] == {"uint8->int8": 2}
    assert lowering["pow2-scales"]["modified"]
    code, text, _ = _run(capsys, "check", out / "model.onnx", "--target", "pow2-int")
    assert code == 0 and "clean for target 'pow2-int'" in text
    enc = collect_encodings(onnx.load(str(out / "model.onnx")))
    assert {e["dtype"] for e in enc["activations"].values()} == {"int8"}
