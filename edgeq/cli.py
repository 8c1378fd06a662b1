"""The ``edgeq`` command line: compile, inspect, eval, export, recipes, passes, targets, check.

Exit codes: 0 success; 2 bad input (one line on stderr, nothing written); 1 internal error (the
failing pass named); 3 a model outside a target profile (``check``, ``compile --target``: the
violations on stdout, nothing written); 4 ``compile``: a pass the recipe marks essential did not
apply to the model (one line naming it, nothing written; ``--allow-partial`` writes it anyway
with a warning per pass). Subcommand groups owned by other modules register
themselves through ``register(subparsers)`` (``edgeq.evaluate.cli``, ``edgeq.models.cli``,
``edgeq.targets.cli``).

``edgeq`` without a command (and ``edgeq eval`` without ``ppl`` or ``compare``) is a usage error
like any other: the help goes to stdout, one ``edgeq: error:`` line to stderr, exit 2 (a script
that forgot the command must not read as a success; ``edgeq --help`` is the way to ask for help,
exit 0). An ``OSError`` about a path the user gave (a name too long, missing, a folder where a file
was expected, no permission), or a file inside it, is bad input too (exit 2, one line), wherever
it surfaces. Signals: SIGINT, SIGTERM and SIGHUP end a run with one line and exit 130 / 143 / 129,
whatever they interrupt (module imports included: the program's entry, ``edgeq.__main__.main``,
installs its handlers before importing this module and, while the command line's modules load, a
signal is only noted and acted on once they are loaded; ``edgeq.__main__`` says what a signal does
before that, while Python itself starts); what was being written is removed on the way out.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import dataclasses
import errno
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from edgeq.argtypes import positive_float, positive_int, seq_len_int
from edgeq import _note_signal as _note
from edgeq import _signals as _RECEIVED
from edgeq.errors import EdgeqError, UserInputError

_EPILOG = """examples:
  edgeq export smollm2 -o artifacts/smollm2
  edgeq compile artifacts/smollm2/model.onnx --calib data/wikitext-2/valid.txt -o artifacts/w8a8
  edgeq eval ppl artifacts/w8a8/model.onnx --text data/wikitext-2/test.txt --tokenizer artifacts/smollm2
  edgeq recipes
  edgeq compile artifacts/smollm2/model.onnx --recipe w8a8 --calib data/wikitext-2/valid.txt --target qnn-htp -o artifacts/htp
  edgeq check artifacts/w8a8/model.onnx --target pow2-int
"""


FORCE_HELP = ("replace the output folder even when it is not empty and was not written by edgeq (everything in it "
              "is deleted); without it such a folder is refused (exit 2). Never allowed: a file, the current "
              "folder, an input's folder or a folder above them")


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage already; keep its message to one line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_compile(sub) -> None:
    p = sub.add_parser("compile", help="quantize/rewrite an ONNX model with a recipe",
                       description="Compile MODEL.onnx with a recipe: calibrate on --calib, run the recipe's passes, "
                                   "write OUTDIR/model.onnx (+ external data), report.json and encodings.json.")
    p.add_argument("model", type=Path, help="input ONNX model (external data next to it is read)")
    p.add_argument("-o", "--out", type=Path, required=True,
                   help="output folder, written under a temporary name and renamed over OUT only on success; an "
                        "existing OUT must be empty or an earlier edgeq output (see --force), and may not be the "
                        "current folder, the input's folder or one above them")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.add_argument("--recipe", default=None, help="built-in recipe name (see `edgeq recipes`) or a .toml file; default: mquant-w8a8")
    p.add_argument("--calib", type=Path, help="calibration data: a text file (cut into token windows) or an .npz of input dicts")
    p.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json (default: the model's folder if it has one)")
    p.add_argument("--calib-windows", type=positive_int, metavar="N", help="number of calibration windows/samples (default: the recipe's)")
    p.add_argument("--seq-len", type=seq_len_int, metavar="L", help="tokens per calibration window (default: the recipe's, 512)")
    p.add_argument("--dump-each", type=Path, metavar="DIR", help="save the graph after every pass into DIR")
    p.add_argument("--verify", action="store_true", help="onnx checker + onnxruntime session after every pass")
    p.add_argument("--check-numerics", action="store_true", help="log output drift against the input model after every pass")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the calibration cache")
    p.add_argument("--target", help="target profile (see `edgeq targets`) or a profile .toml: run its lowering passes "
                                    "after the recipe's, then fail (exit 3, nothing written) if the model is still outside it")
    p.add_argument("--allow-partial", action="store_true",
                   help="write the model even when a pass the recipe marks essential (e.g. rotate for mquant-*) did not "
                        "apply to it, with a warning per such pass; without it compile stops with exit 4 and writes "
                        "nothing, since the result would be a silently weaker recipe")
    p.add_argument("--blockwise", choices=("auto", "on", "off"), default="auto",
                   help="compile one decoder block at a time: weights read per block and written out as each block "
                        "is done, calibration carried from block to block, so memory stays near one block's instead "
                        "of several times the model's (same numbers as in memory). auto (default): for models of "
                        "256 MB or more whose graph splits into blocks and whose recipe passes all run per block; "
                        "one progress line per block with an ETA")
    p.add_argument("--static", metavar="prefill=S,context=C",
                   help="write the deployable static pair instead of one dynamic graph: OUT/prefill.onnx (S tokens "
                        "per run) and OUT/decode.onnx (1 token per run) over a fixed KV cache of C slots per layer, "
                        "every shape static, sharing one weights file (OUT/weights.data), from one recipe run. "
                        "MODEL must have a KV cache (`edgeq export smollm2 --with-past`); run the result with "
                        "`edgeq generate OUT`. The graph contract is in docs/static-llm-deployment.md. A VLM's "
                        "with-past graph (edgeq export trained-vlm: DIR/with-past/model.onnx) gives a static VLM "
                        "deployment: OUT/vision.onnx (batch 1) beside the pair, the visual span at prefill rows "
                        "[0, V) in AIFS order with MSQ's visual scales on that slice (S >= V + 1); run it with "
                        "`edgeq eval vqa OUT` (docs/static-vlm-deployment.md)")
    from edgeq.targets import ort_genai, qnn_htp

    qnn_htp.add_arguments(p)
    ort_genai.add_arguments(p)
    p.set_defaults(func=_run_compile)


def _run_compile(args) -> int:
    from edgeq.api import compile as compile_api
    from edgeq.targets import TargetUnreachable, ort_genai, qnn_htp

    try:  # (the Python API, edgeq.compile, with the options as parsed)
        report = compile_api(
            args.model, out=args.out, recipe=args.recipe, calib=args.calib, tokenizer=args.tokenizer,
            calib_windows=args.calib_windows, seq_len=args.seq_len, dump_each=args.dump_each, verify=args.verify,
            check_numerics=args.check_numerics, use_cache=not args.no_cache, target=args.target,
            allow_partial=args.allow_partial, blockwise=args.blockwise, static=args.static, force=args.force,
            **dataclasses.asdict(qnn_htp.QnnHtpOptions.from_args(args)),
            **dataclasses.asdict(ort_genai.OrtGenaiOptions.from_args(args)))
    except TargetUnreachable as exc:
        for v in exc.result.violations:
            print(v.message)
        raise
    for rec in report.passes + report.lowering:
        state = "modified" if rec.modified else "unchanged"
        print(f"  {rec.name:<17} {rec.seconds:8.2f} s  {state}  {json.dumps(rec.summary)[:160]}")
        for output, d in (rec.numerics or {}).items():
            print(f"    drift {output}: max_abs {d.get('max_abs', 0):.4g}  sqnr {d.get('sqnr_db', 0):.1f} dB")
    for miss in report.partial:
        print(f"edgeq: warning: essential pass '{miss['pass']}' did not apply ({miss['reason']}: {miss['detail']}); "
              f"the model was written without it (--allow-partial)", file=sys.stderr)
    if report.accuracy_warning is not None:
        print(f"edgeq: warning: {report.accuracy_warning}; the model is written, but expect that loss", file=sys.stderr)
    if report.target is not None:
        graphs = "" if report.static is None else " (all three graphs)" if "vlm" in report.static else " (both graphs)"
        print(f"  target {report.target.name}: {len(report.target.lowering)} lowering pass(es), clean{graphs}")
    qnn = report.qnn_context.to_json() if report.qnn_context is not None else {}
    for _graph, rec in qnn.get("graphs", {}).items():
        if rec.get("load_seconds") is None:
            print(f"  qnn context {rec['files'][-1]} over the shared {rec['binary']}, prepared in "
                  f"{rec['prepare_seconds']:.1f} s (HTP v{qnn['htp_arch']}; not loadable on x86-64, not loaded back)")
            continue
        print(f"  qnn context binary {rec['files'][-1]}: {rec['bytes'] / 2**20:.1f} MB, prepared in "
              f"{rec['prepare_seconds']:.1f} s, loads back in {rec['load_seconds']:.1f} s (HTP v{qnn['htp_arch']})")
    for binary, size in qnn.get("binaries", {}).items():
        print(f"  qnn shared binary {binary}: {size / 2**20:.1f} MB")
    written = "prefill.onnx + decode.onnx + weights.data" if report.static is not None else "model.onnx"
    if "vlm" in (report.static or {}):
        written = "vision.onnx + " + written
    parts = (report.static or {}).get("parts")
    if parts:
        written += f" + {len(parts['prefill'])} parts of each graph"
    out = report.output
    assert out is not None  # (a compile's report always carries its output record)
    print(f"wrote {args.out}/{written} in {out.seconds_total:.1f} s (peak RSS {out.peak_rss_mb:.0f} MB, "
          f"model {out.input_size_mb:.0f} MB -> {out.output_size_mb:.0f} MB)")
    return 0


def _add_recipes(sub) -> None:
    p = sub.add_parser("recipes", help="list built-in recipes", description="List built-in recipes, one line each.")
    p.set_defaults(func=_run_recipes)
    p = sub.add_parser("passes", help="list registered passes", description="List registered passes with their exactness class.")
    p.set_defaults(func=_run_passes)


def _run_recipes(args) -> int:
    from edgeq.recipes import DEFAULT_RECIPE, builtin_recipe_names, load_recipe

    names = builtin_recipe_names()
    width = max(len(n) for n in names) + 1
    for name in names:
        recipe = load_recipe(name)
        flag = " (default)" if name == DEFAULT_RECIPE else ""
        passes = ",".join(s.name for s in recipe.passes)
        print(f"{name:<{width}} {recipe.description}{flag}  [passes: {passes}]")
    return 0


def _run_passes(args) -> int:
    from edgeq.passmanager.registry import all_passes

    passes = all_passes()
    width = max(len(n) for n in passes) + 1
    for name, cls in passes.items():
        default = cls().output_exactness  # e.g. a float-equivalent split whose default branch is quantized
        klass = cls.exactness.value if default is cls.exactness else f"{cls.exactness.value}/{default.value}"
        print(f"{name:<{width}} {klass:<20} {cls.summary_line}")
    return 0


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="print a model's structure (and activation ranges with --calib)",
                       description="Print the recognised structure (linears, norms, blocks); with --calib, per-linear "
                                   "input activation ranges and outlier channels.")
    p.add_argument("model", type=Path)
    p.add_argument("--calib", type=Path, help="calibration text or .npz: adds per-linear activation ranges")
    p.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json (default: the model's folder)")
    p.add_argument("--calib-windows", type=positive_int, default=4, metavar="N", help="windows to observe (default 4)")
    p.add_argument("--seq-len", type=seq_len_int, default=512, metavar="L", help="tokens per window (default 512)")
    p.add_argument("--outlier-threshold", type=positive_float, default=6.0, help="|x| above this marks an outlier channel (default 6)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run_inspect)


def _run_inspect(args) -> int:
    from edgeq.inspect import inspect_model

    print(inspect_model(args.model, args.calib, args.tokenizer, args.calib_windows, args.seq_len,
                        args.outlier_threshold, as_json=args.json))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="edgeq", description="edgeq: graph-level ONNX compiler for static quantization on NPUs "
                     "and edge runtimes.", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from edgeq import __version__

    parser.add_argument("--version", action="version", version=f"edgeq {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_compile(sub)
    _add_inspect(sub)
    from edgeq.evaluate.cli import register as register_eval
    from edgeq.generation.cli import register as register_generate
    from edgeq.models.cli import register as register_export
    from edgeq.targets.cli import register as register_targets

    register_eval(sub)
    register_generate(sub)
    register_export(sub)
    _add_recipes(sub)
    register_targets(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is, like Ctrl-C's KeyboardInterrupt: every
    ``finally`` and context manager on the way up removes what it was writing (temporary folders)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
# _RECEIVED (edgeq._signals, shared with the program's entry, edgeq.__main__, which notes signals
# before this module is loaded): the signals received while the current command runs. An exception raised by a signal
# handler can come out changed (an import in C code, numpy's among them, turns it into an
# ImportError) or be swallowed (raised inside a weakref callback or a __del__: importlib has such
# callbacks), so what ends the run is told by this, not by the exception's type.


def _terminate(signum, frame):
    _RECEIVED.append(signum)
    if _held(signum, frame):
        return
    for sig in _TERMINATING:  # a second signal must not interrupt the cleanup the first one starts
        signal.signal(sig, signal.SIG_IGN)
    raise Terminated(signum)


def _interrupt(signum, frame):
    _RECEIVED.append(signum)
    if _held(signum, frame):
        return
    raise KeyboardInterrupt


# where a signal's exception is not raised: in an import (C code turns it into another exception,
# importlib's weakref callbacks drop it), in tempfile (a temporary folder made but not yet anyone's,
# or half removed: left behind), in a folder's removal (half removed), in a ``__del__`` (dropped)
_HOLD_MODULES = frozenset({"importlib._bootstrap", "importlib._bootstrap_external", "tempfile"})
_HOLD_CODE = frozenset({"__del__", "rmtree", "_rmtree_safe_fd", "_rmtree_unsafe", "_rmtree_safe_fd_step"})


def _held(signum: int, frame) -> bool:
    """Whether the program is where a signal's exception must not be raised (any frame up, see
    above); if so the signal is delivered again a moment later, until it is out of there."""
    while frame is not None:
        if frame.f_code.co_name in _HOLD_CODE or frame.f_globals.get("__name__") in _HOLD_MODULES:
            _deliver_again(signum)
            return True
        frame = frame.f_back
    return False


def _unraisable(hook):
    """``sys.unraisablehook`` while a command runs: the exception of a signal raised where Python
    cannot pass it on (a weakref callback; importlib's and ``__del__`` are held already) is not
    printed ("Exception ignored in ...", a traceback) and not lost: the signal is delivered again a
    moment later, once Python is back in the program's own flow."""

    def unraisable(unraisable):
        try:
            if not (_RECEIVED and isinstance(unraisable.exc_value, KeyboardInterrupt)):
                return hook(unraisable)
            _deliver_again(_RECEIVED[0])
        except KeyboardInterrupt:  # delivered again while still in here: once more
            if _RECEIVED:
                _deliver_again(_RECEIVED[0])

    return unraisable


def _deliver_again(signum: int) -> None:
    if signum in _TERMINATING and signal.getsignal(signum) is signal.SIG_IGN:  # (_terminate ignores
        signal.signal(signum, _terminate)  # the signals after the first: this one is the first)
    # a bare thread (no lock of threading's: the callback may have run while one was held), and a
    # delay: interrupt_main now would raise right here, in the hook, where it is dropped again
    _thread.start_new_thread(_interrupt_main_later, (signum, _RUN[0]))


def _interrupt_main_later(signum: int, run: int) -> None:
    time.sleep(0.01)
    if _RUN == [run, True]:  # (not once the run is over: the host's handlers are back)
        _thread.interrupt_main(signal.Signals(signum))


_RUN = [0, False]  # the current run's number, whether it is still on (_signals_unwind)


@contextlib.contextmanager
def _signals_unwind(fresh: bool = True):
    """While a command runs: SIGTERM and SIGHUP raise ``Terminated``, SIGINT ``KeyboardInterrupt``,
    each noted in ``_RECEIVED`` (installed here, not at import, and put back after, so that importing
    edgeq changes nothing for its host; a signal the host ignores or handles itself is left alone,
    the program entry's ``_note_signal`` is taken over). ``fresh``: forget the signals noted before
    (the program keeps those its entry noted while this module was imported)."""
    if fresh:
        _RECEIVED.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    hook = sys.unraisablehook
    try:
        for sig in _TERMINATING:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # (nohup: a hangup stays ignored)
                previous[sig] = signal.signal(sig, _terminate)
        if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _note):
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, _interrupt)
        sys.unraisablehook = _unraisable(hook)
        _RUN[:] = [_RUN[0] + 1, True]
        yield
    finally:
        _RUN[1] = False
        sys.unraisablehook = hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_deferred():
    """While the command line's modules are imported (numpy, onnx: C extensions whose import an
    exception raised in the middle of can turn into an ImportError, or crash), a signal is only
    noted; it ends the run once they are loaded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    active = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *_TERMINATING)}
    mine = {sig: handler for sig, handler in active.items() if handler in (_terminate, _interrupt)}
    try:
        for sig in mine:
            signal.signal(sig, _note)
        if not _RECEIVED:  # (one the program's entry noted: the modules are not needed)
            yield
    finally:
        for sig, handler in mine.items():
            signal.signal(sig, handler)
    if _RECEIVED:
        signum = _RECEIVED[0]
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        for sig in _TERMINATING:  # as _terminate: nothing interrupts the cleanup this starts
            if sig in mine:
                signal.signal(sig, signal.SIG_IGN)
        raise Terminated(signum)


def _stopped(signum: int) -> int:
    """The one line and the exit code of a run a signal ended."""
    print("edgeq: interrupted" if signum == signal.SIGINT else f"edgeq: terminated by {signal.Signals(signum).name}",
          file=sys.stderr)
    return 128 + signum


def one_line(exc: BaseException | str) -> str:
    """``exc``'s message on one line: its lines (a library's message can have several) joined by "; "."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


# an OSError on a path the user typed (or a file inside it) is bad input, not an internal error
_USER_PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ENOENT, errno.EACCES, errno.EISDIR, errno.ENOTDIR,
                               errno.ELOOP})


def _user_path_error(exc: OSError, argv: list[str]) -> str | None:
    """The one line for ``exc`` when it is about a path given on the command line (an option's value
    or a positional, or something inside that folder) or as ``$EDGEQ_CACHE_DIR``; else None."""
    if exc.errno not in _USER_PATH_ERRNOS or not isinstance(exc.filename, (str, bytes, os.PathLike)):
        return None
    name = os.fsdecode(exc.filename)
    given = [a.partition("=")[2] if a.startswith("--") else a for a in argv]
    given.append(os.environ.get("EDGEQ_CACHE_DIR", ""))
    targets = {os.path.abspath(name), os.path.realpath(name)}
    for value in filter(None, given):
        for root in {os.path.abspath(value), os.path.realpath(value)}:
            if any(t == root or t.startswith(root.rstrip(os.sep) + os.sep) for t in targets):
                return f"{exc.strerror or 'cannot use'}: {name}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (see the module docstring). SIGINT, SIGTERM and
    SIGHUP are handled from the first line on (``_signals_unwind``), so a signal while the command's
    modules are still being imported ends the run like one later: one line, 128 + the signal's
    number. ``argv`` None: ``sys.argv``. The program itself is ``edgeq.__main__.main`` (the console
    script and ``python -m edgeq``), which takes the signals over before importing this module and
    ignores them once the command has ended; it calls ``_main`` (importing it from here would make
    the two modules import each other)."""
    return _main(sys.argv[1:] if argv is None else list(argv))


def _main(argv: list[str], program: bool = False) -> int:
    try:
        with _signals_unwind(fresh=not program):
            with _signals_deferred():
                parser = build_parser()
            args = parser.parse_args(argv)
            if not getattr(args, "func", None):
                parser.print_help()
                raise UserInputError("a command is required (the commands are listed above; edgeq COMMAND --help)")
            return int(args.func(args) or 0)
    except SystemExit:  # argparse: usage errors (2), --help and --version (0)
        raise
    except BaseException as exc:
        if _RECEIVED:  # whatever the signal's exception became on its way up
            return _stopped(_RECEIVED[0])
        if isinstance(exc, Terminated):
            return _stopped(exc.signum)
        if isinstance(exc, KeyboardInterrupt):
            return _stopped(signal.SIGINT)
        if isinstance(exc, EdgeqError):  # UserInputError (2) and the others
            print(f"edgeq: error: {one_line(exc)}", file=sys.stderr)
            return exc.exit_code
        if not isinstance(exc, Exception):
            raise
        message = _user_path_error(exc, argv) if isinstance(exc, OSError) else None
        if message is not None:
            print(f"edgeq: error: {one_line(message)}", file=sys.stderr)
            return 2
        # last resort: one line, exit 1
        print(f"edgeq: internal error: {type(exc).__name__}: {one_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
