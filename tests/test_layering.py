"""The layering, checked on the source (AST imports, lazy imports inside functions included):

- pass modules (``edgeq.passes.<pass>``) import the engine and method code (``edgeq.passes.methods``),
  never another pass module, the CLI or the compiler;
- method code never imports a pass module, the CLI or the compiler;
- ``edgeq.runtime_ops``, ``edgeq.kernels`` and ``edgeq.models`` never import ``edgeq.passes``;
- the engine (every other ``edgeq`` module) never imports a pass module (passes are found by the
  registry at run time, not imported by name); it may use method code (``edgeq inspect`` reports
  Eq. 9 layers);
- there is no import cycle anywhere (importing a module imports its parent packages too), type-only
  imports (``if TYPE_CHECKING:``) included, and ``from <package> import x`` inside that package
  counted as an import of the package (its ``__init__`` may be the one importing this module);
- the engine's subpackages (``edgeq.artifacts``, ``edgeq.targets``, ...: every folder of ``edgeq/``)
  import each other one way only: no two of them import each other, directly or around a longer
  loop (the shared piece moves down into a module below both, as ``edgeq.quantize.qdq_encodings``,
  ``edgeq.quantize.sqnr``, ``edgeq.runtime.peak_rss``, ``edgeq.runtime.ort_session`` and ``edgeq.runtime.nll`` did);
- the pass manager (``edgeq.passmanager.pipeline``, ``edgeq.passmanager.passbase``) does not import the evaluation stack
  (``edgeq.evaluate``), not even through another module.
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


def _imports(path: Path, module: str, known: set[str], type_only: bool = False) -> set[str]:
    """The modules ``module`` imports (lazy imports included; ``type_only``: those under ``if
    TYPE_CHECKING:`` too). ``from P import x`` with ``P`` a package above ``module`` imports ``P``
    itself as well (it reads ``P``'s namespace, which ``P``'s ``__init__`` may still be building)."""
    tree = ast.parse(path.read_text())
    skip = set() if type_only else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node) for n in ast.walk(node)}
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
            if module.startswith(base + "."):
                names.append(base)
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        explicit = _imports(path, name, known, type_only)
        deps = set()
        for dep in explicit:
            parts = dep.split(".")
            deps.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))  # parent packages run first
        # a package above ``name`` runs before it: an edge only where ``name`` imports it explicitly
        graph[name] = {d for d in deps if d in known and d != name and (d in explicit or not name.startswith(d + "."))}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    counter = [0]

    def strongconnect(v):  # recursive: deep enough for this tree
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
    return cycles


# the engine's subpackages: every folder of edgeq/ that is a package (artifacts, targets, static, ...)
SUBPACKAGES = sorted(f"edgeq.{p.parent.name}" for p in (REPO / "edgeq").glob("*/__init__.py"))


def _subpackage(module: str) -> str | None:
    return next((s for s in SUBPACKAGES if module == s or module.startswith(s + ".")), None)


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
            if kind in ("pass", "method") and (dkind == "pass" or dep in ("edgeq.cli", "edgeq.compiler", "edgeq.plan")):
                bad.append(f"{module} ({kind}) imports {dep}")
            elif kind in ("runtime_ops", "kernels", "models") and dkind in ("pass", "method", "passes-package"):
                bad.append(f"{module} ({kind}) imports {dep}")
            elif kind == "engine" and dkind == "pass":
                bad.append(f"{module} (engine) imports {dep}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    """No cycle, lazy and type-only imports included (a type-only circle is still a circle: its
    modules cannot be read, or moved, one without the other)."""
    cycles = _cycles(_graph(type_only=True))
    assert not cycles, "import cycles:\n" + "\n".join(", ".join(c) for c in cycles)


def _subpackage_imports(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(A, B) -> the chains by which a module of subpackage A imports one of subpackage B, directly
    or through modules outside every subpackage (``edgeq.recipes``, ...)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for start in sorted(graph):
        a = _subpackage(start)
        if a is None:
            continue
        via, todo = {start: None}, [start]
        while todo:
            module = todo.pop()
            for dep in sorted(graph[module]):
                if dep in via:
                    continue
                via[dep] = module
                b = _subpackage(dep)
                if b is None:
                    todo.append(dep)
                elif b != a:
                    chain = [dep]
                    while via[chain[-1]] is not None:
                        chain.append(via[chain[-1]])
                    edges.setdefault((a, b), []).append(" -> ".join(reversed(chain)))
    return edges


def test_subpackages_import_one_way():
    """No two engine subpackages import each other (lazy and type-only imports included, directly or
    through modules outside them), nor around a longer loop: the piece both need moves down into a
    module below both."""
    edges = _subpackage_imports(_graph(type_only=True))
    both = [f"{a} <-> {b}: " + "; ".join(edges[a, b] + edges[b, a]) for a, b in sorted(edges) if a < b and (b, a) in edges]
    assert not both, "subpackages importing each other:\n" + "\n".join(both)
    loops = _cycles({s: {b for a, b in edges if a == s} for s in SUBPACKAGES})
    assert not loops, "subpackages importing each other around a loop:\n" + "\n".join(
        ", ".join(loop) + ": " + "; ".join(c for a in loop for b in loop if (a, b) in edges for c in edges[a, b])
        for loop in loops)


def test_pass_manager_does_not_import_evaluation():
    """``edgeq.passmanager.pipeline`` and ``edgeq.passmanager.passbase`` reach no ``edgeq.evaluate`` module through any chain of
    (lazy) imports: the SQNR and the peak RSS they use live below (``edgeq.quantize.sqnr``, ``edgeq.runtime.peak_rss``)."""
    graph = _graph()
    bad = []
    for start in ("edgeq.passmanager.pipeline", "edgeq.passmanager.passbase"):
        seen, todo, via = {start}, [start], {start: None}
        while todo:
            module = todo.pop()
            for dep in sorted(graph[module]):
                if dep not in seen:
                    seen.add(dep)
                    via[dep] = module
                    todo.append(dep)
        for reached in sorted(m for m in seen if m == "edgeq.evaluate" or m.startswith("edgeq.evaluate.")):
            chain = [reached]
            while via[chain[-1]] is not None:
                chain.append(via[chain[-1]])
            bad.append(" -> ".join(reversed(chain)))
    assert not bad, "the pass manager imports the evaluation stack:\n" + "\n".join(bad)


def test_passes_are_discovered_not_listed():
    """``passes/__init__.py`` names no pass: the registry finds every module in the folder."""
    from edgeq.passmanager.registry import all_passes

    init = (REPO / "passes" / "__init__.py").read_text()
    assert "import" not in init.split('"""')[-1]
    files = {p.stem for p in (REPO / "passes").glob("*.py") if not p.name.startswith("_")}
    modules = {cls.__module__.rsplit(".", 1)[-1] for cls in all_passes().values()}
    assert modules == files


def test_architecture_table_states_the_subpackage_imports():
    """ARCHITECTURE.md's subpackage table says, for every subpackage of edgeq/, which subpackages it
    imports; that column equals what the source imports (so the table is a fact, not a wish)."""
    import re

    text = (REPO / "ARCHITECTURE.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| .* \| ([^|]+) \|$", text, re.M))
    edges = _subpackage_imports(_graph(type_only=True))
    problems = []
    for sub in SUBPACKAGES:
        short = sub.removeprefix("edgeq.")
        if short not in rows:
            problems.append(f"{short}: no row")
            continue
        stated = set(re.findall(r"`(\w+)`", rows[short]))
        actual = {b.removeprefix("edgeq.") for a, b in edges if a == sub}
        if stated != actual:
            problems.append(f"{short}: table says {sorted(stated)}, the source imports {sorted(actual)}")
    assert not problems, "\n".join(problems)
