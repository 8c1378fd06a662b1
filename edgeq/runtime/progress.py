"""A dependency-free progress bar on stderr for calibration and evaluation loops.

Silent when stderr is not a terminal unless ``EDGEQ_PROGRESS=1``; ``EDGEQ_PROGRESS=0`` silences it
everywhere. Kept tiny so the core does not need tqdm.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TypeVar
from collections.abc import Callable, Iterable, Iterator

T = TypeVar("T")


def _enabled() -> bool:
    flag = os.environ.get("EDGEQ_PROGRESS")
    if flag is not None:
        return flag not in ("0", "", "false")
    return sys.stderr.isatty()


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"


def progress(items: Iterable[T], total: int | None = None, desc: str = "", start_at: int = 0,
             status: Callable[[], str] | None = None) -> Iterator[T]:
    """Yield from ``items`` while drawing ``desc [####....] i/total elapsed ETA status()``.

    ``start_at``: items already done before this call (a resumed loop); the ETA is estimated from
    the items done in this call only. ``status``: called at each redraw for a short trailing text
    (a running loss, say)."""
    if not _enabled():
        yield from items
        return
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    start = time.perf_counter()

    def draw(i: int) -> None:
        elapsed = time.perf_counter() - start
        tail = f" {status()}" if status is not None and i > start_at else ""
        if total:
            filled = int(30 * i / total)
            bar = "#" * filled + "." * (30 - filled)
            done = i - start_at
            eta = f" ETA {_clock(elapsed / done * (total - i))}" if done > 0 and i < total else ""
            sys.stderr.write(f"\r{desc} [{bar}] {i}/{total} {elapsed:5.1f}s{eta}{tail}\x1b[K")
        else:
            sys.stderr.write(f"\r{desc} {i} {elapsed:5.1f}s{tail}")
        sys.stderr.flush()

    draw(start_at)
    i = start_at
    for i, item in enumerate(items, start_at + 1):
        yield item
        draw(i)
    sys.stderr.write("\n")
    sys.stderr.flush()
