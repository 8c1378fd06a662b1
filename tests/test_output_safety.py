"""Output folders are replaced only when that loses nothing of the user's (issue 30): ``-o`` naming
the current folder, a folder above it, the input's folder (or above), an empty path or a file is
refused (exit 2, one line, nothing touched), even with ``--force``; a non-empty folder edgeq did not
write is refused unless ``--force``; an empty folder and edgeq's own earlier output (``manifest.json``
of a compile, ``edgeq-export.json`` of an export, each listing the files written) are replaced, unless
it holds anything else (a file the user saved into it, an empty folder: issue 41), which the one line
names. All checked before any work, by ``edgeq.files.output_dir.check_output_dir``, and again just
before the swap. Signals, staging leftovers and file modes: tests/test_output_leftovers.py.

The toy model of ``tests/toy.py`` and the ``w8a8`` recipe on one 16-token window keep each
compile well under a second; the block-wise cases use the tiny llama.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from toy import write_tokenizer

from edgeq.files import output_dir
from edgeq.cli import main
from edgeq.errors import UserInputError
from output_cases import COMPILE, REPO_ROOT, _foreign, _no_progress, _refused, _llama_calib, _run, _snapshot, toy  # noqa: F401 (fixtures used by name)


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
