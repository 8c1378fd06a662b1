"""argparse value types shared by the command-line modules (one definition, one error wording)."""

from __future__ import annotations

import argparse
import math


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1, or argparse's usage error naming what was given."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0, or argparse's usage error naming what was given."""
    return _int_at_least(text, 0)


def seq_len_int(text: str) -> int:
    """A sequence length: an integer >= 2 (a window must predict at least one token)."""
    return _int_at_least(text, 2)


def positive_float(text: str) -> float:
    """A finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value
