"""``edgeq compile``: plan -> run -> write.

- ``plan``: everything that can be refused is checked before any work (output folder, recipe,
  target, model, opset, calibration data), and what the outputs must record is taken once: the
  recipe as it was read (origin and hash), the input model's file hashes, its fingerprint.
- ``run``: one ``Pipeline`` over the recipe's passes, the target's lowering passes and, unless the
  target allows full-range int8 weights (``ort-cpu-vnni``), the ``u8s8-safe-weights`` guard; then
  the encodings are read from the result once, and with a target the result is checked against
  its profile (``TargetUnreachable``, exit 3, nothing written).
- ``write``: ``edgeq.artifacts.writer`` writes the folder atomically (model, report, encodings,
  AIMET encodings, manifest last).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

import edgeq
from edgeq import ir
from edgeq.artifacts.encodings import collect_encodings
from edgeq.artifacts.manifest import input_model_record
from edgeq.artifacts.writer import write_outputs
from edgeq.calib.dataset import build_calibration_set
from edgeq.calib.session import Calibrator
from edgeq.errors import UserInputError
from edgeq.passbase import Pass, PassContext
from edgeq.pipeline import Pipeline, PipelineOptions
from edgeq.recipes import DEFAULT_RECIPE, Recipe, load_recipe
from edgeq.registry import get_pass
from edgeq.targets import TargetProfile, TargetUnreachable, check_model, load_target
from edgeq.textdata import default_tokenizer_dir


@dataclass(frozen=True)
class CompileRequest:
    model: Path
    out_dir: Path
    recipe: str = DEFAULT_RECIPE
    calib: Path | None = None
    tokenizer: Path | None = None
    calib_windows: int | None = None
    seq_len: int | None = None
    dump_each: Path | None = None
    verify: bool = False
    check_numerics: bool = False
    use_cache: bool = True
    target: str | None = None
    allow_partial: bool = False  # write the model even when an essential pass did not apply


@dataclass
class CompilePlan:
    """What ``run`` and ``write`` need, all validated."""

    req: CompileRequest
    recipe: Recipe
    profile: TargetProfile | None
    passes: list[Pass]  # recipe, then target lowering, then the guard
    counts: tuple[int, int]  # how many of ``passes`` are the recipe's and the lowering's
    int8_weights: str
    model: onnx.ModelProto
    input_model: dict  # manifest record: file hashes
    fingerprint: str
    calibrator: Calibrator | None
    calibration: dict | None
    sample: dict | None
    started: float


def compile_model(req: CompileRequest) -> dict:
    plan = plan_compile(req)
    model, records, encodings, target = run_plan(plan)
    return write_plan(plan, model, records, encodings, target)


def plan_compile(req: CompileRequest) -> CompilePlan:
    started = time.perf_counter()
    _check_out_dir(req)
    recipe = load_recipe(req.recipe)
    profile = load_target(req.target) if req.target else None
    passes = [spec.build() for spec in recipe.passes]
    lowering = [get_pass(name)() for name in profile.lowering] if profile else []
    # every compile that may run on onnxruntime CPU ends with the saturation guard, unless the
    # target allows full-range int8 weights (ort-cpu-vnni): README "Integer kernels and your CPU"
    int8_weights = profile.int8_weight_range if profile else "u8s8-safe"
    guard = [get_pass("u8s8-safe-weights")()] if int8_weights == "u8s8-safe" else []
    model, locations = ir.load_model_and_locations(req.model)
    ir.check_opset(model)
    windows = recipe.calibration.windows if req.calib_windows is None else req.calib_windows
    seq_len = recipe.calibration.seq_len if req.seq_len is None else req.seq_len
    if windows < 1 or seq_len < 2:
        raise UserInputError("--calib-windows must be >= 1 and --seq-len >= 2")
    calibrator = sample = calibration = None
    if any(p.needs_calibration for p in passes) or req.check_numerics:
        if req.calib is None:
            raise UserInputError(f"recipe '{recipe.name}' needs calibration data: pass --calib FILE (text or .npz)")
        tokenizer = req.tokenizer or default_tokenizer_dir(req.model)
        data = build_calibration_set(req.calib, ir.input_specs(model), tokenizer, windows, seq_len,
                                     recipe.calibration.batch_size)
        calibrator = Calibrator(data, use_cache=req.use_cache)
        sample = data.batches[0]
        calibration = {"data": data.description, "samples": data.samples, "tokens": data.tokens}
    return CompilePlan(req, recipe, profile, passes + lowering + guard, (len(passes), len(lowering)), int8_weights,
                       model, input_model_record(req.model, locations), ir.model_fingerprint(model), calibrator,
                       calibration, sample, started)


def run_plan(plan: CompilePlan) -> tuple[onnx.ModelProto, dict, dict, dict | None]:
    """The pipeline, the encodings (read once) and the target check; returns (model, records by
    stage, encodings, target summary)."""
    req = plan.req
    ctx = PassContext(calibrator=plan.calibrator, int8_weights=plan.int8_weights)
    essential = frozenset(i for i, spec in enumerate(plan.recipe.passes) if spec.essential)
    options = PipelineOptions(req.dump_each, req.verify, req.check_numerics, essential=essential,
                              allow_partial=req.allow_partial, recipe=plan.recipe.name)
    model, records = Pipeline(plan.passes, options).run(plan.model, ctx, plan.sample, consume=True)
    plan.model = None  # consumed: the weights are not held twice
    n_recipe, n_lowering = plan.counts
    stages = {"recipe": records[:n_recipe], "lowering": records[n_recipe:n_recipe + n_lowering],
              "guard": records[n_recipe + n_lowering:]}
    encodings = collect_encodings(model)
    target = None
    if plan.profile is not None:
        result = check_model(model, plan.profile, encodings)
        if not result.clean:
            raise TargetUnreachable(result)
        ir.set_metadata(model, "edgeq.target", plan.profile.name)
        target = {"name": plan.profile.name, "description": plan.profile.description,
                  "lowering": stages["lowering"], "check": result.to_dict()}
        if plan.profile.ort_kernels:  # after the check: the profile is stated in edgeq ops
            from edgeq.runtime_ops.ort_kernels import use_ort_kernels

            model = use_ort_kernels(model)
            target["ort_kernels"] = sorted({n.op_type for n in model.graph.node if n.domain == "edgeq.ort"})
    ir.set_metadata(model, "edgeq.version", edgeq.__version__)
    ir.set_metadata(model, "edgeq.recipe", plan.recipe.name)
    return model, stages, encodings, target


def write_plan(plan: CompilePlan, model: onnx.ModelProto, stages: dict, encodings: dict, target: dict | None) -> dict:
    calibration = plan.calibration
    if plan.calibrator is not None:
        log = plan.calibrator.log
        calibration = {**calibration, "onnxruntime_runs": log.runs, "cache_hits": log.cache_hits,
                       "seconds": round(log.seconds, 2), "tensors_observed": log.tensors_observed,
                       "fingerprint_seconds": round(log.fingerprint_seconds, 2), "ranges": log.ranges}
    report = {
        "edgeq_version": edgeq.__version__,
        "input_model": str(plan.req.model),
        "input_fingerprint": plan.fingerprint,
        "recipe": {"name": plan.recipe.name, "description": plan.recipe.description,
                   "calibration": asdict(plan.recipe.calibration)},
        "passes": stages["recipe"],
        "calibration": calibration,
    }
    partial = [{"pass": rec["name"], **rec["not_applicable"]} for rec in stages["recipe"] if rec.get("essential_not_applied")]
    if partial:  # only with --allow-partial: the recipe did not do its job on this model
        report["partial"] = partial
    if target is not None:
        report["target"] = target
    u8s8 = {"int8_weight_range": plan.int8_weights, "guard": stages["guard"][0] if stages["guard"] else None}
    return write_outputs(plan.req.out_dir, model, report, encodings=encodings, recipe=plan.recipe,
                         input_model=plan.input_model, target=plan.profile.name if plan.profile else None,
                         u8s8=u8s8, probe_feeds=plan.sample, started=plan.started)


def _check_out_dir(req: CompileRequest) -> None:
    """Refuse an output folder that cannot be written before any work is done."""
    out = req.out_dir.resolve()
    if out.exists() and not out.is_dir():
        raise UserInputError(f"output path exists and is not a folder: {req.out_dir}")
    ir.check_writable_parent(out)
    model_dir = req.model.resolve().parent
    if out == model_dir or out in model_dir.parents:
        raise UserInputError(f"output folder {req.out_dir} contains the input model; choose another -o")
