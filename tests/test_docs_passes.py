"""docs/layout.md lists every pass: one line per file in ``passes/``, naming the file and the pass
it registers ("- `fuse_norms.py` (`fuse-norms`): ..."), and nothing that is not there; ARCHITECTURE.md's
"The passes" section names every registered pass and nothing else."""

import inspect
import re
from pathlib import Path

from edgeq.passmanager.registry import all_passes

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "layout.md"
ENTRY = re.compile(r"^- `(\w+)\.py` \(`([a-z0-9-]+)`\): \S", re.M)


def _listed() -> dict[str, str]:
    """file name -> pass name, as docs/layout.md lists them."""
    entries = ENTRY.findall(LAYOUT.read_text())
    files = [f for f, _ in entries]
    assert len(files) == len(set(files)), f"a pass file listed twice in docs/layout.md: {sorted(files)}"
    return {f"{f}.py": name for f, name in entries}


def test_every_registered_pass_is_listed_in_layout_md():
    listed = _listed()
    missing = {}
    for name, cls in all_passes().items():
        file = Path(inspect.getfile(cls)).name
        if listed.get(file) != name:
            missing[name] = file
    assert not missing, (f"docs/layout.md ('The passes') lacks a line '- `FILE` (`NAME`): ...' for: "
                         f"{', '.join(f'{n} ({f})' for n, f in sorted(missing.items()))}")


def test_layout_md_lists_only_pass_files():
    files = {p.name for p in (ROOT / "passes").glob("*.py") if not p.name.startswith("_")}
    listed = _listed()
    assert set(listed) == files, (f"docs/layout.md lists {sorted(set(listed) - files)} (no such file in passes/) "
                                  f"and misses {sorted(files - set(listed))}")


def test_architecture_md_names_every_pass():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## The passes", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+)*)`", section))
    assert named == set(all_passes()), (f"ARCHITECTURE.md 'The passes' misses {sorted(set(all_passes()) - named)} "
                                        f"and names {sorted(named - set(all_passes()))}")
