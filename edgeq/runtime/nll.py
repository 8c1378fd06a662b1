"""The negative log-likelihood of one token window, the reduction behind every perplexity edgeq
reports: ``edgeq eval ppl``'s full-window runs (``edgeq.evaluate.ppl``) and its runs through a
decoder (``edgeq.generation.teacher_forced``) score their windows (``edgeq.textdata.token_windows``)
with it."""

from __future__ import annotations

import numpy as np

from edgeq.errors import UserInputError


def window_nll(logits: np.ndarray, ids: np.ndarray) -> float:
    """Total NLL (float64) of ``ids[1:]`` under ``logits[:-1]`` for one window.

    ``logits`` is [seq_len, vocab] float and is OVERWRITTEN (used as scratch: shifted by the row
    max and exponentiated in place), so the reduction makes no [seq_len, vocab] copy. The row max
    shift keeps exp from overflowing; sums and logs are float64.
    """
    rows = logits[:-1]
    targets = ids[1:]
    n = rows.shape[0]
    target_logit = rows[np.arange(n), targets].astype(np.float64)
    row_max = rows.max(axis=-1)
    if not np.all(np.isfinite(row_max)):
        raise UserInputError("model produced non-finite logits")
    np.subtract(rows, row_max[:, None], out=rows)
    np.exp(rows, out=rows)
    sum_exp = rows.sum(axis=-1, dtype=np.float64)
    lse = row_max.astype(np.float64) + np.log(sum_exp)
    return float(np.sum(lse - target_logit))
