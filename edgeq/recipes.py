"""Recipes: TOML files validated into frozen dataclasses.

A recipe names a pipeline of passes with their configs and the calibration defaults::

    description = "static per-tensor INT8 activations, per-channel INT8 weights"
    [calibration]
    windows = 16
    seq_len = 512
    [kv_cache]          # optional: the cache of a static pair (compile --static), "float32" or "int8"
    dtype = "int8"
    [[pass]]
    name = "qdq"
    activation_dtype = "int8"

A pass the recipe's accuracy depends on is marked ``essential = true`` (rotate for MQuant and
QuaRot, resq for ResQ, the quantizer itself): when it does not apply to a graph (its structure is
not there, or a pass it builds on did not apply), ``compile`` stops with exit 4 and names it,
instead of writing a silently degraded model (``--allow-partial`` writes it anyway, with a warning
per pass). ``essential`` is the recipe's word about the pass, not part of the pass's config.

Unknown top-level keys, unknown calibration keys, unknown passes, unknown pass-config keys and
unknown linear roles in a pass's ``*_roles`` list or ``role_activation_dtypes`` (``skip_roles =
["lm_haed"]`` would quantize the head) are all errors (a typo must never silently fall back to a
default), and so is a pass listed before a pass it ``requires``. Built-in recipes live in
``edgeq/recipes/*.toml``; ``--recipe`` also accepts a path to a .toml file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import types
import typing
from dataclasses import dataclass

from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import Pass, PassConfig
from edgeq.passmanager.registry import get_pass
from edgeq.files.tomlfile import builtin_names, load_named_toml, parse_toml

DEFAULT_RECIPE = "mquant-w8a8"


@dataclass(frozen=True)
class CalibrationSettings:
    windows: int = 16
    seq_len: int = 512
    batch_size: int = 1


@dataclass(frozen=True)
class KvCacheSettings:
    """The cache of a static pair (``compile --static``): ``int8`` stores it in 8 bits with one
    calibrated scale per layer and K/V (``edgeq.static.kv_cache_int8``); other compiles ignore it."""

    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in ("float32", "int8"):
            raise ValueError(f"dtype must be float32 or int8, got '{self.dtype}'")


@dataclass(frozen=True)
class PassSpec:
    name: str
    config: PassConfig
    essential: bool = False  # the recipe is broken without it: compile refuses when it does not apply

    def build(self) -> Pass:
        return get_pass(self.name)(self.config)


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    calibration: CalibrationSettings
    passes: tuple[PassSpec, ...]
    kv_cache: KvCacheSettings = KvCacheSettings()
    origin: str = "text"  # "builtin", the file's path, or "text" (parsed from a string)
    sha256: str = ""  # of the TOML text (what manifest.json records)


def builtin_recipe_names() -> list[str]:
    return builtin_names("edgeq", "recipes")


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name, or a recipe file by path (``edgeq.files.tomlfile``)."""
    file = load_named_toml(name_or_path, "edgeq", "recipes", "recipe")
    recipe = parse_recipe(file.text, file.name, source=file.where, sha256=file.sha256)
    return dataclasses.replace(recipe, origin=file.source)


def parse_recipe(text: str, name: str, source: str = "recipe", sha256: str | None = None) -> Recipe:
    """``sha256``: of ``text``, when the caller has it already (``load_recipe``: the file's hash)."""
    data = parse_toml(text, source)
    _reject_unknown(data, {"description", "calibration", "kv_cache", "pass"}, source)
    calibration = _build_dataclass(CalibrationSettings, data.get("calibration", {}), f"{source} [calibration]")
    kv_cache = _build_dataclass(KvCacheSettings, data.get("kv_cache", {}), f"{source} [kv_cache]")
    raw_passes = data.get("pass", [])
    if not isinstance(raw_passes, list) or not raw_passes:
        raise UserInputError(f"{source}: needs at least one [[pass]] table")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise UserInputError(f"{source}: description must be a string, got {description!r}")
    specs: list[PassSpec] = []
    for i, entry in enumerate(raw_passes):
        if not isinstance(entry, dict):
            raise UserInputError(f"{source}: [[pass]] #{i + 1} must be a table, got {entry!r}")
        if "name" not in entry:
            raise UserInputError(f"{source}: [[pass]] #{i + 1} has no 'name'")
        entry = dict(entry)
        pass_name = entry.pop("name")
        if not isinstance(pass_name, str):
            raise UserInputError(f"{source}: [[pass]] #{i + 1} name must be a string, got {pass_name!r}")
        pass_cls = get_pass(pass_name)
        essential = entry.pop("essential", False)
        if not isinstance(essential, bool):
            raise UserInputError(f"{source}: pass '{pass_cls.name}' essential must be true or false, got {essential!r}")
        config = _build_dataclass(pass_cls.Config, entry, f"{source} pass '{pass_cls.name}'")
        missing = [r for r in pass_cls.requires if r not in {spec.name for spec in specs}]
        if missing:
            raise UserInputError(f"{source}: pass '{pass_cls.name}' needs {', '.join(repr(m) for m in missing)} "
                                 f"earlier in the recipe")
        specs.append(PassSpec(pass_cls.name, config, essential))
    return Recipe(name, description, calibration, tuple(specs), kv_cache,
                  sha256=sha256 if sha256 is not None else hashlib.sha256(text.encode()).hexdigest())


def _reject_unknown(data: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise UserInputError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")


def _build_dataclass(cls, values: dict, where: str):
    if not isinstance(values, dict):
        raise UserInputError(f"{where} must be a table, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _reject_unknown(values, set(fields), where)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        kwargs[key] = _coerce(value, hints[key], f"{where} key '{key}'")
        if key.endswith("_roles"):
            _check_roles(kwargs[key], f"{where} key '{key}'")
        elif key in ("role_activation_dtypes", "role_weight_dtypes"):  # "role=dtype" (the config checks the form and the dtype)
            _check_roles([e.partition("=")[0].strip() for e in kwargs[key] if "=" in e], f"{where} key '{key}'")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise UserInputError(f"{where}: {exc}") from None


def _check_roles(roles, where: str) -> None:
    """Every role a pass config names (``skip_roles``, ``sink_roles``, the ``role=`` of
    ``role_activation_dtypes`` and ``role_weight_dtypes`` entries) must be one a linear can get."""
    from edgeq.structure.linears import ROLES

    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise UserInputError(f"{where}: unknown role(s) {', '.join(map(repr, unknown))} (roles: {', '.join(ROLES)})")


def _coerce(value, hint, where: str):
    """Check a TOML value against a field's type hint (lists become tuples)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except UserInputError:
                pass
        raise UserInputError(f"{where}: {value!r} does not match {hint}")
    if origin is tuple:
        if not isinstance(value, list):
            raise UserInputError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(v, args[0], where) for v in value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise UserInputError(f"{where}: expected true or false, got {value!r}")
    if hint in (int, float, str) and (not isinstance(value, hint) or isinstance(value, bool)):
        raise UserInputError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value
