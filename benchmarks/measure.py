"""Run one benchmark step in its own process; wall time and peak RSS read from outside it.

Peak RSS comes from GNU time (``/usr/bin/time -f %M``), a small process that starts the step.
``os.wait4`` on a child of the benchmark process overstates it: a forked child's high-water mark
starts from the image of the (by then large) parent it was forked from, so an 80 MB builder run
from a benchmark holding 1.7 GB of sessions reads as 1.7 GB.

Used by ``benchmarks/peers.py`` (every quantize/compile step), ``benchmarks/peers/build_ortgenai.py``
(onnxruntime-genai's model builder) and ``benchmarks/generate.py``.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

GNU_TIME = "/usr/bin/time"


def run_measured(cmd: list[str], *, log: Path | None = None, cwd: Path | None = None, env: dict | None = None,
                 timeout_s: float | None = None) -> dict:
    """Run ``cmd`` to completion (its process group killed after ``timeout_s``); stderr into ``log``
    (or returned). Returns ``code``, ``seconds``, ``peak_rss_mb`` (GNU time; NaN if the step was
    killed before it could write it), ``stdout``, ``stderr`` (empty when ``log`` is given) and
    ``timed_out``."""
    if not Path(GNU_TIME).is_file():
        raise RuntimeError(f"{GNU_TIME} not found: install GNU time (Debian package 'time') to measure peak RSS")
    start = time.perf_counter()
    timed_out = False
    fd, rss_name = tempfile.mkstemp(prefix="edgeq-rss-")
    os.close(fd)
    rss_file = Path(rss_name)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err_tmp:
        err = open(log, "w") if log else err_tmp
        try:
            proc = subprocess.Popen([GNU_TIME, "-f", "%M", "-o", str(rss_file), *cmd], stdout=out, stderr=err,
                                    cwd=cwd, env=env, start_new_session=True)
            while True:
                pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if timeout_s is not None and not timed_out and time.perf_counter() - start > timeout_s:
                    timed_out = True
                    os.killpg(proc.pid, 9)
                time.sleep(0.2)
        finally:
            if log:
                err.close()
        out.seek(0)
        err_tmp.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err_tmp.read().decode(errors="replace")
    try:
        peak_kb = float(rss_file.read_text().split()[-1])
    except (OSError, ValueError, IndexError):  # killed before GNU time wrote it
        peak_kb = float("nan")
    rss_file.unlink(missing_ok=True)
    return {"code": os.waitstatus_to_exitcode(status), "seconds": round(time.perf_counter() - start, 2),
            "peak_rss_mb": round(peak_kb / 1024, 1), "stdout": stdout, "stderr": stderr, "timed_out": timed_out}

