"""``edgeq compile``: load, calibrate, run the recipe's pipeline, write outputs atomically.

Outputs (all written into a temporary folder that replaces OUTDIR only on success):
``model.onnx`` + ``model.onnx.data``, ``report.json`` (each pass: time, what it changed;
calibration summary; numerics if asked), ``encodings.json`` (every quantized tensor, vendor-neutral),
``aimet_encodings.json`` (the same in the AIMET/QNN 1.0.0 layout, for a QNN-style converter's
quantization overrides; what that layout cannot express is listed in report.json) and
``manifest.json`` (input model hash, recipe, versions, target, every output file's sha256; written
last so it covers the final file set).

With a target (``--target``, a profile in ``edgeq.targets``), the profile's lowering passes run
after the recipe's, in the same pipeline (so ``--verify`` and friends cover them), and the result
is checked against the profile: still outside it, the compile raises ``TargetUnreachable``
(exit 3) before anything is written; inside it, ``report.json`` gets a ``target`` entry (the
lowering passes' records and the check result). A profile with ``ort_kernels = true``
(``ort-cpu-kernels``) then hands the edgeq ops to ``edgeq.runtime_ops.ort_kernels`` (their
function bodies stay in the file as the fallback).
"""

from __future__ import annotations

import json
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

import edgeq
from edgeq import ir
from edgeq.calib.dataset import build_calibration_set
from edgeq.calib.session import Calibrator
from edgeq.encodings import collect_encodings
from edgeq.encodings_aimet import aimet_unsupported, write_aimet
from edgeq.errors import UserInputError
from edgeq.manifest import write_manifest
from edgeq.passbase import PassContext
from edgeq.pipeline import Pipeline, PipelineOptions
from edgeq.recipes import DEFAULT_RECIPE, load_recipe
from edgeq.registry import get_pass
from edgeq.targets import TargetUnreachable, check_model, load_target


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
    seed: int = 0
    target: str | None = None


def default_tokenizer_dir(model_path: Path) -> Path | None:
    """The model's own folder when it holds tokenizer files (what ``edgeq export`` writes)."""
    folder = model_path.resolve().parent
    return folder if (folder / "tokenizer.json").is_file() else None


def _check_out_dir(req: CompileRequest) -> None:
    """Refuse an output folder that cannot be written before any work is done."""
    out = req.out_dir.resolve()
    if out.exists() and not out.is_dir():
        raise UserInputError(f"output path exists and is not a folder: {req.out_dir}")
    ir.check_writable_parent(out)
    model_dir = req.model.resolve().parent
    if out == model_dir or out in model_dir.parents:
        raise UserInputError(f"output folder {req.out_dir} contains the input model; choose another -o")


def compile_model(req: CompileRequest) -> dict:
    start = time.perf_counter()
    _check_out_dir(req)
    recipe = load_recipe(req.recipe)
    passes = [spec.build() for spec in recipe.passes]
    profile = load_target(req.target) if req.target else None
    lowering = [get_pass(name)() for name in profile.lowering] if profile else []
    # every compile that may run on onnxruntime CPU ends with the saturation guard, unless the
    # target allows full-range int8 weights (ort-cpu-vnni): README "Integer kernels and your CPU"
    int8_weights = profile.int8_weight_range if profile else "u8s8-safe"
    guard = [get_pass("u8s8-safe-weights")()] if int8_weights == "u8s8-safe" else []
    model = ir.load_model(req.model)
    ir.check_opset(model)
    windows = recipe.calibration.windows if req.calib_windows is None else req.calib_windows
    seq_len = recipe.calibration.seq_len if req.seq_len is None else req.seq_len
    if windows < 1 or seq_len < 2:
        raise UserInputError("--calib-windows must be >= 1 and --seq-len >= 2")
    needs_calib = any(p.needs_calibration for p in passes) or req.check_numerics
    calibrator = None
    sample = None
    calib_summary = None
    if needs_calib:
        if req.calib is None:
            raise UserInputError(f"recipe '{recipe.name}' needs calibration data: pass --calib FILE (text or .npz)")
        input_specs = ir.input_specs(model)
        tokenizer = req.tokenizer or default_tokenizer_dir(req.model)
        data = build_calibration_set(req.calib, input_specs, tokenizer, windows, seq_len, recipe.calibration.batch_size)
        calibrator = Calibrator(data, use_cache=req.use_cache)
        sample = data.batches[0]
        calib_summary = {"data": data.description, "samples": data.samples, "tokens": data.tokens}
    options = PipelineOptions(req.dump_each, req.verify, req.check_numerics)
    ctx = PassContext(calibrator=calibrator, seed=req.seed, int8_weights=int8_weights)
    fingerprint = ir.model_fingerprint(model)
    out_model, records = Pipeline(passes + lowering + guard, options).run(model, ctx, sample, consume=True)
    records, lowering_records, guard_records = (records[:len(passes)], records[len(passes):len(passes) + len(lowering)],
                                                records[len(passes) + len(lowering):])
    del model
    target_summary = None
    if profile is not None:
        result = check_model(out_model, profile)
        if not result.clean:
            raise TargetUnreachable(result)
        ir.set_metadata(out_model, "edgeq.target", profile.name)
        target_summary = {"name": profile.name, "description": profile.description,
                          "lowering": lowering_records, "check": result.to_dict()}
        if profile.ort_kernels:  # after the check: the profile is stated in edgeq ops
            from edgeq.runtime_ops.ort_kernels import use_ort_kernels

            out_model = use_ort_kernels(out_model)
            moved = sorted({n.op_type for n in out_model.graph.node if n.domain == "edgeq.ort"})
            target_summary["ort_kernels"] = moved
    ir.set_metadata(out_model, "edgeq.version", edgeq.__version__)
    ir.set_metadata(out_model, "edgeq.recipe", recipe.name)
    if calibrator is not None:
        log = calibrator.log
        calib_summary.update({"onnxruntime_runs": log.runs, "cache_hits": log.cache_hits,
                              "seconds": round(log.seconds, 2), "tensors_observed": log.tensors_observed,
                              "ranges": log.ranges})
    report = {
        "edgeq_version": edgeq.__version__,
        "input_model": str(req.model),
        "input_fingerprint": fingerprint,
        "recipe": {"name": recipe.name, "description": recipe.description,
                   "calibration": asdict(recipe.calibration)},
        "passes": records,
        "calibration": calib_summary,
    }
    if target_summary is not None:
        report["target"] = target_summary
    with ir.atomic_output_dir(req.out_dir) as tmp:
        model_path = ir.save_model(out_model, tmp / "model.onnx")
        # the output must load in onnxruntime; the same session measures the u8s8 kernel's risk
        report["u8s8"] = _u8s8_report(onnx.load_model(str(model_path)), sample, int8_weights, guard_records)
        encodings = collect_encodings(out_model)
        (tmp / "encodings.json").write_text(json.dumps(encodings, indent=1))
        report["quantized_tensors"] = {"activations": len(encodings["activations"]), "weights": len(encodings["weights"])}
        write_aimet(tmp / "aimet_encodings.json", encodings, version="1.0.0", strict=False)
        report["aimet_unsupported"] = aimet_unsupported(encodings, "1.0.0")
        report["seconds_total"] = round(time.perf_counter() - start, 2)
        report["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        report["input_size_mb"] = round(_model_bytes(req.model) / 2**20, 1)
        report["output_size_mb"] = round(_model_bytes(model_path) / 2**20, 1)
        (tmp / "report.json").write_text(json.dumps(report, indent=1, default=_json_default))
        write_manifest(req.model, req.recipe, profile.name if profile else None, tmp)
    return report


def _u8s8_report(model: onnx.ModelProto, feeds: dict | None, int8_weights: str, guard_records: list) -> dict:
    """What report.json says about onnxruntime's uint8 x int8 kernels: the weight range chosen,
    the guard's record, and per linear the worst-case pair bound and the VPMADDUBSW model's
    saturation rates on one calibration batch (without calibration data: the bound only)."""
    from edgeq.targets.u8s8_sites import find_u8s8_sites, probe_saturation, static_risk

    out: dict = {"int8_weight_range": int8_weights, "guard": guard_records[0] if guard_records else None}
    if feeds is not None:
        out.update(probe_saturation(model, feeds))
        return out
    ir.make_session(model)
    import onnx_graphsurgeon as gs

    sites = find_u8s8_sites(gs.import_onnx(model))
    risk = static_risk(sites)
    out.update({"linears": len(sites), "linears_at_risk": len(risk), "saturation_free": not risk,
                "at_risk": risk, "note": "no calibration data: worst-case bound only, no saturation rates"})
    return out


def _model_bytes(path: Path) -> int:
    """The model file plus its external data files."""
    path = Path(path)
    total = path.stat().st_size
    for sibling in path.parent.glob(path.name + "*"):
        if sibling != path and sibling.is_file():
            total += sibling.stat().st_size
    return total


def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)
