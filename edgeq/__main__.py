"""Allow ``python -m edgeq``.

``edgeq.cli.main`` handles SIGINT, SIGTERM and SIGHUP from its first line on; before it runs,
while ``edgeq.cli`` itself is imported, a signal ends the run the same way: one line, exit 128 +
the signal's number (nothing is written yet). Nothing here runs on ``import edgeq``.
"""

import signal
import sys


def _stop(signum, frame):
    print(f"edgeq: terminated by {signal.Signals(signum).name}", file=sys.stderr)
    raise SystemExit(128 + signum)


def _run() -> int:
    for name in ("SIGTERM", "SIGHUP"):  # (SIGINT: Python's KeyboardInterrupt, caught below)
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _stop)
    try:
        from edgeq.cli import main

        return main()
    except KeyboardInterrupt:
        print("edgeq: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(_run())
