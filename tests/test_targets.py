"""Target profiles and ``edgeq check`` / ``compile --target``: profiles load and reject typos; the
checker flags each kind of violation on a hand-built model and on tiny models (w8a8 is clean for
generic-qdq; rotate's OnlineHadamard is not until expand-functions; a non-power-of-two scale is
flagged by pow2-int until pow2-scales; a NaN weight is finite-initializer on any profile); the CLI exits
0 / 3 / 2 and writes nothing on refusal."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from toy import random_feeds, toy_model_dir, write_text

from edgeq.graph import ir
from edgeq.calib.session import CalibrationSet, Calibrator
from edgeq.cli import main
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import PassContext
from edgeq.passes.qdq import QDQConfig, QDQPass
from edgeq.passmanager.pipeline import Pipeline
from edgeq.recipes import load_recipe
from edgeq.passmanager.registry import get_pass
from edgeq.targets import builtin_target_names, check_model, load_target, parse_target

BUILTINS = ["generic-qdq", "ort-cpu", "ort-cpu-kernels", "ort-cpu-vnni", "ort-genai", "pow2-int", "qnn-htp"]


# ---------------------------------------------------------------- profiles

def test_builtin_profiles_load():
    assert builtin_target_names() == BUILTINS
    ort, generic, htp, pow2 = (load_target(n) for n in ("ort-cpu", "generic-qdq", "qnn-htp", "pow2-int"))
    assert ort.lowering == () and ort.allows_op("edgeq", "OnlineHadamard") and ort.allows_op("com.microsoft", "MatMulNBits")
    assert generic.lowering == ("expand-functions", "matmulnbits-to-qdq") and not generic.allows_op("edgeq", "OnlineHadamard")
    assert not generic.allows_op("com.microsoft", "MatMulNBits") and generic.activations.allows_dtype("int16")
    assert generic.allows_op("", "NonMaxSuppression") and not generic.weights.symmetric
    assert htp.activations.allows_dtype("uint16") and htp.activations.max_bits == 16 and htp.weights.symmetric
    assert not htp.allows_op("", "Shape") and htp.allows_op("", "MatMul")
    assert pow2.power_of_two_scales
    # full-range int8 weights only where the target says the CPU cannot saturate them (or runs no CPU kernel: the HTP)
    assert [load_target(n).int8_weight_range for n in BUILTINS] == ["u8s8-safe"] * 3 + ["full-vnni-only"] * 2 + ["u8s8-safe"] + ["full-vnni-only"]
    assert pow2.lowering == ("expand-functions", "matmulnbits-to-qdq", "int8-activations", "int8-weights", "symmetric-weights", "pow2-scales")
    assert htp.lowering == ("expand-functions", "matmulnbits-to-qdq", "symmetric-weights", "positive-weight-scales", "outer-product-to-mul",
                            "fp16-safe-norms", "gather-table-qdq", "linear-output-qdq")
    assert htp.node_units and htp.vendor == "qnn-htp" and not generic.node_units and generic.vendor == ""
    genai = load_target("ort-genai")  # a writer target (edgeq.genai): 4-bit weights brought to DQ form, then repacked
    assert genai.vendor == "ort-genai" and genai.lowering == ("matmulnbits-to-qdq",)
    assert pow2.activations.dtypes == {"int8"} and pow2.weights.dtypes == {"int8"}


def _profile_text(**overrides):
    """A valid profile as TOML, with top-level keys or [weights] keys (prefixed w_) replaced
    (None: removed)."""
    top = {"description": '"t"', "lowering": "[]", "ops": '["*"]', "edgeq_ops": "[]", "domains": "[]",
           "dtypes": '["float32"]', "power_of_two_scales": "false"}
    weights = {"dtypes": '["int8"]', "symmetric": "true", "granularity": '["channel"]'}
    for key, value in overrides.items():
        table, key = (weights, key[2:]) if key.startswith("w_") else (top, key)
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value
    lines = [f"{k} = {v}" for k, v in top.items()]
    lines += ["[activations]", 'dtypes = ["int8"]', "symmetric = false", 'granularity = ["tensor"]', "[weights]"]
    lines += [f"{k} = {v}" for k, v in weights.items()]
    return "\n".join(lines) + "\n"


def test_minimal_profile_parses():
    p = parse_target(_profile_text(), "mini")
    assert p.name == "mini" and p.ops is None and p.weights.granularity == {"channel"}


@pytest.mark.parametrize("overrides,needle", [
    ({"colour": '"red"'}, "unknown key(s) colour"),
    ({"w_bits": "8"}, "[weights]: unknown key(s) bits"),
    ({"dtypes": None}, "missing key(s) dtypes"),
    ({"ops": '["Matmul"]'}, "ops onnx does not know: Matmul"),
    ({"ops": '["*", "MatMul"]'}, "takes \"*\" alone"),
    ({"edgeq_ops": '["FastHadamard"]'}, "unknown edgeq ops FastHadamard"),
    ({"domains": '["edgeq"]'}, "other domains only"),
    ({"dtypes": '["int7"]'}, "unknown dtype(s) int7"),
    ({"lowering": '["warp-drive"]'}, "unknown pass 'warp-drive'"),
    ({"power_of_two_scales": '"yes"'}, "'power_of_two_scales' must be bool"),
    ({"w_granularity": '["row"]'}, "granularity must list some of"),
    ({"w_symmetric": "1"}, "'symmetric' must be bool"),
    ({"description": "= ="}, "invalid TOML"),
])
def test_bad_profiles(overrides, needle):
    with pytest.raises(UserInputError) as exc:
        parse_target(_profile_text(**overrides), "bad", source="bad.toml")
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_profile_by_path_and_unknown_name(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(_profile_text())
    assert load_target(str(path)).name == "mine"
    with pytest.raises(UserInputError, match="unknown target 'npu9'.*generic-qdq"):
        load_target("npu9")
    with pytest.raises(UserInputError, match="not found"):
        load_target(str(tmp_path / "nope.toml"))


# ---------------------------------------------------------------- the checker on a hand-built model

def _hand_model() -> onnx.ModelProto:
    """x -> Q/DQ uint16 asymmetric (scale 0.0123) -> MatMul with an int8 per-channel weight (zero
    point 3 on channel 0, scales 0.01 / 0.02 / 0.25 / 0.5) -> Q/DQ per-channel int8 (power-of-two)
    -> MatMul with an int4 blocked weight -> Cast to float64 (an output), plus a Shape output."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.array(0.0123, np.float32), "s_a"),
        numpy_helper.from_array(np.array(5, np.uint16), "zp_a"),
        numpy_helper.from_array(rng.integers(-100, 100, (8, 4)).astype(np.int8), "W1"),
        numpy_helper.from_array(np.array([0.01, 0.02, 0.25, 0.5], np.float32), "W1_scale"),
        numpy_helper.from_array(np.array([3, 0, 0, 0], np.int8), "W1_zp"),
        numpy_helper.from_array(np.full(4, 0.5, np.float32), "s_h"),
        numpy_helper.from_array(np.zeros(4, np.int8), "zp_h"),
        helper.make_tensor("W2", TensorProto.INT4, [4, 4], rng.integers(-8, 8, 16).tolist()),
        numpy_helper.from_array(np.full((2, 4), 0.125, np.float32), "W2_scale"),
        helper.make_tensor("W2_zp", TensorProto.INT4, [2, 4], [0] * 8),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s_a", "zp_a"], ["xq"], name="x_Q"),
        helper.make_node("DequantizeLinear", ["xq", "s_a", "zp_a"], ["xd"], name="x_DQ"),
        helper.make_node("DequantizeLinear", ["W1", "W1_scale", "W1_zp"], ["w1"], name="W1_DQ", axis=1),
        helper.make_node("MatMul", ["xd", "w1"], ["h"], name="mm1"),
        helper.make_node("QuantizeLinear", ["h", "s_h", "zp_h"], ["hq"], name="h_Q", axis=1),
        helper.make_node("DequantizeLinear", ["hq", "s_h", "zp_h"], ["hd"], name="h_DQ", axis=1),
        helper.make_node("DequantizeLinear", ["W2", "W2_scale", "W2_zp"], ["w2"], name="W2_DQ", axis=0, block_size=2),
        helper.make_node("MatMul", ["hd", "w2"], ["y"], name="mm2"),
        helper.make_node("Cast", ["y"], ["y64"], name="to_double", to=TensorProto.DOUBLE),
        helper.make_node("Shape", ["y"], ["y_shape"], name="shape"),
    ]
    graph = helper.make_graph(nodes, "hand", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y64", TensorProto.DOUBLE, [2, 4]),
                               helper.make_tensor_value_info("y_shape", TensorProto.INT64, [2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _rules(result) -> dict[str, list[str]]:
    out = {}
    for v in result.violations:
        out.setdefault(v.rule, []).append(v.message)
    return out


def test_hand_model_runs_and_is_clean_for_ort_cpu():
    model = _hand_model()
    onnx.checker.check_model(model)
    ir.make_session(model).run(None, {"x": np.ones((2, 8), np.float32)})
    assert check_model(model, load_target("ort-cpu")).clean


def test_check_flags_every_kind_on_pow2_int():
    rules = _rules(check_model(_hand_model(), load_target("pow2-int")))
    assert rules["activation-bits"] == ["activation x (x_Q): activation bits 16 > 8 (uint16)"]
    assert rules["activation-granularity"] == ["activation h (h_Q): per-channel scales not allowed by pow2-int (allowed: tensor)"]
    assert "activation-dtype" not in rules  # h is int8: allowed
    assert rules["weight-symmetric"] == ["weight W1 zero point 3: asymmetric weights not allowed by pow2-int"]
    assert any("weight W2: dtype int4 not allowed" in m for m in rules["weight-dtype"])
    assert rules["weight-granularity"] == ["weight W2: per-block scales not allowed by pow2-int (allowed: channel, tensor)"]
    assert sorted(rules["pow2-scale"]) == [
        "DequantizeLinear W1_DQ scale 0.01 is not a power of two (2 of 4 scales)",
        "DequantizeLinear x_DQ scale 0.0123 is not a power of two",
        "QuantizeLinear x_Q scale 0.0123 is not a power of two",
    ]
    assert rules["dtype"] == ["tensor y64: dtype float64 not allowed by pow2-int (allowed: bool, float32, int32, int64, int8)"]
    assert "op" not in rules


def test_check_flags_ops_and_domains():
    model = _hand_model()
    htp = _rules(check_model(model, load_target("qnn-htp")))
    assert htp["op"] == ["node shape: op Shape is not in qnn-htp's op set"]
    assert "activation-bits" not in htp  # 16-bit activations are fine on HTP
    assert "activation-dtype" not in htp  # int8 activations too (onnxruntime-qnn 2.7.0 takes them: tests/test_qnn_vendor.py)
    assert htp["weight-symmetric"] and "pow2-scale" not in htp
    assert "weight-granularity" not in htp and "partial-block" not in htp  # W2: int4 in whole blocks (K 4, blocks of 2)
    model.graph.node.append(helper.make_node("Gelu", ["y"], ["g"], name="contrib", domain="com.microsoft"))
    model.graph.node.append(helper.make_node("OnlineHadamard", ["y", "k", "p"], ["z"], name="had", domain="edgeq"))
    generic = _rules(check_model(model, load_target("generic-qdq")))
    assert generic["op"] == ["node contrib: op com.microsoft::Gelu: domain com.microsoft not supported by generic-qdq",
                             "node had: op edgeq::OnlineHadamard not run natively by generic-qdq"]
    assert "activation-bits" not in generic  # 16-bit QDQ is standard ONNX (opset 21)
    assert _rules(check_model(model, load_target("pow2-int")))["activation-bits"] == [
        "activation x (x_Q): activation bits 16 > 8 (uint16)"]
    assert "weight-symmetric" not in generic
    assert not _rules(check_model(model, load_target("ort-cpu"))).get("op")


def test_check_flags_non_finite_weights_once():
    """``finite-initializer``: a float weight with NaN or inf, whatever the profile; a Q/DQ scale
    with NaN is ``finite-scale`` only (which names the node); a -inf scalar is not a weight."""
    model = _hand_model()
    bias = np.zeros((2, 4), np.float32)
    bias[1, 2] = np.inf
    model.graph.initializer.extend([numpy_helper.from_array(bias, "bias"),
                                    numpy_helper.from_array(np.array(-np.inf, np.float32), "floor")])
    model.graph.node.extend([helper.make_node("Add", ["y", "bias"], ["yb"], name="add_bias"),
                             helper.make_node("Max", ["yb", "floor"], ["ym"], name="floor_max")])
    model.graph.output.append(helper.make_tensor_value_info("ym", TensorProto.FLOAT, [2, 4]))
    scale = next(t for t in model.graph.initializer if t.name == "W1_scale")
    scale.CopyFrom(numpy_helper.from_array(np.array([0.01, np.nan, 0.25, 0.5], np.float32), "W1_scale"))
    for target in ("ort-cpu", "generic-qdq"):
        rules = _rules(check_model(model, load_target(target)))
        assert rules["finite-initializer"] == ["initializer 'bias' holds 1 inf among its 8 values (first at index "
                                               "[1, 2]): every value computed from it is NaN or inf, on any target"]
        assert [m.split(":")[0] for m in rules["finite-scale"]] == ["DequantizeLinear W1_DQ"]


# ---------------------------------------------------------------- tiny models

def _ctx(model, tmp_path):
    specs = ir.make_session(model).get_inputs()
    data = CalibrationSet([random_feeds(specs, seed=s) for s in range(3)], "random:targets", "random", samples=3)
    return PassContext(Calibrator(data, cache_dir=tmp_path / "cache"))


def _recipe(name):
    return [spec.build() for spec in load_recipe(name).passes]


def test_w8a8_is_clean_for_generic_qdq(tiny_models, tmp_path):
    model = ir.load_model(tiny_models["llama"])
    out, _ = Pipeline(_recipe("w8a8")).run(model, _ctx(model, tmp_path))
    assert check_model(out, load_target("generic-qdq")).clean
    assert check_model(out, load_target("ort-cpu")).clean


def test_rotate_needs_expand_functions_for_generic_qdq(tiny_models, tmp_path):
    model = ir.load_model(tiny_models["llama"])
    out, _ = Pipeline(_recipe("quarot-w8a8")).run(model, _ctx(model, tmp_path))
    generic = load_target("generic-qdq")
    result = check_model(out, generic)
    assert result.counts() == {"op": 2}
    assert all("op edgeq::OnlineHadamard not run natively by generic-qdq" in v.message for v in result.violations)
    assert check_model(out, load_target("ort-cpu")).clean
    lowered, _ = Pipeline([get_pass(n)() for n in generic.lowering]).run(out, PassContext())
    assert check_model(lowered, generic).clean


def test_pow2_scales_makes_int8_model_clean_for_pow2_int(tiny_models, tmp_path):
    model = ir.load_model(tiny_models["llama"])
    out, _ = Pipeline([QDQPass(QDQConfig(activation_dtype="int8"))]).run(model, _ctx(model, tmp_path))
    pow2 = load_target("pow2-int")
    assert set(check_model(out, pow2).counts()) == {"pow2-scale"}
    lowered, records = Pipeline([get_pass(n)() for n in pow2.lowering]).run(out, PassContext())
    assert [r["modified"] for r in records] == [False, False, False, False, False, True]
    assert check_model(lowered, pow2).clean


# ---------------------------------------------------------------- CLI

@pytest.fixture
def toy(tmp_path):
    return toy_model_dir(tmp_path / "toy"), write_text(tmp_path / "calib.txt", 400)


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def _compile(capsys, toy, out, *extra, recipe="w8a8"):
    model, calib = toy
    return _run(capsys, "compile", model, "--recipe", recipe, "--calib", calib, "--seq-len", 16, "--calib-windows", 3,
                "--no-cache", "-o", out, *extra)


def test_targets_lists_builtins(capsys):
    code, out, _ = _run(capsys, "targets")
    assert code == 0
    lines = out.strip().splitlines()
    assert [line.split()[0] for line in lines] == BUILTINS
    assert "[lowering: expand-functions,matmulnbits-to-qdq,int8-activations,int8-weights,symmetric-weights,pow2-scales]" in lines[BUILTINS.index("pow2-int")]


def test_check_exit_codes(toy, tmp_path, capsys):
    out = tmp_path / "w8a8"
    assert _compile(capsys, toy, out)[0] == 0
    code, text, _ = _run(capsys, "check", out / "model.onnx", "--target", "generic-qdq")
    assert code == 0 and "clean for target 'generic-qdq'" in text
    code, text, _ = _run(capsys, "check", out / "model.onnx", "--target", "pow2-int")
    lines = text.strip().splitlines()
    assert code == 3
    assert "activation h0 (h0_QuantizeLinear): dtype uint8 not allowed by pow2-int (allowed: int8)" in lines
    assert any(line.startswith("QuantizeLinear h0_QuantizeLinear scale ") and "is not a power of two" in line for line in lines)
    assert lines[-1].endswith("8 violation(s) of target 'pow2-int' (activation-dtype: 2, pow2-scale: 6)")
    code, text, _ = _run(capsys, "check", out / "model.onnx", "--target", "pow2-int", "--json")
    report = json.loads(text)
    assert code == 3 and not report["clean"] and report["counts"] == {"activation-dtype": 2, "pow2-scale": 6}
    assert {"subject", "rule", "message"} == set(report["violations"][0])
    for argv, needle in [((tmp_path / "nope.onnx", "--target", "generic-qdq"), "model file not found"),
                         ((out / "model.onnx", "--target", "npu9"), "unknown target 'npu9'")]:
        code, _, err = _run(capsys, "check", *argv)
        assert code == 2 and len(err.splitlines()) == 1 and needle in err


def test_check_reports_a_nan_weight_as_compile_names_it(tiny_models, tmp_path, capsys):
    """The tiny llama with a NaN in its embedding table (which w8a8 leaves in float): ``check`` exits 3
    with the line ``compile`` refuses it with (exit 2), for every profile; the model itself is clean
    of the rule (its two Constant -inf are masks)."""
    model = ir.load_model(tiny_models["llama"])
    table = next(t for t in model.graph.initializer if t.name == "model.embed_tokens.weight")
    values = numpy_helper.to_array(table).copy()
    values[255, 3] = np.nan
    table.CopyFrom(numpy_helper.from_array(values, table.name))
    path = ir.save_model(model, tmp_path / "nan" / "model.onnx")
    line = ("initializer 'model.embed_tokens.weight' holds 1 NaN among its 16384 values (first at index [255, 3]): "
            "every value computed from it is NaN or inf, on any target")
    code, text, _ = _run(capsys, "check", path, "--target", "generic-qdq")
    assert code == 3 and text.splitlines() == [
        line, f"{path}: 1 violation(s) of target 'generic-qdq' (finite-initializer: 1)"]
    code, text, _ = _run(capsys, "check", path, "--target", "ort-cpu", "--json")
    report = json.loads(text)
    assert code == 3 and report["counts"]["finite-initializer"] == 1
    assert {"subject": "model.embed_tokens.weight", "rule": "finite-initializer", "message": line} in report["violations"]
    code, text, _ = _run(capsys, "check", tiny_models["llama"], "--target", "generic-qdq", "--json")
    assert "finite-initializer" not in json.loads(text)["counts"]


def _fixed_shapes(model_path, batch: int = 1, seq: int = 16) -> None:
    """The toy's [batch, seq] inputs fixed (QNN-like targets take static shapes only)."""
    model = onnx.load(str(model_path))
    for vi in (*model.graph.input, *model.graph.output):
        for dim, value in zip(vi.type.tensor_type.shape.dim, (batch, seq)):
            dim.Clear()
            dim.dim_value = value
    onnx.save(model, str(model_path))


def test_qnn_like_target_refuses_dynamic_shapes(toy, tmp_path, capsys):
    code, _, err = _compile(capsys, toy, tmp_path / "htp", "--target", "qnn-htp")
    assert code == 3 and "static-shape" in err and "input_ids: shape ['batch', 'seq'] is not static" in err
    assert not (tmp_path / "htp").exists()


def test_compile_with_target_records_it(toy, tmp_path, capsys):
    out = tmp_path / "htp"
    _fixed_shapes(toy[0])
    code, text, err = _compile(capsys, toy, out, "--target", "qnn-htp")
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    target = report["target"]
    assert target["name"] == "qnn-htp" and target["check"] == {"target": "qnn-htp", "clean": True, "counts": {}, "violations": []}
    assert [r["name"] for r in target["lowering"]] == ["expand-functions", "matmulnbits-to-qdq", "symmetric-weights",
                                                       "positive-weight-scales", "outer-product-to-mul", "fp16-safe-norms", "gather-table-qdq",
                                                       "linear-output-qdq"]
    assert [r["name"] for r in report["passes"]] == ["qdq"]
    meta = {p.key: p.value for p in onnx.load(str(out / "model.onnx"), load_external_data=False).metadata_props}
    assert meta["edgeq.target"] == "qnn-htp"
    assert "target qnn-htp" in text


def test_compile_with_target_lowers_to_pow2(toy, tmp_path, capsys):
    recipe = tmp_path / "int8.toml"
    recipe.write_text('[[pass]]\nname = "qdq"\nactivation_dtype = "int8"\n')
    out = tmp_path / "pow2"
    code, _, err = _compile(capsys, toy, out, "--target", "pow2-int", recipe=recipe)
    assert code == 0, err
    pow2 = json.loads((out / "report.json").read_text())["target"]["lowering"][-1]
    assert pow2["name"] == "pow2-scales" and pow2["modified"] and pow2["summary"]["scales_changed"] == 6
    code, _, _ = _run(capsys, "check", out / "model.onnx", "--target", "pow2-int")
    assert code == 0


def test_compile_refuses_unreachable_target(toy, tmp_path, capsys):
    """A profile that runs every standard op but QuantizeLinear: no lowering removes the
    quantizers of a static-activation recipe (int8-activations does make the rest compliant)."""
    ops = sorted({s.name for s in onnx.defs.get_all_schemas() if s.domain == ""} - {"QuantizeLinear"})
    profile = tmp_path / "no-quantize.toml"
    profile.write_text(_profile_text(lowering='["int8-activations"]', ops=json.dumps(ops), dtypes='["*"]'))
    out = tmp_path / "out"
    code, text, err = _compile(capsys, toy, out, "--target", profile)
    assert code == 3
    assert len(err.splitlines()) == 1 and "lowering did not reach target 'no-quantize'" in err
    assert "node h0_QuantizeLinear: op QuantizeLinear is not in no-quantize's op set" in text
    lines = text.strip().splitlines()  # one per activation quantizer, nothing else
    assert len(lines) == 2 and all(line.endswith("op QuantizeLinear is not in no-quantize's op set") for line in lines)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    code, _, err = _compile(capsys, toy, out, "--target", "npu9")
    assert code == 2 and "unknown target" in err and not out.exists()


def test_compile_with_ort_cpu_kernels_selects_the_kernels(tiny_models, tmp_path, capsys):
    """``ort-cpu-kernels``: the compiled graph's edgeq ops move to the kernels' domain, run without
    the extension on their function bodies and, with it, on the kernels, with the same outputs."""
    from edgeq.runtime_ops.ort_kernels import has_ort_kernels, ort_kernel_session_options

    recipe = tmp_path / "rot.toml"
    recipe.write_text('[[pass]]\nname = "fuse-norms"\n\n[[pass]]\nname = "ln-to-rms"\n\n[[pass]]\nname = "rotate"\n')
    out, plain = tmp_path / "kernels", tmp_path / "plain"
    model = tiny_models["llama"]
    assert _run(capsys, "compile", model, "--recipe", recipe, "-o", plain, "--target", "ort-cpu")[0] == 0
    code, _, err = _run(capsys, "compile", model, "--recipe", recipe, "-o", out, "--target", "ort-cpu-kernels")
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["target"]["ort_kernels"] == ["OnlineHadamard"]
    # the rewrite is a named stage of the route, recorded with the ops it moved between domains
    (stage,) = report["route_stages"]
    assert stage["name"] == "ort-kernels" and stage["graph"] == "model.onnx"
    assert set(stage["ops_added"]) == {"edgeq.ort:OnlineHadamard"} and stage["ops_removed"]
    kernel_model = ir.load_model(out / "model.onnx")
    assert {n.domain for n in kernel_model.graph.node if n.op_type == "OnlineHadamard"} == {"edgeq.ort"}
    feeds = random_feeds(ir.make_session(kernel_model).get_inputs(), seed=5)
    want = ir.make_session(ir.load_model(plain / "model.onnx")).run(None, feeds)
    for a, b in zip(want, ir.make_session(kernel_model).run(None, feeds)):  # function-body fallback
        np.testing.assert_array_equal(a, b)
    if not has_ort_kernels():
        pytest.skip("onnxruntime-extensions not installed: the kernel half of this test needs it")
    import onnxruntime as ort

    session = ort.InferenceSession(str(out / "model.onnx"), ort_kernel_session_options(), providers=["CPUExecutionProvider"])
    for a, b in zip(want, session.run(None, feeds)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * max(1.0, float(np.abs(a).max())))


def test_route_stages_are_dumped_and_verified_like_passes(tiny_models, tmp_path, capsys):
    """``--dump-each`` / ``--verify`` reach the route's stages outside the recipe (the kernels rewrite):
    its graph is saved as ``route-NN_<stage>.onnx`` and checked, its record says so."""
    recipe = tmp_path / "rot.toml"
    recipe.write_text('[[pass]]\nname = "fuse-norms"\n\n[[pass]]\nname = "ln-to-rms"\n\n[[pass]]\nname = "rotate"\n')
    out, dumps = tmp_path / "out", tmp_path / "dumps"
    code, _, err = _run(capsys, "compile", tiny_models["llama"], "--recipe", recipe, "-o", out, "--target",
                        "ort-cpu-kernels", "--verify", "--dump-each", dumps)
    assert code == 0, err
    (stage,) = json.loads((out / "report.json").read_text())["route_stages"]
    assert stage["name"] == "ort-kernels" and stage["verified"] is True
    dumped = ir.load_model(dumps / "route-01_ort-kernels.onnx")
    assert {n.domain for n in dumped.graph.node if n.op_type == "OnlineHadamard"} == {"edgeq.ort"}
    # the folder now holds only edgeq's dumps: a second compile may dump into it again
    code, _, err = _run(capsys, "compile", tiny_models["llama"], "--recipe", recipe, "-o", out, "--target",
                        "ort-cpu-kernels", "--dump-each", dumps)
    assert code == 0, err
