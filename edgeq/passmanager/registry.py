"""The one registry of passes. A ``Pass`` subclass that declares a name registers itself when it is
created (``Pass.__init_subclass__``; ``edgeq.passmanager.passbase.register_pass`` is the explicit form) in the
table this module looks names up in; the first lookup imports every module in ``passes/`` (found by
listing the folder, not by a hand-kept list: a new pass is a new file). ``passes/methods/`` holds
method code, not passes, and is not scanned."""

from __future__ import annotations

import importlib
import pkgutil

from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import _PASSES, Pass

_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        package = importlib.import_module("edgeq.passes")
        for info in pkgutil.iter_modules(package.__path__):
            if not info.ispkg and not info.name.startswith("_"):
                importlib.import_module(f"{package.__name__}.{info.name}")


def get_pass(name: str) -> type[Pass]:
    _ensure_loaded()
    try:
        return _PASSES[name]
    except KeyError:
        known = ", ".join(sorted(_PASSES))
        raise UserInputError(f"unknown pass '{name}' (known passes: {known})") from None


def all_passes() -> dict[str, type[Pass]]:
    _ensure_loaded()
    return dict(sorted(_PASSES.items()))
