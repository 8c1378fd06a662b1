"""A dependency-free progress bar on stderr for calibration and evaluation loops.

Silent when stderr is not a terminal unless ``EDGEQ_PROGRESS=1``; ``EDGEQ_PROGRESS=0`` silences it
everywhere. Kept tiny so the core does not need tqdm.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def _enabled() -> bool:
    flag = os.environ.get("EDGEQ_PROGRESS")
    if flag is not None:
        return flag not in ("0", "", "false")
    return sys.stderr.isatty()


def progress(items: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
    """Yield from ``items`` while drawing ``desc [####....] i/total elapsed``."""
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
        if total:
            filled = int(30 * i / total)
            bar = "#" * filled + "." * (30 - filled)
            sys.stderr.write(f"\r{desc} [{bar}] {i}/{total} {elapsed:5.1f}s")
        else:
            sys.stderr.write(f"\r{desc} {i} {elapsed:5.1f}s")
        sys.stderr.flush()

    draw(0)
    i = 0
    for i, item in enumerate(items, 1):
        yield item
        draw(i)
    sys.stderr.write("\n")
    sys.stderr.flush()
