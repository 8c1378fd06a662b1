"""CLI error contract on bad input (issue 30): exit 2 and exactly one line on stderr, nothing else
(no library warnings, no onnxruntime log line, no second line of a library's message), nothing
written. stderr is read with ``capfd``, so what onnxruntime writes to file descriptor 2 itself counts.
Also: no command (help on stdout, one error line), a file name too long for any path option, a
signal before the command runs, torch's cache folder kept out of ``$TMPDIR`` during an export.
"""

from __future__ import annotations

import io
import json
import logging
import signal
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from toy import toy_model_dir, write_text, write_tokenizer

import edgeq.cli
from edgeq.cli import main
from edgeq.errors import UserInputError


def _run(capfd, *argv) -> tuple[int, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    return code, capfd.readouterr().err


def _assert_one_line(capfd, *argv, needle: str = "") -> str:
    code, err = _run(capfd, *argv)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert needle in err, err
    return err


def _refused_model(path: Path) -> Path:
    """A model that passes edgeq's load checks but that onnxruntime refuses to initialize (an LRN of
    size 0, which its kernel rejects when the session is built): onnxruntime logs its own
    [E:onnxruntime:...] line for it unless told not to."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["input_ids_f"], to=TensorProto.FLOAT),
         helper.make_node("LRN", ["input_ids_f"], ["logits"], size=0)],
        "refused", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9), str(path))
    return path


@pytest.fixture(scope="module")
def tiny_past(tmp_path_factory) -> Path:
    from edgeq.models.kv_export import export_tiny_with_past

    return export_tiny_with_past("llama", tmp_path_factory.mktemp("errors") / "past") / "model.onnx"


# ---------------------------------------------------------------------------------------------
# 1. export hf: a folder without weights; library warnings never precede the error line
# ---------------------------------------------------------------------------------------------


def _hf_folder(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return folder


def test_export_hf_without_weights_is_one_line_before_torch(tmp_path, capfd):
    hf = _hf_folder(tmp_path / "hf")
    out = tmp_path / "out"
    _assert_one_line(capfd, "export", "hf", hf, "-o", out, needle="no weights")
    assert not out.exists()


def test_export_hf_unreadable_weights_hide_the_library_warnings(tmp_path, capfd):
    """Past the checks edgeq makes itself: transformers fails on the weights, after its own warnings."""
    hf = _hf_folder(tmp_path / "hf")
    (hf / "model.safetensors").write_bytes(b"not safetensors")
    out = tmp_path / "out"
    _assert_one_line(capfd, "export", "hf", hf, "-o", out, needle="cannot load the model")
    assert not out.exists()


def test_library_output_is_passed_on_after_success_only():
    from edgeq.models.export_log import held_library_output

    lib = logging.getLogger("edgeq-test-library")  # like transformers: its own stderr handler
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    lib.addHandler(handler)
    lib.propagate = False

    def export(fail: bool) -> None:
        lib.warning("the library says")
        lib.warning("`torch_dtype` is deprecated! Use `dtype` instead!")  # NOISE
        warnings.warn("careful", UserWarning, stacklevel=2)
        if fail:
            raise UserInputError("bad input")

    try:
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            with pytest.raises(UserInputError), held_library_output():
                export(fail=True)
            assert stream.getvalue() == "" and shown == []
            with held_library_output():
                export(fail=False)
                assert stream.getvalue() == "" and shown == []  # held until the export ends
        assert stream.getvalue() == "the library says\n"
        assert [str(w.message) for w in shown] == ["careful"]
        assert lib.handlers == [handler] and lib.propagate is False
    finally:
        lib.removeHandler(handler)


# ---------------------------------------------------------------------------------------------
# 2. seeds are non-negative
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["generate", "DIR", "--prompt", "hi", "--temperature", "1", "--seed", "-1"],
    ["eval", "compare", "A.onnx", "B.onnx", "--random", "1", "--seed", "-1"],
    ["export", "tiny", "llama", "-o", "OUT", "--seed", "-1"],
])
def test_negative_seed_is_a_usage_error(argv, tmp_path, capfd):
    argv = [str(tmp_path / a) if a.isupper() else a for a in argv]
    _assert_one_line(capfd, *argv, needle=">= 0, got -1")


# ---------------------------------------------------------------------------------------------
# 3. --static with a context past 32768 slots
# ---------------------------------------------------------------------------------------------


def test_static_context_past_32k_specializes(tiny_past, tmp_path, capfd):
    """The positions Range of C + W values outgrew graphsurgeon's folding threshold at C + W > 32768
    and stayed in the graph; it is folded whatever its length now."""
    from edgeq.generation import open_decoder
    from edgeq.static.specialize import check_static

    out = tmp_path / "static"
    code, err = _run(capfd, "compile", tiny_past, "--recipe", "fp32", "--static", "prefill=16,context=32768",
                     "-o", out)
    assert code == 0, err
    for role in ("prefill", "decode"):
        assert check_static(onnx.load(str(out / f"{role}.onnx"))) == []
    prompt = list(range(5, 25))
    dynamic = open_decoder(tiny_past, optimize=False)
    static = open_decoder(out, optimize=False)
    assert static.context == 32768
    np.testing.assert_allclose(static.prefill(prompt), dynamic.prefill(prompt), atol=1e-4, rtol=1e-4)
    for token in (7, 11):
        np.testing.assert_allclose(static.step(token), dynamic.step(token), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# 4. onnxruntime's own log line
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def refused(tmp_path) -> dict[str, Path]:
    folder = tmp_path / "refused"
    model = _refused_model(folder / "model.onnx")
    write_tokenizer(folder)
    return {"model": model, "folder": folder, "text": write_text(tmp_path / "text.txt", 200)}


def test_generate_on_a_model_onnxruntime_refuses(refused, capfd):
    _assert_one_line(capfd, "generate", refused["folder"], "--prompt", "the", needle="onnxruntime cannot load")


def test_eval_ppl_on_a_model_onnxruntime_refuses(refused, capfd):
    _assert_one_line(capfd, "eval", "ppl", refused["model"], "--text", refused["text"], "--tokenizer",
                     refused["folder"], "--seq-len", "4", "--windows", "1", needle="onnxruntime cannot load")


def test_eval_compare_on_a_model_onnxruntime_refuses(refused, capfd):
    _assert_one_line(capfd, "eval", "compare", refused["model"], refused["model"], "--random", "1",
                     needle="onnxruntime cannot load")


# ---------------------------------------------------------------------------------------------
# 5. one line for every bad input
# ---------------------------------------------------------------------------------------------


def test_a_multi_line_message_is_printed_on_one_line(monkeypatch, capfd):
    def fails(args):
        raise UserInputError("first\n  second\n\nthird")

    monkeypatch.setattr(edgeq.cli, "_run_inspect", fails)
    err = _assert_one_line(capfd, "inspect", "model.onnx")
    assert err == "edgeq: error: first; second; third\n"


def _bad_input(kind: str, tmp_path: Path) -> Path:
    path = tmp_path / f"bad-{kind}.onnx"
    if kind == "directory":
        path.mkdir()
    elif kind == "not-onnx":
        path.write_text("this is a text file, not a protobuf\n")
    elif kind == "empty":
        path.write_bytes(b"")
    return path


@pytest.mark.parametrize("kind", ["missing", "directory", "not-onnx", "empty"])
@pytest.mark.parametrize("command", ["eval ppl", "eval compare A", "eval compare B", "generate", "inspect",
                                     "export hf"])
def test_bad_model_path_is_one_line(command, kind, tmp_path, capfd):
    bad = _bad_input(kind, tmp_path)
    tok = write_tokenizer(tmp_path / "tok")
    good = toy_model_dir(tmp_path / "good")
    argv = {
        "eval ppl": ["eval", "ppl", bad, "--text", write_text(tmp_path / "t.txt", 100), "--tokenizer", tok,
                     "--seq-len", "4"],
        "eval compare A": ["eval", "compare", bad, good, "--random", "1"],
        "eval compare B": ["eval", "compare", good, bad, "--random", "1"],
        "generate": ["generate", bad, "--prompt", "the", "--tokenizer", tok],
        "inspect": ["inspect", bad],
        "export hf": ["export", "hf", bad, "-o", tmp_path / "out"],
    }[command]
    _assert_one_line(capfd, *argv)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# 6. no command, a file name too long, a signal before the command runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, needle", [([], "a command is required"),
                                          (["eval"], "eval needs a subcommand: ppl, compare or vqa")],
                         ids=["edgeq", "edgeq eval"])
def test_a_missing_command_is_a_usage_error(capfd, argv, needle):
    """The help on stdout, one error line on stderr, exit 2 (``edgeq --help`` is the way to ask)."""
    code = main(argv)
    out, err = capfd.readouterr()
    assert code == 2
    assert err.startswith("edgeq: error: ") and len(err.splitlines()) == 1 and needle in err, err
    assert "usage: edgeq" in out


@pytest.fixture
def long_name(tmp_path) -> Path:
    return tmp_path / ("n" * 300)  # past NAME_MAX (255): ENAMETOOLONG wherever it is opened or stat'ed


@pytest.mark.parametrize("command", ["compile model", "compile calib", "compile out", "inspect calib", "eval ppl text",
                                     "eval compare npz", "generate", "check", "export out"])
def test_a_file_name_too_long_is_one_line(command, long_name, tmp_path, capfd):
    model = toy_model_dir(tmp_path / "toy")
    calib = write_text(tmp_path / "calib.txt", 100)
    argv = {
        "compile model": ["compile", long_name, "--calib", calib, "-o", tmp_path / "out"],
        "compile calib": ["compile", model, "--recipe", "w8a8", "--calib", long_name, "-o", tmp_path / "out"],
        "compile out": ["compile", model, "--recipe", "w8a8", "--calib", calib, "-o", long_name],
        "inspect calib": ["inspect", model, "--calib", long_name],
        "eval ppl text": ["eval", "ppl", model, "--text", long_name, "--tokenizer", model.parent],
        "eval compare npz": ["eval", "compare", model, model, "--npz", long_name],
        "generate": ["generate", long_name, "--prompt", "w1"],
        "check": ["check", long_name, "--target", "generic-qdq"],
        "export out": ["export", "tiny", "llama", "-o", long_name / "sub"],
    }[command]
    err = _assert_one_line(capfd, *argv)
    assert "Traceback" not in err and "internal error" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_a_signal_while_the_modules_load_is_one_line(monkeypatch, capfd, signum, code, foreground_signals):
    """main handles signals from its first line on: one that comes while the command line's modules
    are imported (build_parser) is noted, not raised inside an import (numpy's C import turns it into
    an ImportError), and ends the run, one line, once they are loaded: the command never runs."""
    real = edgeq.cli.build_parser

    def importing():
        signal.raise_signal(signum)
        return real()

    monkeypatch.setattr(edgeq.cli, "build_parser", importing)
    assert main(["recipes"]) == code
    out, err = capfd.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert ("interrupted" if signum == signal.SIGINT else "terminated") in err


def test_a_signal_that_comes_out_as_another_exception_still_ends_the_run(monkeypatch, capfd):
    """An import in C code can turn the signal's exception into an ImportError: the signal decides."""
    def command(args):
        try:
            signal.raise_signal(signal.SIGTERM)
        except KeyboardInterrupt:
            raise ImportError("PyCapsule_Import could not import module \"datetime\"") from None

    monkeypatch.setattr(edgeq.cli, "_run_recipes", command)
    assert main(["recipes"]) == 143
    assert capfd.readouterr().err == "edgeq: terminated by SIGTERM\n"


def test_export_keeps_torch_cache_out_of_tmpdir(monkeypatch, tmp_path):
    """Importing torch._dynamo makes $TMPDIR/torchinductor_<user>: during an export it is a temporary
    folder of edgeq's, removed at the end."""
    import os

    from edgeq.models.hf_export import private_torch_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with private_torch_cache():
        inside = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        assert inside.is_dir()
    # removed; the variable stays set for the process, so torch's exit hooks write there too
    assert not inside.exists() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(inside)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the user's own choice is kept
    with private_torch_cache():
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


def test_every_edgeq_session_logs_fatal_only():
    """Level 3 lets onnxruntime's own [E:onnxruntime:...] line through before edgeq's one line."""
    from edgeq.graph import ir

    assert ir.session_options().log_severity_level == 4
    assert ir.session_options(optimize=True, threads=2).log_severity_level == 4
