"""The tree passes its linters: ruff over everything, mypy over the product packages (the settings
are pyproject.toml's; pre-commit runs the same two). Both are in the dev extra, so a machine that
runs the suite has them: a missing one fails here rather than passing unchecked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_is_clean():
    done = _run("ruff", "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_is_clean():
    """mypy on edgeq/, passes/, runtime_ops/ and models/, as the installed package (tests/typecheck.py)."""
    done = subprocess.run([sys.executable, str(REPO / "tests" / "typecheck.py")], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
