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
                                          "outside it and the rule it breaks. Exit 0 clean, 3 violations, 2 bad input. "
                                          "For a profile with a vendor compiler (qnn-htp) that is installed "
                                          "(`pip install 'edgeq[qnn]'`), the vendor decides: the model is opened on "
                                          "Qualcomm's (emulated) HTP with CPU fallback disabled and every node it "
                                          "refuses is listed with the compiler's reason; without it, the profile's "
                                          "rules answer and say they are an approximation.")
    p.add_argument("model", type=Path, help="ONNX model (external data next to it is read)")
    p.add_argument("--target", required=True, help="built-in target name (see `edgeq targets`) or a profile .toml")
    p.add_argument("--htp-arch", type=int, metavar="N", help="qnn-htp with the vendor: the HTP generation asked "
                                                              "(73, 75, 79; default 79, Snapdragon 8 Elite)")
    p.add_argument("--profile-only", action="store_true", help="judge by the profile's rules even when the vendor's "
                                                               "compiler is installed (seconds instead of minutes)")
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
    from edgeq.graph import ir
    from edgeq.targets.check import check_model
    from edgeq.targets.profile import load_target

    profile = load_target(args.target)  # before the model: a typo fails fast
    model = ir.load_model(args.model)
    ir.check_opset(model)  # what compile refuses, check refuses too
    result = check_model(model, profile)
    del model
    verdict, note = _ask_vendor(args, profile)
    if args.json:
        print(json.dumps({"model": str(args.model), **result.to_dict(), "decided_by": "vendor" if verdict else "profile",
                          "vendor": verdict.to_dict() if verdict else None, "note": note}, indent=1))
    elif verdict is not None:
        for r in verdict.refusals:
            print(f"node {r.node or '(unnamed)'} ({r.op}): refused by QNN HTP: {r.reason}")
        print(f"{args.model}: {verdict.headline()}; edgeq's profile: {result.headline()}")
    else:
        for v in result.violations:
            print(v.message)
        print(f"{args.model}: {result.headline()}" + (f" ({note})" if note else ""))
    clean = verdict.accepted if verdict is not None else result.clean
    return 0 if clean else CHECK_FAILED_EXIT


def _ask_vendor(args: argparse.Namespace, profile):
    """(the vendor's verdict or None, a note saying why the profile answers instead)."""
    if profile.vendor != "qnn-htp":
        if args.htp_arch is not None:
            from edgeq.errors import UserInputError

            raise UserInputError(f"--htp-arch is for a target with Qualcomm's compiler (qnn-htp), not '{profile.name}'")
        return None, ""
    from edgeq.targets.qnn_vendor import DEFAULT_HTP_ARCH, HTP_SOCS, ask_htp, vendor_version

    arch = DEFAULT_HTP_ARCH if args.htp_arch is None else args.htp_arch
    if arch not in HTP_SOCS:
        from edgeq.errors import UserInputError

        raise UserInputError(f"--htp-arch {arch}: known HTP generations are {', '.join(map(str, HTP_SOCS))}")
    if args.profile_only:
        return None, "an approximation of Qualcomm's compiler: --profile-only"
    if vendor_version() is None:
        return None, ("an approximation of Qualcomm's compiler, which is not installed here "
                      "(pip install 'edgeq[qnn]' to ask it)")
    return ask_htp(args.model, arch), ""
