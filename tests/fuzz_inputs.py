"""What the fuzz campaigns feed edgeq (tests/test_fuzz.py): mutated models, calibration files, files
beside the model, recipes and target profiles, command lines and a damaged cache, each as a Hypothesis
case builder over the harness of ``fuzz_harness``."""

from __future__ import annotations

import json
import math
import os
import re
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
    REPO_ROOT,
    _run_inprocess,
    fz,
)


# -- mutated models ------------------------------------------------------------------------------------

TOY_MUTATIONS = ["bitflip", "truncate", "ir_version", "opset", "drop_outputs", "missing_input", "nonfinite",
                 "init_dtype", "input_dtype", "ext_location", "ext_offset", "ext_length", "ext_number",
                 "data_truncate", "data_symlink", "dup_output", "self_loop", "empty", "text", "directory",
                 "missing", "bad_dims", "unknown_op", "model_symlink"]
TINY_MUTATIONS = ["bitflip", "truncate", "ir_version", "opset", "drop_outputs", "missing_input", "nonfinite",
                  "init_dtype", "input_dtype", "unknown_op"]


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


# -- recipes and target profiles -------------------------------------------------------------------------


def _toml_str(text: str) -> str:
    """A TOML basic string (json.dumps would write characters beyond the BMP as surrogate pairs)."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) < 0xE000:
            out.append(f"\\u{ord(c):04x}")  # (a lone surrogate stays invalid TOML: a fuzz case of its own)
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_str(k)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def toml_dump(data: dict) -> str:
    lines, tables, arrays = [], [], []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            arrays.append((k, v))
        else:
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    for k, v in tables:
        lines.append(f"[{_toml_key(k)}]")
        lines.extend(f"{_toml_key(kk)} = {_toml_value(vv)}" for kk, vv in v.items())
    for k, items in arrays:
        for item in items:
            lines.append(f"[[{_toml_key(k)}]]")
            lines.extend(f"{_toml_key(kk)} = {_toml_value(vv)}" for kk, vv in item.items())
    return "\n".join(lines) + "\n"


SCALARS = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 16, 2**31, 2**63]),
                    st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                    st.text(max_size=12), st.sampled_from(["", "int8", "uint8", "int4", "channel", "tensor", "lm_head"]))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=5), SCALARS, max_size=2))


def _pass_table() -> dict[str, dict[str, object]]:
    """pass name -> {config key: its type hint}."""
    import dataclasses
    import typing

    from edgeq.registry import all_passes

    return {name: {f.name: typing.get_type_hints(cls.Config)[f.name] for f in dataclasses.fields(cls.Config)}
            for name, cls in all_passes().items()}


WORDS_OF_CONFIG = ["int8", "uint8", "int16", "int4", "uint4", "channel", "tensor", "group", "block", "minmax", "mse",
                   "percentile", "token", "w8a8", "w4a8", "eq9", "lm_head", "down_proj=int16", "fc1", "nope", ""]


def _plausible(hint):
    """Values of the right type (mostly): what a user who read the docs, roughly, would write."""
    import typing

    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.sampled_from([0, 1, 2, 4, 8, 16, 32, 128, -1, 2**31])
    if hint is float:
        return st.sampled_from([0.0, 0.5, 1.0, 2.0, 20.0, 99.99, 100.0, -1.0, 1e-9, float("nan"), float("inf")])
    if hint is str:
        return st.sampled_from(WORDS_OF_CONFIG)
    if typing.get_origin(hint) is tuple:
        return st.lists(st.sampled_from(ROLES + WORDS_OF_CONFIG[-4:]), max_size=3)
    return VALUES


ROLES = ["lm_head", "fc1", "fc2", "q_proj", "down_proj", "nope", "", "LM_HEAD", "*"]


def _recipe_dict(draw, passes: dict) -> tuple[dict, str]:
    data, notes = {}, []
    if draw(st.booleans(), label="description"):
        data["description"] = draw(st.one_of(st.text(max_size=20), VALUES), label="description_value")
    if draw(st.booleans(), label="calibration"):
        cal = {}
        for k in draw(st.lists(st.sampled_from(["windows", "seq_len", "batch_size", "nope"]), unique=True, max_size=3)):
            cal[k] = draw(st.one_of(*[st.sampled_from([1, 2, 16, 0, -1, 2**40])] * 3, SCALARS), label=f"calibration.{k}")
        data["calibration"] = draw(st.one_of(*[st.just(cal)] * 4, VALUES), label="calibration_table")
    if draw(st.integers(0, 5), label="kv") == 0:
        data["kv_cache"] = {"dtype": draw(st.sampled_from(["int8", "float32", "int4", 8]))}
    if draw(st.integers(0, 19), label="extra_key") == 0:
        data[draw(st.text(min_size=1, max_size=6), label="extra")] = draw(SCALARS)
    n = draw(st.sampled_from([0, 1, 1, 1, 1, 1, 2, 2, 3]), label="n_passes")
    entries = []
    for i in range(n):
        name = draw(st.sampled_from([*passes, *["qdq"] * 8, "nope", "", "QDQ", "qdq "]), label=f"pass{i}")
        entry = {"name": name}
        if draw(st.integers(0, 15), label=f"noname{i}") == 0:
            entry = {}
        hints = passes.get(name, {})
        fields = [*hints, *hints, "nope", "essential"]
        for k in draw(st.lists(st.sampled_from(fields), unique=True, max_size=4), label=f"keys{i}"):
            if k == "essential":
                entry[k] = draw(st.one_of(st.booleans(), st.booleans(), SCALARS), label=k)
            elif k in hints and draw(st.integers(0, 3), label=f"plausible_{k}"):
                entry[k] = draw(_plausible(hints[k]), label=f"{name}.{k}")
            else:
                entry[k] = draw(VALUES, label=f"{name}.{k}")
        entries.append(entry)
        notes.append(name)
    if entries or draw(st.booleans(), label="pass_key"):
        data["pass"] = draw(st.one_of(*[st.just(entries)] * 8, VALUES), label="pass_value")
    return data, f"passes {notes}"


def _target_dict(draw) -> tuple[dict, str]:
    import tomllib

    from edgeq.registry import all_passes

    base = draw(st.sampled_from(["generic-qdq", "pow2-int", "qnn-htp"]), label="profile")
    path = REPO_ROOT / "edgeq" / "targets" / "profiles" / f"{base}.toml"
    data = tomllib.loads(path.read_text())
    notes = [base]
    for i in range(draw(st.sampled_from([0, 1, 1, 2, 3]), label="n_mutations")):
        op = draw(st.sampled_from(["drop", "add", "retype", "bad_item"]), label=f"op{i}")
        keys = sorted(data)
        key = draw(st.sampled_from(keys), label=f"key{i}")
        if op == "drop":
            data.pop(key)
        elif op == "add":
            key = draw(st.sampled_from(["nope", "ort_kernels", "int8_weight_range", "static_shapes", "Ops"]))
            data[key] = draw(st.one_of(VALUES, st.sampled_from(["full-vnni-only", "u8s8-safe", True])))
        elif op == "retype":
            data[key] = draw(VALUES, label=f"value{i}")
        else:
            item = draw(st.sampled_from(["NotAnOp", "int3", "nope-pass", "", "*", "Matmul", *list(all_passes())[:3]]))
            target = data.get(key)
            if isinstance(target, list):
                target.append(item)
            elif isinstance(target, dict) and target:
                sub = draw(st.sampled_from(sorted(target)))
                target[sub] = [item] if isinstance(target[sub], list) else item
            else:
                data[key] = [item]
        notes.append(f"{op} {key}")
    return data, ", ".join(notes)


def _raw_mutation(draw, text: str) -> tuple[bytes, str]:
    how = draw(st.sampled_from(["none"] * 10 + ["non_utf8", "cut", "bom", "empty", "garbage", "nul"]),
               label="raw")
    data = text.encode()
    if how == "non_utf8":
        where = draw(st.integers(0, len(data)), label="where")
        return data[:where] + b"\xff\xfe\xc3" + data[where:], f"non-UTF-8 bytes at {where}"
    if how == "cut":
        where = draw(st.integers(0, len(data)), label="where")
        return data[:where], f"cut at byte {where}"
    if how == "bom":
        return b"\xef\xbb\xbf" + data, "UTF-8 BOM"
    if how == "empty":
        return b"", "empty"
    if how == "garbage":
        return draw(st.binary(max_size=64), label="garbage"), "random bytes"
    if how == "nul":
        return data.replace(b"\n", b"\x00\n", 1), "a NUL byte"
    return data, ""


def build_toml_case(draw, fz: Fuzz, passes: dict) -> Case:
    out = str(fz.ws / "out")
    calib = str(fz.ws / "calib.txt")
    tok = str(fz.ws / "toy")
    kind = draw(st.sampled_from(["recipe", "recipe", "recipe", "target", "target", "recipe_name", "target_name"]),
                label="kind")
    if kind in ("recipe_name", "target_name"):
        value = draw(st.sampled_from(["", ".", "..", "nope", "W8A8", "w8a8.toml", "qnn-htp.toml", str(fz.ws / "foreign"),
                                      str(fz.ws / "calib.txt"), str(fz.ws / "toy" / "model.onnx"),
                                      str(fz.ws / "missing.toml"), "/dev/null", str(fz.ws / "foreign") + "/"]),
                     label="name")
        if kind == "recipe_name":
            argv = ["compile", str(fz.ws / "toy" / "model.onnx"), "--recipe", value, "--calib-windows", "1",
                    "--seq-len", "16", "--no-cache", "--calib", calib, "-o", out]
        elif draw(st.booleans()):
            argv = ["check", str(fz.base / "q8" / "model.onnx"), "--target", value]
        else:
            argv = ["compile", str(fz.ws / "toy" / "model.onnx"), *FAST, "--calib", calib, "--target", value, "-o", out]
        return Case("toml", kind, argv, "")
    if kind == "recipe":
        data, notes = _recipe_dict(draw, passes)
    else:
        data, notes = _target_dict(draw)
    raw, how = _raw_mutation(draw, toml_dump(data))
    path = fz.ws / f"fz_{kind}.toml"
    path.write_bytes(raw)
    setup = f"{path.name}: {notes}{'; ' + how if how else ''}: {raw[:300]!r}"
    if kind == "recipe":
        tiny = draw(st.booleans(), label="tiny")
        model = str(fz.base / "tiny" / "model.onnx") if tiny else str(fz.ws / "toy" / "model.onnx")
        fast = draw(st.sampled_from([["--calib-windows", "1", "--seq-len", "16"], ["--seq-len", "16"], []]))
        argv = ["compile", model, "--recipe", str(path), *fast, "--no-cache", "--calib", calib, "--tokenizer", tok,
                "-o", out]
        kind = f"recipe:{'raw-' + how.split(' ')[0] if how else 'structure'}"
    else:
        if draw(st.booleans(), label="check"):
            argv = ["check", str(fz.base / "q8" / "model.onnx"), "--target", str(path)]
        else:
            argv = ["compile", str(fz.ws / "toy" / "model.onnx"), *FAST, "--calib", calib, "--target", str(path),
                    "-o", out]
        kind = f"target:{'raw-' + how.split(' ')[0] if how else 'structure'}"
    return Case("toml", kind, argv, setup)


# -- command-line arguments --------------------------------------------------------------------------------

INTS = ["-1", "0", "1", "2", "3", "16", "x", "", "1e3", "nan", " 3", "99999999999999999999"]
SMALL_INTS = ["-1", "0", "1", "2", "x", ""]
FLOATS = ["-1", "0", "0.5", "1", "2", "nan", "inf", "-inf", "1e309", "x", ""]
SEEDS = ["-1", "0", "7", "4294967296", "-9223372036854775809", "x"]


def _paths(fz: Fuzz) -> dict[str, list[str]]:
    ws, base = fz.ws, fz.base
    toy = str(ws / "toy" / "model.onnx")
    common = ["", ".", "..", str(ws / "missing"), str(ws / "file.txt" / "sub"), str(ws / ("n" * 300)), "rel/missing"]
    return {
        "model": [toy, toy, toy, str(base / "q8" / "model.onnx"), str(base / "tiny" / "model.onnx"),
                  str(ws / "calib.txt"), str(ws / "toy"), str(base / "q8"), str(ws / "foreign"),
                  str(ws / "toy" / "tokenizer.json"), *common],
        "folder": [str(ws / "toy"), str(base / "q8"), str(base / "tiny"), toy, str(ws / "foreign"),
                   str(ws / "toy" / "tokenizer.json"), *common],
        "text": [str(ws / "calib.txt")] * 3 + [str(base / "calib.npz"), toy, str(ws / "toy"), "/dev/null", *common],
        "out": [str(ws / "out")] * 4 + [str(ws / "link_foreign"), str(ws / "link_dangling"),
                                         str(ws / "new" / "deeper" / "out"), str(ws / "foreign"), str(ws / "calib.txt"),
                                         str(ws / "toy"), str(ws / "foreign" / "notes.txt"), "rel/out", *common],
        "recipe": ["w8a8", "w8a8", "fp32", "w8a16", "mquant-w8a8", "nope", "", str(ws / "calib.txt")],
        "target": ["generic-qdq", "pow2-int", "qnn-htp", "ort-cpu", "nope", "", str(ws / "calib.txt")],
    }


def _option_table(fz: Fuzz, p: dict) -> dict[str, tuple[list, list]]:
    """command -> (positional pools, [(flag, pool or None for a switch)])."""
    force = [("--force", None)]
    return {
        "compile": ([p["model"]], [
            ("-o", p["out"]), ("-o", p["out"]), ("--recipe", p["recipe"]), ("--calib", p["text"]),
            ("--tokenizer", p["folder"]), ("--calib-windows", INTS), ("--seq-len", INTS), ("--dump-each", p["out"]),
            ("--verify", None), ("--check-numerics", None), ("--no-cache", None), ("--target", p["target"]),
            ("--allow-partial", None), ("--blockwise", ["auto", "on", "off", "x"]),
            ("--static", ["prefill=16,context=32", "", "x", "prefill=-1,context=0", "prefill=16", "context=8,prefill=4"]),
            *(force if fz.has_force.get("compile") else [])]),
        "check": ([p["model"]], [("--target", p["target"]), ("--target", p["target"]), ("--json", None)]),
        "inspect": ([p["model"]], [("--calib", p["text"]), ("--tokenizer", p["folder"]), ("--calib-windows", SMALL_INTS),
                                   ("--seq-len", INTS), ("--outlier-threshold", FLOATS), ("--json", None)]),
        "eval ppl": ([p["model"]], [
            ("--text", p["text"]), ("--text", p["text"]), ("--tokenizer", p["folder"]), ("--tokenizer", p["folder"]),
            ("--windows", SMALL_INTS), ("--offset", INTS), ("--seq-len", INTS), ("--batch-size", SMALL_INTS),
            ("--no-special-tokens", None), ("--threads", SMALL_INTS), ("--exact-qdq", None), ("--no-optimize", None),
            ("--kernel-check", None), ("--through", ["prefill", "decode", "x"]), ("--json", None)]),
        "eval compare": ([p["model"], p["model"]], [
            ("--text", p["text"]), ("--npz", p["text"] + [str(fz.base / "calib.npz")] * 3), ("--random", SMALL_INTS),
            ("--tokenizer", p["folder"]), ("--windows", SMALL_INTS), ("--offset", INTS), ("--seq-len", SMALL_INTS + ["16"]),
            ("--no-special-tokens", None), ("--seed", SEEDS), ("--layers", None), ("--max-layers", SMALL_INTS),
            ("--optimize", None), ("--exact-qdq", None), ("--threads", SMALL_INTS), ("--json", None)]),
        "generate": ([p["folder"]], [
            ("--prompt", ["w1 w2 w3", "", "zzz", "\u00e9\u4e2d\U0001F600", "w1 " * 50, "-x"]), ("--prompt", ["w1 w2"]),
            ("--max-new-tokens", SMALL_INTS + ["3"]), ("--temperature", FLOATS), ("--top-p", FLOATS), ("--seed", SEEDS),
            ("--chat", None), ("--json", None), ("--tokenizer", p["folder"]), ("--threads", SMALL_INTS),
            ("--ignore-eos", None)]),
        "export tiny": ([["llama", "llama", "gpt2", "qwen2", "nope", "", "LLAMA"]], [
            ("-o", p["out"]), ("-o", p["out"]), ("--output", p["out"]), ("--seed", SEEDS), ("--with-past", None),
            *(force if fz.has_force.get("export") else [])]),
        "recipes": ([], [("--json", None), ("x", None), ("-o", p["out"])]),
        "passes": ([], [("--json", None), ("x", None)]),
        "targets": ([], [("--json", None), ("x", None)]),
        "": ([], [("--version", None), ("nope", None), ("-h", None), ("compile", None), ("eval", None),
                  ("export", None), ("--", None)]),
    }


def _skeletons(fz: Fuzz, out: str) -> dict[str, list[list[str]]]:
    """command -> a valid invocation, as pieces, that the random options are added to (and override)."""
    toy, q8 = str(fz.ws / "toy" / "model.onnx"), str(fz.base / "q8" / "model.onnx")
    calib, tok = str(fz.ws / "calib.txt"), str(fz.ws / "toy")
    text = [["--text", calib], ["--tokenizer", tok], ["--seq-len", "16"], ["--windows", "1"]]
    return {
        "compile": [[toy], *[FAST[i:i + 2] for i in range(0, 6, 2)], ["--no-cache"], ["--calib", calib], ["-o", out]],
        "check": [[q8], ["--target", "generic-qdq"]],
        "inspect": [[toy]],
        "eval ppl": [[q8], *text],
        "eval compare": [[toy], [q8], *text],
        "generate": [[tok], ["--prompt", "w1 w2"], ["--max-new-tokens", "2"]],
        "export tiny": [["llama"], ["-o", out]],
    }


def build_args_case(draw, fz: Fuzz, commands: list[str]) -> Case:
    command = draw(st.sampled_from(commands), label="command")
    paths = _paths(fz)
    positionals, options = _option_table(fz, paths)[command]
    skeleton = _skeletons(fz, draw(st.sampled_from(paths["out"]), label="skeleton_out")).get(command)
    use_skeleton = skeleton is not None and draw(st.booleans(), label="skeleton")
    chosen = draw(st.lists(st.sampled_from(range(len(options))), unique=True, max_size=len(options) if not use_skeleton
                           else 3), label="options")
    pieces = []
    for i in chosen:
        flag, pool = options[i]
        pieces.append([flag] if pool is None else [flag, draw(st.sampled_from(pool), label=flag)])
    if use_skeleton:
        pieces = skeleton + pieces  # a later value of an option overrides the skeleton's
    else:
        for j, pool in enumerate(positionals):
            if draw(st.integers(0, 7), label=f"drop_positional{j}") != 0:
                pieces.insert(draw(st.integers(0, len(pieces)), label=f"at{j}"),
                              [draw(st.sampled_from(pool), label=f"pos{j}")])
    argv = command.split() + [a for piece in pieces for a in piece]
    return Case("args", f"args:{command or 'top-level'}{' (valid base)' if use_skeleton else ''}", argv, "")


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

