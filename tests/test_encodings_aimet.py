"""AIMET/QNN encodings export of graphs edgeq's own passes write, and encodings.json coverage.

The property that matters for a converter: for every exported encoding, AIMET's grid
``scale * (u + offset)``, ``0 <= u < 2**bw``, is exactly the ONNX grid ``(q - zp) * scale`` of
the Q/DQ in the graph (read here straight from the graph's tensors, not from collect_encodings),
under the name the converter sees.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from toy import random_feeds, toy_lm

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.artifacts.aimet import aimet_offsets, aimet_unsupported, export_aimet, write_aimet
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import PassContext
from edgeq.passes.qdq import QDQConfig, QDQPass
from edgeq.passmanager.pipeline import Pipeline
from edgeq.quantize.qdq_encodings import collect_encodings
from edgeq.quantize.quant import QuantSpec, quantize_weight
from edgeq.recipes import load_recipe
from edgeq.passmanager.registry import get_pass

_RANGES = {TensorProto.INT8: (-128, 127), TensorProto.UINT8: (0, 255), TensorProto.INT16: (-32768, 32767),
           TensorProto.UINT16: (0, 65535), TensorProto.INT4: (-8, 7), TensorProto.UINT4: (0, 15)}


def _ctx(model, seq=16):
    specs = ir.make_session(model).get_inputs()
    batches = [random_feeds(specs, seed=s, seq=seq) for s in range(3)]
    return PassContext(Calibrator(CalibrationSet(batches, "random:aimet", "random", len(batches)), use_cache=False))


def _run(model, passes):
    out, _ = Pipeline(passes).run(model, _ctx(model))
    return out


def _qdq(**cfg):
    return QDQPass(QDQConfig(**cfg))


# -- reading the graph independently of collect_encodings ----------------------------------------
def _graph_sites(model):
    """(kind, converter name, scale, zero point, qmin, qmax, block axis) of every Q and weight DQ."""
    inits = {t.name: t for t in model.graph.initializer}
    arr = {n: numpy_helper.to_array(t) for n, t in inits.items()}
    readers = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    sites = []
    for n in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "QuantizeLinear":
            lo, hi = _RANGES[inits[n.input[2]].data_type]
            clips = [r for r in readers.get(n.output[0], []) if r.op_type == "Clip"]
            if clips:
                lo, hi = int(arr[clips[0].input[1]]), int(arr[clips[0].input[2]])
            sites.append(("activation", n.input[0], arr[n.input[1]], arr[n.input[2]], lo, hi, None))
        elif n.op_type == "DequantizeLinear" and n.input[0] in inits:
            lo, hi = _RANGES[inits[n.input[0]].data_type]
            block_axis = attrs.get("axis", 1) if attrs.get("block_size") else None
            sites.append(("param", n.output[0], arr[n.input[1]], arr[n.input[2]], lo, hi, block_axis))
    return sites


def _aimet_entries(data):
    """kind -> name -> (scales, offsets, bw) of an AIMET dict of either version."""
    out = {}
    for kind in ("activation", "param"):
        table = data[f"{kind}_encodings"]
        if data["version"] == "1.0.0":
            out[kind] = {e["name"]: (e["scale"], e["offset"], e["bw"]) for e in table}
        else:
            out[kind] = {name: ([c["scale"] for c in chans], [c["offset"] for c in chans], chans[0]["bitwidth"])
                         for name, chans in table.items()}
    return out


def _assert_same_grids(model, data):
    """Every Q/DQ site of ``model`` is in ``data`` under its converter name with the same floats."""
    entries = _aimet_entries(data)
    sites = _graph_sites(model)
    assert sites
    for kind, name, scale, zp, qmin, qmax, block_axis in sites:
        scales, offsets, bw = entries[kind][name]
        raw_s, raw_z = np.asarray(scale, np.float32), np.asarray(zp).astype(np.int64)
        if block_axis == 0:  # AIMET 1.0.0 lists blocks channel-major
            raw_s, raw_z = raw_s.T, raw_z.T
        raw_s, raw_z = raw_s.ravel(), raw_z.ravel()
        assert len(scales) == len(offsets) == raw_s.size and 2**bw == qmax - qmin + 1
        q, u = np.arange(qmin, qmax + 1), np.arange(2**bw)
        for s_aimet, off, s, z in zip(scales, offsets, raw_s, raw_z):
            assert float(off) == int(off)
            onnx_grid = (q - z).astype(np.float32) * s
            aimet_grid = (u + int(off)).astype(np.float32) * np.float32(s_aimet)
            np.testing.assert_array_equal(aimet_grid, onnx_grid)
    n_sites = {k: len({s[1] for s in sites if s[0] == k}) for k in ("activation", "param")}
    assert {k: len(v) for k, v in entries.items()} == n_sites  # nothing extra exported


# -- the passes' graphs --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def w8a8(tiny_models):
    """The w8a8 recipe on tiny llama: per-channel symmetric int8 weights, uint8 symmetric activations."""
    model = ir.load_model(tiny_models["llama"])
    return _run(model, [spec.build() for spec in load_recipe("w8a8").passes])


@pytest.mark.parametrize("version", ["1.0.0", "0.6.1"])
def test_w8a8_recipe_exports_the_graphs_grids(w8a8, version):
    data = export_aimet(w8a8, version)
    assert data["version"] == version
    _assert_same_grids(w8a8, data)
    entries = _aimet_entries(data)
    for scales, offsets, bw in entries["param"].values():  # symmetric int8: AIMET's offset -128
        assert bw == 8 and len(scales) > 1 and set(offsets) == {-128}
    for scales, offsets, bw in entries["activation"].values():  # uint8, zero point 128
        assert bw == 8 and len(scales) == 1 and offsets == [-128]


def test_w8a8_version_fields(w8a8):
    v1 = export_aimet(w8a8, "1.0.0")
    assert set(v1) == {"version", "activation_encodings", "param_encodings"}
    p, a = v1["param_encodings"][0], v1["activation_encodings"][0]
    assert set(p) == set(a) == {"name", "dtype", "enc_type", "is_sym", "bw", "scale", "offset"}
    assert (p["dtype"], p["enc_type"], p["is_sym"]) == ("INT", "PER_CHANNEL", True)
    assert (a["enc_type"], a["is_sym"]) == ("PER_TENSOR", False)
    assert all(e["name"].endswith("_dequantized") for e in v1["param_encodings"])  # the float weight read
    legacy = export_aimet(w8a8, "0.6.1")
    for table in (legacy["param_encodings"], legacy["activation_encodings"]):
        for chans in table.values():
            for c in chans:
                assert set(c) == {"bitwidth", "dtype", "is_symmetric", "max", "min", "offset", "scale"}
                assert c["dtype"] == "int" and c["is_symmetric"] in ("True", "False") and isinstance(c["offset"], int)
                assert c["min"] == c["scale"] * c["offset"]
                assert c["max"] == c["scale"] * (2 ** c["bitwidth"] - 1 + c["offset"])
    assert {c["is_symmetric"] for chans in legacy["param_encodings"].values() for c in chans} == {"True"}


@pytest.mark.parametrize("version", ["1.0.0", "0.6.1"])
def test_signed_asymmetric_activations(version):
    """int8 activations with non-zero zero points: offset = qmin - zp (not -zp)."""
    out = _run(toy_lm(), [_qdq(activation_dtype="int8", activation_symmetric=False)])
    enc = collect_encodings(out)
    assert any(e["zero_point"] != [0] for e in enc["activations"].values())
    for e in enc["activations"].values():
        assert aimet_offsets(e) == [-128 - e["zero_point"][0]]
    data = export_aimet(out, version)
    _assert_same_grids(out, data)
    if version == "1.0.0":
        assert not any(e["is_sym"] for e in data["activation_encodings"])  # stored unsigned by the converter


def test_qdq_per_tensor_weights():
    out = _run(toy_lm(), [_qdq(weight_granularity="tensor")])
    _assert_same_grids(out, export_aimet(out))


@pytest.mark.parametrize("version", ["1.0.0", "0.6.1"])
def test_per_tensor_weight(version):
    """A per-tensor asymmetric int8 weight DQ, hand-built."""
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    q, scale, zp = quantize_weight(w, QuantSpec("int8", symmetric=False))
    inits = [numpy_helper.from_array(q, "w_int8"), numpy_helper.from_array(np.asarray(scale, np.float32), "w_scale"),
             numpy_helper.from_array(np.asarray(zp), "w_zp")]
    nodes = [helper.make_node("DequantizeLinear", ["w_int8", "w_scale", "w_zp"], ["w_f"], name="dq_w"),
             helper.make_node("MatMul", ["x", "w_f"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "pt", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    data = export_aimet(model, version)
    _assert_same_grids(model, data)
    offset = -128 - int(zp)
    if version == "1.0.0":
        assert data["param_encodings"] == [{"name": "w_f", "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": False,
                                            "bw": 8, "scale": [float(scale)], "offset": [float(offset)]}]
    else:
        (chan,) = data["param_encodings"]["w_f"]
        assert (chan["offset"], chan["is_symmetric"], chan["min"]) == (offset, "False", float(scale) * offset)


def test_int16_and_narrow_activations_keep_their_width():
    out16 = _run(toy_lm(), [_qdq(activation_dtype="int16")])
    data = export_aimet(out16)
    _assert_same_grids(out16, data)
    assert {(e["bw"], e["is_sym"], e["offset"][0]) for e in data["activation_encodings"]} == {(16, True, -32768.0)}
    narrow = _run(toy_lm(), [_qdq(activation_dtype="int8", activation_bits=6)])  # Clip to [-32, 31]
    data = export_aimet(narrow, "0.6.1")
    _assert_same_grids(narrow, data)
    assert {c[0]["bitwidth"] for c in data["activation_encodings"].values()} == {6}


def test_uint4_asymmetric_blocks():
    out = _run(toy_lm(), [_qdq(weight_dtype="uint4", weight_symmetric=False, weight_granularity="group", group_size=16)])
    data = export_aimet(out, "1.0.0")
    _assert_same_grids(out, data)
    assert {(e["enc_type"], e["bw"], e["is_sym"], e["block_size"]) for e in data["param_encodings"]} == {("PER_BLOCK", 4, False, 16)}


@pytest.fixture(scope="module")
def gptq_int4(tiny_models):
    model = ir.load_model(tiny_models["llama"])
    gptq = get_pass("gptq")
    return _run(model, [gptq(gptq.Config(weight_dtype="int4", weight_granularity="group", group_size=32))])


def test_gptq_int4_groups_export_per_block(gptq_int4):
    data = export_aimet(gptq_int4, "1.0.0")
    _assert_same_grids(gptq_int4, data)
    params = data["param_encodings"]
    assert params and not data["activation_encodings"]
    for e in params:
        assert (e["enc_type"], e["bw"], e["is_sym"], e["block_size"]) == ("PER_BLOCK", 4, True, 32)
        assert set(e["offset"]) == {-8.0}


def test_per_block_has_no_legacy_form(gptq_int4):
    with pytest.raises(UserInputError, match="0.6.1"):
        export_aimet(gptq_int4, "0.6.1")
    skipped = aimet_unsupported(gptq_int4, "0.6.1")
    assert skipped and all("1.0.0" in why for why in skipped.values())
    assert export_aimet(gptq_int4, "0.6.1", strict=False)["param_encodings"] == {}
    assert aimet_unsupported(gptq_int4, "1.0.0") == {}


@pytest.mark.parametrize("recipe", ["muxq-w8a8", "mquant-w4a8", "resq-w4a8", "w8a16"])
def test_other_recipes_export_every_site(tiny_models, recipe):
    """MUXQ's Gather/Concat on integers, MSQ, ResQ's split weights, int16 activations: every Q/DQ
    is described (nothing unrepresented) and exports with the graph's grid."""
    model = ir.load_model(tiny_models["llama"])
    out = _run(model, [spec.build() for spec in load_recipe(recipe).passes])
    assert collect_encodings(out)["unrepresented"] == {}
    _assert_same_grids(out, export_aimet(out, "1.0.0"))


def test_write_aimet_from_encodings_json(w8a8, tmp_path):
    enc_file = tmp_path / "encodings.json"
    enc_file.write_text(json.dumps(collect_encodings(w8a8)))
    path = write_aimet(tmp_path / "model.encodings", enc_file, "1.0.0")
    assert json.loads(path.read_text()) == export_aimet(w8a8, "1.0.0")
    with pytest.raises(UserInputError, match="version"):
        export_aimet(w8a8, "2.0.0")


# -- hand-built graphs: FP8, integer graph inputs, run-time scales ------------------------------
def _fp8_and_oddities():
    """x -> Q/DQ(fp8) -> MatMul(w); kv (int8 graph input) -> DQ; y -> Q(run-time scale) -> DQ."""
    s = numpy_helper.from_array(np.array(0.5, np.float32), "s")
    z8 = numpy_helper.from_array(np.zeros((), ml_dtypes.float8_e4m3fn), "z8")
    zi = numpy_helper.from_array(np.array(3, np.int8), "zi")
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z8"], ["xq"], name="q_fp8"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z8"], ["xd"], name="dq_fp8"),
        helper.make_node("MatMul", ["xd", "w"], ["y"], name="mm"),
        helper.make_node("DequantizeLinear", ["kv", "s", "zi"], ["kv_f"], name="dq_kv"),
        helper.make_node("ReduceMax", ["y"], ["ys"], name="amax", keepdims=0),
        helper.make_node("QuantizeLinear", ["y", "ys", "zi"], ["yq"], name="q_dyn"),
        helper.make_node("DequantizeLinear", ["yq", "ys", "zi"], ["yd"], name="dq_dyn"),
    ]
    graph = helper.make_graph(
        nodes, "odd", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                       helper.make_tensor_value_info("kv", TensorProto.INT8, [2, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("yd", "kv_f")], [s, z8, zi, w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_every_q_and_dq_is_accounted_for():
    enc = collect_encodings(_fp8_and_oddities())
    assert enc["activations"]["x"]["dtype"] == "float8e4m3fn" and enc["activations"]["x"]["qmin"] is None
    kv = enc["activations"]["kv_f"]  # keyed by the float tensor the DQ produces
    assert (kv["dtype"], kv["zero_point"], kv["qmin"], kv["qmax"]) == ("int8", [3], -128, 127)
    assert set(enc["unrepresented"]) == {"q_dyn"}  # dq_fp8 is covered by q_fp8; dq_dyn by q_dyn's note
    assert "run time" in enc["unrepresented"]["q_dyn"]["reason"]


def test_fp8_is_refused_or_left_out():
    model = _fp8_and_oddities()
    with pytest.raises(UserInputError, match="float8e4m3fn"):
        export_aimet(model)
    data = export_aimet(model, strict=False)
    assert [e["name"] for e in data["activation_encodings"]] == ["kv_f"]
    assert data["activation_encodings"][0]["offset"] == [-131.0]  # int8 zero point 3
    assert set(aimet_unsupported(model)) == {"x"}


def test_a_dq_with_other_parameters_than_its_q_is_reported():
    model = _fp8_and_oddities()
    other = numpy_helper.from_array(np.array(0.25, np.float32), "s2")
    model.graph.initializer.append(other)
    dq = next(n for n in model.graph.node if n.name == "dq_fp8")
    dq.input[1] = "s2"
    enc = collect_encodings(model)
    assert "differ" in enc["unrepresented"]["dq_fp8"]["reason"]
