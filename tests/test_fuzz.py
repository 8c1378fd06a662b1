"""Property-based fuzz of the command line's bad-input contract (Hypothesis).

The contract (``edgeq/cli.py``, ``edgeq/errors.py``), checked for every case:

- every ``edgeq`` command exits with 0, 2, 3 or 4 (1 is an internal error: never for bad input);
- exit 2 (and 4) prints exactly one line on stderr (3: at most one), and no traceback, ever;
- nothing is written on failure: no output folder, no ``.NAME.tmp-*`` / ``.NAME.weights-*`` left;
- no file outside ``-o`` (and ``--dump-each``) is created, changed or removed, ever: the whole
  fuzz tree (inputs, foreign folders, the temporary-files folder) is snapshotted with sizes,
  mtimes and hashes before and after each case; only the calibration/token cache
  (``$EDGEQ_CACHE_DIR``, pointed into the tree) is left out;
- an existing non-empty folder that edgeq did not write is never replaced without ``--force``.

Cases, drawn reproducibly (``derandomize=True``): mutated models (bytes flipped or cut, IR version,
opset, outputs, dangling inputs, NaN/inf weights, wrong dtypes, external-data locations, offsets,
lengths, ``../`` paths, symlinks, a cut data file), calibration files (text and .npz), the files
beside a model (tokenizer, configs, chat template), recipe and target TOML, random option sets of
every command, a damaged or misplaced cache, signals at random moments. Most run in-process
(``edgeq.cli.main``, stdout/stderr captured at the file-descriptor level), some as ``python -m
edgeq`` (Python warnings, logging and native log lines reach stderr there). Models are the toy of
``tests/toy.py`` and ``edgeq export tiny llama`` (the conftest test-model cache), made once per
module; a compile takes well under a second.

``EDGEQ_FUZZ_SCALE`` multiplies every campaign's number of cases (0.1: a quick look; 10: a soak)
and ``EDGEQ_FUZZ_LOG`` names a file that gets one JSON line per case.

A breach does not stop a campaign: every case runs, distinct breaches are collected (one
reproduction each) and each test fails listing them. The counts ("tried N / contract kept M") are
printed at the end of the module and written to ``$EDGEQ_FUZZ_SUMMARY`` (default
``<pytest basetemp>/fuzz-summary.json``).
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_harness import (  # noqa: F401
    Case,
    FAST,
    Fuzz,
    _check,
    _run_inprocess,
    assert_kept,
    fuzz_settings,
    fz,
    run_case,
)
from fuzz_config import _pass_table, build_args_case, build_toml_case  # noqa: F401
from fuzz_files import (  # noqa: F401
    _fill_cache,
    build_cache_case,
    build_calib_case,
    build_model_case,
    build_sidecar_case,
)


# -- the campaigns -----------------------------------------------------------------------------------------


def _timed(fz: Fuzz, group: str, start: float) -> None:
    fz.seconds[group] = fz.seconds.get(group, 0.0) + time.monotonic() - start


@fuzz_settings(120)
@given(data=st.data())
def _models_campaign(fz, capfd, data):
    fz.fresh_ws()
    run_case(fz, build_model_case(data.draw, fz), capfd)


def test_fuzz_mutated_models(fz, capfd):
    start = time.monotonic()
    _models_campaign(fz, capfd)
    _timed(fz, "models", start)
    assert_kept(fz, "models")


@fuzz_settings(90)
@given(data=st.data())
def _calib_campaign(fz, capfd, data):
    fz.fresh_ws()
    run_case(fz, build_calib_case(data.draw, fz), capfd)


def test_fuzz_calibration_files(fz, capfd):
    start = time.monotonic()
    _calib_campaign(fz, capfd)
    _timed(fz, "calibration", start)
    assert_kept(fz, "calibration")


@fuzz_settings(50)
@given(data=st.data())
def _sidecar_campaign(fz, capfd, data):
    fz.fresh_ws()
    run_case(fz, build_sidecar_case(data.draw, fz), capfd)


def test_fuzz_files_beside_the_model(fz, capfd):
    """tokenizer.json, config.json, generation_config.json, tokenizer_config.json, chat_template.jinja."""
    start = time.monotonic()
    _sidecar_campaign(fz, capfd)
    _timed(fz, "sidecar", start)
    assert_kept(fz, "sidecar")


@fuzz_settings(90)
@given(data=st.data())
def _toml_campaign(fz, capfd, passes, data):
    fz.fresh_ws()
    run_case(fz, build_toml_case(data.draw, fz, passes), capfd)


def test_fuzz_recipes_and_targets(fz, capfd):
    start = time.monotonic()
    _toml_campaign(fz, capfd, _pass_table())
    _timed(fz, "toml", start)
    assert_kept(fz, "toml")


ARG_COMMANDS = ["compile", "compile", "compile", "check", "inspect", "eval ppl", "eval ppl", "eval compare",
                "eval compare", "generate", "generate", "recipes", "passes", "targets", ""]


@fuzz_settings(150)
@given(data=st.data())
def _args_campaign(fz, capfd, data):
    fz.fresh_ws()
    run_case(fz, build_args_case(data.draw, fz, ARG_COMMANDS), capfd)


@fuzz_settings(12)
@given(data=st.data())
def _export_campaign(fz, capfd, data):
    fz.fresh_ws()
    run_case(fz, build_args_case(data.draw, fz, ["export tiny"]), capfd)


def test_fuzz_command_line(fz, capfd):
    start = time.monotonic()
    _args_campaign(fz, capfd)
    _export_campaign(fz, capfd)
    _timed(fz, "args", start)
    assert_kept(fz, "args")


@fuzz_settings(30)
@given(data=st.data())
def _cache_campaign(fz, capfd, data):
    fz.fresh_ws()
    run_case(fz, build_cache_case(data.draw, fz), capfd)


def test_fuzz_damaged_cache(fz, capfd):
    start = time.monotonic()
    _fill_cache(fz, capfd)
    _cache_campaign(fz, capfd)
    _timed(fz, "cache", start)
    assert_kept(fz, "cache")


@fuzz_settings(8)
@given(data=st.data())
def _subprocess_campaign(fz, passes, data):
    fz.fresh_ws()
    which = data.draw(st.sampled_from(["models", "calibration", "toml", "args"]), label="group")
    if which == "models":
        case = build_model_case(data.draw, fz)
    elif which == "calibration":
        case = build_calib_case(data.draw, fz)
    elif which == "toml":
        case = build_toml_case(data.draw, fz, passes)
    else:
        case = build_args_case(data.draw, fz, ARG_COMMANDS[:-1])
    case.group = "subprocess"
    run_case(fz, case)


def test_fuzz_subprocess_no_traceback(fz):
    """A few cases as a real process: Python warnings, logging and native (onnxruntime) log lines
    reach stderr here, which in-process capture does not see."""
    start = time.monotonic()
    _subprocess_campaign(fz, _pass_table())
    _timed(fz, "subprocess", start)
    assert_kept(fz, "subprocess")


def _fake_command(behaviour: str, fz: Fuzz):
    """A stand-in for ``main`` that breaks the contract in one way (or keeps it: ok*)."""

    def run(argv):
        out = Path(argv[argv.index("-o") + 1])
        if behaviour == "exit1":
            return 1
        if behaviour == "raise":
            raise ValueError("boom")
        if behaviour == "two_lines":
            print("edgeq: error: one\nmore", file=sys.stderr)
            return 2
        if behaviour == "traceback":
            print("Traceback (most recent call last):", file=sys.stdout)
        if behaviour == "touch_input":
            with open(fz.ws / "calib.txt", "a") as f:
                f.write("x")
            return 0
        if behaviour == "staging":
            (out.parent / f".{out.name}.tmp-abc").mkdir()
        if behaviour == "out_on_failure":
            out.mkdir()
        if behaviour == "tmp_leak":
            (fz.systmp / "edgeq-session-x").mkdir()
            return 0
        if behaviour in ("clobber", "ok"):
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            (out / "model.onnx").write_bytes(b"m")
            return 0
        print("edgeq: error: bad input", file=sys.stderr)
        return 2

    return run


@pytest.mark.parametrize("behaviour, flagged", [
    ("exit1", "exit 1"), ("raise", "raised"), ("two_lines", "2 stderr lines"), ("traceback", "traceback"),
    ("touch_input", "changed outside -o"), ("staging", "left staging"), ("out_on_failure", "output on failure"),
    ("tmp_leak", "created outside -o"), ("clobber", "foreign folder"), ("ok", None), ("ok_fail", None)])
def test_checker_flags_each_breach(fz, capfd, monkeypatch, behaviour, flagged):
    """The checker itself, on fake commands: each breach kind is caught, a kept contract is not flagged."""
    fz.fresh_ws()
    out = fz.ws / ("foreign" if behaviour == "clobber" else "out")
    import fuzz_harness  # the cases run through its ``main``

    monkeypatch.setattr(fuzz_harness, "main", _fake_command(behaviour, fz))
    case = Case("selftest", behaviour, ["compile", "-o", str(out)])
    before = fz.snapshot()
    res = _run_inprocess(case, capfd)
    problems = _check(case, res, before, fz.snapshot(), fz)
    if flagged is None:
        assert problems == []
    else:
        assert any(flagged in p for p in problems), problems


# -- signals -----------------------------------------------------------------------------------------------
#
# What a signal may do (fuzz_harness._check): end the run with 128 + N and its one line, or let the
# command finish (0, ...); before edgeq's entry has taken the signals over (CPython starting up, a
# tenth of a second or more under load: edgeq/__main__.py) what it does to any Python program: killed
# by it with nothing printed, or for SIGINT CPython's own KeyboardInterrupt report with no frame of
# edgeq's past its entry's first lines. Nothing is ever left.


def _toy_compile(fz: Fuzz, out: str) -> list[str]:
    return ["compile", str(fz.ws / "toy" / "model.onnx"), *FAST, "--calib", str(fz.ws / "calib.txt"), "-o", out]


def build_signal_case(draw, fz: Fuzz) -> Case:
    sig = draw(st.sampled_from([signal.SIGINT, signal.SIGTERM, signal.SIGHUP]), label="signal")
    delay = draw(st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.5, 1.0, 1.5, 2.0, 3.0, 4.5]), label="delay")
    script = draw(st.booleans(), label="console script")
    out = str(fz.ws / draw(st.sampled_from(["out", "foreign"]), label="out"))
    what = draw(st.sampled_from(["compile-toy", "compile-tiny", "compile-tiny", "export"]), label="command")
    calib, tok = str(fz.ws / "calib.txt"), str(fz.ws / "toy")
    if what == "compile-toy":
        argv = _toy_compile(fz, out)
    elif what == "compile-tiny":  # mquant-w8a8: six passes, a couple of seconds
        argv = ["compile", str(fz.base / "tiny" / "model.onnx"), "--calib-windows", "2", "--seq-len", "16",
                "--no-cache", "--calib", calib, "--tokenizer", tok, "--verify", "-o", out]
    else:
        argv = ["export", "tiny", "llama", "-o", out]
    if out.endswith("foreign") and draw(st.booleans(), label="force"):
        argv.append("--force")
    name = signal.Signals(sig).name
    return Case("signals", f"signal:{name}:{what}", argv, f"{name} after {delay} s{' (edgeq script)' if script else ''}",
                signal_after=(sig, delay), script=script)


@fuzz_settings(8)
@given(data=st.data())
def _signal_campaign(fz, data):
    fz.fresh_ws()
    run_case(fz, build_signal_case(data.draw, fz))


def test_fuzz_signals(fz):
    """SIGINT / SIGTERM / SIGHUP at a random moment of a compile or export (a subprocess, ``python -m
    edgeq`` or the console script): exit 130 / 143 / 129 with one line, or finished (0), or, before
    edgeq's entry took the signals over, what the signal does to any Python program (above);
    nothing left either way."""
    start = time.monotonic()
    _signal_campaign(fz)
    _timed(fz, "signals", start)
    assert_kept(fz, "signals")


START_UP = (0.0, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)  # s: Python starting, the entry, the imports


@pytest.mark.parametrize("script", [False, True], ids=["python -m edgeq", "edgeq script"])
def test_signals_during_start_up(fz, script):
    """Each signal at fixed moments of a compile's first third of a second, whatever they fall on
    with this machine's load: CPython starting up (site, the installation's .pth files), runpy or the
    console script importing edgeq, its entry taking the signals over, the command line's modules
    loading. Every outcome must be one the contract allows (above), none a traceback of edgeq's."""
    start = time.monotonic()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        for delay in START_UP:
            fz.fresh_ws()
            name = signal.Signals(sig).name
            run_case(fz, Case("start-up", f"start-up:{name}", _toy_compile(fz, str(fz.ws / "out")),
                              f"{name} after {delay} s{' (edgeq script)' if script else ''}",
                              signal_after=(sig, delay), script=script))
    _timed(fz, "start-up", start)
    assert_kept(fz, "start-up")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/PID/status (Linux)")
@pytest.mark.parametrize("script", [False, True], ids=["python -m edgeq", "edgeq script"])
def test_a_signal_once_the_entry_handles_it(fz, script):
    """Sent the moment edgeq's entry has taken the signals over (its SIGTERM and SIGHUP handlers seen
    in /proc/PID/status; nothing else of edgeq's is loaded yet): whatever the load, exactly 128 + N
    and its one line, nothing written."""
    group = f"handled{'-script' if script else ''}"
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        fz.fresh_ws()
        name = signal.Signals(sig).name
        run_case(fz, Case(group, f"handled:{name}", _toy_compile(fz, str(fz.ws / "out")),
                          f"{name} once handled{' (edgeq script)' if script else ''}",
                          signal_after=(sig, "handled"), script=script))
    assert_kept(fz, group)
    assert fz.stats[group]["exit_codes"] == {"130": 1, "143": 1, "129": 1}
