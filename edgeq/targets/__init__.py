"""Deployment targets: profiles (``profiles/*.toml``, loaded and validated by ``profile``), the
checker that lists what a model does outside a profile (``check``), and the ``edgeq targets`` /
``edgeq check`` commands (``cli``). The lowering passes a profile names live in ``edgeq.passes``
(``expand-functions``, ``symmetric-weights``, ``pow2-scales``), registered like every pass.

Importing this package reads no file and loads none of its modules: profiles are parsed when
``load_target`` is called, each name's module loaded when the name is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgeq.targets.check import CheckResult, TargetUnreachable, Violation, check_model
    from edgeq.targets.profile import QuantRules, TargetProfile, builtin_target_names, load_target, parse_target

# name -> module it is defined in: read on first use (``edgeq compile --help`` builds the target
# options of ``edgeq.targets.qnn_htp`` without loading onnx and the checker)
_EXPORTS = {"CheckResult": "check", "TargetUnreachable": "check", "Violation": "check", "check_model": "check",
            "QuantRules": "profile", "TargetProfile": "profile", "builtin_target_names": "profile",
            "load_target": "profile", "parse_target": "profile"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'edgeq.targets' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"edgeq.targets.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


__all__ = ["CheckResult", "QuantRules", "TargetProfile", "TargetUnreachable", "Violation", "builtin_target_names",
           "check_model", "load_target", "parse_target"]
