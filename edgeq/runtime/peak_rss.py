"""This process's peak resident memory, as edgeq reports it: after every pass (``edgeq.passmanager.pipeline``),
every block of a block-wise compile (``edgeq.blockwise``) and in ``report.json``
(``edgeq.artifacts.writer``). Beside ``edgeq.runtime.progress``, below all of them."""

from __future__ import annotations


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports KB, macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)
