"""The fuzz harness (tests/test_fuzz.py): the tree each case runs in, the case and its outcome, the
checks of the bad-input contract after every case, and the module fixture ``fz``. See test_fuzz.py for
what the campaigns are and how to scale them."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from toy import VOCAB, toy_model_dir, write_text

from edgeq.cli import build_parser, main


REPO_ROOT = Path(__file__).resolve().parent.parent
EXIT_CODES = {0, 2, 3, 4}
FAST = ["--recipe", "w8a8", "--calib-windows", "1", "--seq-len", "16", "--no-cache"]
OUTPUT_FLAGS = {"-o", "--out", "--output", "--dump-each"}


LOG = os.environ.get("EDGEQ_FUZZ_LOG")  # a file: one JSON line per case (argv, exit code, stderr, breaches)
SCALE = float(os.environ.get("EDGEQ_FUZZ_SCALE", "1"))  # e.g. 0.1 for a quick look, 10 for a long soak


def _foreground_signals() -> None:
    """preexec_fn: the child gets a terminal foreground job's signal dispositions (the runner may
    have inherited SIGHUP ignored under nohup, or SIGINT ignored in a background job)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)

def fuzz_settings(n: int):
    return settings(max_examples=max(1, round(n * SCALE)), deadline=None, derandomize=True, database=None,
                    print_blob=False, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                           HealthCheck.large_base_example])


# -- the tree, its snapshot and the bookkeeping ------------------------------------------------------


@dataclass
class Fuzz:
    root: Path
    base: Path  # pristine inputs, shared by every case (read only)
    ws: Path  # per-case workspace, rebuilt before every case
    cache: Path  # $EDGEQ_CACHE_DIR: the one place outside -o edgeq may write
    systmp: Path  # tempfile's folder: must be empty after every case
    has_force: dict = field(default_factory=dict)  # command -> whether it takes --force
    stats: dict = field(default_factory=dict)  # group -> {"tried", "kept"}
    breaches: dict = field(default_factory=dict)  # group -> {signature: {"repro", "count"}}
    seconds: dict = field(default_factory=dict)
    _hashes: dict = field(default_factory=dict)

    # paths inside a fresh workspace
    @property
    def cwd(self) -> Path:
        return self.ws / "cwd"

    def fresh_ws(self) -> None:
        os.chdir(self.root)
        if self.ws.is_symlink() or self.ws.is_file():
            self.ws.unlink()
        shutil.rmtree(self.ws, ignore_errors=True)
        for leftover in self.root.glob(".ws.*"):  # a case that replaced the workspace itself (-o ..)
            shutil.rmtree(leftover, ignore_errors=True)
        shutil.rmtree(self.cache, ignore_errors=True)
        self.cache.mkdir()
        for p in self.systmp.iterdir():
            if p.name != ".ses":  # onnxruntime's session-id file, made at its import (see fz)
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
        shutil.copytree(self.base / "toy", self.ws / "toy")
        shutil.copy(self.base / "calib.txt", self.ws / "calib.txt")
        (self.ws / "foreign" / "data").mkdir(parents=True)
        (self.ws / "foreign" / "notes.txt").write_text("not edgeq's\n")
        (self.ws / "foreign" / "data" / "x.bin").write_bytes(bytes(range(256)))
        (self.ws / "file.txt").write_text("a plain file\n")
        (self.ws / "link_foreign").symlink_to(self.ws / "foreign")
        (self.ws / "link_dangling").symlink_to(self.ws / "nowhere")
        self.cwd.mkdir()
        (self.cwd / "keep.txt").write_text("the user's working folder\n")
        os.chdir(self.cwd)

    def snapshot(self) -> dict[str, tuple]:
        """rel path -> ("dir",) | ("link", target) | ("file", size, mtime_ns, sha256), cache left out."""
        snap = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            d = Path(dirpath)
            if d == self.cache:
                dirnames[:] = []
                continue
            for name in list(dirnames):
                p = d / name
                rel = str(p.relative_to(self.root))
                if p.is_symlink():
                    snap[rel] = ("link", os.readlink(p))
                    dirnames.remove(name)
                elif p == self.cache:
                    dirnames.remove(name)
                else:
                    snap[rel] = ("dir",)
            for name in filenames:
                p = d / name
                rel = str(p.relative_to(self.root))
                try:
                    st_ = os.lstat(p)
                except FileNotFoundError:
                    continue
                if stat.S_ISLNK(st_.st_mode):
                    snap[rel] = ("link", os.readlink(p))
                    continue
                key = (rel, st_.st_ino, st_.st_size, st_.st_mtime_ns, st_.st_ctime_ns)
                digest = self._hashes.get(key)
                if digest is None:
                    try:
                        digest = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
                    except OSError as exc:
                        digest = f"unreadable:{exc.errno}"
                    self._hashes[key] = digest
                snap[rel] = ("file", st_.st_size, st_.st_mtime_ns, digest)
        return snap

    def rel(self, text: str) -> str:
        return text.replace(str(self.root), "$T")


@dataclass
class Case:
    group: str
    kind: str  # what was fuzzed, for grouping breaches ("model:bitflip", "args:compile")
    argv: list[str]
    setup: str = ""  # how the inputs were made, for the reproduction
    env: dict = field(default_factory=dict)  # variables set (None: unset) for this case only
    # (signal, when): sent to the subprocess that many seconds after its start, or, when is "handled",
    # as soon as edgeq's entry has taken the signals over (``_handles_signals``)
    signal_after: tuple | None = None
    script: bool = False  # run as the ``edgeq`` console script (else ``python -m edgeq``)


@dataclass
class Outcome:
    code: int | None
    out: str
    err: str
    raised: str | None = None


def _run_inprocess(case: Case, capfd) -> Outcome:
    capfd.readouterr()
    saved = {k: os.environ.get(k) for k in case.env}
    for k, v in case.env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    raised = None
    try:
        code = main(list(case.argv))
    except SystemExit as exc:  # argparse: usage errors (2), --help/--version (0)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 (anything escaping main is a breach)
        code, raised = None, f"{type(exc).__name__}: {exc}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out, err = capfd.readouterr()
    return Outcome(code, out, err, raised)


def _program(case: Case) -> list[str]:
    """``python -m edgeq``, or the console script installed beside this Python when the case asks."""
    script = Path(sys.executable).with_name("edgeq")
    return [str(script)] if case.script and script.is_file() else [sys.executable, "-m", "edgeq"]


# SigCgt (/proc/PID/status): the signals a process handles. CPython handles SIGINT from its start;
# SIGTERM and SIGHUP only get a handler from edgeq's entry, which installs SIGINT's first.
_ENTRY_HANDLES = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGHUP - 1))


def _handles_signals(pid: int) -> bool:
    """Whether edgeq's entry has taken the signals over in process ``pid`` (Linux)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    m = re.search(r"^SigCgt:\s*([0-9a-fA-F]+)$", status, re.M)
    return bool(m) and int(m.group(1), 16) & _ENTRY_HANDLES == _ENTRY_HANDLES


def _run_subprocess(case: Case, fz: Fuzz) -> Outcome:
    env = {**os.environ, "EDGEQ_PROGRESS": "0", "EDGEQ_CACHE_DIR": str(fz.cache), "TMPDIR": str(fz.systmp)}
    # An in-process export earlier in this pytest process (models/hf_export.py's private_torch_cache)
    # points TORCHINDUCTOR_CACHE_DIR at its own temporary folder for the rest of the process, and
    # removes the folder. A subprocess inheriting that stale name takes it for the user's choice and
    # leaves it alone; an interrupted torch import then creates it in systmp. A user's shell holds
    # no such variable: neither does the case's unless the case sets it.
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    for k, v in case.env.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    cmd = [*_program(case), *case.argv]
    if case.signal_after is None:
        try:
            done = subprocess.run(cmd, cwd=fz.cwd, env=env, capture_output=True, text=True, errors="replace",
                                  timeout=300)
        except subprocess.TimeoutExpired as exc:
            return Outcome(None, "", str(exc.stderr or ""), raised="timed out after 300 s")
        return Outcome(done.returncode, done.stdout, done.stderr)
    sig, when = case.signal_after
    with subprocess.Popen(cmd, cwd=fz.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          errors="replace", preexec_fn=_foreground_signals) as proc:
        if when == "handled":
            deadline = time.monotonic() + 120
            while proc.poll() is None and not _handles_signals(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.0002)
            if proc.poll() is None:
                proc.send_signal(sig)
        else:
            try:
                proc.wait(timeout=when)
            except subprocess.TimeoutExpired:
                proc.send_signal(sig)
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return Outcome(None, out, err, raised="did not stop within 300 s of the signal")
    return Outcome(proc.returncode, out, err)


def _outputs(case: Case, fz: Fuzz) -> list[Path]:
    """Where the case may write on success: the last value of -o/--out/--output and of --dump-each
    (argparse keeps the last), and, for a symlink given there, where it leads."""
    last = {}
    for flag, value in zip(case.argv, case.argv[1:]):
        if flag in OUTPUT_FLAGS:
            last["dump" if flag == "--dump-each" else "out"] = value
    paths = []
    for value in last.values():
        paths.append(Path(os.path.abspath(fz.cwd / value)))
        paths.append(Path(os.path.realpath(fz.cwd / value)))
    return paths


def _under(rel: str, prefixes: list[str]) -> bool:
    return any(rel == p or rel.startswith(p + "/") for p in prefixes)


def _edgeq_listed(folder: Path) -> set[str] | None:
    """What edgeq's records in ``folder`` say it wrote (read before the case runs; independent of
    edgeq.files.output_dir): the keys of manifest.json's "files", the items of edgeq-export.json's
    "files", and each record itself; None when neither has a file list."""
    known = None
    for name, version in (("manifest.json", "edgeq-manifest/"), ("edgeq-export.json", "edgeq-export/")):
        path = folder / name
        try:
            data = json.loads(path.read_bytes()) if path.is_file() and not path.is_symlink() else None
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not str(data.get("version", "")).startswith(version):
            continue
        files = data.get("files")
        if isinstance(files, (dict, list)) and all(isinstance(f, str) for f in files):
            known = (known or set()) | set(files) | {name}
    return known


def _foreign(before: dict, rel: str, listed: set[str] | None) -> bool:
    """An existing non-empty folder holding anything edgeq's records there (``listed``, read before
    the run) do not list: a file, or a folder that is no parent of a listed file (rel "" is the
    fuzz root)."""
    if rel and before.get(rel) != ("dir",):
        return False
    inside = {k[len(rel) + 1:]: v for k, v in before.items() if k.startswith(rel + "/")}
    if not inside:
        return False
    if listed is None:
        return True
    parents = {str(parent) for f in listed if f in inside for parent in Path(f).parents}
    return any(k not in listed if v != ("dir",) else k not in parents for k, v in inside.items())


def _edgeq_roots() -> list[Path]:
    """The folders edgeq's code is in (an editable install maps some subpackages beside ``edgeq/``)."""
    from importlib.util import find_spec

    roots = []
    for name in ("edgeq", "edgeq.passes", "edgeq.runtime_ops", "edgeq.kernels", "edgeq.models"):
        spec = find_spec(name)
        roots += [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else []
    return roots


# edgeq's only code that can run before its entry has handlers: these modules' bodies, main's first lines
_BEFORE_HANDLERS = {"__init__.py", "__main__.py"}
_FRAME = re.compile(r'^  File "([^"]+)", line \d+,? in \S+$')  # a traceback's, or a thread dump's
_TRACEBACK = r"Traceback \(most recent call last\):\n(?:(?:  .*)?\n)*?"  # its frames and source lines
_REPORT = re.compile(r"(?P<fatal>Fatal Python error: init_\w+: .*\nPython runtime state: .*\n"
                     r"|Could not import runpy module\n)?"
                     r"(?P<ignored>Exception ignored in: .*\n)?"
                     rf"(?P<frames>(?:{_TRACEBACK}\S.*\n\n(?:During handling of the above exception, another exception "
                     r"occurred:|The above exception was the direct cause of the following exception:)\n\n)*"
                     rf"{_TRACEBACK})?KeyboardInterrupt:? ?\n"
                     # a fatal error raised where no Python code ran: the threads' stacks instead
                     r"(?P<dump>\nCurrent thread 0x[0-9a-f]+ \(most recent call first\):\n(?:  .*\n)*)?"
                     r"(?P<modules>\nExtension modules: .*\n)?")


def _cpython_interrupt(err: str) -> tuple[str, str | None]:
    """A SIGINT that came before edgeq's entry took the signals over is CPython's to report
    (``edgeq/__main__.py`` says how): split that report off the start of stderr. Returns the rest and
    the report's kind: "fatal" (it stopped CPython's initialization, or ``-m``'s import of runpy:
    exit 1), "uncaught" (runpy or the console script importing edgeq: exit -2), "ignored" (raised in
    a weakref callback of importlib's: printed, swallowed, the run goes on) or None. A report with a
    frame in edgeq's code other than the module bodies its entry runs in is not CPython's: None."""
    m = _REPORT.match(err)
    if not m or (not m.group("fatal") and not m.group("frames")) or (
            not m.group("fatal") and (m.group("dump") or m.group("modules"))):
        return err, None
    roots = _edgeq_roots()
    for line in ((m.group("frames") or "") + (m.group("dump") or "")).splitlines():
        frame = _FRAME.match(line)
        if not frame:
            continue  # a source line or a caret line
        path = Path(frame.group(1))
        if not path.is_absolute():
            continue  # <frozen ...>, <string> (a .pth line)
        path = path.resolve()
        if any(root in path.parents for root in roots) and not (
                path.parent == roots[0] and path.name in _BEFORE_HANDLERS):
            return err, None
    kind = "fatal" if m.group("fatal") else "ignored" if m.group("ignored") else "uncaught"
    return err[m.end():], kind


def _signal_line(signum: int) -> str:
    return "edgeq: interrupted" if signum == signal.SIGINT else f"edgeq: terminated by {signal.Signals(signum).name}"


def _check(case: Case, res: Outcome, before: dict, after: dict, fz: Fuzz, listed: dict | None = None) -> list[str]:
    problems = []
    sig = case.signal_after[0] if case.signal_after else None
    # a signal sent: 128 + its number and one line (edgeq's handler ran), the finished command's own
    # outcome, or, before edgeq's entry installed a handler (Python starting up), what the signal
    # does to any Python program: killed by it, nothing printed, or for SIGINT CPython's own report
    # (_cpython_interrupt); either way nothing may be left
    err, cpython = _cpython_interrupt(res.err) if sig == signal.SIGINT else (res.err, None)
    err_lines = [line for line in err.splitlines() if line.strip()]
    allowed = EXIT_CODES | ({128 + sig} if sig else set())
    if res.raised:
        problems.append(f"main() raised {res.raised.splitlines()[0][:120]}")
    elif cpython in ("fatal", "uncaught"):
        if res.code != {"fatal": 1, "uncaught": -sig}[cpython] or err_lines:
            problems.append(f"exit {res.code} after CPython's {cpython} KeyboardInterrupt")
    elif sig and res.code == -sig:
        if err_lines:
            problems.append(f"killed by the signal with {len(err_lines)} stderr lines")
    elif res.code not in allowed:
        problems.append(f"exit {res.code}")
    if "Traceback (most recent call last)" in err + res.out or "Fatal Python error" in err:
        problems.append("traceback printed")
    if res.code in (2, 4) and len(err_lines) != 1:
        problems.append(f"exit {res.code} with {len(err_lines)} stderr lines")
    if sig and res.code == 128 + sig and err_lines != [_signal_line(sig)]:
        problems.append(f"exit {res.code} with {len(err_lines)} stderr lines, not {_signal_line(sig)!r} alone")
    if res.code == 3 and len(err_lines) > 1:
        problems.append(f"exit 3 with {len(err_lines)} stderr lines")

    outs = []
    for p in _outputs(case, fz):
        try:
            outs.append(str(p.relative_to(fz.root)) if p != fz.root else "")
        except ValueError:
            pass
    keep = outs if res.code == 0 else []
    b = {k: v for k, v in before.items() if not _under(k, keep)}
    a = {k: v for k, v in after.items() if not _under(k, keep)}
    if res.code == 0 and "" in keep:
        b, a = {}, {}
    created = sorted(set(a) - set(b))
    removed = sorted(set(b) - set(a))
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    staging = [k for k in created if re.search(r"/?\.[^/]*\.(tmp|weights|old)-[^/]*$", k)]
    if staging:
        problems.append(f"left staging {staging[:3]}")
    if res.code != 0 and any(_under(k, outs) for k in created if k not in staging):
        problems.append("wrote the output on failure")
    # on success the missing parents of -o were made for it
    parents = {str(up) for o in outs for up in Path(o).parents} if res.code == 0 else set()
    rest_created = [k for k in created if k not in staging and not _under(k, outs) and k not in parents]
    if rest_created:
        problems.append(f"created outside -o {rest_created[:3]}")
    if removed:
        problems.append(f"removed {'under -o on failure' if _under(removed[0], outs) else 'outside -o'} {removed[:3]}")
    if changed:
        problems.append(f"changed {'under -o on failure' if _under(changed[0], outs) else 'outside -o'} {changed[:3]}")
    if res.code == 0 and "--force" not in case.argv:
        for rel in outs:
            if rel in before and before[rel][0] == "file":
                problems.append("replaced an existing file given as -o")
            elif _foreign(before, rel, (listed or {}).get(rel)) and {k: v for k, v in before.items() if _under(k, [rel])} != \
                    {k: v for k, v in after.items() if _under(k, [rel])}:
                problems.append("replaced a non-empty foreign folder given as -o without --force")
    return problems


_NOISE = re.compile(r"'.*?'|\".*?\"|\d+|\S*/\S*")


def _signature(case: Case, res: Outcome, problems: list[str]) -> str:
    kinds = sorted({re.sub(r"\[.*", "", p).strip() for p in problems})
    err = "\n".join(line for line in res.err.splitlines() if line.strip())
    m = re.search(r"(internal error|failed): (.*)", err)
    # an internal error: its exception type and message, quoted names, numbers and paths left out
    detail = f" [{re.sub(_NOISE, '_', m.group(2))[:70]}]" if m and res.code not in EXIT_CODES else ""
    if "Traceback" in err:
        last = [line for line in err.splitlines() if re.match(r"^\w+(Error|Exception)\b", line)]
        detail += f" [{last[-1].split(':')[0]}]" if last else ""
    cmd = " ".join(a for a in case.argv[:2] if not a.startswith(("-", "/", "$"))) or "(none)"
    return f"{case.kind} | {cmd} | {'; '.join(kinds)}{detail}"


def run_case(fz: Fuzz, case: Case, capfd=None) -> None:
    """Run one case (in-process with capfd, else as a subprocess) and record whether it kept the contract."""
    before = fz.snapshot()
    listed = {}  # -o folder (rel) -> what edgeq's records in it list, read before the run
    for p in _outputs(case, fz):
        try:
            rel = str(p.relative_to(fz.root)) if p != fz.root else ""
        except ValueError:
            continue
        try:
            listed[rel] = _edgeq_listed(p) if p.is_dir() else None
        except OSError:  # (a name too long, a loop of links: not a folder edgeq could replace)
            listed[rel] = None
    res = _run_subprocess(case, fz) if capfd is None else _run_inprocess(case, capfd)
    after = fz.snapshot()
    problems = _check(case, res, before, after, fz, listed)
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps({"group": case.group, "kind": case.kind, "setup": fz.rel(case.setup),
                                "argv": [fz.rel(a) for a in case.argv], "code": res.code,
                                "err": fz.rel(res.err.strip())[-300:], "problems": problems}) + "\n")
    stats = fz.stats.setdefault(case.group, {"tried": 0, "kept": 0, "exit_codes": {}})
    stats["tried"] += 1
    codes = stats["exit_codes"]
    codes[str(res.code)] = codes.get(str(res.code), 0) + 1
    if not problems:
        stats["kept"] += 1
        return
    sig = _signature(case, res, problems)
    seen = fz.breaches.setdefault(case.group, {})
    if sig in seen:
        seen[sig]["count"] += 1
        return
    err_lines = [line for line in res.err.splitlines() if line.strip()]
    shown = " / ".join(err_lines[-3:]) if len(err_lines) > 1 else (err_lines[0] if err_lines else "(no stderr)")
    seen[sig] = {"count": 1, "repro": fz.rel(
        (f"[{case.setup}] " if case.setup else "")
        + ("env " + " ".join(f"{k}={shlex.quote(str(v))}" for k, v in case.env.items()) + " " if case.env else "")
        + "edgeq " + " ".join(shlex.quote(a) for a in case.argv)
        + f"  ->  exit {res.code}{' (' + res.raised[:100] + ')' if res.raised else ''}: {shown[:400]}"
        + f"  ({'; '.join(problems)[:300]})")}


def assert_kept(fz: Fuzz, group: str) -> None:
    found = fz.breaches.get(group, {})
    stats = fz.stats.get(group, {"tried": 0, "kept": 0})
    assert stats["tried"] > 0, f"{group}: no case ran"
    if found:
        lines = [f"{group}: {stats['tried'] - stats['kept']} of {stats['tried']} cases broke the contract, "
                 f"{len(found)} distinct:"]
        for sig, rec in found.items():
            lines.append(f"- {sig}  (x{rec['count']})\n    {rec['repro']}")
        pytest.fail("\n".join(lines), pytrace=False)


# -- the module fixture: models made once, environment pointed into the tree --------------------------


def _parser_has_force(command: list[str]) -> bool:
    parser = build_parser()
    for name in command:
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[name]
    return "--force" in parser._option_string_actions


def _tiny_llama() -> Path:
    """``edgeq export tiny llama`` (seed 0), from the test-model cache of conftest.py (the entry the
    ``tiny_models`` fixture uses), exported there first if missing."""
    from conftest import _cache_key, _cache_root, _cached

    from edgeq.models.tiny import export_tiny

    key = _cache_key("tiny", "llama", "seed0", sources=("tiny.py", "hf_export.py"))
    return _cached(_cache_root() / key, lambda out: export_tiny("llama", out, seed=0))


@pytest.fixture(scope="module")
def fz(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("fuzz")
    fz = Fuzz(root=root, base=root / "base", ws=root / "ws", cache=root / "cache", systmp=root / "systmp")
    fz.base.mkdir()
    fz.cache.mkdir()
    fz.systmp.mkdir()
    mp = pytest.MonkeyPatch()
    mp.setenv("EDGEQ_PROGRESS", "0")  # stderr must hold the error line only
    mp.setenv("EDGEQ_CACHE_DIR", str(fz.cache))
    mp.setenv("TMPDIR", str(fz.systmp))
    mp.setattr(tempfile, "tempdir", str(fz.systmp))
    mp.chdir(root)
    # onnxruntime (1.32) writes $TMPDIR/.ses (a session id) when first imported in a process and
    # reuses it afterwards: a third-party file made before any edgeq code runs, so made here, once
    subprocess.run([sys.executable, "-c", "import onnxruntime"], env={**os.environ}, check=True)
    start = time.monotonic()
    try:
        toy_model_dir(fz.base / "toy")
        write_text(fz.base / "calib.txt", 400)
        ids = np.random.default_rng(1).integers(0, VOCAB, (2, 16)).astype(np.int64)
        np.savez(fz.base / "calib.npz", input_ids=ids)
        assert main(["compile", str(fz.base / "toy" / "model.onnx"), *FAST, "--calib",
                     str(fz.base / "calib.txt"), "-o", str(fz.base / "q8")]) == 0
        shutil.copytree(_tiny_llama().parent, fz.base / "tiny")
        shutil.copy(fz.base / "toy" / "tokenizer.json", fz.base / "tiny" / "tokenizer.json")
        for cmd in (["compile"], ["export", "tiny"]):
            fz.has_force[cmd[0]] = _parser_has_force(cmd)
        fz.seconds["setup"] = time.monotonic() - start
        yield fz
    finally:
        mp.undo()
        tried = sum(s["tried"] for s in fz.stats.values())
        kept = sum(s["kept"] for s in fz.stats.values())
        distinct = sum(len(b) for b in fz.breaches.values())
        summary = {"tried": tried, "kept": kept, "distinct_breaches": distinct, "groups": fz.stats,
                   "seconds": {k: round(v, 1) for k, v in fz.seconds.items()},
                   "breaches": {g: {s: r for s, r in b.items()} for g, b in fz.breaches.items()}}
        dest = Path(os.environ.get("EDGEQ_FUZZ_SUMMARY") or tmp_path_factory.getbasetemp() / "fuzz-summary.json")
        dest.write_text(json.dumps(summary, indent=1))
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        groups = ", ".join(f"{g} {s['kept']}/{s['tried']}" for g, s in fz.stats.items())
        line = f"fuzz: tried {tried} / contract kept {kept} ({distinct} distinct breaches; {groups}) -> {dest}"
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(line)
        else:
            print(line, file=sys.__stderr__)

