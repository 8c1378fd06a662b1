"""The one registry of passes. Pass modules register with ``@register_pass``; lookups import
``edgeq.passes`` on first use so every pass in ``passes/`` is known."""

from __future__ import annotations

from edgeq.errors import UserInputError
from edgeq.passbase import Pass

_PASSES: dict[str, type[Pass]] = {}
_loaded = False


def register_pass(cls: type[Pass]) -> type[Pass]:
    name = cls.name
    if name in _PASSES and _PASSES[name] is not cls:
        raise ValueError(f"pass name '{name}' registered twice")
    _PASSES[name] = cls
    return cls


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        import edgeq.passes  # noqa: F401  (registers every pass)


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
