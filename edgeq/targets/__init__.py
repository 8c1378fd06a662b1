"""Deployment targets: profiles (``profiles/*.toml``, loaded and validated by ``profile``), the
checker that lists what a model does outside a profile (``check``), and the ``edgeq targets`` /
``edgeq check`` commands (``cli``). The lowering passes a profile names live in ``edgeq.passes``
(``expand-functions``, ``symmetric-weights``, ``pow2-scales``), registered like every pass.

Importing this package reads no file: profiles are parsed when ``load_target`` is called.
"""

from edgeq.targets.check import CheckResult, TargetUnreachable, Violation, check_model
from edgeq.targets.profile import QuantRules, TargetProfile, builtin_target_names, load_target, parse_target

__all__ = [
    "CheckResult",
    "QuantRules",
    "TargetProfile",
    "TargetUnreachable",
    "Violation",
    "builtin_target_names",
    "check_model",
    "load_target",
    "parse_target",
]
