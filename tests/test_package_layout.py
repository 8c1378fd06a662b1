"""The installed package's layout, checked against pyproject.toml.

The package ``edgeq`` is assembled from five folders at the repository root (pyproject's
``[tool.setuptools] package-dir``)::

    edgeq              -> edgeq/
    edgeq.passes       -> passes/
    edgeq.runtime_ops  -> runtime_ops/
    edgeq.kernels      -> kernels/
    edgeq.models       -> models/

and ``packages`` lists every package explicitly (no discovery), so a new subfolder that is not
listed would be silently left out of the wheel, and a listed one that was removed would break the
build. These tests keep the list equal to the folders: a folder under a root that holds an
``__init__.py``, other ``.py`` files or ``.toml`` data is a package and must be listed. Benchmarks
(``bench_*``) live in ``benchmarks/`` (``benchmarks/kernels/`` for the GPU kernels), never in the
installed package.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]
PACKAGES: list[str] = SETUPTOOLS["packages"]


def _is_package_folder(folder: Path) -> bool:
    return any(folder.glob("*.py")) or any(folder.glob("*.toml"))


def _folders_as_packages() -> dict[str, Path]:
    """package name -> folder, for every package folder under the package-dir roots."""
    out = {}
    for root_pkg, root in PACKAGE_DIR.items():
        base = REPO / root
        for folder in [base, *sorted(p for p in base.rglob("*") if p.is_dir())]:
            rel = folder.relative_to(base).parts
            if any(part == "__pycache__" or part.startswith(".") for part in rel):
                continue
            name = ".".join([root_pkg, *rel])
            # a subfolder that is another root's package (none today) is walked from that root
            if rel and any(name == other or name.startswith(other + ".") for other in PACKAGE_DIR
                           if len(other) > len(root_pkg) and other.startswith(root_pkg + ".")):
                continue
            if _is_package_folder(folder):
                out[name] = folder
    return out


def _folder_of(package: str) -> Path:
    """The folder setuptools takes ``package`` from: its longest package-dir prefix, then the rest."""
    root = max((p for p in PACKAGE_DIR if package == p or package.startswith(p + ".")), key=len)
    rest = package[len(root) + 1:].split(".") if package != root else []
    return (REPO / PACKAGE_DIR[root]).joinpath(*rest)


def test_package_list_matches_folders():
    found = _folders_as_packages()
    assert len(PACKAGES) == len(set(PACKAGES)), "pyproject's packages lists a package twice"
    missing = sorted(set(found) - set(PACKAGES))
    extra = sorted(set(PACKAGES) - set(found))
    assert not missing, f"folders not in pyproject's [tool.setuptools] packages (not shipped): {missing}"
    assert not extra, f"pyproject lists packages with no folder of code or data: {extra}"
    for package in PACKAGES:
        folder = _folder_of(package)
        assert folder.is_dir(), f"{package}: {folder.relative_to(REPO)} does not exist"
        assert folder == found[package]


def test_code_packages_have_init():
    """A folder of Python code is a regular package (data-only folders need no ``__init__.py``)."""
    for package, folder in _folders_as_packages().items():
        if any(p.name != "__init__.py" for p in folder.glob("*.py")):
            assert (folder / "__init__.py").is_file(), f"{package}: {folder.relative_to(REPO)} has no __init__.py"


def test_no_benchmarks_in_the_installed_package():
    bench = sorted(str(p.relative_to(REPO)) for package, folder in _folders_as_packages().items()
                   for p in folder.glob("*.py") if p.name.startswith("bench_"))
    assert not bench, f"benchmark modules in the installed package (move them to benchmarks/): {bench}"


def test_package_dir_maps_exactly_the_roots():
    """package-dir names each root folder once, each exists, every Python package at the repository
    root (a folder with ``__init__.py``) is one of them, and ARCHITECTURE.md's table states it."""
    table = dict(re.findall(r"^\| `(edgeq[\w.]*)` \| `(\w+)/` \|", (REPO / "ARCHITECTURE.md").read_text(), re.M))
    assert table == PACKAGE_DIR, "ARCHITECTURE.md's import path -> folder table differs from pyproject's package-dir"
    for package, root in PACKAGE_DIR.items():
        assert (REPO / root / "__init__.py").is_file(), f"{package}: {root}/__init__.py does not exist"
        assert package in PACKAGES, f"package-dir maps {package}, which packages does not list"
    assert len(set(PACKAGE_DIR.values())) == len(PACKAGE_DIR), "two packages map to one folder"
    roots = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert roots == set(PACKAGE_DIR.values()), f"root folders with __init__.py vs package-dir: {sorted(roots)}"


# -- edgeq/ grouped by layer (ARCHITECTURE.md) -------------------------------------------------------

MAX_TOP_LEVEL_MODULES = 16


def _engine_subpackages() -> list[str]:
    return sorted(p.parent.name for p in (REPO / "edgeq").glob("*/__init__.py"))


def test_edgeq_top_level_stays_small():
    """At most 16 modules directly in edgeq/ (``__init__`` and ``__main__`` counted): the rest live in
    the subpackages named after the layers ARCHITECTURE.md draws."""
    modules = sorted(p.name for p in (REPO / "edgeq").glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, f"{len(modules)} modules in edgeq/: {modules}"


def test_no_module_re_exports_another_modules_names():
    """No ``# noqa: F401`` re-export in the package: a name is imported from the module that defines it
    (a re-export lets callers keep saying ``ir.`` for what moved out of ``ir``)."""
    found = []
    for root in PACKAGE_DIR.values():
        for path in sorted((REPO / root).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if "noqa: F401" in line and "re-export" in line.lower():
                    found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, "re-exports:\n" + "\n".join(found)


def test_docs_name_every_engine_subpackage():
    """ARCHITECTURE.md's layer table and docs/layout.md's tree name every subpackage of edgeq/."""
    arch = (REPO / "ARCHITECTURE.md").read_text()
    layout = (REPO / "docs" / "layout.md").read_text()
    missing = [f"{doc}: edgeq/{sub}/" for sub in _engine_subpackages()
               for doc, text in (("ARCHITECTURE.md", arch), ("docs/layout.md", layout)) if f"`{sub}`" not in text
               and f"{sub}/" not in text]
    assert not missing, "subpackages the docs do not name:\n" + "\n".join(missing)
