"""Output folders: the one check of a folder before any work (what may be replaced), the staging
folders a compile writes into, and the rename that puts a whole output in place at the end.

Why its own module: every writer (compile, export, the static pair, the genai folder) goes through
these, and none of it is graph code; ``edgeq.graph.ir`` re-exports the names for older imports.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from collections.abc import Iterator

from edgeq.errors import UserInputError


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def honour_umask(path: str | os.PathLike, folder: bool = False) -> None:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would (0666/0777 less the umask): onnx writes
    external data files 0600 and ``mkdtemp`` makes 0700 folders, unlike every other output file."""
    os.chmod(path, (0o777 if folder else 0o666) & ~_umask())


def check_writable_parent(out_dir: Path, what: str = "the output folder") -> None:
    """The nearest existing ancestor of ``out_dir`` must be a folder this process can write into,
    else a one-line ``UserInputError`` (checked before any work, so nothing is half-done)."""
    parent = Path(out_dir).parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserInputError(f"cannot create {what} {out_dir}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserInputError(f"cannot create {what} {out_dir}: {parent} is not writable")


# What edgeq wrote in a folder, which a later run may replace without --force: a compile writes
# manifest.json (edgeq.artifacts.manifest, "version": "edgeq-manifest/N", its "files" every file it
# wrote but itself), an export writes EXPORT_MARKER ({"version": "edgeq-export/N", ..., "files": [every
# file it wrote but itself]}) through ``atomic_output_dir(marker=...)``. Names only, no hashes: the
# check runs twice per output and must stay cheap.
EXPORT_MARKER = "edgeq-export.json"
_MANIFEST = ("manifest.json", "edgeq-manifest/")
_EXPORT = (EXPORT_MARKER, "edgeq-export/")
# the temporary folders beside an output: .NAME.tmp-PID-<random suffix> (the folder being written),
# .NAME.weights-PID-<random suffix> (a block-wise compile's streamed weights), .NAME.old-PID (the
# previous output during the swap)
STAGING_KINDS = ("tmp", "weights", "old")
_RECORD_BYTES = 64 * 2**20


def _record(marker: Path, version: str) -> set[str] | None:
    """The files ``marker`` (a manifest or an export marker) says edgeq wrote, itself included; None
    when it is not edgeq's (not a regular file, not JSON, another ``version``) or has no usable
    ``files`` (a mapping or a list of relative paths, as strings)."""
    try:
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > _RECORD_BYTES:
            return None
        data = json.loads(marker.read_bytes())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and str(data.get("version", "")).startswith(version) and "edgeq" in data):
        return None
    files = data.get("files")
    names = list(files) if isinstance(files, dict) else files
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return {*names, marker.name}


def written_by_edgeq(folder: str | os.PathLike) -> set[str] | None:
    """The relative posix paths of the files edgeq wrote in ``folder``, per its ``manifest.json``
    and/or ``EXPORT_MARKER`` (each listing itself too); None when neither is there with a usable
    file list (then nothing in the folder counts as edgeq's)."""
    known = None
    for name, version in (_MANIFEST, _EXPORT):
        names = _record(Path(folder) / name, version)
        if names is not None:
            known = (known or set()) | names
    return known


def folder_entries(folder: str | os.PathLike) -> list[str]:
    """Every file under ``folder`` (anything but a folder: symlinks are not followed) as a relative
    posix path, and every empty folder below it as ``path/``; sorted. Raises OSError when a folder
    cannot be read."""
    found, stack = [], [(os.fspath(folder), "")]
    while stack:
        path, prefix = stack.pop()
        with os.scandir(path) as it:
            entries = list(it)
        if not entries and prefix:
            found.append(prefix)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                stack.append((entry.path, f"{prefix}{entry.name}/"))
            else:
                found.append(prefix + entry.name)
    return sorted(found)


def not_written_by_edgeq(folder: str | os.PathLike) -> list[str] | None:
    """What in ``folder`` edgeq did not write (``folder_entries`` not listed by its records: the
    user's files, and folders that are not parents of edgeq's files); None when the folder has no
    record of edgeq's at all (``written_by_edgeq``). Raises OSError when a folder cannot be read."""
    known = written_by_edgeq(folder)
    if known is None:
        return None
    return [name for name in folder_entries(folder) if name not in known]


def is_edgeq_output(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is an output edgeq wrote and holds nothing else: a compile's
    ``manifest.json`` or an export's ``EXPORT_MARKER`` (edgeq's ``version``, a file list), and no
    file or empty folder beyond those they list."""
    try:
        return not_written_by_edgeq(folder) == []
    except OSError:
        return False


def _shown(name: str) -> str:
    """A path for a one-line message (a name with a newline or undecodable bytes is quoted)."""
    return name if name.isprintable() else ascii(name)


def check_output_dir(out_dir: str | os.PathLike, *, force: bool = False, inputs: tuple = (),
                     option: str = "-o") -> Path:
    """The one check of an output folder (compile, export, the static pair), run before any work
    and again by ``atomic_output_dir`` just before the swap; returns the resolved folder.

    Refused with a one-line ``UserInputError``, whatever ``force`` says: an empty path; the current
    folder or one above it; the folder of an input (``inputs``: files or folders) or one above it
    (the swap renames the old folder away); a path that exists and is not a folder (never replaced
    by one); a parent that cannot be written. Refused unless ``force``: a folder that exists, is not
    empty and was not written by edgeq (no usable ``manifest.json`` / ``EXPORT_MARKER``), or was
    but holds anything its record does not list (a file the user saved into it, an empty folder:
    the message names the first, sorted). An empty folder and edgeq's own earlier output holding
    nothing else are replaced. The staging folders dead runs left beside it are removed first
    (``remove_stale_staging``)."""
    raw = os.fspath(out_dir)
    if raw == "":
        raise UserInputError(f"{option} is empty: name the output folder")
    out = Path(raw).resolve()
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        where = "the current folder" if out == cwd else "a folder above the current folder"
        raise UserInputError(f"{option} {raw} is {where} ({out}), which the output would replace; "
                             f"name a new folder")
    for item in inputs:
        item = Path(item).resolve()
        folder = item if item.is_dir() else item.parent
        if out == folder or out in folder.parents:
            raise UserInputError(f"{option} {raw} contains the input model or data ({item}), which the output "
                                 f"would replace; name another folder")
    remove_stale_staging(out)
    if out.is_symlink() or out.exists():
        if not out.is_dir():
            raise UserInputError(f"{option} {raw} exists and is not a folder; edgeq does not replace a file "
                                 f"with a folder")
        try:
            empty = next(out.iterdir(), None) is None
            foreign = None if empty or force else not_written_by_edgeq(out)
        except OSError as exc:
            raise UserInputError(f"cannot read the output folder {raw}: {exc.strerror or exc}") from None
        if not (empty or force):
            if foreign is None:
                raise UserInputError(f"{option} {raw} is a folder that is not empty and was not written by edgeq; "
                                     f"pass --force to replace it (everything in it is deleted)")
            if foreign:
                raise UserInputError(f"{option} {raw} holds {_shown(foreign[0])}, which edgeq did not write; move it "
                                     f"away or pass --force (everything in it is deleted)")
    check_writable_parent(out)
    return out


def staging_dir(out_dir: Path, kind: str) -> Path:
    """A new temporary folder ``.NAME.KIND-PID-<random suffix>`` beside ``out_dir`` (mode 0777 less the
    umask); the pid lets a later run (``remove_stale_staging``) tell whether its owner is alive."""
    out_dir = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{kind}-{os.getpid()}-", dir=out_dir.parent))
    honour_umask(tmp, folder=True)
    return tmp


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's process / not a pid: keep
        return True
    return True


def remove_stale_staging(out_dir: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders (``STAGING_KINDS``) that edgeq processes which are no longer
    alive left beside ``out_dir`` (killed with SIGKILL, a power cut); returns what was removed.
    Only folders named exactly as edgeq names them, with the pid of a dead process, are touched. A
    ``.NAME.old-PID`` left while ``out_dir`` itself is missing (killed between the two renames of
    the swap) is renamed back to ``out_dir`` instead: it is the previous output."""
    out_dir = Path(out_dir)
    pattern = re.compile(rf"^\.{re.escape(out_dir.name)}\.(tmp|weights|old)-(\d+)(-[a-z0-9_]{{8}})?$")
    removed: list[Path] = []
    try:
        entries = list(out_dir.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None or (m.group(1) == "old") != (m.group(3) is None):
            continue
        if entry.is_symlink() or not entry.is_dir() or _alive(int(m.group(2))):
            continue
        if m.group(1) == "old" and not out_dir.exists() and not out_dir.is_symlink():
            with contextlib.suppress(OSError):
                entry.rename(out_dir)
            continue  # (never deleted while it may be the only copy of the previous output)
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _write_marker(folder: Path, marker: dict) -> None:
    """``EXPORT_MARKER`` with ``files``: every file in ``folder`` (the staging folder, complete) but
    the marker, which is what a later run may replace without ``--force`` (``written_by_edgeq``)."""
    import edgeq

    files = [name for name in folder_entries(folder) if name != EXPORT_MARKER and not name.endswith("/")]
    body = {"version": "edgeq-export/1", "edgeq": edgeq.__version__, **marker, "files": files}
    (folder / EXPORT_MARKER).write_text(json.dumps(body, indent=1) + "\n")


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, *, force: bool = False, inputs: tuple = (),
                      marker: dict | None = None) -> Iterator[Path]:
    """Yield a temporary folder beside ``out_dir``; on success it replaces ``out_dir``.

    ``out_dir`` must pass ``check_output_dir`` (with ``force`` and ``inputs``), at the start and
    again just before the swap. On any exception (KeyboardInterrupt, and SIGTERM/SIGHUP through
    ``edgeq.cli.main``, included) the temporary folder is removed and ``out_dir`` is left as it was,
    so a failed run never leaves half-written outputs. ``marker``: write ``EXPORT_MARKER`` (this
    dict plus edgeq's version and the list of the files written) into the folder, which marks it
    as edgeq's output (exports; a compile's ``manifest.json`` does that already). Without either,
    the folder is not edgeq's: a later run replaces it only with ``force``.
    """
    raw = out_dir
    out_dir = check_output_dir(raw, force=force, inputs=inputs)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = staging_dir(out_dir, "tmp")
    except OSError as exc:
        raise UserInputError(f"cannot create the output folder {out_dir}: {exc.strerror or exc}") from None
    try:
        yield tmp
        if marker is not None:
            _write_marker(tmp, marker)
        check_output_dir(raw, force=force, inputs=inputs)  # still ours to replace (nothing appeared meanwhile)
    except OSError as exc:  # disk full, quota, permissions changed under us: bad environment, not a bug
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EROFS, errno.EPERM):
            raise UserInputError(f"cannot write the output in {out_dir.parent}: {exc.strerror or exc}") from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    try:
        if out_dir.is_symlink() or out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(old)
        tmp.rename(out_dir)
    except BaseException:  # (a signal between the two renames): put the previous output back
        if old is not None and not out_dir.exists():
            with contextlib.suppress(OSError):
                old.rename(out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# what --dump-each writes: NN_<pass>.onnx, <prefix>-NN_<stage>.onnx (static-prefill-, route-), data beside
DUMP_FILE = re.compile(r"([a-z0-9-]+-)?\d\d_[a-z0-9-]+\.onnx(\.data)?")


def check_dump_each(dump_each: Path, out: Path, force: bool = False) -> None:
    """``--dump-each DIR``: a folder (or a path where one can be made) that is writable and outside
    the output folder, which the end of the compile replaces (the dumps would be thrown away). The
    dumps are written into it as the passes run, so an existing folder must be empty or hold only
    earlier dumps (``NN_<pass>.onnx``, ``<prefix>-NN_<stage>.onnx``): files of the user's would be overwritten (``--force`` allows it)."""
    dump = dump_each.resolve()
    if dump == out or out in dump.parents:
        raise UserInputError(f"--dump-each {dump_each} is inside the output folder {out}, which is replaced at "
                             f"the end of the compile; choose a folder outside it")
    if dump.exists() or dump.is_symlink():
        if not dump.is_dir():
            raise UserInputError(f"--dump-each {dump_each} exists and is not a folder")
        if not os.access(dump, os.W_OK | os.X_OK):
            raise UserInputError(f"--dump-each {dump_each} is not writable")
        foreign = [p.name for p in dump.iterdir() if not DUMP_FILE.fullmatch(p.name)]
        if foreign and not force:
            raise UserInputError(f"--dump-each {dump_each} holds files edgeq did not dump (e.g. {foreign[0]}); "
                                 f"name an empty or new folder, or pass --force to write the dumps among them")
        return
    check_writable_parent(dump, what="the --dump-each folder")
