"""The one loader of "a built-in name or a path to a .toml file" (recipes, target profiles).

``--recipe mquant-w8a8`` and ``--target qnn-htp`` name files shipped in the package;
``--recipe my.toml`` and ``--target ./npu.toml`` name the user's own. The rule (a value ending in
``.toml`` or containing a slash is a path), the errors (one line: file not found, unknown name
with the known ones listed, a file that is not UTF-8, invalid TOML with the parser's position)
and the recorded origin and hash (what ``manifest.json`` writes) are the same for every kind of
file.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from edgeq.errors import UserInputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class NamedToml:
    name: str  # the built-in name, or the file's stem
    text: str
    source: str  # "builtin" or the path it was read from
    where: str  # how errors name it: "recipe 'w8a8'", "my.toml"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def parse(self) -> dict:
        return parse_toml(self.text, self.where)


def is_path(name_or_path: str) -> bool:
    return name_or_path.endswith(".toml") or "/" in name_or_path


def builtin_names(package: str, folder: str) -> list[str]:
    root = resources.files(package) / folder
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def load_named_toml(name_or_path: str, package: str, folder: str, kind: str) -> NamedToml:
    """A built-in ``<package>/<folder>/<name>.toml`` by name, or a file by path."""
    if is_path(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise UserInputError(f"{kind} file not found: {path}")
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as exc:
            raise UserInputError(f"cannot read {kind} file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise UserInputError(f"{path}: invalid TOML: not UTF-8 text (byte {exc.start}: "
                                 f"{exc.object[exc.start:exc.start + 1]!r})") from None
        return NamedToml(path.stem, text, str(path), str(path))
    names = builtin_names(package, folder)
    if name_or_path not in names:
        raise UserInputError(f"unknown {kind} '{name_or_path}' (known: {', '.join(names)})")
    text = (resources.files(package) / folder / f"{name_or_path}.toml").read_text()
    return NamedToml(name_or_path, text, "builtin", f"{kind} '{name_or_path}'")


def parse_toml(text: str, where: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserInputError(f"{where}: invalid TOML: {exc}") from None
