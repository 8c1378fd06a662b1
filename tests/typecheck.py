"""mypy over the installed package's layout: ``edgeq`` with ``edgeq.passes``, ``edgeq.runtime_ops``
and ``edgeq.models`` where pyproject's ``package-dir`` puts them, so that imports between them
resolve as they do at run time (mypy reads folders, not setuptools' mapping). The layout is built
from links in a temporary folder; the settings are pyproject.toml's ``[tool.mypy]``.

Usage: python tests/typecheck.py   (exit status: mypy's; tests/test_lint.py and pre-commit run it)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAPPED = ("passes", "runtime_ops", "models")  # edgeq.<name> -> <name>/ (kernels: Triton, not checked)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="edgeq-typecheck-") as tmp:
        package = Path(tmp) / "edgeq"
        package.mkdir()
        for entry in (REPO / "edgeq").iterdir():
            if entry.name != "__pycache__":
                os.symlink(entry, package / entry.name)
        for name in MAPPED:
            os.symlink(REPO / name, package / name)
        cache = REPO / ".cache" / "mypy"
        done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                               "--cache-dir", str(cache), "-p", "edgeq"], cwd=tmp, text=True, capture_output=True)
        sys.stdout.write(done.stdout.replace(tmp + os.sep, ""))
        sys.stderr.write(done.stderr)
        return done.returncode


if __name__ == "__main__":
    sys.exit(main())
