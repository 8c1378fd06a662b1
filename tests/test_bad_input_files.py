"""Bad input files and a bad environment on the large-model paths (weights as external data, outputs
written into a full filesystem): each is one line on stderr, exit 2, found before any work, and
nothing half-written is left (no output folder, no ``.NAME.tmp-*`` / ``.NAME.weights-*`` beside it).

Uses the hand-built toy model of ``tests/toy.py`` (saved by ``ir.save_model`` with every initializer
external) and the ``w8a8`` recipe on one 16-token window, so every compile here takes well under a
second.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from toy import toy_model_dir, write_text

from edgeq.graph import ir
from edgeq.cli import main
from edgeq.errors import UserInputError

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPILE = ["--recipe", "w8a8", "--calib-windows", "1", "--seq-len", "16", "--no-cache"]


@pytest.fixture(autouse=True)
def _no_progress(monkeypatch):
    monkeypatch.setenv("EDGEQ_PROGRESS", "0")  # stderr must hold the error line only


@pytest.fixture
def toy(tmp_path):
    """(model.onnx with all weights in model.onnx.data, calibration text)."""
    model = toy_model_dir(tmp_path / "toy")
    calib = write_text(tmp_path / "calib.txt", 400)
    return model, calib


def _extent(info: dict) -> tuple[int, int]:
    return int(info.get("offset", 0)), int(info["length"])


@pytest.fixture
def truncated(toy):
    """The toy model with its data file cut in the middle of its last tensor; returns
    (model, calib, the one-line message the loader must give)."""
    model, calib = toy
    proto = onnx.load_model(str(model), load_external_data=False)
    tensors = [(t.name, {e.key: e.value for e in t.external_data}) for t in proto.graph.initializer
               if t.data_location == TensorProto.EXTERNAL]
    name, info = max(tensors, key=lambda item: _extent(item[1])[0])
    offset, length = _extent(info)
    data = model.parent / info["location"]
    assert data.stat().st_size == offset + length  # the last tensor ends the file
    cut = offset + length // 2
    os.truncate(data, cut)
    message = (f"external data file {info['location']} is truncated: tensor '{name}' needs bytes "
               f"{offset}..{offset + length} but the file has {cut}")
    return model, calib, message


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err.strip(), captured.out


def _assert_nothing_written(parent: Path, before: set[str], out: Path):
    assert not out.exists()
    assert {p.name for p in parent.iterdir()} == before, "left something beside the output folder"


# -- a data file cut in the middle of a tensor ------------------------------------------------------


def test_compile_refuses_truncated_external_data(truncated, tmp_path, capsys):
    model, calib, message = truncated
    out = tmp_path / "out"
    before = {p.name for p in tmp_path.iterdir()}
    code, err, stdout = _run(capsys, "compile", model, *COMPILE, "--calib", calib, "-o", out)
    assert code == 2, err
    assert err.splitlines() == [f"edgeq: error: {message}"]
    assert stdout == ""  # refused before any pass ran
    _assert_nothing_written(tmp_path, before, out)


def test_inspect_refuses_truncated_external_data(truncated, capsys):
    model, _, message = truncated
    code, err, _ = _run(capsys, "inspect", model)
    assert code == 2, err
    assert err.splitlines() == [f"edgeq: error: {message}"]


@pytest.mark.parametrize("argv", [["eval", "ppl", "{model}"], ["eval", "compare", "{model}", "{model}"]],
                         ids=["ppl", "compare"])
def test_eval_refuses_truncated_external_data(truncated, capsys, argv):
    """``eval`` opens the model with onnxruntime (not ``ir.load_model``), whose own bounds check
    must still come out as one line and exit 2."""
    model, calib, _ = truncated
    argv = [a.format(model=model) for a in argv]
    code, err, _ = _run(capsys, *argv, "--text", calib, "--tokenizer", model.parent, "--seq-len", "16",
                        "--windows", "1")
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("edgeq: error:"), err


@pytest.mark.parametrize("load_external", [False, True])
def test_loader_checks_extent_without_reading(truncated, load_external):
    model, _, message = truncated
    with pytest.raises(UserInputError) as info:
        ir.load_model_and_locations(model, load_external=load_external)
    assert str(info.value) == message


def _external_model(folder: Path, tensors: list[tuple[str, int, list[int], bytes]], keep_length: bool = False,
                    cut: int = 0) -> Path:
    """A model whose initializers (name, data type, dims, bytes) all live in ``w.bin`` without a
    ``length`` entry (unless ``keep_length``), the file ``cut`` bytes short."""
    folder.mkdir(parents=True, exist_ok=True)
    blob, inits, nodes, outputs = b"", [], [], []
    for name, dtype, dims, raw in tensors:
        t = TensorProto(name=name, data_type=dtype, dims=dims, data_location=TensorProto.EXTERNAL)
        entries = {"location": "w.bin", "offset": str(len(blob))}
        if keep_length:
            entries["length"] = str(len(raw))
        for key, value in entries.items():
            t.external_data.add(key=key, value=value)
        blob += raw
        inits.append(t)
        nodes.append(helper.make_node("Identity", [name], [f"{name}_out"]))
        outputs.append(helper.make_tensor_value_info(f"{name}_out", dtype, dims))
    (folder / "w.bin").write_bytes(blob[:len(blob) - cut])
    graph = helper.make_graph(nodes, "ext", [], outputs, inits)
    path = folder / "model.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return path


@pytest.mark.parametrize("dtype, dims, nbytes", [(TensorProto.FLOAT, [3, 5], 60), (TensorProto.FLOAT16, [7], 14),
                                                 (TensorProto.INT4, [5], 3), (TensorProto.INT64, [], 8)],
                         ids=["float", "float16", "int4-packed", "scalar"])
def test_length_absent_is_computed_from_dims_and_type(tmp_path, dtype, dims, nbytes):
    tensors = [("a", TensorProto.FLOAT, [4], bytes(16)), ("b", dtype, dims, bytes(nbytes))]
    good = _external_model(tmp_path / "good", tensors)
    assert ir.load_model_and_locations(good, load_external=False)[1] == {"w.bin"}
    bad = _external_model(tmp_path / "bad", tensors, cut=1)
    with pytest.raises(UserInputError, match=rf"tensor 'b' needs bytes 16\.\.{16 + nbytes} but the file has "
                                             rf"{16 + nbytes - 1}$"):
        ir.load_model_and_locations(bad, load_external=False)


def test_extent_check_stats_each_file_once(tmp_path, monkeypatch):
    """Thousands of tensors in one data file: that file is resolved and stat-ed once, not per tensor."""
    n = 3000
    model = _external_model(tmp_path / "many", [(f"t{i}", TensorProto.FLOAT, [2], bytes(8)) for i in range(n)],
                            keep_length=True)
    calls = []
    real_stat = Path.stat

    def counting_stat(self, *args, **kwargs):
        calls.append(self.name)
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", counting_stat)
    _, locations = ir.load_model_and_locations(model, load_external=False)
    assert locations == {"w.bin"}
    # resolve() stats on some Pythons: at most two per file, however many tensors (was 2 per tensor)
    assert calls.count("w.bin") <= 2 and len(calls) < 10, calls[:20]


# -- a NaN in the external weights: judged as read, or streamed in bounded reads ----------------------


@pytest.fixture
def small_reads(monkeypatch):
    """``edgeq.graph.loadcheck`` reading 64 bytes and judging 8 values at a time: every tensor below spans
    many reads and slices."""
    from edgeq.graph import loadcheck

    monkeypatch.setattr(loadcheck, "_READ_BYTES", 64)
    monkeypatch.setattr(loadcheck, "_SLICE_ELEMENTS", 8)


def test_nan_in_external_weights_is_found_however_they_are_read(tmp_path, small_reads):
    """The same verdict read into memory (``finite=True``: judged as each tensor comes off the
    file), streamed from the file without reading the weights (the block-wise compile's
    skeleton), and on a skeleton afterwards (``ir.check_finite``); a mask of 0 and -inf over many
    reads (read a second time for the mask test) and an inf scalar pass."""
    mask = np.triu(np.full((8, 8), -np.inf, np.float32), 1)
    a = np.ones(1000, np.float32)
    a[[700, 701, 950]] = [np.nan, np.inf, np.nan]
    half = np.ones(40, np.float16)
    tensors = [("mask", TensorProto.FLOAT, [8, 8], mask.tobytes()),
               ("hi", TensorProto.FLOAT, [], np.float32(np.inf).tobytes()),
               ("half", TensorProto.FLOAT16, [40], half.tobytes()),
               ("a", TensorProto.FLOAT, [1000], a.tobytes())]
    path = _external_model(tmp_path / "m", tensors, keep_length=True)
    message = f"{path}: initializer 'a' holds 2 NaN and 1 inf among its 1000 values (first at index [700])"
    for load_external in (True, False):
        with pytest.raises(UserInputError, match=re.escape(message)):
            ir.load_model_and_locations(path, load_external=load_external, finite=True)
    skeleton = ir.load_model(path, load_external=False)
    with pytest.raises(UserInputError, match=re.escape(message)):
        ir.check_finite(skeleton, path)
    good = _external_model(tmp_path / "good", tensors[:3])
    ir.load_model(good, finite=True)
    ir.check_finite(ir.load_model(good, load_external=False), good)


def test_compile_refuses_nan_in_external_weights_before_any_work(toy, tmp_path, capsys):
    model, calib = toy
    proto = onnx.load_model(str(model), load_external_data=False)
    info = next({e.key: e.value for e in t.external_data} for t in proto.graph.initializer if t.name == "w2")
    offset, _ = _extent(info)
    with open(model.parent / info["location"], "r+b") as f:  # w2[0, 5] (the toy's head: 16 x 64)
        f.seek(offset + 5 * 4)
        f.write(np.float32(np.nan).tobytes())
    out = tmp_path / "out"
    before = {p.name for p in tmp_path.iterdir()}
    code, err, stdout = _run(capsys, "compile", model, *COMPILE, "--calib", calib, "-o", out)
    assert code == 2, err
    assert err.splitlines() == [f"edgeq: error: {model}: initializer 'w2' holds 1 NaN among its 1024 values (first "
                                "at index [0, 5]): every value computed from it would be NaN or inf; fix or "
                                "re-export the model"]
    assert stdout == ""
    _assert_nothing_written(tmp_path, before, out)


# -- disk full while the outputs are written --------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB tmpfs (needs the right to mount: root, or CAP_SYS_ADMIN in a container)."""
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if not sys.platform.startswith("linux") or not mount or not umount:
        pytest.skip("tmpfs mounting needs Linux and mount(8); the RLIMIT_FSIZE variant covers disk-full here")
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run([mount, "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["mount failed"])[-1]
        pytest.skip(f"not permitted to mount a tmpfs here ({reason}); the RLIMIT_FSIZE variant covers disk-full")
    try:
        yield where
    finally:
        if subprocess.run([umount, str(where)], capture_output=True).returncode != 0:
            subprocess.run([umount, "-l", str(where)], capture_output=True)


def test_compile_into_a_full_filesystem(toy, small_fs, capsys):
    model, calib = toy
    free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
    (small_fs / "filler").write_bytes(bytes(free - 4096))  # one page left: the outputs start, then fail
    before = {p.name for p in small_fs.iterdir()}
    out = small_fs / "out"
    code, err, _ = _run(capsys, "compile", model, *COMPILE, "--calib", calib, "-o", out)
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert "cannot write the output" in err and os.strerror(errno.ENOSPC) in err, err
    _assert_nothing_written(small_fs, before, out)
    assert os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize >= 4096  # the partial files are gone


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="RLIMIT_FSIZE / SIGXFSZ are POSIX only")
def test_compile_past_the_file_size_limit(toy, tmp_path):
    """Disk full without root: the compile runs under RLIMIT_FSIZE = 1 KiB (SIGXFSZ ignored, so a
    write past it fails with EFBIG instead of killing the process)."""
    import resource

    model, calib = toy
    out = tmp_path / "out"
    before = {p.name for p in tmp_path.iterdir()}

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = {**os.environ, "EDGEQ_PROGRESS": "0"}
    done = subprocess.run([sys.executable, "-m", "edgeq", "compile", str(model), *COMPILE, "--calib", str(calib),
                           "-o", str(out)], cwd=REPO_ROOT, env=env, preexec_fn=limit_file_size,
                          capture_output=True, text=True, timeout=300)
    err = done.stderr.strip()
    left = {p.name for p in tmp_path.iterdir()} - before
    if out.exists() or left:
        pytest.fail(f"a failed compile left {sorted(left)} beside the output folder")
    assert done.returncode == 2, err
    assert len(err.splitlines()) == 1, err
    # (the first write past the limit: a calibration session's temporary weights file, or the output)
    assert ("cannot write the output" in err or "cannot write temporary files" in err) and os.strerror(errno.EFBIG) in err, err
