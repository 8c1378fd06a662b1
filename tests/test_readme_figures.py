"""Every figure in the README comes from a committed results file that names its command, machine and date.

The README's figures sit in markdown tables; each table is followed (before the next table or
heading) by a line naming its results file(s) under ``benchmarks/results/``. Every number in a
table must be in one of those files, as written there or as the ratio of two of its numbers
(``x fp32`` columns), at the precision the README prints; each file must name the command that
made it, the machine (``machine``: CPU and ISA flags) and the date (a ``date`` key or the date in
its name). A figure typed by hand, or a file that is not committed, fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RESULTS = re.compile(r"benchmarks/results/[\w.\-]+\.json")
NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d+(?![\w.])")


def _tables(text: str) -> list[tuple[list[str], list[str]]]:
    """(table lines, results files named after it) for each markdown table."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            table = lines[start:i]
            files = []
            j = i
            while j < len(lines) and not lines[j].startswith(("|", "#")):
                files += RESULTS.findall(lines[j])
                j += 1
            out.append((table, files))
        else:
            i += 1
    return out


def _numbers(obj) -> list[float]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in _numbers(v)]
    return []


def _found(cell: str, numbers: set[float], ratios: set[float]) -> bool:
    decimals = len(cell.split(".")[1])
    value = float(cell)
    tol = 0.5 * 10 ** -decimals + 1e-12
    return any(abs(n - value) <= tol for n in numbers) or any(abs(r - value) <= tol for r in ratios)


def test_readme_tables_name_their_results_files():
    tables = _tables(README.read_text(encoding="utf-8"))
    assert tables, "the README has no table of figures"
    for table, files in tables:
        assert files, f"no benchmarks/results/*.json named after the table starting {table[0]!r}"


@pytest.mark.parametrize("index", range(len(_tables(README.read_text(encoding="utf-8")))))
def test_every_readme_figure_is_in_its_results_file(index):
    table, files = _tables(README.read_text(encoding="utf-8"))[index]
    data = []
    for name in files:
        path = REPO / name
        assert path.is_file(), f"{name} is named in the README but not committed"
        record = json.loads(path.read_text())
        text = json.dumps(record)
        assert '"machine"' in text and ("avx" in text or "isa" in text), f"{name}: no machine (CPU, ISA flags)"
        assert re.search(r'"commands?"', text), f"{name}: no command"
        assert '"date"' in text or re.search(r"\d{4}-\d\d-\d\d", name), f"{name}: no date"
        data.append(record)
    numbers = {round(n, 6) for n in _numbers(data)}
    big = sorted(n for n in numbers if abs(n) > 1e-9)
    ratios = {a / b for a in big for b in big if 0.2 <= a / b <= 5}
    missing = [cell for line in table[2:] for cell in NUMBER.findall(line) if not _found(cell, numbers, ratios)]
    assert not missing, f"figures not in {files}: {missing} (table {table[0]!r})"
