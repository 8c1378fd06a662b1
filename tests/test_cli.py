"""CLI contract: every bad input is one line on stderr, exit 2, and nothing half-written;
an internal error in a pass exits 1 naming the pass; a good compile writes the three outputs."""

import json
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from toy import VOCAB, toy_model_dir, write_text

from edgeq.graph import ir
from edgeq.cli import main
from edgeq.passmanager.passbase import Exactness, Pass, PassConfig
from edgeq.passmanager.registry import _PASSES


@pytest.fixture
def toy(tmp_path):
    model = toy_model_dir(tmp_path / "toy")
    calib = write_text(tmp_path / "calib.txt", 400)
    return model, calib


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    return code, err


def _assert_user_error(capsys, out_dir, argv, needle):
    code, err = _run(capsys, *argv)
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert needle in err, err
    assert not out_dir.exists()
    assert not [p for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}.tmp")]


def test_compile_writes_model_report_and_encodings(toy, tmp_path, capsys):
    model, calib = toy
    out = tmp_path / "out"
    code, err = _run(capsys, "compile", model, "--recipe", "w8a8", "--calib", calib, "--seq-len", 16,
                     "--calib-windows", 4, "-o", out, "--verify", "--check-numerics")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["aimet_encodings.json", "encodings.json", "manifest.json",
                                                     "model.onnx", "model.onnx.data", "report.json"]
    from edgeq.artifacts.manifest import verify_manifest

    assert verify_manifest(out) == []  # every output file hashed, nothing missing or extra
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recipe"]["name"] == "w8a8" and manifest["target"] is None
    aimet = json.loads((out / "aimet_encodings.json").read_text())
    assert aimet["version"] == "1.0.0" and {e["name"] for e in aimet["activation_encodings"]} == {"h0", "h2"}
    report = json.loads((out / "report.json").read_text())
    assert report["aimet_unsupported"] == {}
    assert report["passes"][0]["name"] == "qdq" and report["passes"][0]["modified"]
    assert report["calibration"]["samples"] == 4
    assert "logits" in report["passes"][0]["numerics"]
    enc = json.loads((out / "encodings.json").read_text())
    assert set(enc["activations"]) == {"h0", "h2"}
    assert enc["weights"] and all(e["bits"] == 8 and e["granularity"] == "channel" for e in enc["weights"].values())
    sess = ir.make_session(ir.load_model(out / "model.onnx"))
    (logits,) = sess.run(None, {"input_ids": np.zeros((1, 8), np.int64)})
    assert logits.shape == (1, 8, VOCAB)


def test_missing_model(tmp_path, capsys):
    out = tmp_path / "out"
    _assert_user_error(capsys, out, ["compile", tmp_path / "nope.onnx", "-o", out], "not found")


def test_not_onnx(tmp_path, toy, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_text("definitely not a protobuf model")
    out = tmp_path / "out"
    _assert_user_error(capsys, out, ["compile", bad, "--calib", toy[1], "-o", out], "not")


def test_truncated_protobuf(tmp_path, toy, capsys):
    model, calib = toy
    data = model.read_bytes()
    trunc = tmp_path / "trunc" / "model.onnx"
    trunc.parent.mkdir()
    trunc.write_bytes(data[: len(data) - 7])
    out = tmp_path / "out"
    _assert_user_error(capsys, out, ["compile", trunc, "--calib", calib, "-o", out], "")


def test_missing_external_data(toy, tmp_path, capsys):
    model, calib = toy
    (model.parent / "model.onnx.data").unlink()
    out = tmp_path / "out"
    _assert_user_error(capsys, out, ["compile", model, "--calib", calib, "-o", out], "missing external data")


def test_external_data_escaping_folder(toy, tmp_path, capsys):
    model, calib = toy
    m = onnx.load_model(str(model), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../../etc/passwd"
    onnx.save_model(m, str(model))
    out = tmp_path / "out"
    _assert_user_error(capsys, out, ["compile", model, "--calib", calib, "-o", out], "outside")


def test_unknown_recipe(toy, tmp_path, capsys):
    out = tmp_path / "out"
    _assert_user_error(capsys, out, ["compile", toy[0], "--calib", toy[1], "--recipe", "w9a9", "-o", out], "unknown recipe")


def test_unknown_pass_in_recipe(toy, tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[pass]]\nname = "warp-drive"\n')
    out = tmp_path / "out"
    _assert_user_error(capsys, out, ["compile", toy[0], "--calib", toy[1], "--recipe", recipe, "-o", out], "unknown pass")


def test_unknown_recipe_key(toy, tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[pass]]\nname = "qdq"\nweight_bitz = 4\n')
    out = tmp_path / "out"
    _assert_user_error(capsys, out, ["compile", toy[0], "--calib", toy[1], "--recipe", recipe, "-o", out], "weight_bitz")


def test_calibration_text_shorter_than_one_window(toy, tmp_path, capsys):
    short = write_text(tmp_path / "short.txt", 10)
    out = tmp_path / "out"
    _assert_user_error(capsys, out, ["compile", toy[0], "--calib", short, "--seq-len", 512, "-o", out], "")


@pytest.mark.parametrize("arrays,needle", [
    ({"input_idz": np.zeros((2, 1, 8), np.int64)}, "input_id"),
    ({"input_ids": np.zeros((2, 1, 8), np.float32)}, "dtype"),
    ({"input_ids": np.zeros((2, 1, 8, 3), np.int64)}, ""),
])
def test_npz_not_matching_inputs(toy, tmp_path, capsys, arrays, needle):
    npz = tmp_path / "calib.npz"
    np.savez(npz, **arrays)
    out = tmp_path / "out"
    _assert_user_error(capsys, out, ["compile", toy[0], "--calib", npz, "-o", out], needle)


def test_unsupported_opset(tmp_path, capsys):
    model = toy_model_dir(tmp_path / "old", opset=11)
    calib = write_text(tmp_path / "c.txt", 400)
    out = tmp_path / "out"
    _assert_user_error(capsys, out, ["compile", model, "--calib", calib, "-o", out], "opset 11")


def test_output_folder_containing_input_refused(toy, capsys):
    model, calib = toy
    out = model.parent
    code, err = _run(capsys, "compile", model, "--calib", calib, "-o", out)
    assert code == 2 and "contains the input model" in err
    assert model.exists()


@dataclass(frozen=True)
class _BoomConfig(PassConfig):
    pass


def test_internal_error_names_pass(toy, tmp_path, capsys):
    try:
        class _BoomPass(Pass, name="test-boom", exactness=Exactness.EXACT, config=_BoomConfig):  # registers it
            def run(self, graph, ctx):
                raise ZeroDivisionError("simulated bug")

        recipe = tmp_path / "r.toml"
        recipe.write_text('[[pass]]\nname = "test-boom"\n')
        out = tmp_path / "out"
        code, err = _run(capsys, "compile", toy[0], "--calib", toy[1], "--recipe", recipe, "-o", out)
        assert code == 1
        assert "pass 'test-boom' failed" in err and "ZeroDivisionError" in err
        assert not out.exists()
    finally:
        _PASSES.pop("test-boom", None)


def test_recipes_lists_default(capsys):
    assert main(["recipes"]) == 0
    text = capsys.readouterr().out
    assert "w8a8" in text and "mquant-w8a8" in text and "(default)" in text


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compile", "--help"])
    assert exc.value.code == 0
    assert "--calib" in capsys.readouterr().out


def test_dump_each_and_calibration_cache(toy, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path / "cache"))
    model, calib = toy
    args = ["compile", model, "--recipe", "w8a8", "--calib", calib, "--seq-len", 16, "--calib-windows", 3]
    code, err = _run(capsys, *args, "-o", tmp_path / "a", "--dump-each", tmp_path / "dumps")
    assert code == 0, err
    # the recipe's pass, then the saturation guard every compile for onnxruntime CPU ends with
    assert [p.name for p in sorted((tmp_path / "dumps").glob("*.onnx"))] == ["00_qdq.onnx", "01_u8s8-safe-weights.onnx"]
    first = json.loads((tmp_path / "a" / "report.json").read_text())["calibration"]
    assert (first["onnxruntime_runs"], first["cache_hits"]) == (1, 0)

    code, err = _run(capsys, *args, "-o", tmp_path / "b")
    assert code == 0, err
    second = json.loads((tmp_path / "b" / "report.json").read_text())["calibration"]
    assert (second["onnxruntime_runs"], second["cache_hits"]) == (0, 1)
    assert second["ranges"] == first["ranges"]
    a = (tmp_path / "a" / "model.onnx.data").read_bytes()
    assert a == (tmp_path / "b" / "model.onnx.data").read_bytes()


def _argv_code(capsys, *argv):
    """Exit code and stderr of the CLI, argparse's usage errors (SystemExit) included."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip()


_NUMERIC_CASES = [
    # (command prefix, option, bad value, words the one-line error must contain)
    (["compile", "{model}", "--calib", "{calib}", "-o", "{out}"], "--calib-windows", "0", "--calib-windows"),
    (["compile", "{model}", "--calib", "{calib}", "-o", "{out}"], "--calib-windows", "-3", "--calib-windows"),
    (["compile", "{model}", "--calib", "{calib}", "-o", "{out}"], "--calib-windows", "many", "--calib-windows"),
    (["compile", "{model}", "--calib", "{calib}", "-o", "{out}"], "--seq-len", "1", "--seq-len"),
    (["compile", "{model}", "--calib", "{calib}", "-o", "{out}"], "--seq-len", "0", "--seq-len"),
    (["eval", "ppl", "{model}", "--text", "{calib}", "--tokenizer", "{tok}"], "--windows", "0", "--windows"),
    (["eval", "ppl", "{model}", "--text", "{calib}", "--tokenizer", "{tok}"], "--offset", "-1", "--offset"),
    (["eval", "ppl", "{model}", "--text", "{calib}", "--tokenizer", "{tok}"], "--seq-len", "1", "--seq-len"),
    (["eval", "ppl", "{model}", "--text", "{calib}", "--tokenizer", "{tok}"], "--batch-size", "0", "--batch-size"),
    (["eval", "ppl", "{model}", "--text", "{calib}", "--tokenizer", "{tok}"], "--threads", "0", "--threads"),
    (["eval", "compare", "{model}", "{model}"], "--random", "0", "--random"),
    (["eval", "compare", "{model}", "{model}"], "--max-layers", "0", "--max-layers"),
    (["eval", "compare", "{model}", "{model}"], "--threads", "-2", "--threads"),
    (["eval", "compare", "{model}", "{model}", "--text", "{calib}", "--tokenizer", "{tok}"], "--windows", "0", "--windows"),
    (["inspect", "{model}"], "--calib-windows", "0", "--calib-windows"),
    (["inspect", "{model}"], "--seq-len", "1", "--seq-len"),
    (["inspect", "{model}"], "--outlier-threshold", "nan", "--outlier-threshold"),
    (["inspect", "{model}"], "--outlier-threshold", "0", "--outlier-threshold"),
    (["export", "composed-vlm", "-o", "{out}"], "--calib-samples", "0", "--calib-samples"),
    (["export", "composed-vlm", "-o", "{out}"], "--eval-samples", "0", "--eval-samples"),
    (["export", "composed-vlm", "-o", "{out}"], "--prefix-tokens", "0", "--prefix-tokens"),
]


@pytest.mark.parametrize("prefix,option,value,needle", _NUMERIC_CASES,
                         ids=[f"{c[0][0]}{'-' + c[0][1] if c[0][0] in ('eval', 'export') else ''}{c[1]}={c[2]}" for c in _NUMERIC_CASES])
def test_numeric_options_refuse_bad_values(toy, tmp_path, capsys, prefix, option, value, needle):
    """Every numeric option: a value outside its range is one line on stderr, exit 2, nothing written."""
    model, calib = toy
    out = tmp_path / "out"
    fill = {"model": model, "calib": calib, "tok": model.parent, "out": out}
    argv = [a.format(**fill) for a in prefix] + [option, value]
    code, err = _argv_code(capsys, *argv)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


def test_output_folder_that_cannot_be_created(toy, tmp_path, capsys):
    model, calib = toy
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "sub" / "out"
    code, err = _argv_code(capsys, "compile", model, "--calib", calib, "-o", out)
    assert code == 2 and len(err.splitlines()) == 1 and "is not a folder" in err, err
    assert blocker.read_text() == "not a folder" and not (tmp_path / "sub").exists()


def test_seq_len_longer_than_the_model_context(toy, tmp_path, capsys):
    model, calib = toy
    (model.parent / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    code, err = _argv_code(capsys, "eval", "ppl", model, "--text", calib, "--tokenizer", model.parent,
                           "--seq-len", "65", "--windows", "1")
    assert code == 2 and "longer than the model's context of 64" in err, err
    out = tmp_path / "out"
    code, err = _argv_code(capsys, "compile", model, "--calib", calib, "--seq-len", "65", "-o", out)
    assert code == 2 and "longer than the model's context" in err and not out.exists(), err


def _subcommand_paths(parser, prefix=()):
    """Every command path of the CLI (("compile",), ("eval", "ppl"), ...), found by walking argparse."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,)
                yield from _subcommand_paths(sub, prefix + (name,))


def test_every_help_renders(capsys):
    """argparse formats help strings with %: a stray '%' in one option's help breaks only that
    command's --help (``eval ppl --help`` once crashed on "0.5% (")."""
    from edgeq.cli import build_parser

    paths = list(_subcommand_paths(build_parser()))
    assert ("eval", "ppl") in paths and ("compile",) in paths
    for path in paths:
        with pytest.raises(SystemExit) as exc:
            main([*path, "--help"])
        assert exc.value.code == 0, path
        assert "usage:" in capsys.readouterr().out


def test_warm_compile_hits_every_calibration(tmp_path, capsys, monkeypatch):
    """A second compile of the same model, recipe and data runs no calibration at all, for a
    recipe that calibrates several times on graphs holding edgeq custom ops (mquant-w8a8:
    massive-split, rms, qdq after rotate's OnlineHadamard). The key once depended on whether the
    previous calibration had exported the graph (a side effect on its domain imports), so a warm
    compile missed every calibration that followed a hit."""
    from edgeq.models.tiny import export_tiny

    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path / "cache"))
    tiny = export_tiny("llama", tmp_path / "tiny")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", input_ids=rng.integers(0, 256, (2, 16)), attention_mask=np.ones((2, 16), np.int64),
             position_ids=np.tile(np.arange(16), (2, 1)))
    args = ["compile", tiny / "model.onnx", "--recipe", "mquant-w8a8", "--calib", tmp_path / "calib.npz"]
    runs = []
    for out in ("cold", "warm"):
        code, err = _run(capsys, *args, "-o", tmp_path / out)
        assert code == 0, err
        runs.append(json.loads((tmp_path / out / "report.json").read_text())["calibration"])
    assert runs[0]["onnxruntime_runs"] >= 3 and runs[0]["cache_hits"] == 0
    assert (runs[1]["onnxruntime_runs"], runs[1]["cache_hits"]) == (0, runs[0]["onnxruntime_runs"])


def test_report_records_peak_memory_per_pass(toy, tmp_path, capsys):
    """Each pass record has the process's peak RSS after it (a high-water mark: never falls), and
    the report's peak is at least the last pass's."""
    model, calib = toy
    code, err = _run(capsys, "compile", model, "--recipe", "w8a8", "--calib", calib, "--seq-len", 16,
                     "--calib-windows", 2, "--no-cache", "-o", tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    peaks = [rec["peak_rss_mb"] for rec in report["passes"]] + [report["u8s8"]["guard"]["peak_rss_mb"]]
    assert all(p > 10 for p in peaks) and peaks == sorted(peaks)
    assert report["peak_rss_mb"] >= peaks[-1]


# -- signals (the rest: test_cli_errors.py, test_output_leftovers.py, test_fuzz.py) ------------------


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_swallowed_by_a_weakref_callback_still_ends_the_run(monkeypatch, capfd, foreground_signals,
                                                                     name, code):
    """A signal's exception raised inside a weakref callback (importlib has some: an import the
    signal lands in) is printed and dropped by Python ("Exception ignored in ..."): edgeq prints
    nothing of it and the signal still ends the run, one line, 128 + N."""
    import signal
    import time
    import weakref

    import edgeq.cli

    def command(args):
        class Thing:
            pass

        thing = Thing()
        ref = weakref.ref(thing, lambda r: signal.raise_signal(getattr(signal, name)))  # noqa: F841
        del thing  # the callback runs, the handler raises in it
        end = time.monotonic() + 30
        while time.monotonic() < end:  # the command goes on; the signal again, in its own flow
            pass
        print("finished")
        return 0

    monkeypatch.setattr(edgeq.cli, "_run_recipes", command)
    assert main(["recipes"]) == code
    out, err = capfd.readouterr()
    assert out == "" and err == ("edgeq: interrupted\n" if name == "SIGINT" else "edgeq: terminated by SIGTERM\n")


def test_importing_the_entry_changes_no_signal_handler():
    """``python -m edgeq`` and the console script run ``edgeq.__main__.main``; importing it (and
    ``edgeq.cli``) takes no signal over: only ``main`` does, first thing."""
    import subprocess
    import sys

    code = ("import signal; names = ('SIGINT', 'SIGTERM', 'SIGHUP'); "
            "before = [signal.getsignal(getattr(signal, n)) for n in names]; "
            "import edgeq.__main__, edgeq.cli; "
            "assert [signal.getsignal(getattr(signal, n)) for n in names] == before")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("where", ["a temporary folder", "an import", "shutil.rmtree"])
@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_waits_for_a_cleanup_or_an_import(monkeypatch, capfd, tmp_path, foreground_signals, where, name, code):
    """A signal that lands while a folder (a temporary one or any) is being removed, or a module
    imported (C code would turn its exception into another one, importlib's callbacks drop it), is
    raised once that is over: the folder is gone, the module loaded; then one line, 128 + N."""
    import importlib
    import os
    import shutil
    import signal
    import sys
    import tempfile
    import time
    from pathlib import Path

    import edgeq.cli

    done = []
    module = f"signalled_by_{name.lower()}"  # (one per signal: imported once)
    (tmp_path / f"{module}.py").write_text(f"import signal\nsignal.raise_signal(signal.{name})\nLOADED = True\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    for i in range(50):
        (folder / f"f{i}").write_text("x")

    def signal_at_the_first_unlink():
        unlink = os.unlink

        def signalled(*a, **kw):
            monkeypatch.setattr(os, "unlink", unlink)
            signal.raise_signal(getattr(signal, name))
            return unlink(*a, **kw)

        monkeypatch.setattr(os, "unlink", signalled)

    def command(args):
        if where == "a temporary folder":
            with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
                for i in range(50):
                    (Path(tmp) / f"f{i}").write_text("x")
                signal_at_the_first_unlink()
            done.append("cleaned" if not Path(tmp).exists() else "")
        elif where == "an import":
            monkeypatch.syspath_prepend(str(tmp_path))
            try:
                done.append("cleaned" if importlib.import_module(module).LOADED else "")
            finally:
                sys.modules.pop(module, None)
        else:
            signal_at_the_first_unlink()
            shutil.rmtree(folder)
            done.append("cleaned" if not folder.exists() else "")
        end = time.monotonic() + 10
        while time.monotonic() < end:  # the command goes on: the signal comes here
            pass
        return 0

    monkeypatch.setattr(edgeq.cli, "_run_recipes", command)
    assert main(["recipes"]) == code
    assert done == ["cleaned"]
    assert capfd.readouterr().err == ("edgeq: interrupted\n" if name == "SIGINT" else "edgeq: terminated by SIGTERM\n")
