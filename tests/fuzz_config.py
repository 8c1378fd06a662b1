"""Configuration the fuzz campaigns feed edgeq (tests/test_fuzz.py): recipe and target-profile TOML
(well-formed, plausible and raw-mutated) and command lines, each as a Hypothesis case builder over
the harness of ``fuzz_harness``. Model, calibration, sidecar and cache files: ``fuzz_files``."""

from __future__ import annotations

import math
import re

from hypothesis import strategies as st

from fuzz_harness import (  # noqa: F401
    Case,
    FAST,
    Fuzz,
    REPO_ROOT,
    fz,
)


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

    from edgeq.passmanager.registry import all_passes

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

    from edgeq.passmanager.registry import all_passes

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
                                         str(ws / "toy"), str(ws / "foreign" / "notes.txt"), "rel/out", *common,
                                         str(ws / EARLIER)],
        "recipe": ["w8a8", "w8a8", "fp32", "w8a16", "mquant-w8a8", "nope", "", str(ws / "calib.txt")],
        "target": ["generic-qdq", "pow2-int", "qnn-htp", "ort-cpu", "nope", "", str(ws / "calib.txt")],
    }


# an earlier compile output (a copy of base/q8) the user saved a file into: not edgeq's to replace
# without --force (issue 41); made only for a case that names it
EARLIER = "earlier"


def _earlier_output(fz: Fuzz, argv: list[str]) -> str:
    """Make ws/EARLIER when ``argv`` names it; the case's setup note."""
    import shutil

    path = fz.ws / EARLIER
    if str(path) not in argv:
        return ""
    shutil.copytree(fz.base / "q8", path)
    (path / "notes.txt").write_text("the user's notes, saved into an earlier output\n")
    return f"{EARLIER}: an earlier compile output (base/q8) holding the user's notes.txt"


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
    return Case("args", f"args:{command or 'top-level'}{' (valid base)' if use_skeleton else ''}", argv,
                _earlier_output(fz, argv))
