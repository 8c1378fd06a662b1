"""``edgeq compile``'s plan: everything that can be refused is checked before any work, and the
route decided once (``plan_compile``), into a frozen ``CompilePlan`` that ``edgeq.compiler``'s routes
run.

Checked here: the output folder and the ``--dump-each`` folder, the recipe, the target and its options
(``edgeq.targets.qnn_htp``, ``edgeq.targets.ort_genai``), the model (its structure, an onnxruntime
session on it, its weights finite: ``edgeq.graph.loadcheck``; its opset), a static shape or a static
VLM layout, the calibration data. Taken once for what the outputs must record: the recipe as read,
the input model's file hashes, its fingerprint. The route (``Route``): in memory, block-wise (by
``--blockwise`` and the model's size), ``--static``, ``--target ort-genai``.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from edgeq.artifacts.manifest import input_model_record
from edgeq.artifacts.report import CalibrationSection
from edgeq.calib.dataset import InputLimits, build_calibration_set
from edgeq.calib.session import Calibrator
from edgeq.errors import UserInputError
from edgeq.files import output_dir
from edgeq.graph import ir
from edgeq.graph.fingerprint import model_fingerprint
from edgeq.graph.loadcheck import check_onnxruntime
from edgeq.passmanager.passbase import Pass
from edgeq.passmanager.registry import get_pass
from edgeq.passmanager.stages import ModelStages, StageOptions
from edgeq.recipes import DEFAULT_RECIPE, Recipe, load_recipe
from edgeq.targets import TargetProfile, load_target
from edgeq.targets.ort_genai import OrtGenaiOptions
from edgeq.targets.qnn_htp import QnnHtpOptions
from edgeq.textdata import default_tokenizer_dir

if TYPE_CHECKING:  # (imported where the plan needs them: the block-wise and static modules load only when used)
    from edgeq.blockwise.partition import Partition
    from edgeq.static.specialize import StaticShape
    from edgeq.static.vlm import StaticVlm

BLOCKWISE_MODES = ("auto", "on", "off")
# models at least this large (weights on disk) compile block-wise under --blockwise auto
BLOCKWISE_MIN_BYTES = 256 * 2**20  # SmolLM2 (514 MB) compiles block-wise: 1.4x its size instead of 7x in memory
# --static compiles block-wise under --blockwise auto from this size: below it the in-memory static
# route (about 5x the fp32 weights at peak, 2.6 GB for SmolLM2) is the measured default; above it
# (a 1B model: ~35 GB in memory) only the block-wise form fits a 24 GB machine
STATIC_BLOCKWISE_MIN_BYTES = 2**30


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
    blockwise: str = "auto"  # "auto" | "on" | "off": compile one decoder block at a time
    static: tuple[int, int] | None = None  # (prefill, context): write the static prefill/decode pair
    force: bool = False  # replace a non-empty out_dir that edgeq did not write (output_dir.check_output_dir)
    qnn_htp: QnnHtpOptions = QnnHtpOptions()  # --target qnn-htp: context binaries, parts (edgeq.targets.qnn_htp)
    ort_genai: OrtGenaiOptions = OrtGenaiOptions()  # --target ort-genai: the folder's settings (edgeq.targets.ort_genai)


class Route(enum.Enum):
    """How a compile runs and what it writes; decided once per compile (``choose_route``)."""

    IN_MEMORY = "in-memory"  # the whole model in one graph: model.onnx
    BLOCKWISE = "blockwise"  # one decoder block at a time, weights streamed out: model.onnx
    STATIC = "static"  # --static: the prefill/decode pair over one weights file
    GENAI = "genai"  # --target ort-genai: the folder onnxruntime-genai opens


@dataclass(frozen=True)
class CompilePlan:
    """What the routes need, all validated; never changed once made."""

    req: CompileRequest
    recipe: Recipe
    profile: TargetProfile | None
    passes: list[Pass]  # recipe, then target lowering, then the guard
    counts: tuple[int, int]  # how many of ``passes`` are the recipe's and the lowering's
    int8_weights: str
    input_model: dict  # manifest record: file hashes
    fingerprint: str
    calibrator: Calibrator | None
    calibration: CalibrationSection | None
    sample: dict | None
    started: float
    route: Route
    partition: Partition | None = None  # when compiling block-wise
    blockwise_reason: str = ""  # why this path was chosen (report.json)
    static_shape: StaticShape | None = None  # with --static
    static_vlm: StaticVlm | None = None  # --static of a VLM (the fixed visual slice)
    # the route's named stages outside the passes (ort-kernels, a VLM's layout, genai's emission),
    # recorded as they run: report.json's route_stages
    route_stages: ModelStages = dataclasses.field(default_factory=ModelStages)


def plan_compile(req: CompileRequest) -> tuple[CompilePlan, onnx.ModelProto]:
    """The validated plan and the model it read (without its weights when compiling block-wise),
    which the route consumes."""
    started = time.perf_counter()
    _check_out_dir(req)
    recipe = load_recipe(req.recipe)
    profile = load_target(req.target) if req.target else None
    passes = [spec.build() for spec in recipe.passes]
    lowering = [get_pass(name)() for name in profile.lowering] if profile else []
    # every compile that may run on onnxruntime CPU ends with the saturation guard, unless the
    # target allows full-range int8 weights (ort-cpu-vnni): docs/cpu-int8-kernels.md
    int8_weights = profile.int8_weight_range if profile else "u8s8-safe"
    guard = [get_pass("u8s8-safe-weights")()] if int8_weights == "u8s8-safe" else []
    model, locations = ir.load_model_and_locations(req.model, load_external=False)
    ir.check_opset(model)
    req.qnn_htp.validate(req.static is not None, profile.vendor if profile else None)
    budget = req.qnn_htp.budget_bytes
    if budget is not None:  # a table no part can hold: refused now, not after the blocks
        from edgeq.static.split import check_tables_fit, stored_table_bits

        check_tables_fit(model, budget, stored_table_bits(lowering))
    _check_genai(req, profile, recipe)
    static_shape = None
    if req.static is not None:
        from edgeq.static.specialize import cache_layout

        static_shape = cache_layout(model, *req.static)
        if recipe.kv_cache.dtype != "float32":
            static_shape = dataclasses.replace(static_shape, cache_dtype=recipe.kv_cache.dtype)
    static_vlm = _plan_static_vlm(req, model, recipe) if req.static is not None else None
    if static_vlm is not None:  # the recipe as run: without the passes the fixed layout realizes (aifs)
        static_vlm, recipe = static_vlm
        passes = [spec.build() for spec in recipe.passes]
    route, part, why = choose_route(req, profile, model, passes + lowering + guard, locations)
    if static_vlm is not None and part is not None:
        raise UserInputError("--static of a VLM compiles in memory: drop --blockwise on")
    # before any work, what the structural check at load cannot see (edgeq.graph.loadcheck): a model
    # onnxruntime refuses (one session, its weights mapped, not read) and a weight holding NaN or inf
    check_onnxruntime(model, req.model, external=bool(locations))
    if part is None and locations:  # in memory: read the weights too, each judged as it is read
        del model
        model, locations = ir.load_model_and_locations(req.model, finite=True)
    else:  # weights inside the .onnx (in memory already), or block-wise: streamed from their files
        ir.check_finite(model, req.model)
    windows = recipe.calibration.windows if req.calib_windows is None else req.calib_windows
    seq_len = recipe.calibration.seq_len if req.seq_len is None else req.seq_len
    if windows < 1 or seq_len < 2:
        raise UserInputError("--calib-windows must be >= 1 and --seq-len >= 2")
    calibrator = sample = calibration = None
    if any(p.needs_calibration for p in passes + lowering) or req.check_numerics:
        if req.calib is None:
            raise UserInputError(f"recipe '{recipe.name}' needs calibration data: pass --calib FILE (text or .npz)")
        tokenizer = req.tokenizer or default_tokenizer_dir(req.model)
        data = build_calibration_set(req.calib, ir.input_specs(model), tokenizer, windows, seq_len,
                                     recipe.calibration.batch_size, InputLimits.of(model, req.model))
        calibrator = Calibrator(data, use_cache=req.use_cache)
        sample = data.batches[0]
        calibration = CalibrationSection(data.description, data.samples, data.tokens)
    fingerprint = model_fingerprint(model, ir.model_folder(req.model))
    plan = CompilePlan(req, recipe, profile, passes + lowering + guard, (len(passes), len(lowering)), int8_weights,
                       input_model_record(req.model, locations), fingerprint, calibrator,
                       calibration, sample, started, route, part, why, static_shape=static_shape,
                       static_vlm=static_vlm, route_stages=ModelStages(StageOptions(req.dump_each, req.verify)))
    return plan, model


def _plan_static_vlm(req: CompileRequest, model: onnx.ModelProto, recipe: Recipe):
    """(layout, recipe as run) for ``--static`` of a VLM language graph (``edgeq.static.vlm``), else None."""
    from edgeq.static.vlm import is_vlm_graph, plan_static_vlm

    if not is_vlm_graph(model):
        return None
    assert req.static is not None  # (planned only with --static)
    return plan_static_vlm(req.model, model, recipe, req.static[0], req.calib,
                           split=req.qnn_htp.max_context_mb is not None, shared=req.qnn_htp.share_weights)


def choose_route(req: CompileRequest, profile: TargetProfile | None, skeleton: onnx.ModelProto,
                 passes: list[Pass], locations: set[str]) -> tuple[Route, Partition | None, str]:
    """(route, partition, reason) for this compile, decided once: ``--target ort-genai`` compiles
    the whole with-past graph in memory (``--blockwise on`` is refused with it); ``--static``
    compiles its with-past graph block-wise from ``STATIC_BLOCKWISE_MIN_BYTES`` (or with
    ``--blockwise on``), else in memory; otherwise block-wise or in memory by ``--blockwise`` and
    the model's size."""
    if req.blockwise not in BLOCKWISE_MODES:
        raise UserInputError(f"--blockwise must be one of {', '.join(BLOCKWISE_MODES)}")
    if req.static is not None:
        part, why = _choose_path(req, skeleton, passes, locations, STATIC_BLOCKWISE_MIN_BYTES)
        return Route.STATIC, part, f"--static: the with-past graph {'block by block' if part else 'in memory'} ({why})"
    if profile is not None and profile.vendor == "ort-genai":  # the genai writer reads the whole result
        if req.blockwise == "on":
            raise UserInputError("--target ort-genai compiles in memory: drop --blockwise on")
        return Route.GENAI, None, "--blockwise off"
    part, why = _choose_path(req, skeleton, passes, locations)
    return (Route.IN_MEMORY if part is None else Route.BLOCKWISE), part, why


def _choose_path(req: CompileRequest, skeleton: onnx.ModelProto, passes: list[Pass], locations: set[str],
                 min_bytes: int = BLOCKWISE_MIN_BYTES) -> tuple[Partition | None, str]:
    """(partition, reason): a ``Partition`` to compile block-wise, or None for the in-memory path
    (under ``--blockwise auto``, models under ``min_bytes`` on disk)."""
    from edgeq.blockwise import NotPartitionable, partition

    if req.blockwise == "off":
        return None, "--blockwise off"
    base = ir.model_folder(req.model)
    size = req.model.stat().st_size + sum((base / loc).stat().st_size for loc in locations)
    forced = req.blockwise == "on"
    if not forced and size < min_bytes:
        return None, f"model under {min_bytes >> 20} MB: in memory"
    blockers = sorted({p.name for p in passes if not p.per_block})
    if req.dump_each or req.verify or req.check_numerics:
        blockers.append("--dump-each/--verify/--check-numerics (whole-graph instruments)")
    if blockers:
        if forced:
            raise UserInputError(f"--blockwise on: cannot compile block by block with {', '.join(blockers)}")
        return None, f"in memory: {', '.join(blockers)} need the whole graph"
    try:
        return partition(skeleton), "block-wise" + ("" if forced else f": model {size / 2**20:.0f} MB")
    except NotPartitionable as exc:
        if forced:
            raise UserInputError(f"--blockwise on: the graph does not split into decoder blocks: {exc}") from None
        return None, f"in memory: the graph does not split into blocks ({exc})"


def _check_genai(req: CompileRequest, profile: TargetProfile | None, recipe: Recipe) -> None:
    """--target ort-genai: its settings, and a weight-only recipe on a with-past Llama-form export
    (refused before any work)."""
    genai = profile is not None and profile.vendor == "ort-genai"
    req.ort_genai.validate(genai, req.static is not None)
    if genai:
        from edgeq.genai import check_recipe, read_config

        check_recipe(recipe)
        read_config(req.model)


def compile_inputs(req: CompileRequest) -> tuple[Path, ...]:
    """The files the compile reads, whose folders the output must not replace (nor any folder above)."""
    named = [req.model, req.calib, req.tokenizer, req.recipe, req.target]
    return tuple(Path(p) for p in named if p is not None and (p is req.model or Path(p).exists()))


def _check_out_dir(req: CompileRequest) -> None:
    """Refuse, before any work is done, an output folder that must not or cannot be replaced
    (``output_dir.check_output_dir``) and a ``--dump-each`` folder that cannot hold the dumps."""
    output_dir.check_output_dir(req.out_dir, force=req.force, inputs=compile_inputs(req))
    if req.dump_each is not None:
        output_dir.check_dump_each(req.dump_each, req.out_dir.resolve(), req.force)
