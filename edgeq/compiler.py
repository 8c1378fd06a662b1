"""``edgeq compile``: plan -> route -> write.

- ``plan`` (``edgeq.plan.plan_compile``): everything that can be refused is checked before any
  work, what the outputs must record is taken once, and the route is decided.
- ``run``: one ``Pipeline`` over the recipe's passes, the target's lowering passes and, unless the
  target allows full-range int8 weights (``ort-cpu-vnni``), the ``u8s8-safe-weights`` guard; then
  the encodings are read from the result once, and with a target the result is checked against
  its profile (``TargetUnreachable``, exit 3, nothing written).
- ``route``: decided once, in the plan, as a value on it (``Route``); each route is
  one function ``(plan, model) -> CompileResult`` that writes nothing: ``compile_in_memory``,
  ``compile_blockwise``, ``compile_static`` (``--static``) and ``compile_genai`` (``--target
  ort-genai``). The plan is frozen and nothing in it is toggled afterwards: the model
  ``plan_compile`` read is handed to the route beside it (the pipeline clears it as it imports
  it), block-wise calibration runs on its own streaming view of the calibrator
  (``Calibrator.streaming``) and on fresh pass instances for every block, and what a route
  measures (block-wise: the u8s8 risk, block by block) is returned in its result.
- ``report``: a typed record (``edgeq.artifacts.report.CompileReport``), its sections filled by the
  plan, the route and the writer that own them, serialized once by the writer.
- ``write``: ``edgeq.artifacts.writer.write(result)`` writes the folder atomically (the graphs
  through the result's per-kind writer, then encodings, AIMET encodings, report, manifest last).

Two paths run the passes. In memory: the whole model in one graph (any model, any pass). Block
wise (``edgeq.blockwise``): one decoder block at a time, weights read per block and written out
as each block is done, so memory is bounded by a block instead of growing with the model; chosen
by ``--blockwise auto`` for models of ``BLOCKWISE_MIN_BYTES`` or more whose recipe passes all run
per block and whose graph splits into blocks, or forced with ``--blockwise on``.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import onnx

import edgeq
from edgeq.measured_accuracy import measured_accuracy
from edgeq.graph import ir
from edgeq.files import output_dir
from edgeq.artifacts.report import CompilePathSection, CompileReport, RecipeSection, TargetSection
from edgeq.artifacts.writer import CompileResult, ModelGraphs, OutputStage, StaticGraphs, write
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import Pass, PassContext
from edgeq.passmanager.pipeline import Pipeline, PipelineOptions
from edgeq.passmanager.stages import StageOptions
from edgeq.plan import CompilePlan, CompileRequest, Route, compile_inputs, plan_compile
from edgeq.quantize.qdq_encodings import collect_encodings
from edgeq.targets import TargetUnreachable, check_model


def compile_model(req: CompileRequest) -> CompileReport:
    """Plan, run the plan's route, write its result; returns the report written."""
    plan, model = plan_compile(req)
    if plan.partition is None:
        route = {Route.IN_MEMORY: compile_in_memory, Route.STATIC: compile_static, Route.GENAI: compile_genai}
        return write(route[plan.route](plan, model))
    try:
        staging = _staging_dir(req.out_dir)
    except OSError as exc:
        raise UserInputError(f"cannot write beside the output folder {req.out_dir}: {exc.strerror or exc}") from None
    try:  # block-wise (a plain compile, or --static's with-past graph): the weights stream into staging
        streamed = compile_blockwise if plan.route is Route.BLOCKWISE else compile_static
        return write(streamed(plan, model, staging / "model.onnx.data"))
    except OSError as exc:  # disk full while the weights stream out: nothing half-written is left
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise UserInputError(f"cannot write the output in {req.out_dir.resolve().parent}: {exc.strerror or exc}") from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def compile_in_memory(plan: CompilePlan, model: onnx.ModelProto) -> CompileResult:
    """The whole model in one graph (any model, any pass)."""
    model, stages, encodings, target, _ = run_plan(plan, model)
    report, u8s8 = build_report(plan, stages, target)
    return _result(plan, ModelGraphs(model, u8s8, probe_feeds=plan.sample), report, encodings)


def compile_blockwise(plan: CompilePlan, skeleton: onnx.ModelProto, external_data: Path) -> CompileResult:
    """One decoder block at a time (``edgeq.blockwise``): the weights stream into ``external_data``
    (which ``write`` moves into the output), the u8s8 risk is measured block by block."""
    model, stages, encodings, target, measured = run_plan(plan, skeleton, external_data)
    report, u8s8 = build_report(plan, stages, target, measured)
    return _result(plan, ModelGraphs(model, u8s8, external_data=external_data), report, encodings)


def _result(plan: CompilePlan, graphs, report: CompileReport, encodings: dict,
            stages: list[OutputStage] | None = None) -> CompileResult:
    return CompileResult(plan.req.out_dir, graphs, report, encodings, recipe=plan.recipe,
                         input_model=plan.input_model, target=plan.profile.name if plan.profile else None,
                         started=plan.started, force=plan.req.force, inputs=compile_inputs(plan.req), stages=stages or [])


def run_plan(plan: CompilePlan, model: onnx.ModelProto, external_data: Path | None = None
             ) -> tuple[onnx.ModelProto, dict, dict, TargetSection | None, Any]:
    """The pipeline on ``model`` (consumed), the encodings (read once) and the target check;
    returns (model, records by stage, encodings, target summary, u8s8 measured block by block).
    Block-wise, the weights go to ``external_data``."""
    req = plan.req
    ctx = PassContext(calibrator=plan.calibrator, int8_weights=plan.int8_weights)
    essential = frozenset(i for i, spec in enumerate(plan.recipe.passes) if spec.essential)
    options = PipelineOptions(req.dump_each, req.verify, req.check_numerics, essential=essential,
                              allow_partial=req.allow_partial, recipe=plan.recipe.name)
    measured = None
    if plan.partition is not None:
        assert external_data is not None  # (the block-wise routes stream their weights into a file)
        model, records, measured = _run_blocks(plan, model, ctx, options, external_data)
    else:
        model, records = Pipeline(plan.passes, options).run(model, ctx, plan.sample, consume=True)
    n_recipe, n_lowering = plan.counts
    stages = {"recipe": records[:n_recipe], "lowering": records[n_recipe:n_recipe + n_lowering],
              "guard": records[n_recipe + n_lowering:]}
    ir.set_metadata(model, "edgeq.version", edgeq.__version__)
    ir.set_metadata(model, "edgeq.recipe", plan.recipe.name)
    if plan.route is Route.STATIC:  # the static graphs are read and checked once specialized
        return model, stages, {}, None, None
    encodings = collect_encodings(model, str(external_data.parent) if external_data is not None else "")
    if plan.profile is not None and external_data is not None:
        # the target checks read weights from the graph: bring the streamed ones back (output-sized)
        onnx.load_external_data_for_model(model, str(external_data.parent))
    model, target = reach_target(plan, model, encodings, stages["lowering"])
    return model, stages, encodings, target, measured


def reach_target(plan: CompilePlan, model: onnx.ModelProto, encodings: dict, lowering: list,
                 graph: str = "model.onnx") -> tuple[onnx.ModelProto, TargetSection | None]:
    """With a target: check ``model`` against its profile (``TargetUnreachable`` when it is not
    clean), mark it, and select the profile's onnxruntime kernels; returns (model, target summary)."""
    if plan.profile is None:
        return model, None
    result = check_model(model, plan.profile, encodings)
    if not result.clean:
        raise TargetUnreachable(result)
    ir.set_metadata(model, "edgeq.target", plan.profile.name)
    target = TargetSection(plan.profile.name, plan.profile.description, lowering, result.to_dict())
    if plan.profile.ort_kernels:  # after the check: the profile is stated in edgeq ops
        from edgeq.runtime_ops.ort_kernels import use_ort_kernels

        model = plan.route_stages.run("ort-kernels", graph, model, use_ort_kernels)
        target.ort_kernels = sorted({n.op_type for n in model.graph.node if n.domain == "edgeq.ort"})
    return model, target


def compile_static(plan: CompilePlan, model: onnx.ModelProto, external_data: Path | None = None) -> CompileResult:
    """``--static``: the recipe once on the with-past graph (one calibration), then the prefill and
    decode graphs specialized from its result (``edgeq.static``), each checked against the target,
    written over one weights file. With the recipe's ``[kv_cache] dtype = "int8"`` the cache scales
    come from the same calibration windows.

    Block-wise (``external_data``: the with-past graph compiled one block at a time, its weights
    streamed into that file), the pair is specialized and written with the weights left in the
    file: each graph's are read in only while its target check runs, and the writer copies them
    tensor by tensor, so the peak stays near one copy of the compiled weights."""
    from edgeq.static.compile import kv_scales, pair_encodings, static_report, tokenizer_files
    from edgeq.static.specialize import build_pair

    shape = plan.static_shape
    assert shape is not None  # (the static route is planned with its shape)
    model, stages, _, _, measured = run_plan(plan, model, external_data)
    weights_dir = external_data.parent if external_data is not None else None
    scales = None
    if shape.cache_dtype == "int8":
        if plan.calibrator is None:
            raise UserInputError("an int8 KV cache needs calibration data: pass --calib FILE")
        if weights_dir is not None:
            raise UserInputError("an int8 KV cache is calibrated on the whole with-past graph: compile with --blockwise off")
        scales = kv_scales(plan.calibrator, model, shape.layers)
    vlm = plan.static_vlm
    if vlm is not None:  # the visual span at a fixed slice (edgeq.static.vlm)
        from edgeq.static.vlm import order_invariant_mask, role_graph

        model = plan.route_stages.run("vlm-order-invariant-mask", "with-past", model, order_invariant_mask)

        def prepare(m: onnx.ModelProto, role: str) -> onnx.ModelProto:
            return plan.route_stages.run("vlm-fixed-visual-slice", f"{role}.onnx", m, lambda g: role_graph(vlm, g, role))
    stages_run: dict = {}  # graph file -> the static stages' records (report.json's static.stages)
    pair = build_pair(model, shape, scales, weights_dir, prepare=prepare if vlm else None,
                      records=stages_run, options=StageOptions(plan.req.dump_each, plan.req.verify))
    del model
    encodings = pair_encodings(pair, weights_dir)
    target, checks = None, {}
    for name in pair:
        if weights_dir is None:
            pair[name], target = reach_target(plan, pair[name], encodings, stages["lowering"], name)
        else:  # the check reads weights: a copy holds them while it runs, then goes
            from edgeq.blockwise import release_memory

            checked, target = reach_target(plan, ir.weights_read_in(pair[name], weights_dir), encodings,
                                           stages["lowering"], name)
            pair[name] = ir.weights_pointed_back(checked, pair[name])
            del checked
            release_memory()
        if target is not None:
            checks[name] = target.check
    extra = tokenizer_files(plan.req.model)
    if vlm is not None:  # vision.onnx beside the pair (static, batch 1), checked like them
        from edgeq.static.vlm import static_vision

        vision = plan.route_stages.run("vlm-static-vision", "vision.onnx", ir.load_model(vlm.vision),
                                       lambda m: static_vision(vlm, m))
        vision, vision_target = reach_target(plan, vision, collect_encodings(vision), stages["lowering"], "vision.onnx")
        pair["vision.onnx"] = vision
        if vision_target is not None:
            checks["vision.onnx"], target = vision_target.check, target or vision_target
        extra += list(vlm.side_files)
    if target is not None:
        target.check = checks
    report, u8s8 = build_report(plan, stages, target, measured)
    report.static = static_report(shape, pair, scales)
    report.static["stages"] = {name: [r.to_json() for r in records] for name, records in stages_run.items()}
    if vlm is not None:
        report.static["vlm"] = vlm.report()
    graphs = StaticGraphs(pair, u8s8, extra_files=extra, weights_dir=weights_dir)
    output_stages: list[OutputStage] = list(plan.req.qnn_htp.output_stages(pair))
    if output_stages and vlm is None:  # the binaries as onnxruntime-genai's decoder pipeline (edgeq.genai.qnn_config)
        from edgeq.genai.qnn_config import GenaiQnnPipeline

        output_stages.append(GenaiQnnPipeline(plan.req.qnn_htp.max_context_mb is not None,
                                              plan.req.qnn_htp.share_weights))
    return _result(plan, graphs, report, encodings, output_stages)


def compile_genai(plan: CompilePlan, model: onnx.ModelProto) -> CompileResult:
    """``--target ort-genai``: the recipe on the with-past graph, then the folder onnxruntime-genai
    opens, written from the result (``edgeq.genai``)."""
    from edgeq.genai.write import GenaiGraphs, genai_graphs

    model, stages, encodings, target, _ = run_plan(plan, model)
    report, _ = build_report(plan, stages, target)
    options = plan.req.ort_genai
    emitted: list[GenaiGraphs] = []

    def emit(m: onnx.ModelProto) -> onnx.ModelProto:
        emitted.append(genai_graphs(m, report, plan.req.model, options.level, lm_head_bits=options.head_bits))
        return cast(onnx.ModelProto, emitted[0].model)

    plan.route_stages.run("genai-emit", "model.onnx", model, emit)
    (graphs,) = emitted
    del model
    return _result(plan, graphs, report, encodings)


def _run_blocks(plan: CompilePlan, skeleton: onnx.ModelProto, ctx: PassContext, options: PipelineOptions,
                external_data: Path):
    """The passes on one decoder block at a time (``edgeq.blockwise``), fresh pass instances per
    block; returns (model, the records of each pass merged over the blocks, the u8s8 report
    measured block by block)."""
    from edgeq.blockwise import BlockProgress, compile_blocks, merge_records
    from edgeq.calib.session import StreamCarry
    from edgeq.runtime.progress import _enabled

    part = plan.partition
    assert part is not None  # (called for block-wise plans only)
    carry = None
    if plan.calibrator is not None:  # the plan's calibrator is left as it is: blocks calibrate on a streaming view
        carry = StreamCarry(cut=None, capture=part.stream[1], spill_dir=external_data.parent / "carry")
        ctx = dataclasses.replace(ctx, calibrator=plan.calibrator.streaming(carry))

    block_options = dataclasses.replace(options, collect_garbage=True)

    def run_block(graph, i: int):
        return Pipeline(_build_passes(plan), block_options).run(graph, ctx, consume=True)

    progress = BlockProgress(part.num_layers, _enabled() or os.environ.get("EDGEQ_PROGRESS") is None)
    model, per_block, u8s8 = compile_blocks(skeleton, part, ir.model_folder(plan.req.model),
                                            external_data, run_block, carry, progress, plan.sample)
    return model, merge_records(per_block), u8s8


def _build_passes(plan: CompilePlan) -> list[Pass]:
    """New instances of the plan's passes (same classes and configs): one set per block."""
    return [type(p)(p.config) for p in plan.passes]


def _staging_dir(out_dir: Path) -> Path:
    """A temporary folder beside the output for the weights a block-wise compile streams out
    (``.OUT.weights-PID-*``: a later run removes it if this process dies without cleaning up)."""
    out = out_dir.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    return output_dir.staging_dir(out, "weights")


def build_report(plan: CompilePlan, stages: dict, target: TargetSection | None, measured_u8s8: dict | None = None
                 ) -> tuple[CompileReport, dict]:
    """The plan's part of report.json and its u8s8 section (with ``measured_u8s8``, what block-wise
    measured), before the route and the writer fill theirs."""
    calibration = plan.calibration
    if plan.calibrator is not None and calibration is not None:
        log = plan.calibrator.log
        calibration = dataclasses.replace(
            calibration, onnxruntime_runs=log.runs, cache_hits=log.cache_hits, seconds=round(log.seconds, 2),
            tensors_observed=log.tensors_observed, fingerprint_seconds=round(log.fingerprint_seconds, 2),
            ranges=log.ranges)
    report = CompileReport(
        edgeq_version=edgeq.__version__,
        input_model=str(plan.req.model),
        input_fingerprint=plan.fingerprint,
        compile_path=CompilePathSection(plan.partition is not None, plan.blockwise_reason,
                                        plan.partition.num_layers if plan.partition is not None else None),
        recipe=RecipeSection(plan.recipe.name, plan.recipe.description, asdict(plan.recipe.calibration)),
        passes=stages["recipe"],
        calibration=calibration,
        # only with --allow-partial: the recipe did not do its job on this model
        partial=[{"pass": rec.name, **(rec.not_applicable or {})} for rec in stages["recipe"]
                 if rec.essential_not_applied],
        target=target,
        route_stages=plan.route_stages.records,  # (the same list: stages run after this still land in it)
    )
    measured = measured_accuracy(plan.req.model, plan.req.recipe)
    if measured is not None:  # what this recipe costs on the model's family, measured on real weights
        report.measured_accuracy = measured
        if not measured["sane"]:
            report.accuracy_warning = (f"recipe {measured['recipe']} measured {measured['ppl_x_fp32']:.2f}x fp32 "
                                       f"perplexity on {measured['measured_on']} ({measured['family']} family; "
                                       f"{measured['results']})")
    u8s8 = {"int8_weight_range": plan.int8_weights, "guard": stages["guard"][0].to_json() if stages["guard"] else None}
    if measured_u8s8 is not None:
        u8s8.update(measured_u8s8)  # (block-wise: probed block by block)
    return report, u8s8


