"""``edgeq targets`` (the built-in profiles, one line each) and ``edgeq check MODEL --target NAME``.

``check`` exits 0 when the model is inside the profile, 3 when it is not (one line per violation,
then a summary line), 2 on bad input (missing model, unknown target: one line on stderr).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

CHECK_FAILED_EXIT = 3


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("targets", help="list built-in target profiles",
                              description="List built-in target profiles, one line each: name, description, "
                                          "the lowering passes `--target` runs.")
    p.set_defaults(func=run_targets)
    p = subparsers.add_parser("check", help="list what a model does outside a target profile",
                              description="Check MODEL.onnx against a target profile: one line per node or tensor "
                                          "outside it and the rule it breaks. Exit 0 clean, 3 violations, 2 bad input.")
    p.add_argument("model", type=Path, help="ONNX model (external data next to it is read)")
    p.add_argument("--target", required=True, help="built-in target name (see `edgeq targets`) or a profile .toml")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    p.set_defaults(func=run_check)


def run_targets(args: argparse.Namespace) -> int:
    from edgeq.targets.profile import builtin_target_names, load_target

    names = builtin_target_names()
    width = max(len(n) for n in names) + 1
    for name in names:
        profile = load_target(name)
        lowering = ",".join(profile.lowering) or "none"
        print(f"{name:<{width}} {profile.description}  [lowering: {lowering}]")
    return 0


def run_check(args: argparse.Namespace) -> int:
    from edgeq import ir
    from edgeq.targets.check import check_model
    from edgeq.targets.profile import load_target

    profile = load_target(args.target)  # before the model: a typo fails fast
    model = ir.load_model(args.model)
    ir.check_opset(model)  # what compile refuses, check refuses too
    result = check_model(model, profile)
    if args.json:
        print(json.dumps({"model": str(args.model), **result.to_dict()}, indent=1))
    else:
        for v in result.violations:
            print(v.message)
        print(f"{args.model}: {result.headline()}")
    return 0 if result.clean else CHECK_FAILED_EXIT
