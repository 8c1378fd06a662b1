"""Every figure in the README comes from a committed results file that names its command, machine and date.

The README's figures sit in markdown tables; each table is followed (before the next table or
heading) by a line naming its results file(s) under ``benchmarks/results/``. Each file must name the
command that made it, the machine (``machine``: CPU and ISA flags) and the date (a ``date`` key or
the date in its name).

Two kinds of cell:

- a ratio column (its header starts with ``x ``, e.g. ``x fp32``) must be declared in the lines
  after its table, as ``"x fp32" is "perplexity" divided by that of row "fp32"``: a column of the
  same table and a row of it (the row's first cell, ``**`` and backticks dropped). Each ratio cell
  is checked against exactly two numbers: its own row's cell in that column and the named row's.
  A cell holding several numbers (``137.5 / 95.2``) is a ratio number for number. The ratio passes
  when it is the quotient of any two values that round to the printed numerator and denominator,
  rounded to the printed precision (nothing wider);
- every other number with a decimal point (perplexities, times, memory) must be in one of the
  table's results files, at the precision the README prints.

A figure typed by hand, a ratio not of its own row's figures, or a file that is not committed fails
here; ``readme_problems`` takes the README's text so that the tests below can check altered copies.
"""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RESULTS = re.compile(r"benchmarks/results/[\w.\-]+\.json")
NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d+(?![\w.])")  # what must be in a results file
VALUE = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")  # the numbers of a ratio and of its operands
RATIO = re.compile(r'"([^"]+)" is "([^"]+)" divided by that of row "([^"]+)"')


def _tables(text: str) -> list[tuple[list[str], list[str], str]]:
    """(table lines, results files named after it, the text after it) for each markdown table."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            j = i
            while j < len(lines) and not lines[j].startswith(("|", "#")):
                j += 1
            after = " ".join(lines[i:j])
            out.append((lines[start:i], RESULTS.findall(after), re.sub(r"\s+", " ", after)))
        else:
            i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _label(cell: str) -> str:
    return re.sub(r"\s+", " ", cell.replace("**", "").replace("`", "")).strip()


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


def _half_ulp(cell: str) -> float:
    return 0.5 * 10 ** -(len(cell.split(".")[1]) if "." in cell else 0)


def _found(cell: str, numbers: set[float]) -> bool:
    value, tol = float(cell), _half_ulp(cell) + 1e-12
    return any(abs(n - value) <= tol for n in numbers)


def _ratio_ok(ratio: str, top: str, bottom: str) -> bool:
    """``ratio`` is top / bottom: the quotient of some values that print as ``top`` and ``bottom``,
    printed at ``ratio``'s precision."""
    a, ea, b, eb = float(top), _half_ulp(top), float(bottom), _half_ulp(bottom)
    if b - eb <= 0:
        return False
    lo, hi = (a - ea) / (b + eb), (a + ea) / (b - eb)
    r, er = float(ratio), _half_ulp(ratio) + 1e-12
    return lo - er <= r <= hi + er


@functools.cache
def _load(path: Path) -> tuple[dict | None, str | None]:
    """(record, problem) of one results file."""
    if not path.is_file():
        return None, "is named in the README but not committed"
    record = json.loads(path.read_text())
    text = json.dumps(record)
    if not ('"machine"' in text and ("avx" in text or "isa" in text)):
        return None, "no machine (CPU, ISA flags)"
    if not re.search(r'"commands?"', text):
        return None, "no command"
    if not ('"date"' in text or re.search(r"\d{4}-\d\d-\d\d", path.name)):
        return None, "no date"
    return record, None


@functools.cache
def _file_numbers(paths: tuple[Path, ...]) -> frozenset[float]:
    return frozenset(round(n, 6) for path in paths for n in _numbers(_load(path)[0]))


def table_problems(table: list[str], files: list[str], after: str, root: Path) -> list[str]:
    """What is wrong with one table's figures (nothing: an empty list)."""
    where = f"table {table[0]!r}"
    if not files:
        return [f"{where}: no benchmarks/results/*.json named after it"]
    loaded = [(name, *_load((root / name).resolve())) for name in files]
    problems = [f"{name}: {problem}" for name, _, problem in loaded if problem]
    numbers = _file_numbers(tuple((root / name).resolve() for name, _, problem in loaded if not problem))
    header, rows = _cells(table[0]), [_cells(line) for line in table[2:]]
    labels = [_label(row[0]) for row in rows]
    problems += [f"{where}: row {row[0]!r} has {len(row)} cells, the header {len(header)}"
                 for row in rows if len(row) != len(header)]
    if len(problems) > 0:
        return problems

    ratios = {}  # ratio column -> (numerator column, reference row)
    for column, top, ref in RATIO.findall(after):
        if column not in header or top not in header:
            problems.append(f"{where}: ratio {column!r} of {top!r}: no such column")
        elif labels.count(ref) != 1:
            problems.append(f"{where}: ratio {column!r}: {labels.count(ref)} rows named {ref!r}")
        else:
            ratios[header.index(column)] = (header.index(top), labels.index(ref))
    problems += [f"{where}: ratio column {h!r} says nowhere what it divides ('\"{h}\" is \"COLUMN\" divided by "
                 f"that of row \"ROW\"' after the table)" for i, h in enumerate(header)
                 if h.startswith("x ") and i not in ratios]

    for row in rows:
        for i, cell in enumerate(row):
            if i not in ratios:
                problems += [f"{where}: {n} (row {row[0]!r}) is not in {files}"
                             for n in NUMBER.findall(cell) if not _found(n, numbers)]
        for i, (top, ref) in ratios.items():
            r, a, b = (VALUE.findall(c) for c in (row[i], row[top], rows[ref][top]))
            if not r:
                continue
            if not (len(r) == len(a) == len(b)):
                problems.append(f"{where}: {row[i]!r} (row {row[0]!r}) is not {row[top]!r} / {rows[ref][top]!r}")
                continue
            problems += [f"{where}: {x} (row {row[0]!r}, {header[i]!r}) is not {y} / {z} (= {float(y) / float(z):.4f})"
                         for x, y, z in zip(r, a, b) if not _ratio_ok(x, y, z)]
    return problems


def readme_problems(text: str, root: Path) -> list[str]:
    """Everything wrong with the figures of a README's text, its results files under ``root``."""
    tables = _tables(text)
    if not tables:
        return ["the README has no table of figures"]
    return [p for table in tables for p in table_problems(*table, root)]


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_tables_name_their_results_files():
    tables = _tables(_readme())
    assert tables, "the README has no table of figures"
    for table, files, _ in tables:
        assert files, f"no benchmarks/results/*.json named after the table starting {table[0]!r}"


@pytest.mark.parametrize("index", range(len(_tables(_readme()))))
def test_every_readme_figure_is_in_its_results_file(index):
    problems = table_problems(*_tables(_readme())[index], REPO)
    assert not problems, "\n".join(problems)


def _replace_in_row(text: str, row_marker: str, old: str, new: str) -> str:
    """``text`` with ``old`` -> ``new`` in the one table row containing ``row_marker``."""
    lines = text.splitlines()
    [i] = [k for k, line in enumerate(lines) if line.startswith("|") and row_marker in line]
    assert old in lines[i], (old, lines[i])
    lines[i] = lines[i].replace(old, new, 1)
    return "\n".join(lines) + "\n"


ALTERED = {
    "headline ratio": ("(default recipe)", "1.017", "1.067"),
    "perplexity": ("NNCF PTQ + SmoothQuant, in OpenVINO", "28.228", "28.229"),  # its x fp32 still rounds to 1.104
    "headline perplexity": ("(default recipe)", "25.994", "26.994"),
    "decode ratio": ("edgeq gptq-w4a16 L4", "1.241", "1.291"),
}


@pytest.mark.parametrize("what", list(ALTERED))
def test_an_altered_readme_figure_fails(what):
    marker, old, new = ALTERED[what]
    assert not readme_problems(_readme(), REPO)
    problems = readme_problems(_replace_in_row(_readme(), marker, old, new), REPO)
    assert any(new in p for p in problems), problems


def test_a_ratio_column_must_say_what_it_divides():
    text = _readme()
    declaration = next(m.group(0) for m in RATIO.finditer(text) if m.group(1) == "x genai's own")
    problems = readme_problems(text.replace(declaration, "", 1), REPO)
    assert any("x genai's own" in p and "says nowhere" in p for p in problems), problems


@pytest.mark.parametrize("marker, old", [("(default recipe)", "1.017"), ("edgeq gptq-w4a16 L4", "1.241")])
def test_random_ratios_fail(marker, old):
    """Random values in [1, 2] put in a ratio cell pass only within the rounding of its operands."""
    assert not readme_problems(_readme(), REPO)
    rng = random.Random(0)
    values = [f"{rng.uniform(1, 2):.3f}" for _ in range(200)]
    passed = [v for v in values if not readme_problems(_replace_in_row(_readme(), marker, old, v), REPO)]
    assert len(passed) <= 0.01 * len(values), passed
