"""Files the fuzz campaigns feed edgeq (tests/test_fuzz.py): mutated models, calibration files,
files beside the model and a damaged cache, each as a Hypothesis case builder over the harness of
``fuzz_harness``. Recipes, target profiles and command lines: ``fuzz_config``."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper
from toy import VOCAB, WORDS

from fuzz_harness import (  # noqa: F401
    Case,
    FAST,
    Fuzz,
    _run_inprocess,
    fz,
)


# -- mutated models ------------------------------------------------------------------------------------

TOY_MUTATIONS = ["bitflip", "truncate", "ir_version", "opset", "drop_outputs", "missing_input", "nonfinite",
                 "init_dtype", "input_dtype", "ext_location", "ext_offset", "ext_length", "ext_number",
                 "data_truncate", "data_symlink", "dup_output", "self_loop", "empty", "text", "directory",
                 "missing", "bad_dims", "unknown_op", "model_symlink", "nonfinite_anywhere", "ort_refused"]
TINY_MUTATIONS = ["bitflip", "truncate", "ir_version", "opset", "drop_outputs", "missing_input", "nonfinite",
                  "init_dtype", "input_dtype", "unknown_op", "nonfinite_anywhere", "ort_refused"]
# a node onnxruntime refuses at session creation though every structural check passes (issue 41)
ORT_REFUSED = [("LRN", {"size": 0}), ("LRN", {"size": -2}), ("LpNormalization", {"p": 3}),
               ("LpNormalization", {"p": 0}), ("unknown_attribute", {"edgeq_nope": 1})]


def _ext_info(t: TensorProto) -> dict:
    return {e.key: e.value for e in t.external_data}


def _set_ext(t: TensorProto, key: str, value: str) -> None:
    for e in t.external_data:
        if e.key == key:
            e.value = value
            return
    t.external_data.add(key=key, value=value)


def _mutate_model(draw, path: Path, how: str, fz: Fuzz) -> str:
    """Apply mutation ``how`` to the model at ``path`` (its folder is a scratch copy); returns a description."""
    folder = path.parent
    if how in ("bitflip", "truncate"):
        data = bytearray(path.read_bytes())
        if how == "truncate":
            cut = draw(st.integers(0, len(data) - 1), label="cut")
            path.write_bytes(bytes(data[:cut]))
            return f"model.onnx cut to {cut} of {len(data)} bytes"
        flips = draw(st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(1, 255)), min_size=1,
                              max_size=8), label="flips")
        for pos, xor in flips:
            data[pos] ^= xor
        path.write_bytes(bytes(data))
        return f"model.onnx bytes xored at {[p for p, _ in flips]}"
    if how == "empty":
        path.write_bytes(b"")
        return "model.onnx empty"
    if how == "text":
        path.write_text(draw(st.sampled_from(["hello\n", "{}", "\x00" * 10, "ir_version: 9"])))
        return "model.onnx holds text"
    if how == "directory":
        path.unlink()
        path.mkdir()
        return "model.onnx is a folder"
    if how == "missing":
        path.unlink()
        return "model.onnx removed"
    if how == "model_symlink":  # a hub snapshot: model.onnx links to a blob elsewhere, its data beside the link
        blob = fz.ws / "blobs" / "abc123"
        blob.parent.mkdir()
        shutil.move(path, blob)
        path.symlink_to(draw(st.sampled_from([blob, os.path.relpath(blob, folder), fz.ws / "blobs" / "gone"])))
        return f"model.onnx is a symlink to {os.readlink(path)}"

    m = onnx.load_model(str(path), load_external_data=False)
    g = m.graph
    if how == "ir_version":
        m.ir_version = draw(st.sampled_from([-1, 0, 1, 2, 3, 6, 11, 12, 99, 2**40]), label="ir")
        desc = f"ir_version {m.ir_version}"
    elif how == "opset":
        choice = draw(st.sampled_from(["version", "remove", "domain", "duplicate"]), label="opset")
        if choice == "version":
            v = draw(st.sampled_from([-1, 0, 1, 6, 10, 13, 23, 24, 99, 2**40]), label="opset_version")
            m.opset_import[0].version = v
            desc = f"default opset {v}"
        elif choice == "remove":
            del m.opset_import[:]
            desc = "no opset_import"
        elif choice == "domain":
            m.opset_import.append(helper.make_opsetid("com.example.nope", 1))
            g.node[1].domain = "com.example.nope"
            desc = "node fc1 in an unknown domain"
        else:
            m.opset_import.append(helper.make_opsetid("", 7))
            desc = "default domain imported twice (18 and 7)"
    elif how == "drop_outputs":
        n = draw(st.integers(0, len(g.output) - 1), label="keep")
        del g.output[n:]
        desc = f"graph outputs cut to {n}"
    elif how == "missing_input":
        node = draw(st.sampled_from([n for n in g.node if n.input]), label="node")
        i = draw(st.integers(0, len(node.input) - 1))
        node.input[i] = draw(st.sampled_from(["nope", "", "logits", node.output[0]]), label="name")
        desc = f"node {node.name or node.op_type} input {i} -> '{node.input[i]}'"
    elif how == "unknown_op":
        node = draw(st.sampled_from(list(g.node)), label="node")
        node.op_type = draw(st.sampled_from(["Nope", "matmul", "", "QuantizeLinear"]), label="op")
        desc = f"node {node.name} op_type '{node.op_type}'"
    elif how == "dup_output":
        g.node[1].output[0] = g.node[0].output[0]
        desc = "two nodes write the same tensor"
    elif how == "self_loop":
        g.node[2].input[0] = g.node[2].output[0]
        desc = "a node reads its own output"
    elif how == "input_dtype":
        dt = draw(st.sampled_from([TensorProto.FLOAT, TensorProto.INT32, TensorProto.STRING, TensorProto.BOOL, 0]))
        g.input[0].type.tensor_type.elem_type = dt
        desc = f"graph input dtype {dt}"
    elif how == "bad_dims":
        t = draw(st.sampled_from([t for t in g.initializer]), label="init")
        dims = draw(st.sampled_from([[], [0], [-1, 16], [2**40, 16], [1, 2, 3]]), label="dims")
        del t.dims[:]
        t.dims.extend(dims)
        desc = f"initializer {t.name} dims {dims}"
    elif how == "init_dtype":
        t = draw(st.sampled_from([t for t in g.initializer]), label="init")
        dt = draw(st.sampled_from([TensorProto.INT8, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.STRING,
                                   TensorProto.INT4, 0, 99]), label="dtype")
        t.data_type = dt
        desc = f"initializer {t.name} data_type {dt}"
    elif how == "nonfinite":
        t = draw(st.sampled_from([t for t in g.initializer if t.data_type == TensorProto.FLOAT]), label="init")
        value = draw(st.sampled_from([np.nan, np.inf, -np.inf, 3e38, -3e38]), label="value")
        count = draw(st.integers(1, 4), label="count")
        if t.data_location == TensorProto.EXTERNAL:
            info = _ext_info(t)
            data_path = folder / info["location"]
            raw = bytearray(data_path.read_bytes())
            offset = int(info.get("offset", 0))
            arr = np.frombuffer(bytes(raw[offset:offset + int(info["length"])]), np.float32).copy()
            arr[:count] = value
            raw[offset:offset + arr.nbytes] = arr.tobytes()
            data_path.write_bytes(bytes(raw))
        else:
            arr = onnx.numpy_helper.to_array(t).copy()
            arr.flat[:count] = value
            t.CopyFrom(onnx.numpy_helper.from_array(arr, t.name))
        desc = f"{count} value(s) of {t.name} set to {value}"
    elif how == "nonfinite_anywhere":  # any float weight, any cell: also those the recipe leaves in float
        desc = _nonfinite_anywhere(draw, m, folder)
    elif how == "ort_refused":
        op, attrs = draw(st.sampled_from(ORT_REFUSED), label="refused")
        if op == "unknown_attribute":
            node = draw(st.sampled_from([n for n in g.node if n.domain in ("", "ai.onnx") and n.op_type != "Constant"]),
                        label="node")
            node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
            desc = f"node {node.name or node.op_type} gets attribute {attrs}"
        else:  # after a float node whose output is at least 3-D (the toy's Relu; any of the tiny's RMS norms)
            node = draw(st.sampled_from([n for n in g.node if n.op_type in ("Relu", "SimplifiedLayerNormalization")
                                         or (n.op_type == "Mul" and "norm" in n.name.lower())]), label="node")
            inner = node.output[0] + "__pre"
            for other in g.node:
                other.input[:] = [inner if x == node.output[0] else x for x in other.input]
            g.node.insert(list(g.node).index(node) + 1, helper.make_node(op, [node.output[0]], [inner],
                                                                         name="fuzz_refused", **attrs))
            desc = f"{op} {attrs} after node {node.name or node.op_type}"
    else:  # external data: only the toy model has it
        t = draw(st.sampled_from([t for t in g.initializer if t.data_location == TensorProto.EXTERNAL]), label="init")
        info = _ext_info(t)
        if how == "ext_location":
            outside = fz.ws / "outside.bin"
            shutil.copy(folder / info["location"], outside)
            loc = draw(st.sampled_from(["nope.bin", "../outside.bin", str(outside), "", ".", "model.onnx",
                                        "../toy/model.onnx.data", "/dev/zero", "sub/../model.onnx.data"]), label="loc")
            _set_ext(t, "location", loc)
            desc = f"{t.name} external location '{loc}'"
        elif how in ("ext_offset", "ext_length"):
            key = how[4:]
            size = (folder / info["location"]).stat().st_size
            v = draw(st.sampled_from([-1, 0, 1, 3, size - 1, size, size + 1, 2**62, 2**64 + 5]), label=key)
            _set_ext(t, key, str(v))
            desc = f"{t.name} external {key} {v} (file {size} bytes)"
        elif how == "ext_number":
            key = draw(st.sampled_from(["offset", "length", "checksum", "nope"]), label="key")
            v = draw(st.sampled_from(["abc", "", "1.5", " 4", "0x10", "\u0664"]), label="value")
            _set_ext(t, key, v)
            desc = f"{t.name} external {key} '{v}'"
        elif how == "data_truncate":
            data_path = folder / info["location"]
            size = data_path.stat().st_size
            cut = draw(st.integers(0, size - 1), label="cut")
            os.truncate(data_path, cut)
            return f"model.onnx.data cut to {cut} of {size} bytes"
        elif how == "data_symlink":
            data_path = folder / info["location"]
            target = fz.ws / "elsewhere" / "weights.bin"
            target.parent.mkdir(exist_ok=True)
            shutil.move(data_path, target)
            dangling = draw(st.booleans(), label="dangling")
            if dangling:
                target.unlink()
            data_path.symlink_to(target)
            return f"model.onnx.data is a symlink to ../elsewhere/weights.bin{' (dangling)' if dangling else ''}"
        else:
            raise AssertionError(how)
    onnx.save_model(m, str(path))
    return desc


def _nonfinite_anywhere(draw, m: onnx.ModelProto, folder: Path) -> str:
    """NaN / inf written into random cells of a random float initializer (any of them: the toy's
    embedding and head, the tiny's norms and embedding table, which w8a8 leaves in float) or of a
    float Constant node's value (the tiny's -inf masks), in memory or in its external data file."""
    g = m.graph
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)
    targets = [(t.name, t) for t in g.initializer if t.data_type in floats]
    targets += [(f"Constant {n.name}", a.t) for n in g.node if n.op_type == "Constant" for a in n.attribute
                if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in floats]
    label, t = draw(st.sampled_from(targets), label="tensor")
    size = max(1, int(np.prod(t.dims, dtype=np.int64)))
    cells = draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=3, unique=True), label="cells")
    value = draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="value")
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    if t.data_location == TensorProto.EXTERNAL:
        info = _ext_info(t)
        with open(folder / info["location"], "r+b") as f:
            for cell in cells:
                f.seek(int(info.get("offset", 0)) + cell * dtype.itemsize)
                f.write(np.array(value, dtype).tobytes())
    else:
        arr = onnx.numpy_helper.to_array(t).copy()
        arr.reshape(-1)[cells] = value
        t.CopyFrom(onnx.numpy_helper.from_array(arr, t.name))
    return f"{label} cells {cells} set to {value}"


def _model_command(draw, model: Path, base_model: Path, fz: Fuzz) -> list[str]:
    tok = str(fz.ws / "toy")
    calib = str(fz.ws / "calib.txt")
    out = str(fz.ws / "out")
    cmd = draw(st.sampled_from(["compile", "compile", "compile", "check", "inspect", "inspect-calib", "ppl",
                                "compare", "generate"]), label="command")
    m = str(model)
    if cmd == "compile":
        extra = draw(st.sampled_from([[], [], ["--target", "generic-qdq"], ["--verify"], ["--blockwise", "on"]]))
        return ["compile", m, *FAST, "--calib", calib, "--tokenizer", tok, *extra, "-o", out]
    if cmd == "check":
        return ["check", m, "--target", draw(st.sampled_from(["generic-qdq", "pow2-int"]))]
    if cmd == "inspect":
        return ["inspect", m]
    if cmd == "inspect-calib":
        return ["inspect", m, "--calib", calib, "--tokenizer", tok, "--calib-windows", "1", "--seq-len", "16"]
    if cmd == "ppl":
        return ["eval", "ppl", m, "--text", calib, "--tokenizer", tok, "--seq-len", "16", "--windows", "1"]
    if cmd == "compare":
        return ["eval", "compare", str(base_model), m, "--text", calib, "--tokenizer", tok, "--windows", "1",
                "--seq-len", "16"]
    return ["generate", m, "--prompt", "w1 w2 w3", "--max-new-tokens", "2", "--tokenizer", tok]


def build_model_case(draw, fz: Fuzz) -> Case:
    which = draw(st.sampled_from(["toy", "toy", "toy", "tiny"]), label="model")
    if which == "toy":
        model, base_model = fz.ws / "toy" / "model.onnx", fz.base / "toy" / "model.onnx"
        how = draw(st.sampled_from(TOY_MUTATIONS), label="mutation")
    else:
        shutil.copytree(fz.base / "tiny", fz.ws / "tiny")
        model, base_model = fz.ws / "tiny" / "model.onnx", fz.base / "tiny" / "model.onnx"
        how = draw(st.sampled_from(TINY_MUTATIONS), label="mutation")
    setup = f"{which}: " + _mutate_model(draw, model, how, fz)
    return Case("models", f"model:{how}", _model_command(draw, model, base_model, fz), setup)


# -- calibration files ---------------------------------------------------------------------------------

TEXT_KINDS = ["empty", "whitespace", "binary", "non_utf8", "huge_line", "nul", "bom", "unknown_words", "few_words",
              "crlf", "long_token", "directory", "missing", "npz_as_txt"]
NPZ_KINDS = ["arrays", "arrays", "arrays", "corrupt_zip", "random_bytes", "npy", "foreign_member", "empty_zip",
             "pickled", "text"]


def _text_calib(draw, path: Path, kind: str) -> str:
    words = lambda n: " ".join(WORDS[i % len(WORDS)] for i in range(n))  # noqa: E731
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "whitespace":
        path.write_text(draw(st.sampled_from([" ", "\n\n\n", "\t \r\n", "\u3000\u00a0"])))
    elif kind == "binary":
        path.write_bytes(draw(st.binary(min_size=1, max_size=4096), label="bytes"))
    elif kind == "non_utf8":
        bad = draw(st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\xe9t\xe9", b"\x80"]))
        where = draw(st.integers(0, 300), label="where")
        data = words(400).encode()
        path.write_bytes(data[:where] + bad + data[where:])
        return f"calib text with {bad!r} at byte {where}"
    elif kind == "huge_line":
        n = draw(st.sampled_from([10_000, 100_000]), label="words")
        path.write_text(words(n))
        return f"calib text: one line of {n} words, no newline"
    elif kind == "nul":
        path.write_bytes(words(200).encode().replace(b" ", b"\x00"))
    elif kind == "bom":
        path.write_bytes(b"\xef\xbb\xbf" + words(400).encode())
    elif kind == "unknown_words":
        path.write_text("zzz " * 400)
    elif kind == "few_words":
        n = draw(st.integers(1, 17), label="words")
        path.write_text(words(n))
        return f"calib text of {n} words"
    elif kind == "crlf":
        path.write_bytes((words(20) + "\r\n").encode() * 30)
    elif kind == "long_token":
        path.write_text("w1" * 200_000)
    elif kind == "directory":
        path.mkdir()
    elif kind == "missing":
        pass
    elif kind == "npz_as_txt":
        np.savez(path.with_suffix(".npz"), input_ids=np.zeros((1, 16), np.int64))
        path.with_suffix(".npz").rename(path)
    return f"calib text: {kind}"


def _npz_array(draw, name: str):
    dtype = draw(st.sampled_from(["int64", "int64", "int32", "float32", "float64", "bool", "uint8", "<U3"]),
                 label=f"{name}.dtype")
    shape = draw(st.sampled_from([(1, 16), (2, 16), (2, 1, 16), (), (16,), (0, 16), (1, 0), (0,), (1, 1, 1, 16),
                                  (3, 5), (1, 200)]), label=f"{name}.shape")
    fill = draw(st.sampled_from(["valid", "valid", "negative", "vocab", "huge", "nan", "inf", "zeros"]),
                label=f"{name}.fill")
    rng = np.random.default_rng(0)
    if dtype == "<U3":
        return np.full(shape, "w1", dtype=dtype), f"{name} {dtype}{list(shape)}"
    values = rng.integers(0, VOCAB, shape).astype(np.float64)
    values = {"valid": values, "zeros": np.zeros(shape), "negative": -values - 1, "vocab": values + VOCAB,
              "huge": np.full(shape, 2.0**62), "nan": np.full(shape, np.nan), "inf": np.full(shape, np.inf)}[fill]
    if np.dtype(dtype).kind in "iub" and fill in ("nan", "inf"):
        fill = "valid"
        values = rng.integers(0, VOCAB, shape).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        arr = values.astype(dtype)
    return arr, f"{name} {dtype}{list(shape)} {fill}"


def _npz_calib(draw, path: Path, kind: str) -> str:
    if kind == "arrays":
        keys = draw(st.lists(st.sampled_from(["input_ids", "input_ids", "attention_mask", "position_ids", "bogus"]),
                             min_size=0, max_size=3, unique=True), label="keys")
        arrays, parts = {}, []
        for k in keys:
            arrays[k], d = _npz_array(draw, k)
            parts.append(d)
        np.savez(path, **arrays)
        return "calib npz: " + (", ".join(parts) or "no arrays")
    if kind == "corrupt_zip":
        np.savez(path, input_ids=np.zeros((2, 16), np.int64))
        data = path.read_bytes()
        cut = draw(st.integers(0, len(data) - 1), label="cut")
        flip = draw(st.booleans(), label="flip")
        if flip:
            b = bytearray(data)
            b[cut] ^= 0xFF
            path.write_bytes(bytes(b))
            return f"calib npz with byte {cut} flipped"
        path.write_bytes(data[:cut])
        return f"calib npz cut to {cut} of {len(data)} bytes"
    if kind == "random_bytes":
        path.write_bytes(draw(st.binary(min_size=0, max_size=512), label="bytes"))
    elif kind == "npy":
        with open(path, "wb") as f:
            np.save(f, np.zeros((1, 16), np.int64))
    elif kind == "foreign_member":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("input_ids.npy", b"not an npy header")
    elif kind == "empty_zip":
        with zipfile.ZipFile(path, "w"):
            pass
    elif kind == "pickled":
        np.savez(path, input_ids=np.array([[1, 2, 3]], dtype=object))
    elif kind == "text":
        path.write_text("w1 w2 w3 " * 100)
    return f"calib npz: {kind}"


def build_calib_case(draw, fz: Fuzz) -> Case:
    tok = str(fz.ws / "toy")
    out = str(fz.ws / "out")
    use_tiny = draw(st.sampled_from([False, False, False, True]), label="tiny")
    model = str(fz.base / "tiny" / "model.onnx") if use_tiny else str(fz.ws / "toy" / "model.onnx")
    if draw(st.booleans(), label="npz"):
        kind = draw(st.sampled_from(NPZ_KINDS), label="npz_kind")
        path = fz.ws / "calib_fz.npz"
        setup = _npz_calib(draw, path, kind)
        cmd = draw(st.sampled_from(["compile", "compile", "inspect", "compare"]), label="command")
        if cmd == "compare":
            argv = ["eval", "compare", model, model, "--npz", str(path)]
        elif cmd == "inspect":
            argv = ["inspect", model, "--calib", str(path), "--calib-windows", "1", "--seq-len", "16"]
        else:
            argv = ["compile", model, *FAST, "--calib", str(path), "-o", out]
        kind = f"npz:{kind}"
    else:
        kind = draw(st.sampled_from(TEXT_KINDS), label="text_kind")
        path = fz.ws / "calib_fz.txt"
        setup = _text_calib(draw, path, kind)
        cmd = draw(st.sampled_from(["compile", "compile", "inspect", "ppl", "compare"]), label="command")
        seq = ["--seq-len", "16"]
        if cmd == "compare":
            argv = ["eval", "compare", model, model, "--text", str(path), "--tokenizer", tok, "--windows", "1", *seq]
        elif cmd == "ppl":
            argv = ["eval", "ppl", model, "--text", str(path), "--tokenizer", tok, "--windows", "1", *seq]
        elif cmd == "inspect":
            argv = ["inspect", model, "--calib", str(path), "--tokenizer", tok, "--calib-windows", "1", *seq]
        else:
            argv = ["compile", model, *FAST, "--calib", str(path), "--tokenizer", tok, "-o", out]
        kind = f"text:{kind}"
    return Case("calibration", kind, argv, setup)


# -- files beside the model: tokenizer, config, chat template ---------------------------------------------

SIDECARS = ["tokenizer.json", "tokenizer.json", "config.json", "generation_config.json", "tokenizer_config.json",
            "chat_template.jinja"]
SIDECAR_JSON = [[], 5, "x", None, {}, {"eos_token_id": "x"}, {"eos_token_id": [1, "a"]}, {"eos_token_id": 10**30},
                {"eos_token_id": -1}, {"eos_token_id": [999999]}, {"vocab_size": -1}, {"vocab_size": "64"},
                {"chat_template": 5}, {"chat_template": []}, {"chat_template": [{"name": "x"}]},
                {"chat_template": "{{ nope() }}"}, {"chat_template": "{% for %}"}, {"bos_token": {"content": 5}},
                {"eos_token": ["w1"]}, {"model": {}}, {"model": {"type": "WordLevel", "vocab": {}}}, {"version": "1.0"}]
SIDECAR_TEXT = ["", "not json", "{", "{}{}", "\ufeff{}", "{{ messages[0]['content'] | nope }}", "{% raw %}",
                "{{ ''.__class__.__mro__ }}", "{% for i in range(10**9) %}x{% endfor %}",
                "{{ raise_exception('no') }}", "{{ raise_exception('') }}",
                "{% for m in messages %}{{ m.content }}{% endfor %}", "{{ 1 / 0 }}", "{{ messages.nope.nope }}",
                "{% include 'other.jinja' %}", "{{ messages[0].content | int + 'a' }}",
                "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}"]


def build_sidecar_case(draw, fz: Fuzz) -> Case:
    folder = fz.ws / "toy"
    name = draw(st.sampled_from(SIDECARS), label="file")
    path = folder / name
    chat = name in ("chat_template.jinja", "tokenizer_config.json")
    hows = ["json", "json", "text", "bytes", "non_utf8", "cut", "directory", "dangling", "missing"]
    how = draw(st.sampled_from(["text"] if name == "chat_template.jinja" else hows), label="how")
    if how == "json":
        value = draw(st.sampled_from(SIDECAR_JSON), label="value")
        path.write_text(json.dumps(value))
        detail = json.dumps(value)
    elif how == "text":
        value = draw(st.sampled_from(SIDECAR_TEXT), label="value")
        path.write_text(value)
        detail = repr(value)
    elif how == "bytes":
        value = draw(st.binary(max_size=64), label="value")
        path.write_bytes(value)
        detail = repr(value)
    elif how == "non_utf8":
        text = path.read_bytes() if path.exists() else b'{"eos_token_id": 2}'
        where = draw(st.integers(0, len(text)), label="where")
        path.write_bytes(text[:where] + b"\xff\xfe" + text[where:])
        detail = f"\\xff\\xfe at byte {where}"
    elif how == "cut":
        text = path.read_bytes() if path.exists() else b'{"chat_template": "{{ messages }}"}'
        where = draw(st.integers(0, max(len(text) - 1, 0)), label="where")
        path.write_bytes(text[:where])
        detail = f"cut to {where} bytes"
    elif how == "directory":
        path.unlink(missing_ok=True)
        path.mkdir()
        detail = "a folder"
    elif how == "dangling":
        path.unlink(missing_ok=True)
        path.symlink_to(fz.ws / "nowhere")
        detail = "a dangling symlink"
    else:
        path.unlink(missing_ok=True)
        detail = "removed"
    calib = str(fz.ws / "calib.txt")
    model = str(folder / "model.onnx")
    cmd = draw(st.sampled_from(["generate-chat"] * 6 * chat + ["generate", "generate", "generate-chat", "compile", "ppl",
                                                                  "inspect", "compare"]), label="command")
    if cmd.startswith("generate"):
        argv = ["generate", str(folder), "--prompt", "w1 w2", "--max-new-tokens", "2",
                *(["--chat"] if cmd == "generate-chat" else [])]
    elif cmd == "compile":
        argv = ["compile", model, *FAST, "--calib", calib, "-o", str(fz.ws / "out")]
    elif cmd == "ppl":
        argv = ["eval", "ppl", model, "--text", calib, "--tokenizer", str(folder), "--seq-len", "16", "--windows", "1"]
    elif cmd == "inspect":
        argv = ["inspect", model, "--calib", calib, "--calib-windows", "1", "--seq-len", "16"]
    else:
        argv = ["eval", "compare", model, str(fz.base / "q8" / "model.onnx"), "--text", calib, "--tokenizer",
                str(folder), "--windows", "1", "--seq-len", "16"]
    return Case("sidecar", f"sidecar:{name}:{how}", argv, f"toy/{name}: {detail}")


# -- damaged cache -----------------------------------------------------------------------------------------


CACHE_DAMAGE = ["truncate", "flip", "empty", "text", "directory", "symlink_foreign", "dangling_symlink", "npz_wrong"]


def build_cache_case(draw, fz: Fuzz) -> Case:
    calib = str(fz.ws / "calib.txt")
    model = str(fz.ws / "toy" / "model.onnx")
    cached = ["compile", model, "--recipe", "w8a8", "--calib-windows", "1", "--seq-len", "16", "--calib", calib,
              "-o", str(fz.ws / "out")]
    cmd = draw(st.sampled_from(["compile", "compile", "inspect"]), label="command")
    argv = cached if cmd == "compile" else ["inspect", model, "--calib", calib, "--calib-windows", "1", "--seq-len", "16"]
    if draw(st.integers(0, 3), label="env") == 0:
        where = draw(st.sampled_from([str(fz.ws / "file.txt"), str(fz.ws / "file.txt" / "sub"),
                                      str(fz.ws / "foreign" / "notes.txt"), ""]), label="cache_dir")
        return Case("cache", f"cache-env:{'empty' if not where else Path(where).name}", argv, "",
                    {"EDGEQ_CACHE_DIR": where})
    shutil.copytree(fz.base / "cache", fz.cache, dirs_exist_ok=True)
    files = sorted(p for p in fz.cache.rglob("*") if p.is_file())
    victims = draw(st.lists(st.sampled_from(files), min_size=1, max_size=len(files), unique=True), label="victims")
    how = draw(st.sampled_from(CACHE_DAMAGE), label="damage")
    for v in victims:
        if how == "truncate":
            os.truncate(v, draw(st.integers(0, max(v.stat().st_size - 1, 0)), label="cut"))
        elif how == "flip":
            b = bytearray(v.read_bytes())
            pos = draw(st.integers(0, len(b) - 1), label="pos")
            b[pos] ^= 0xFF
            v.write_bytes(bytes(b))
        elif how == "empty":
            v.write_bytes(b"")
        elif how == "text":
            v.write_text("garbage\n")
        elif how == "directory":
            v.unlink()
            v.mkdir()
            (v / "x").write_text("x")
        elif how == "symlink_foreign":
            v.unlink()
            v.symlink_to(fz.ws / "foreign" / "notes.txt")
        elif how == "dangling_symlink":
            v.unlink()
            v.symlink_to(fz.ws / "nowhere")
        elif how == "npz_wrong":
            with open(v, "wb") as f:
                np.savez(f, bogus=np.array([np.nan]))
    return Case("cache", f"cache:{how}", argv,
                f"cache entries {[str(v.relative_to(fz.cache)) for v in victims]} damaged: {how}")


def _fill_cache(fz: Fuzz, capfd) -> None:
    """Populate the calibration and token cache once (kept in base/cache, copied in per case)."""
    if (fz.base / "cache").exists():
        return
    fz.fresh_ws()
    model, calib = str(fz.ws / "toy" / "model.onnx"), str(fz.ws / "calib.txt")
    for argv in (["compile", model, "--recipe", "w8a8", "--calib-windows", "1", "--seq-len", "16", "--calib", calib,
                  "-o", str(fz.ws / "out")],
                 ["inspect", model, "--calib", calib, "--calib-windows", "1", "--seq-len", "16"]):
        res = _run_inprocess(Case("setup", "setup", argv), capfd)
        assert res.code == 0, res.err
    shutil.copytree(fz.cache, fz.base / "cache")
    assert any(p.is_file() for p in (fz.base / "cache").rglob("*")), "the cache stayed empty"
