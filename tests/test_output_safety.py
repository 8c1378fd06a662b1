"""Output folders are replaced only when that loses nothing of the user's (issue 30).

- ``-o`` naming the current folder, a folder above it, the input's folder (or above), an empty
  path or a file is refused (exit 2, one line, nothing touched), even with ``--force``; a
  non-empty folder edgeq did not write is refused unless ``--force``; an empty folder and edgeq's
  own earlier output (``manifest.json`` of a compile, ``edgeq-export.json`` of an export, each
  listing the files written) are replaced, unless it holds anything else (a file the user saved
  into it, an empty folder: issue 41), which the one line names. All checked before any work, by
  ``edgeq.files.output_dir.check_output_dir``, and again just before the swap.
- SIGTERM and SIGHUP unwind like Ctrl-C: the ``.OUT.tmp-PID-*`` / ``.OUT.weights-PID-*`` staging
  folders are removed, exit 128 + signal; those a killed process (SIGKILL) left are removed by the
  next run into the same folder once their pid is dead.
- Every output file honours the umask (``model.onnx.data`` was 0600).
- ``--dump-each`` inside ``-o``, at a file or on a read-only mount: exit 2 before any work.

The toy model of ``tests/toy.py`` and the ``w8a8`` recipe on one 16-token window keep each
compile well under a second; the block-wise and static cases use the tiny llama.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from toy import toy_model_dir, write_text, write_tokenizer

from edgeq.graph import ir
from edgeq.files import output_dir
from edgeq.cli import main
from edgeq.errors import UserInputError

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPILE = ["--recipe", "w8a8", "--calib-windows", "1", "--seq-len", "16", "--no-cache"]


@pytest.fixture(autouse=True)
def _no_progress(monkeypatch):
    monkeypatch.setenv("EDGEQ_PROGRESS", "0")  # stderr must hold the error line only


@pytest.fixture
def toy(tmp_path):
    """(model.onnx with all weights in model.onnx.data, calibration text), in tmp_path/in."""
    model = toy_model_dir(tmp_path / "in" / "toy")
    calib = write_text(tmp_path / "in" / "calib.txt", 400)
    return model, calib


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err.strip(), captured.out


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones too) with its content (None for folders)."""
    return {p.relative_to(root).as_posix(): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def _refused(capsys, root: Path, argv, needle: str) -> str:
    before = _snapshot(root)
    code, err, out = _run(capsys, *argv)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("edgeq: error:"), err
    assert needle in err, err
    assert out == "", "refused after work had started"
    assert _snapshot(root) == before, "a refused command touched files"
    return err


def _foreign(folder: Path) -> Path:
    """A folder of the user's: not empty, not written by edgeq."""
    (folder / "notes").mkdir(parents=True)
    (folder / "notes" / "todo.txt").write_text("keep me")
    (folder / "photo.jpg").write_bytes(b"\xff\xd8 jpeg")
    return folder


# -- 1. what -o may replace -------------------------------------------------------------------------


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
@pytest.mark.parametrize("where", [".", "", "..", "CWD", "/"], ids=["dot", "empty", "parent", "cwd-absolute", "root"])
def test_compile_never_replaces_the_current_folder_or_above(toy, tmp_path, monkeypatch, capsys, where, force):
    model, calib = toy
    work = _foreign(tmp_path / "work")
    monkeypatch.chdir(work)
    out = str(work) if where == "CWD" else where
    needle = "current folder"
    _refused(capsys, tmp_path, ["compile", model, *COMPILE, "--calib", calib, "-o", out, *force], needle)


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_compile_never_replaces_an_input_folder_or_above(toy, tmp_path, capsys, force):
    model, calib = toy
    for out in (model.parent, model.parent.parent, calib.parent):
        _refused(capsys, tmp_path, ["compile", model, *COMPILE, "--calib", calib, "-o", out, *force],
                 "contains the input model or data")


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_compile_never_replaces_a_file(toy, tmp_path, capsys, force):
    model, calib = toy
    target = tmp_path / "results.csv"
    target.write_text("a,b\n1,2\n")
    _refused(capsys, tmp_path, ["compile", model, *COMPILE, "--calib", calib, "-o", target, *force],
             "exists and is not a folder")
    assert target.read_text() == "a,b\n1,2\n"


def test_compile_refuses_a_foreign_folder_unless_forced(toy, tmp_path, capsys):
    model, calib = toy
    out = _foreign(tmp_path / "mine")
    err = _refused(capsys, tmp_path, ["compile", model, *COMPILE, "--calib", calib, "-o", out],
                   "not written by edgeq")
    assert "--force" in err
    code, err, _ = _run(capsys, "compile", model, *COMPILE, "--calib", calib, "-o", out, "--force")
    assert code == 0, err
    assert (out / "manifest.json").is_file() and not (out / "notes").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "mine"]  # nothing left beside it


def test_compile_uses_an_empty_folder_and_replaces_its_own_output(toy, tmp_path, capsys):
    model, calib = toy
    out = tmp_path / "out"
    out.mkdir()
    code, err, _ = _run(capsys, "compile", model, *COMPILE, "--calib", calib, "-o", out)
    assert code == 0, err
    assert output_dir.is_edgeq_output(out)
    first = json.loads((out / "manifest.json").read_text())
    (out / "report.json").write_text("{}")  # edgeq's output, edited: still edgeq's to replace
    code, err, _ = _run(capsys, "compile", model, *COMPILE, "--calib", calib, "-o", out)
    assert code == 0, err
    assert json.loads((out / "report.json").read_text()) != {}
    assert json.loads((out / "manifest.json").read_text())["files"].keys() == first["files"].keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


def _users_file_refused(capsys, root: Path, argv: list, out: Path, force_replaces: bool = True) -> None:
    """Issue 41: ``out`` is edgeq's earlier output; a file the user saved into it, or an empty folder
    of theirs, is named and refused (exit 2, one line, nothing touched); ``--force`` replaces it all."""
    assert output_dir.is_edgeq_output(out)
    (out / "notes.txt").write_text("the user's notes")
    needle = f"-o {out} holds notes.txt, which edgeq did not write; move it away or pass --force (everything in it is deleted)"
    assert _refused(capsys, root, [*argv, "-o", out], needle) == f"edgeq: error: {needle}"
    assert (out / "notes.txt").read_text() == "the user's notes"
    (out / "notes.txt").unlink()
    (out / "mine").mkdir()
    _refused(capsys, root, [*argv, "-o", out], f"-o {out} holds mine/, which edgeq did not write")
    (out / "mine" / "z.txt").write_text("the user's")
    (out / "a.txt").write_text("the user's")
    _refused(capsys, root, [*argv, "-o", out], "holds a.txt, which")  # the first, sorted
    if force_replaces:
        code, err, _ = _run(capsys, *argv, "-o", out, "--force")
        assert code == 0, err
        assert output_dir.is_edgeq_output(out) and not (out / "mine").exists() and not (out / "a.txt").exists()


def test_compile_refuses_a_users_file_in_its_earlier_output(toy, tmp_path, capsys):
    model, calib = toy
    out = tmp_path / "out"
    argv = ["compile", model, *COMPILE, "--calib", calib]
    code, err, _ = _run(capsys, *argv, "-o", out)
    assert code == 0, err
    _users_file_refused(capsys, tmp_path, argv, out)
    code, err, _ = _run(capsys, *argv, "-o", out)  # (a clean earlier output: replaced)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


def test_export_refuses_a_users_file_in_its_earlier_output(tmp_path, capsys):
    out = tmp_path / "tiny"
    code, err, _ = _run(capsys, "export", "tiny", "llama", "-o", out)
    assert code == 0, err
    marker = json.loads((out / output_dir.EXPORT_MARKER).read_text())
    assert marker["files"] == sorted(p.name for p in out.iterdir() if p.name != output_dir.EXPORT_MARKER)
    _users_file_refused(capsys, tmp_path, ["export", "tiny", "llama"], out, force_replaces=False)
    shutil.rmtree(out / "mine")
    (out / "a.txt").unlink()
    (out / output_dir.EXPORT_MARKER).write_text(json.dumps({k: v for k, v in marker.items() if k != "files"}))
    _refused(capsys, tmp_path, ["export", "tiny", "llama", "-o", out], "not written by edgeq")  # (before issue 41)
    (out / output_dir.EXPORT_MARKER).write_text(json.dumps(marker))
    code, err, _ = _run(capsys, "export", "tiny", "llama", "-o", out)  # (a clean earlier output: replaced)
    assert code == 0, err
    assert output_dir.is_edgeq_output(out) and sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


@pytest.mark.parametrize("kind", ["blockwise", "static"])
def test_every_compile_route_replaces_its_own_output(tiny_models, tmp_path, capsys, kind):
    """What each route writes is in its manifest: a second compile into the same folder needs no --force."""
    if kind == "static":
        from edgeq.models.kv_export import export_tiny_with_past

        model = export_tiny_with_past("llama", tmp_path / "past") / "model.onnx"
        write_tokenizer(model.parent)
        argv = ["compile", model, "--recipe", "fp32", "--static", "prefill=16,context=32"]
    else:
        model = tiny_models["llama"]
        argv = ["compile", model, "--recipe", "w8a8", "--calib", _llama_calib(model, tmp_path), "--blockwise", "on",
                "--no-cache"]
    out = tmp_path / "out"
    for _ in range(2):
        code, err, _ = _run(capsys, *argv, "-o", out)
        assert code == 0, err
        assert output_dir.is_edgeq_output(out)
    _users_file_refused(capsys, tmp_path, argv, out, force_replaces=False)


def test_a_folder_with_a_fake_manifest_is_not_edgeqs(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    for text in ('{"files": {}}', '{"version": "other/1", "edgeq": "1"}', "not json", '["edgeq-manifest/1"]',
                 '{"version": "edgeq-manifest/1", "edgeq": "0.1.0"}',  # (no file list: not usable)
                 '{"version": "edgeq-manifest/1", "edgeq": "0.1.0", "files": "model.onnx"}',
                 '{"version": "edgeq-manifest/1", "edgeq": "0.1.0", "files": [1]}'):
        (folder / "manifest.json").write_text(text)
        assert not output_dir.is_edgeq_output(folder), text
        with pytest.raises(UserInputError, match="not written by edgeq"):
            output_dir.check_output_dir(folder)
    (folder / "manifest.json").write_text('{"version": "edgeq-manifest/1", "edgeq": "0.1.0", "files": {}}')
    assert output_dir.is_edgeq_output(folder)
    (folder / "manifest.json").unlink()
    (folder / output_dir.EXPORT_MARKER).write_text('{"version": "edgeq-export/1", "edgeq": "0.1.0"}')  # (before issue 41)
    assert not output_dir.is_edgeq_output(folder)
    with pytest.raises(UserInputError, match="not written by edgeq"):
        output_dir.check_output_dir(folder)
    (folder / output_dir.EXPORT_MARKER).write_text('{"version": "edgeq-export/1", "edgeq": "0.1.0", "files": []}')
    assert output_dir.is_edgeq_output(folder)


def test_only_what_the_record_lists_is_edgeqs(tmp_path, monkeypatch):
    """Names only: every file listed (or the record itself), folders only as their parents; the
    first other entry, sorted, is named (an empty folder with a slash, an odd name quoted)."""
    from edgeq.files.output_dir import folder_entries, not_written_by_edgeq, written_by_edgeq

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    (out / "qnn").mkdir(parents=True)
    for name in ("model.onnx", "qnn/a_ctx.onnx"):
        (out / name).write_text("x")
    (out / "manifest.json").write_text(json.dumps({"version": "edgeq-manifest/1", "edgeq": "0.1.0",
                                                   "files": {"model.onnx": {}, "qnn/a_ctx.onnx": {},
                                                             "gone.data": {}}}))
    assert written_by_edgeq(out) == {"model.onnx", "qnn/a_ctx.onnx", "gone.data", "manifest.json"}
    assert not_written_by_edgeq(out) == [] and output_dir.check_output_dir("out") == out.resolve()  # (a listed file missing: fine)
    (out / "qnn" / "b").mkdir()
    (out / "z.txt").write_text("mine")
    (out / "qnn" / "notes\nx.txt").write_text("mine")
    assert folder_entries(out) == ["manifest.json", "model.onnx", "qnn/a_ctx.onnx", "qnn/b/", "qnn/notes\nx.txt",
                                   "z.txt"]
    assert not_written_by_edgeq(out) == ["qnn/b/", "qnn/notes\nx.txt", "z.txt"]
    assert not output_dir.is_edgeq_output(out)
    with pytest.raises(UserInputError, match=r"^-o out holds qnn/b/, which edgeq did not write; move it away or pass "
                                             r"--force \(everything in it is deleted\)$"):
        output_dir.check_output_dir("out")
    (out / "qnn" / "b").rmdir()
    with pytest.raises(UserInputError) as info:
        output_dir.check_output_dir("out")
    assert "\n" not in str(info.value) and "holds 'qnn/notes\\nx.txt', which" in str(info.value)
    assert output_dir.check_output_dir("out", force=True) == out.resolve()


def test_atomic_output_dir_rechecks_before_the_swap(tmp_path):
    """A folder that appears (or fills) while the output is written is not replaced."""
    out = tmp_path / "out"
    with pytest.raises(UserInputError, match="not written by edgeq"):
        with output_dir.atomic_output_dir(out, marker={"export": "test"}) as tmp:
            (tmp / "a.txt").write_text("new")
            _foreign(out)
    assert (out / "notes" / "todo.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with output_dir.atomic_output_dir(out, force=True, marker={"export": "test"}) as tmp:
        (tmp / "a.txt").write_text("new")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", output_dir.EXPORT_MARKER, "sub"]
    assert json.loads((out / output_dir.EXPORT_MARKER).read_text())["files"] == ["a.txt", "sub/b.txt"]  # (the marker: itself)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    before = _snapshot(out)
    with pytest.raises(UserInputError, match="holds notes.txt, which edgeq did not write"):
        with output_dir.atomic_output_dir(out, marker={"export": "test"}) as tmp:  # edgeq's: may be replaced at the start
            (tmp / "c.txt").write_text("newer")
            (out / "notes.txt").write_text("saved meanwhile")  # but not once the user saved a file into it
    assert _snapshot(out) == {**before, "notes.txt": b"saved meanwhile"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# -- export -----------------------------------------------------------------------------------------


@pytest.fixture
def no_build(monkeypatch):
    """The tiny builder fails if it is reached: a refusal must come before any work."""
    from edgeq.models import tiny

    def fail(*args, **kwargs):
        raise AssertionError("the model was built before the output folder was checked")

    monkeypatch.setattr(tiny, "build_tiny", fail)


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
@pytest.mark.parametrize("where, needle", [(".", "current folder"), ("..", "above the current folder"),
                                           ("", "-o is empty"), ("FILE", "exists and is not a folder")],
                         ids=["dot", "parent", "empty", "file"])
def test_export_refusals_come_first(tmp_path, monkeypatch, capsys, no_build, where, needle, force):
    work = _foreign(tmp_path / "work")
    (work / "model.txt").write_text("a file")
    monkeypatch.chdir(work)
    out = "model.txt" if where == "FILE" else where
    _refused(capsys, tmp_path, ["export", "tiny", "llama", "-o", out, *force], needle)


def test_export_refuses_a_foreign_folder_and_its_hf_input(tmp_path, capsys, no_build):
    _refused(capsys, tmp_path, ["export", "tiny", "llama", "-o", _foreign(tmp_path / "mine")], "--force")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    for out in (hf, tmp_path):
        _refused(capsys, tmp_path, ["export", "hf", hf, "-o", out, "--force"], "contains the input model")


def test_export_force_then_replace_its_own_output(tmp_path, capsys):
    """``--force`` replaces the user's folder; the export marks it, so the next export replaces it
    without ``--force``."""
    out = _foreign(tmp_path / "mine")
    code, err, _ = _run(capsys, "export", "tiny", "llama", "-o", out, "--force")
    assert code == 0, err
    marker = json.loads((out / output_dir.EXPORT_MARKER).read_text())
    assert marker["version"].startswith("edgeq-export/") and marker["export"] == "tiny" and marker["arch"] == "llama"
    assert (out / "model.onnx").is_file() and not (out / "notes").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert output_dir.check_output_dir(out) == out.resolve()  # edgeq's now: the next export may replace it


@pytest.mark.parametrize("argv", [["compile"], *[["export", s] for s in
                                                ("smollm2", "composed-vlm", "trained-vlm", "hf", "tiny", "random")]],
                         ids=lambda a: "-".join(a))
def test_force_is_documented(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--force" in text and "not written by edgeq" in text and "not empty" in text


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


def _llama_calib(model: Path, folder: Path) -> Path:
    names = {i.name for i in onnx.load(str(model), load_external_data=False).graph.input}
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 256, (2, 16)), "attention_mask": np.ones((2, 16), np.int64),
             "position_ids": np.tile(np.arange(16), (2, 1))}
    path = folder / "calib.npz"
    np.savez(path, **{k: v for k, v in feeds.items() if k in names})
    return path


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
