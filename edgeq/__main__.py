"""``python -m edgeq``, and the ``edgeq`` console script (``edgeq.__main__:main``): ``main``.

Signals. SIGINT, SIGTERM and SIGHUP end a run with one line on stderr and exit 128 + N (130, 143,
129); what was being written is removed, nothing is left. ``main`` takes them over in its first
statements, before anything else is imported (through ``_signal``, the C module: ``signal`` itself
runs enum code on import), and from then on only notes them until the command line's modules are
loaded (``edgeq.cli``: ``_signals_deferred``); a signal noted then ends the run as soon as they are.
A signal the host ignores (``nohup``, a background job's SIGINT) stays ignored. Once the command has
returned, the three are ignored: a signal then would turn a finished run into a failed one.

Before ``main`` runs there is no handler of edgeq's (and none can be: that is CPython starting up,
``site`` and the ``.pth`` files of the installation, ``runpy`` or the console script importing this
package). A signal there does what it does to any Python program, and nothing has been written:
SIGTERM and SIGHUP kill the process (exit -15 / -1 to a parent, 143 / 129 in a shell). SIGINT kills
it likewise (-2) until CPython installs its own handler, early in its initialization; from there on
it raises ``KeyboardInterrupt`` where the interpreter is. Inside its initialization (the io
streams, ``site``) that is a fatal error: "Fatal Python error: init_import_site: Failed to import
the site module", the traceback, exit 1 (``-m``: "Could not import runpy module", exit 1, while
runpy loads). After it (``runpy``; the console script's ``from edgeq.__main__ import main``) it is
an uncaught KeyboardInterrupt: the traceback, and CPython ends the process with SIGINT (-2).
Raised in one of importlib's weakref callbacks it is printed ("Exception ignored in ...") and
dropped: the run goes on. Under load that start-up takes a tenth of a second or more; no ``-X`` option or
environment variable turns CPython's SIGINT handler off (``-S``/``-I`` would shorten it, but a
console script cannot pass them and an editable install needs ``site``).

Importing this module changes nothing (the signals noted are kept in ``edgeq._signals``, shared
with ``edgeq.cli``).
"""

import _signal
import sys

from edgeq import _note_signal


def _take_over() -> list[int]:
    """Handle SIGINT (first: its window is the one that prints), SIGTERM and SIGHUP by noting them
    where they are Python's default (KeyboardInterrupt) or the system's (killed): the ones taken."""
    taken = []
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(_signal, name, None)
        if sig is None:
            continue
        try:
            current = _signal.getsignal(sig)
            if current is _signal.default_int_handler or current == _signal.SIG_DFL:
                _signal.signal(sig, _note_signal)
                taken.append(sig)
        except ValueError:  # not the main thread: signals are not ours to handle
            break
    return taken


def _torch_cache_for_export(argv: list[str]) -> None:
    """``edgeq export`` imports torch, which creates its compile-cache folder,
    ``$TMPDIR/torchinductor_<user>``, outside ``-o`` (also after an interrupted run: a torch import
    a signal cut short leaves it to torch's own exit path). So, before anything imports torch,
    ``TORCHINDUCTOR_CACHE_DIR`` names ``$EDGEQ_CACHE_DIR/torchinductor`` (default
    ``~/.cache/edgeq``), the one place outside ``-o`` edgeq writes; with the cache turned off
    (``EDGEQ_CACHE_DIR=""``) a temporary folder removed at exit. A ``TORCHINDUCTOR_CACHE_DIR`` the
    user set is left alone."""
    import os

    if argv[:1] != ["export"] or "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # an export compiles nothing: no workers
    cache = os.environ.get("EDGEQ_CACHE_DIR")
    if cache is None:
        cache = os.path.join(os.path.expanduser("~"), ".cache", "edgeq")
    if cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "torchinductor")
        return
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="edgeq-torch-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    atexit.register(shutil.rmtree, folder, True)


def main() -> int:
    """Run the command line (``sys.argv``) as the program; returns its exit code."""
    taken = _take_over()
    try:
        _torch_cache_for_export(sys.argv[1:])
        from edgeq.cli import _main  # (a signal meanwhile is noted: it ends the run once loaded)

        return _main(sys.argv[1:], program=True)
    finally:  # the command is over (or argparse exits: --help, usage errors)
        for sig in taken:
            _signal.signal(sig, _signal.SIG_IGN)


if __name__ == "__main__":
    raise SystemExit(main())
