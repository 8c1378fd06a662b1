"""The layering, checked on the source (AST imports, lazy imports inside functions included):

- pass modules (``edgeq.passes.<pass>``) import the engine and method code (``edgeq.passes.methods``),
  never another pass module, the CLI or the compiler;
- method code never imports a pass module, the CLI or the compiler;
- ``edgeq.runtime_ops``, ``edgeq.kernels`` and ``edgeq.models`` never import ``edgeq.passes``;
- the engine (every other ``edgeq`` module) never imports a pass module (passes are found by the
  registry at run time, not imported by name); it may use method code (``edgeq inspect`` reports
  Eq. 9 layers);
- there is no import cycle anywhere (importing a module imports its parent packages too).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# source folder -> package it installs as (pyproject's package-dir)
ROOTS = {"edgeq": "edgeq", "passes": "edgeq.passes", "runtime_ops": "edgeq.runtime_ops", "kernels": "edgeq.kernels",
         "models": "edgeq.models"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node) for n in ast.walk(node)}
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        deps = set()
        for dep in _imports(path, name, known):
            parts = dep.split(".")
            deps.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))  # parent packages run first
        graph[name] = {d for d in deps if d in known and d != name and not name.startswith(d + ".")}
    return graph


def _kind(module: str) -> str:
    if module.startswith("edgeq.passes.methods"):
        return "method"
    if module == "edgeq.passes":
        return "passes-package"
    if module.startswith("edgeq.passes."):
        return "pass"
    for sub in ("runtime_ops", "kernels", "models"):
        if module.startswith(f"edgeq.{sub}"):
            return sub
    return "engine"


def test_layering_rules():
    graph = _graph()
    bad = []
    for module, deps in sorted(graph.items()):
        kind = _kind(module)
        for dep in sorted(deps):
            dkind = _kind(dep)
            if kind in ("pass", "method") and (dkind == "pass" or dep in ("edgeq.cli", "edgeq.compiler")):
                bad.append(f"{module} ({kind}) imports {dep}")
            elif kind in ("runtime_ops", "kernels", "models") and dkind in ("pass", "method", "passes-package"):
                bad.append(f"{module} ({kind}) imports {dep}")
            elif kind == "engine" and dkind == "pass":
                bad.append(f"{module} (engine) imports {dep}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    counter = [0]

    def strongconnect(v):  # Tarjan, iterative enough for this tree's depth
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    assert not cycles, "import cycles:\n" + "\n".join(", ".join(c) for c in cycles)


def test_passes_are_discovered_not_listed():
    """``passes/__init__.py`` names no pass: the registry finds every module in the folder."""
    from edgeq.registry import all_passes

    init = (REPO / "passes" / "__init__.py").read_text()
    assert "import" not in init.split('"""')[-1]
    files = {p.stem for p in (REPO / "passes").glob("*.py") if not p.name.startswith("_")}
    modules = {cls.__module__.rsplit(".", 1)[-1] for cls in all_passes().values()}
    assert modules == files
