"""Bad input the loaders must refuse with exit 2 and one line (issue 30), where it used to pass
silently or fail deep inside a pass with exit 1: NaN / inf weights, unsupported IR and opset
versions in ``check``, unknown ``skip_roles``, calibration data that does not fit the model, a graph
without outputs or with a dangling input, TOML that is not UTF-8; an .npz member that is not a .npy;
recipe sections of the wrong type; and what must keep working: a damaged calibration-cache entry (or
a token-cache entry that is an .npz) is a miss, external data behind a symbolic link (a Hugging Face
hub snapshot) loads, report.json is strict JSON. The structural check at load:
tests/test_model_load_checks.py.

Everything runs on the hand-built toy models of ``tests/toy.py`` and the ``w8a8`` recipe on one
16-token window, well under a second per compile.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from toy import (VOCAB, set_external_location, single_linear, toy_lm, toy_model_dir, write_text)

from edgeq.graph import ir
from edgeq.artifacts.aimet import write_aimet
from edgeq.artifacts.encodings import strict_json
from edgeq.errors import UserInputError
from edgeq.quantize.qdq_encodings import collect_encodings
from edgeq.recipes import parse_recipe
from edgeq.structure.linears import ROLES
from input_cases import COMPILE, _quiet, _refused, _run, _save, _set_initializer, _embedded, _node, toy  # noqa: F401 (fixtures used by name)
# -- 1. NaN / inf in a weight, in a scale -----------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("weight", ["w1", "w2"])
def test_compile_refuses_a_non_finite_weight(toy, tmp_path, capsys, bad, weight):
    """Refused at load (``edgeq.graph.loadcheck``), before the quantizer's own check would see it."""
    model_path, calib = toy
    model = ir.load_model(model_path)
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == weight)).copy()
    w[2, 3] = bad
    _set_initializer(model, weight, w)
    path = _save(model, tmp_path / "bad")
    out = tmp_path / "out"
    what = "NaN" if math.isnan(bad) else "inf"
    _refused(capsys, "compile", path, *COMPILE, "--calib", calib, "-o", out,
             match=f"{path}: initializer '{weight}' holds 1 {what} among its {w.size} values (first at index [2, 3])")
    assert not out.exists()


def test_quantizing_a_non_finite_weight_is_refused_where_the_scale_is_computed():
    """The backstop every weight-quantizing pass goes through (``insert_weight_dequantize``)."""
    import onnx_graphsurgeon as gs

    from edgeq.quantize.qdq_nodes import insert_weight_dequantize
    from edgeq.quantize.quant import QuantSpec

    graph = gs.Graph()
    w = np.ones((4, 3), np.float32)
    w[1, 1] = np.inf
    with pytest.raises(UserInputError, match=r"weight 'lin_w' holds 1 non-finite value\(s\).*index \[1, 1\]"):
        insert_weight_dequantize(graph, ir.GraphIndex(graph), w, QuantSpec("int8", axis=1), "lin_w")


def _encodings_with(scale: float) -> dict:
    enc = {"dtype": "int8", "bits": 8, "symmetric": True, "granularity": "tensor", "axis": None, "block_size": 0,
           "scale": [scale], "zero_point": [0], "qmin": -128, "qmax": 127, "scale_shape": [], "shape": [4, 4],
           "float_name": "w_dq"}
    return {"version": "edgeq-encodings/1", "activations": {}, "weights": {"w_q": enc}, "unrepresented": {}}


@pytest.mark.parametrize("scale", [math.nan, math.inf])
def test_encodings_writers_never_emit_nan(tmp_path, scale):
    good = _encodings_with(0.5)
    assert json.loads(strict_json(good, good)) == good
    bad = _encodings_with(scale)
    with pytest.raises(UserInputError, match="weight 'w_q' has a non-finite scale"):
        strict_json(bad, bad)
    with pytest.raises(UserInputError, match="weight 'w_q' has a non-finite scale"):
        write_aimet(tmp_path / "aimet.json", bad)
    assert not list(tmp_path.iterdir())


@pytest.fixture
def compiled(toy, tmp_path, capsys):
    model, calib = toy
    out = tmp_path / "w8a8"
    code, err, _ = _run(capsys, "compile", model, *COMPILE, "--calib", calib, "-o", out)
    assert code == 0, err
    return out / "model.onnx"


def test_check_reports_a_non_finite_scale(compiled, tmp_path, capsys):
    code, err, _ = _run(capsys, "check", compiled, "--target", "ort-cpu")
    assert code == 0, err
    model = ir.load_model(compiled)
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear")
    _set_initializer(model, q.input[1], np.array(np.nan, np.float32))
    path = _save(model, tmp_path / "nan_scale")
    code, err, out = _run(capsys, "check", path, "--target", "ort-cpu", "--json")
    assert code == 3, err
    violations = json.loads(out)["violations"]  # the QuantizeLinear and the DequantizeLinears sharing its scale
    assert {v["rule"] for v in violations} == {"finite-scale"}
    assert f"QuantizeLinear {q.name}: scale {q.input[1]} is nan" in [v["message"].split(";")[0] for v in violations]
    encodings = collect_encodings(model)  # what compile's writer would have been handed
    with pytest.raises(UserInputError, match=f"activation '{q.input[0]}' has a non-finite scale"):
        strict_json(encodings, encodings)


# -- 2. IR version and opset beyond what onnx / onnxruntime read --------------------------------------


@pytest.mark.parametrize("field, match", [("ir_version", "IR version 99 is not supported"),
                                          ("opset", "opset 99 is not supported")])
def test_check_and_compile_refuse_unsupported_versions(tmp_path, capsys, field, match):
    model = toy_lm()
    if field == "ir_version":
        model.ir_version = 99
    else:
        model.opset_import[0].version = 99
    path = toy_model_dir(tmp_path / "m")
    _save(model, path.parent)
    calib = write_text(tmp_path / "calib.txt", 400)
    _refused(capsys, "check", path, "--target", "ort-cpu", match=match)
    _refused(capsys, "compile", path, *COMPILE, "--calib", calib, "-o", tmp_path / "out", match=match)
    assert not (tmp_path / "out").exists()


# -- 3. skip_roles --------------------------------------------------------------------------------


def test_unknown_skip_role_is_refused(toy, tmp_path, capsys):
    model, calib = toy
    recipe = tmp_path / "typo.toml"
    recipe.write_text('[[pass]]\nname = "qdq"\nskip_roles = ["lm_haed"]\n')
    err = _refused(capsys, "compile", model, "--recipe", recipe, "--calib-windows", "1", "--seq-len", "16",
                   "--calib", calib, "-o", tmp_path / "out", match="unknown role(s) 'lm_haed'")
    assert "lm_head" in err and "down_proj" in err  # the valid roles are listed
    for pass_name in ("qdq", "gptq"):  # every pass config with a *_roles list, through one check
        parse_recipe(f'[[pass]]\nname = "{pass_name}"\nskip_roles = ["lm_head", "o_proj"]\n', "ok")
        with pytest.raises(UserInputError, match="unknown role"):
            parse_recipe(f'[[pass]]\nname = "{pass_name}"\nskip_roles = ["head"]\n', "bad")
    parse_recipe('[[pass]]\nname = "qdq"\nrole_activation_dtypes = ["down_proj=int16"]\n', "ok")
    with pytest.raises(UserInputError, match="unknown role\\(s\\) 'down' "):
        parse_recipe('[[pass]]\nname = "qdq"\nrole_activation_dtypes = ["down=int16"]\n', "bad")
    assert {"lm_head", "q_proj", "gate_proj", "fc2", "classifier"} <= set(ROLES)


# -- 4. calibration data that does not fit the model --------------------------------------------------


def _ids_npz(path: Path, ids) -> Path:
    np.savez(path, input_ids=np.asarray(ids, np.int64))
    return path


@pytest.mark.parametrize("ids, match", [
    ([[[1, 2, 100000, 3]]], f"token id 100000, but the model's vocabulary has {VOCAB} tokens (rows of its "
                            "embedding 'embed')"),
    ([[[1, -1, 2, 3]]], "negative token id (-1)"),
    (np.zeros((1, 1, 0)), "'input_ids' has an empty axis (sample shape [1, 0])"),
], ids=["beyond-vocab", "negative", "length-0"])
def test_npz_token_ids_are_checked(toy, tmp_path, capsys, ids, match):
    model, _ = toy
    npz = _ids_npz(tmp_path / "ids.npz", ids)
    _refused(capsys, "compile", model, *COMPILE, "--calib", npz, "-o", tmp_path / "out", match=match)
    _refused(capsys, "inspect", model, "--calib", npz, match=match)


def test_tokenizer_of_another_model_is_refused(toy, tmp_path, capsys):
    """A tokenizer whose ids run past the model's embedding rows (here 64)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model, _ = toy
    words = [f"v{i}" for i in range(4 * VOCAB)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="v0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    other = tmp_path / "other"
    other.mkdir()
    tok.save(str(other / "tokenizer.json"))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words[::-1] * 2))
    match = f"the tokenizer in {other} gives token id {4 * VOCAB - 1}, but the model's vocabulary has {VOCAB}"
    _refused(capsys, "compile", model, *COMPILE, "--calib", text, "--tokenizer", other, "-o", tmp_path / "out",
             match=match)
    _refused(capsys, "inspect", model, "--calib", text, "--tokenizer", other, "--seq-len", "16", match=match)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_npz_with_non_finite_values_is_refused(tmp_path, capsys, bad):
    model, _ = single_linear(8, 4)
    path = _save(model, tmp_path / "lin")
    x = np.random.default_rng(0).standard_normal((3, 1, 5, 8)).astype(np.float32)
    x[1, 0, 2, 6] = bad
    np.savez(tmp_path / "x.npz", x=x)
    _refused(capsys, "compile", path, *COMPILE, "--calib", tmp_path / "x.npz", "-o", tmp_path / "out",
             match="'x' holds 1 NaN or inf value(s) (first at index [1, 0, 2, 6])")


def _image_model(folder: Path) -> Path:
    """pixel_values [batch, channels, height, width], all symbolic as HF exports have them, and a
    config.json declaring 3 x 32 x 32 images: mean over the pixels, one linear."""
    w = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    axes = numpy_helper.from_array(np.array([2, 3], np.int64), "axes")
    nodes = [helper.make_node("ReduceMean", ["pixel_values", "axes"], ["pooled"], keepdims=0),
             helper.make_node("MatMul", ["pooled", "w"], ["logits"], name="classifier")]
    graph = helper.make_graph(
        nodes, "img", [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["b", "c", "h", "w"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 4])], [numpy_helper.from_array(w, "w"), axes])
    path = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9), folder)
    (folder / "config.json").write_text(json.dumps({"image_size": 32, "num_channels": 3}))
    return path


@pytest.mark.parametrize("shape, ok", [((2, 1, 3, 32, 32), True), ((2, 1, 3, 48, 48), False),
                                       ((2, 1, 4, 32, 32), False)], ids=["32x32", "48x48", "4-channels"])
def test_image_size_must_match_the_model(tmp_path, capsys, shape, ok):
    path = _image_model(tmp_path / "img")
    np.savez(tmp_path / "px.npz", pixel_values=np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    argv = ["compile", path, *COMPILE, "--calib", tmp_path / "px.npz", "-o", tmp_path / "out"]
    if ok:
        code, err, _ = _run(capsys, *argv)
        assert code == 0, err
    else:
        got = "x".join(map(str, shape[2:]))
        _refused(capsys, *argv, match=f"images of {got} (channels x height x width) in 'pixel_values', "
                                       "but the model takes 3x32x32")


# -- 5. graph wiring ------------------------------------------------------------------------------


def test_graph_without_outputs_is_refused(toy, tmp_path, capsys):
    model, calib = toy
    proto = ir.load_model(model)
    del proto.graph.output[:]
    path = _save(proto, tmp_path / "no_out")
    _refused(capsys, "compile", path, *COMPILE, "--calib", calib, "-o", tmp_path / "out",
             match="the graph has no outputs")
    _refused(capsys, "check", path, "--target", "ort-cpu", match="the graph has no outputs")


def test_node_reading_a_tensor_nothing_produces_is_refused(toy, tmp_path, capsys):
    model, calib = toy
    proto = ir.load_model(model)
    proto.graph.node[1].input[0] = "h_missing"  # fc1 reads a tensor no node, input or initializer gives
    path = _save(proto, tmp_path / "dangling")
    match = "node 'fc1' reads tensor 'h_missing', which is not a graph input, an initializer or any node's output"
    _refused(capsys, "compile", path, *COMPILE, "--calib", calib, "-o", tmp_path / "out", match=match)
    _refused(capsys, "inspect", path, match=match)


# -- 6. TOML that is not UTF-8 ----------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--recipe", "--target"])
def test_non_utf8_toml_is_refused(toy, tmp_path, capsys, option):
    model, calib = toy
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('description = "caf\u00e9"\n'.encode("latin-1"))
    _refused(capsys, "compile", model, *COMPILE, option, bad, "--calib", calib, "-o", tmp_path / "out",
             match=f"{bad}: invalid TOML: not UTF-8")
    if option == "--target":
        _refused(capsys, "check", model, "--target", bad, match="not UTF-8")


# -- 7. a damaged calibration-cache entry is a miss ---------------------------------------------------


def test_truncated_cache_entries_are_recomputed(toy, tmp_path, capsys):
    model, calib = toy
    argv = ["compile", model, "--recipe", "w8a8", "--calib-windows", "1", "--seq-len", "16", "--calib", calib]
    code, err, _ = _run(capsys, *argv, "-o", tmp_path / "first")
    assert code == 0, err
    entries = sorted((tmp_path / "cache").rglob("*.np[yz]"))
    assert {p.suffix for p in entries} == {".npz", ".npy"}  # observers and the tokenized text
    sizes = {p: p.stat().st_size for p in entries}
    for p in entries:
        os.truncate(p, p.stat().st_size // 2)
    code, err, _ = _run(capsys, *argv, "-o", tmp_path / "second")
    assert code == 0, err
    assert {p: p.stat().st_size for p in entries} == sizes  # rewritten whole
    report = json.loads((tmp_path / "second" / "report.json").read_text())
    assert report["calibration"]["cache_hits"] == 0
    code, err, _ = _run(capsys, *argv, "-o", tmp_path / "third")
    assert code == 0, err
    assert json.loads((tmp_path / "third" / "report.json").read_text())["calibration"]["cache_hits"] >= 1


# -- 8. external data behind a symbolic link ----------------------------------------------------------


def test_hub_snapshot_with_symlinked_files_loads(toy, tmp_path, capsys):
    """A Hugging Face hub cache: snapshots/REV/* are links into ../../blobs/."""
    model, calib = toy
    hub = tmp_path / "hub"
    (hub / "blobs").mkdir(parents=True)
    snapshot = hub / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    for f in sorted(model.parent.iterdir()):
        blob = hub / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    linked = snapshot / "model.onnx"
    assert (snapshot / "model.onnx.data").is_symlink()
    loaded, locations = ir.load_model_and_locations(linked)
    assert locations == {"model.onnx.data"}
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]),
                                  numpy_helper.to_array(ir.load_model(model).graph.initializer[0]))
    code, err, _ = _run(capsys, "compile", linked, *COMPILE, "--calib", calib, "-o", tmp_path / "out")
    assert code == 0, err


@pytest.mark.parametrize("location", ["../outside.data", "sub/../../outside.data", "/abs/outside.data"])
def test_external_location_outside_the_folder_is_still_refused(toy, tmp_path, location):
    model, _ = toy
    set_external_location(model, location)
    (tmp_path / "outside.data").write_bytes((model.parent / "model.onnx.data").read_bytes())
    with pytest.raises(UserInputError, match=f"points outside the model's folder: {location}"):
        ir.load_model(model)


# -- 10. an .npz that is not one: one loader, one line --------------------------------------------------


def test_npz_member_that_is_not_npy_is_refused(toy, tmp_path, capsys):
    import zipfile

    model, _ = toy
    npz = tmp_path / "junk.npz"
    with zipfile.ZipFile(npz, "w") as z:
        z.writestr("input_ids.npy", b"junk")
    match = f"cannot read {npz} as .npz of model inputs: member 'input_ids' is not a .npy array"
    _refused(capsys, "inspect", model, "--calib", npz, "--seq-len", "16", match=match)
    _refused(capsys, "compile", model, *COMPILE, "--calib", npz, "-o", tmp_path / "out", match=match)
    _refused(capsys, "eval", "compare", model, model, "--npz", npz, match=match)


def test_token_cache_entry_that_is_an_npz_is_a_miss(toy, tmp_path, capsys):
    model, calib = toy
    argv = ["compile", model, "--recipe", "w8a8", "--calib-windows", "1", "--seq-len", "16", "--calib", calib]
    code, err, _ = _run(capsys, *argv, "-o", tmp_path / "first")
    assert code == 0, err
    (entry,) = (tmp_path / "cache" / "tokens").glob("*.npy")
    ids = np.load(entry)
    with open(entry, "wb") as f:
        np.savez(f, bogus=np.array([np.nan]))
    for calib_entry in (tmp_path / "cache" / "calib").glob("*.npz"):  # so that the tokens are needed again
        calib_entry.unlink()
    code, err, _ = _run(capsys, *argv, "-o", tmp_path / "second")
    assert code == 0, err
    np.testing.assert_array_equal(np.load(entry), ids)  # recomputed and rewritten


# -- 11. recipe values of the wrong type ----------------------------------------------------------------


@pytest.mark.parametrize("text, match", [
    ("calibration = []\n", "[calibration] must be a table, got []"),
    ("calibration = 0\n", "[calibration] must be a table, got 0"),
    ("calibration = false\n", "[calibration] must be a table, got False"),
    ("kv_cache = 1\n", "[kv_cache] must be a table, got 1"),
    ("description = 5\n", "description must be a string, got 5"),
    ("", None),
], ids=["list", "int", "bool", "kv-cache", "description", "pass-not-table"])
def test_recipe_sections_of_the_wrong_type_are_refused(toy, tmp_path, capsys, text, match):
    model, calib = toy
    recipe = tmp_path / "bad.toml"
    if match is None:  # [[pass]] given as a list of values, and a pass name that is not a string
        recipe.write_text("pass = [1]\n")
        _refused(capsys, "compile", model, *COMPILE[2:], "--recipe", recipe, "--calib", calib, "-o", tmp_path / "out",
                 match="[[pass]] #1 must be a table, got 1")
        recipe.write_text("[[pass]]\nname = 5\n")
        match = "[[pass]] #1 name must be a string, got 5"
    else:
        recipe.write_text(text + '[[pass]]\nname = "qdq"\n')
    _refused(capsys, "compile", model, *COMPILE[2:], "--recipe", recipe, "--calib", calib, "-o", tmp_path / "out",
             match=match)


# -- 12. report.json is strict JSON -----------------------------------------------------------------------


def test_report_values_json_cannot_hold_are_strings():
    from edgeq.artifacts.encodings import json_safe

    report = {"sqnr_db": math.inf, "drift": [np.float32(-np.inf), np.float64(np.nan)], "n": np.int64(3),
              "path": Path("x")}
    text = strict_json(json_safe(report, default=str), None)
    assert json.loads(text) == {"sqnr_db": "inf", "drift": ["-inf", "nan"], "n": 3, "path": "x"}



def test_empty_cache_dir_turns_caching_off(toy, tmp_path, capsys, monkeypatch):
    """EDGEQ_CACHE_DIR="" is no cache (as for the tokens), not a calib/ folder in the current one."""
    model, calib = toy
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("EDGEQ_CACHE_DIR", "")
    code, err, _ = _run(capsys, "compile", model, "--recipe", "w8a8", "--calib-windows", "1", "--seq-len", "16",
                        "--calib", calib, "-o", tmp_path / "out")
    assert code == 0, err
    assert list(cwd.iterdir()) == []


# -- 13. issue 41: a NaN where the recipe does not quantize; a model onnxruntime will not initialize ------


def _tiny_llama_with(tiny_models, folder: Path, **values) -> Path:
    """The tiny llama with ``values`` ({initializer: {index: value}}) written into its weights, saved
    with its weights external (as ``edgeq export`` writes it) and the toy's tokenizer (64 ids: the
    embedding rows past 63 are never looked up in calibration)."""
    model = ir.load_model(tiny_models["llama"])
    for name, cells in values.items():
        w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name)).copy()
        for index, value in cells.items():
            w[index] = value
        _set_initializer(model, name, w)
    return _save(model, folder)


@pytest.mark.parametrize("blockwise", ["off", "on"])
def test_nan_in_a_weight_the_recipe_keeps_float_is_refused(tiny_models, tmp_path, capsys, blockwise):
    """w8a8 leaves the embedding table in float, so the quantizer never saw its NaN and compile wrote
    the model (exit 0). Refused at load now, on both routes (block-wise: streamed from the data file)."""
    path = _tiny_llama_with(tiny_models, tmp_path / "nan", **{"model.embed_tokens.weight": {(255, 3): np.nan}})
    calib = write_text(tmp_path / "calib.txt", 400)
    out = tmp_path / "out"
    code, err, stdout = _run(capsys, "compile", path, *COMPILE, "--calib", calib, "--blockwise", blockwise, "-o", out)
    assert code == 2, err
    assert err.splitlines() == [f"edgeq: error: {path}: initializer 'model.embed_tokens.weight' holds 1 NaN among its "
                                "16384 values (first at index [255, 3]): every value computed from it would be NaN or "
                                "inf; fix or re-export the model"]
    assert stdout == "" and not out.exists()


def test_nan_and_inf_are_counted(tiny_models, tmp_path, capsys):
    cells = {(254, 0): np.inf, (255, 3): np.nan, (255, 4): -np.inf, (200, 1): np.nan}
    path = _tiny_llama_with(tiny_models, tmp_path / "bad", **{"model.embed_tokens.weight": cells})
    _refused(capsys, "compile", path, *COMPILE, "--calib", write_text(tmp_path / "calib.txt", 400), "-o",
             tmp_path / "out", match="initializer 'model.embed_tokens.weight' holds 2 NaN and 2 inf among its 16384 "
                                     "values (first at index [200, 1])")


def test_minus_inf_masks_are_not_weights(tiny_models, tmp_path):
    """The tiny llama's attention writes two Constant -inf (masking); a mask folded into an
    initializer (0 and -inf only) and a scalar inf are accepted too. NaN is refused anywhere."""
    from edgeq.graph.loadcheck import nonfinite_tensors

    model = ir.load_model(tiny_models["llama"])
    constants = [n for n in model.graph.node if n.op_type == "Constant" and any(
        a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT
        and np.isneginf(numpy_helper.to_array(a.t)).any() for a in n.attribute)]
    assert len(constants) == 2 and list(nonfinite_tensors(model)) == []

    mask = np.triu(np.full((4, 4), -np.inf, np.float32), 1)
    inits = {"mask": mask, "clip_hi": np.array(np.inf, np.float32), "w16": np.ones((3, 4), np.float16),
             "w64": np.ones(5, np.float64), "unused": np.array([np.nan, 1.0], np.float32)}
    inits["w16"][1, 2] = -np.inf
    inits["w64"][4] = np.nan
    bf16 = helper.make_tensor("wbf", TensorProto.BFLOAT16, [2, 2], [1.0, np.nan, np.inf, 2.0])
    nodes = [helper.make_node("Add", ["x", "mask"], ["a"]), helper.make_node("Min", ["a", "clip_hi"], ["b"]),
             helper.make_node("Add", ["b", "w16"], ["c"]), helper.make_node("Add", ["c", "w64"], ["d"]),
             helper.make_node("Add", ["d", "wbf"], ["e"]),
             helper.make_node("Constant", [], ["k_ninf"], name="k_ok", value_float=-np.inf),
             helper.make_node("Constant", [], ["k_nan"], name="k_bad", value=numpy_helper.from_array(
                 np.array([0.5, np.nan], np.float32))),
             helper.make_node("Add", ["k_ninf", "k_nan"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()] + [bf16])
    found = {f.name: (f.subject, f.nan, f.inf, f.first) for f in nonfinite_tensors(helper.make_model(graph))}
    assert found == {"w16": ("initializer 'w16'", 0, 1, [1, 2]), "w64": ("initializer 'w64'", 1, 0, [4]),
                     "wbf": ("initializer 'wbf'", 1, 1, [0, 1]), "k_nan": ("Constant node 'k_bad'", 1, 0, [1])}


def _with_node_after_relu(toy_path: Path, folder: Path, op: str, **attrs) -> Path:
    """The toy with ``op`` (its attributes ``attrs``) between its Relu and its head: a graph every
    structural check (and onnx's strict type inference) accepts."""
    model = ir.load_model(toy_path)
    if op == "Relu":  # the Relu itself gets the attributes
        _node(model, "act").attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
    else:
        _node(model, "act").output[0] = "h2_pre"
        model.graph.node.insert(3, helper.make_node(op, ["h2_pre"], ["h2"], name="bad", **attrs))
    return _save(model, folder)


@pytest.mark.parametrize("op, attrs, reason", [
    ("LRN", {"size": 0}, "onnxruntime::LRN<T>::LRN(const onnxruntime::OpKernelInfo&) [with T = float] size_ > 0 "
                         "was false."),
    ("LpNormalization", {"p": 3}, "p_ == 1 || p_ == 2 was false."),
    ("Relu", {"alpha": 1.0}, 'In Node, ("act", Relu, "", -1) : ("h1": tensor(float),) -> ("h2",) , Error '
                             "Unrecognized attribute: alpha for operator Relu"),
], ids=["lrn-size-0", "lpnorm-p-3", "unknown-attribute"])
def test_a_model_onnxruntime_cannot_initialize_is_refused_before_any_work(toy, tmp_path, capsys, op, attrs, reason):
    """It passes every structural check; compile failed inside its first pass (exit 1)."""
    model, calib = toy
    path = _with_node_after_relu(model, tmp_path / "bad", op, **attrs)
    out = tmp_path / "out"
    code, err, stdout = _run(capsys, "compile", path, *COMPILE, "--calib", calib, "-o", out)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"edgeq: error: {path}: onnxruntime cannot load this model: ")
    assert err.endswith(reason), err
    assert stdout == "" and not out.exists()


def test_a_single_lrn_of_size_zero_is_refused(tmp_path, capsys):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])
    graph = helper.make_graph([helper.make_node("LRN", ["x"], ["y"], name="lrn", size=0)], "lrn", [x], [y])
    path = _embedded(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
                     tmp_path / "lrn")
    calib = tmp_path / "x.npz"
    np.savez(calib, x=np.zeros((2, 1, 4, 8, 8), np.float32))
    _refused(capsys, "compile", path, "--recipe", "w8a8", "--calib", calib, "-o", tmp_path / "out",
             match=f"{path}: onnxruntime cannot load this model: [ONNXRuntimeError] : 1 : FAIL : Exception during "
                   "initialization: ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("with_bias", [False, True], ids=["file", "copy"])
def test_onnxruntime_check_maps_the_weights_instead_of_copying_them(tmp_path, monkeypatch, with_bias):
    """The session is built on the model file (onnxruntime maps its external data), or, for a file
    whose external tensors the loader read in (``external``: the bias; onnxruntime's type inference
    reads such constants), on a copy of the graph as loaded, never holding the 256 KiB weight;
    prepacking off (no weight touched), graph optimizations off, one thread."""
    import onnxruntime as ort

    from edgeq.graph.loadcheck import check_onnxruntime

    model, w = single_linear(256, 256)
    if with_bias:
        model.graph.initializer.append(numpy_helper.from_array(np.ones(256, np.float32), "bias"))
        model.graph.node[0].output[0] = "y0"
        model.graph.node.append(helper.make_node("Add", ["y0", "bias"], ["y"], name="add"))
    path = _save(model, tmp_path / "m")
    seen = []
    real = ort.InferenceSession

    def spy(source, sess_options=None, **kwargs):
        seen.append((source, sess_options))
        return real(source, sess_options=sess_options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    check_onnxruntime(ir.load_model(path, load_external=False), path, external=with_bias)
    [(source, so)] = seen
    if with_bias:
        assert isinstance(source, bytes) and 1024 < len(source) < w.nbytes // 4
        folder = so.get_session_config_entry("session.model_external_initializers_file_folder_path")
        assert folder == str(path.parent.resolve())
    else:
        assert source == str(path)
    assert so.get_session_config_entry("session.disable_prepacking") == "1"
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL and so.intra_op_num_threads == 1


def test_models_with_edgeq_ops_still_compile(tiny_models, tmp_path, capsys):
    """edgeq ops in the input: with their function bodies (ort-cpu), without them (compile adds
    them; the onnxruntime check does too, on a copy), in the kernels' domain (ort-cpu-kernels)."""
    from edgeq.graph.loadcheck import check_onnxruntime
    from edgeq.runtime_ops.schema import used_ops

    recipe = tmp_path / "rot.toml"
    recipe.write_text('[[pass]]\nname = "fuse-norms"\n\n[[pass]]\nname = "ln-to-rms"\n\n[[pass]]\nname = "rotate"\n')
    for target in ("ort-cpu", "ort-cpu-kernels"):
        code, err, _ = _run(capsys, "compile", tiny_models["llama"], "--recipe", recipe, "--target", target, "-o",
                            tmp_path / target)
        assert code == 0, err
    bare = ir.load_model(tmp_path / "ort-cpu" / "model.onnx")
    assert used_ops(bare) == {"OnlineHadamard"}
    del bare.functions[:]
    ir.save_model(bare, tmp_path / "bare" / "model.onnx")
    for source in (tmp_path / "ort-cpu", tmp_path / "ort-cpu-kernels", tmp_path / "bare"):
        code, err, _ = _run(capsys, "compile", source / "model.onnx", "--recipe", "fp32", "-o",
                            tmp_path / f"{source.name}-again")
        assert code == 0, f"{source.name}: {err}"
    skeleton = ir.load_model(tmp_path / "bare" / "model.onnx", load_external=False)
    check_onnxruntime(skeleton, tmp_path / "bare" / "model.onnx")
    assert not skeleton.functions  # the check added them to a copy only
