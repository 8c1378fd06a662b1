"""What an interrupted or finished edgeq leaves behind (issue 30): SIGTERM and SIGHUP unwind like
Ctrl-C: the ``.OUT.tmp-PID-*`` / ``.OUT.weights-PID-*`` staging folders are removed, exit 128 +
signal; those a killed process (SIGKILL) left are removed by the next run into the same folder once
their pid is dead. Every output file honours the umask (``model.onnx.data`` was 0600).
``--dump-each`` inside ``-o``, at a file or on a read-only mount: exit 2 before any work.
What ``-o`` may replace: tests/test_output_safety.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from toy import write_tokenizer

from edgeq.graph import ir
from edgeq.files import output_dir
from edgeq.cli import main
from output_cases import COMPILE, REPO_ROOT, _foreign, _no_progress, _refused, _llama_calib, _run, _snapshot, toy  # noqa: F401 (fixtures used by name)


# -- 2. signals and leftovers -----------------------------------------------------------------------

# The child pauses while its output folder is being written (both staging folders exist then),
# after saying so through $READY; the test sends the signal from outside.
_CHILD = r"""
import os, sys, time
from pathlib import Path
import edgeq.artifacts.writer as writer
real = writer.write_records
def paused(tmp, *args, **kwargs):
    Path(os.environ["READY"]).write_text(str(tmp))
    time.sleep(120)
    return real(tmp, *args, **kwargs)
writer.write_records = paused
from edgeq.cli import main
sys.exit(main(sys.argv[1:]))
"""


def default_signals() -> None:
    """preexec_fn: the child starts with the dispositions of a terminal's foreground job, whatever
    the test runner inherited (under nohup SIGHUP is ignored, in a background job SIGINT is)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _signal_mid_compile(tmp_path: Path, argv: list, out: Path, signum: int, staging: tuple[str, ...]):
    ready = tmp_path / "ready"
    env = {**os.environ, "EDGEQ_PROGRESS": "0", "READY": str(ready)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, *map(str, argv), "-o", str(out)], cwd=REPO_ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=default_signals)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            if child.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the compile never reached the writer: {child.communicate()[1]}")
            time.sleep(0.05)
        ready.unlink()
        names = [p.name for p in out.parent.iterdir()]
        for kind in staging:  # mid-compile indeed: its staging folders, named with its pid
            assert any(n.startswith(f".{out.name}.{kind}-{child.pid}-") for n in names), (kind, names)
        child.send_signal(signum)
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, err.strip()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: signal.Signals(s).name)
def test_signals_mid_compile_leave_nothing(toy, tmp_path, capsys, signum):
    """Killed while writing over an earlier output: that output stays as it was, nothing beside it."""
    model, calib = toy
    out = tmp_path / "out"
    code, err, _ = _run(capsys, "compile", model, *COMPILE, "--calib", calib, "-o", out)
    assert code == 0, err
    before = _snapshot(tmp_path)
    code, err = _signal_mid_compile(tmp_path, ["compile", model, *COMPILE, "--calib", calib], out, signum, ("tmp",))
    assert code == 128 + signum, err
    assert len(err.splitlines()) == 1 and err.startswith("edgeq: "), err
    if signum != signal.SIGINT:
        assert signal.Signals(signum).name in err
    assert _snapshot(tmp_path) == before


def test_sigterm_mid_blockwise_compile_leaves_nothing(tiny_models, tmp_path):
    model = tiny_models["llama"]
    calib = _llama_calib(model, tmp_path)
    before = {p.name for p in tmp_path.iterdir()}
    argv = ["compile", model, "--recipe", "w8a8", "--calib", calib, "--blockwise", "on", "--no-cache"]
    code, err = _signal_mid_compile(tmp_path, argv, tmp_path / "out", signal.SIGTERM, ("tmp", "weights"))
    assert code == 143, err
    assert err == "edgeq: terminated by SIGTERM"
    assert {p.name for p in tmp_path.iterdir()} == before


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_next_run_removes_what_dead_runs_left(toy, tmp_path, capsys):
    model, calib = toy
    out = tmp_path / "out"
    code, err, _ = _run(capsys, "compile", model, *COMPILE, "--calib", calib, "-o", out)  # (the old one is not restored)
    assert code == 0, err
    dead, alive = _dead_pid(), os.getppid()
    stale = [f".out.tmp-{dead}-abcd_123", f".out.weights-{dead}-zz00yy11", f".out.old-{dead}"]
    kept = [f".out.tmp-{alive}-abcd_123",  # a live process's
            ".out.tmp-abcd_123", f".out.old-{dead}-x",  # not named as edgeq names them
            f".other.tmp-{dead}-abcd_123"]  # another output's
    for name in stale + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx.data").write_bytes(b"half")
    (tmp_path / f".out.weights-{dead}-filefile").write_text("a file, not a staging folder")
    kept.append(f".out.weights-{dead}-filefile")
    code, err, _ = _run(capsys, "compile", model, *COMPILE, "--calib", calib, "-o", out)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in", "out", *kept])


def test_a_swap_cut_short_is_undone(tmp_path):
    """Killed (SIGKILL) between moving the old output aside and moving the new one in: the old
    output comes back under its name; it is never deleted as a leftover."""
    out = tmp_path / "out"
    old = tmp_path / f".out.old-{_dead_pid()}"
    old.mkdir()
    (old / "model.onnx").write_text("previous")
    assert output_dir.remove_stale_staging(out) == []
    assert (out / "model.onnx").read_text() == "previous" and not old.exists()


def test_staging_folders_carry_the_pid(tmp_path):
    out = tmp_path / "out"
    with output_dir.atomic_output_dir(out) as tmp:
        assert tmp.name.startswith(f".out.tmp-{os.getpid()}-") and tmp.parent == tmp_path


# -- 3. file modes ----------------------------------------------------------------------------------


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _assert_modes(folder: Path):
    for path in [folder, *folder.rglob("*")]:
        want = 0o755 if path.is_dir() else 0o644
        assert stat.S_IMODE(path.stat().st_mode) == want, f"{path.name}: {oct(stat.S_IMODE(path.stat().st_mode))}"


def test_in_memory_outputs_honour_the_umask(toy, tmp_path, capsys, umask_022):
    model, calib = toy
    code, err, _ = _run(capsys, "compile", model, *COMPILE, "--calib", calib, "-o", tmp_path / "out")
    assert code == 0, err
    assert (tmp_path / "out" / "model.onnx.data").is_file()
    _assert_modes(tmp_path / "out")


def test_blockwise_outputs_honour_the_umask(tiny_models, tmp_path, capsys, monkeypatch, umask_022):
    from edgeq.blockwise import assemble

    monkeypatch.setattr(assemble, "SPILL_BYTES", 1024)  # the weights go to model.onnx.data
    model = tiny_models["llama"]
    code, err, _ = _run(capsys, "compile", model, "--recipe", "w8a8", "--calib", _llama_calib(model, tmp_path),
                        "--blockwise", "on", "--no-cache", "-o", tmp_path / "out")
    assert code == 0, err
    assert (tmp_path / "out" / "model.onnx.data").is_file()
    _assert_modes(tmp_path / "out")


def test_static_outputs_honour_the_umask(tmp_path, capsys, umask_022):
    from edgeq.models.kv_export import export_tiny_with_past

    model = export_tiny_with_past("llama", tmp_path / "past") / "model.onnx"
    write_tokenizer(model.parent)
    code, err, _ = _run(capsys, "compile", model, "--recipe", "fp32", "--static", "prefill=4,context=16",
                        "-o", tmp_path / "out")
    assert code == 0, err
    assert (tmp_path / "out" / "weights.data").is_file()
    _assert_modes(tmp_path / "out")


def test_save_model_data_file_honours_the_umask(tmp_path, umask_022):
    from toy import toy_lm

    path = ir.save_model(toy_lm(), tmp_path / "m" / "model.onnx", size_threshold=0)
    assert stat.S_IMODE((tmp_path / "m" / "model.onnx.data").stat().st_mode) == 0o644
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


# -- 4. --dump-each ---------------------------------------------------------------------------------


@pytest.mark.parametrize("inside", ["", "dumps"], ids=["equal", "inside"])
def test_dump_each_inside_the_output_is_refused(toy, tmp_path, capsys, inside):
    model, calib = toy
    out = tmp_path / "out"
    _refused(capsys, tmp_path, ["compile", model, *COMPILE, "--calib", calib, "-o", out, "--dump-each", out / inside],
             "inside the output folder")


def test_dump_each_at_a_file_is_refused(toy, tmp_path, capsys):
    model, calib = toy
    dump = tmp_path / "dumps"
    dump.write_text("a file")
    _refused(capsys, tmp_path, ["compile", model, *COMPILE, "--calib", calib, "-o", tmp_path / "out",
                                "--dump-each", dump], "exists and is not a folder")


@pytest.fixture
def read_only_fs(tmp_path):
    """A read-only tmpfs (needs the right to mount: root, or CAP_SYS_ADMIN in a container)."""
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if not sys.platform.startswith("linux") or not mount or not umount:
        pytest.skip("mounting needs Linux and mount(8)")
    where = tmp_path / "ro"
    where.mkdir()
    done = subprocess.run([mount, "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"not permitted to mount a tmpfs here: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    try:
        yield where
    finally:
        if subprocess.run([umount, str(where)], capture_output=True).returncode != 0:
            subprocess.run([umount, "-l", str(where)], capture_output=True)


@pytest.mark.parametrize("sub", ["", "dumps"], ids=["mount", "below-mount"])
def test_dump_each_on_a_read_only_mount_is_refused(toy, tmp_path, capsys, read_only_fs, sub):
    model, calib = toy
    _refused(capsys, tmp_path / "in", ["compile", model, *COMPILE, "--calib", calib, "-o", tmp_path / "out",
                                       "--dump-each", read_only_fs / sub], "not writable")
    assert not (tmp_path / "out").exists()


def test_dump_each_into_a_folder_of_the_users_needs_force(tmp_path, capsys, monkeypatch):
    from toy import toy_with_calib

    model, calib = toy_with_calib(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    argv = ["compile", str(model), "--recipe", "w8a8", "--calib", str(calib), "--calib-windows", "1", "--seq-len", "16",
            "--no-cache", "-o", str(tmp_path / "out"), "--dump-each", str(mine)]
    assert main(argv) == 2
    assert "holds files edgeq did not dump" in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and not (tmp_path / "out").exists()
    assert main(argv + ["--force"]) == 0
    assert (mine / "notes.txt").read_text() == "keep" and any(p.name.endswith("_qdq.onnx") for p in mine.iterdir())
    assert main(argv[:-2] + ["--dump-each", str(tmp_path / "dumps")]) == 0
    assert main(argv[:-2] + ["--dump-each", str(tmp_path / "dumps")]) == 0  # earlier dumps only: no --force needed
