"""argparse value types shared by the command-line modules (one definition, one error wording)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1, or argparse's usage error naming what was given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value
