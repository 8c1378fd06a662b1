"""The Pass base class: a named, classified graph rewrite with a frozen config.

A pass receives a graphsurgeon graph and a ``PassContext`` (calibration access, settings shared by
the pipeline). Where it applies, it rewrites the graph and returns ``PassResult(True, summary)``
(what it did). Where it does not, it raises ``PassNotApplicable(reason, detail, **counts)`` (a typed
``Reason``, a detail saying what it looked for, the counts it would report) before rewriting the
graph, and the pipeline records that as the pass's typed ``not_applicable``: the one way to say
"did not apply", always with a reason. ``PassResult`` cannot say ``modified=False`` without one
(``TypeError``), and the pipeline refuses, as an internal error (``PassFailure``), a ``run`` that
returns anything but an applied result. Running a pass a second time on its own output must not
apply (its marker: ``already-applied``; else it raises); the generic test harness checks that for
every registered pass.

The lifecycle belongs to the framework, not to each pass, and every pass declares its part in its
class line (``Pass.__init_subclass__`` refuses the same names set as plain class attributes):

- ``establishes``: the marker (an ``edgeq.graph.facts`` fact) a pass leaves on the graph. When it is
  already there, the pipeline does not run the pass and records ``already-applied``.
- ``requires``: passes that must come earlier. Recipes are checked against it when parsed. The
  pipeline records the outcome of every pass it runs and checks each required pass against its
  marker on the graph and its outcome earlier in the same run:

  - its marker is on the graph: satisfied, unless the marker records why the pass did not apply
    (``marks_when_not_applicable``): then the pass is skipped (``prerequisite-did-not-apply``, that reason);
  - it leaves a marker and there is none: skipped (``prerequisite-did-not-apply``: it did not apply,
    in this run or in the compile that made this graph), or refused (a one-line ``UserInputError``:
    put X before it) when it marks even where it does not apply (so it never ran);
  - it leaves no marker (``fuse-norms``, ``ln-to-rms``): satisfied by its outcome earlier in this
    run, applied or not (``no-sites``, ``structure-not-found``: the graph already has the form it
    makes); skipped when it was itself skipped for a prerequisite; refused when it did not run
    earlier in this pipeline.
- ``marks_when_not_applicable``: where the pass does not apply, the pipeline leaves its marker
  anyway, recording the reason (``JsonFact.reason_key``), so later compiles and the passes that
  require it read why (``resq`` -> ``resq-qdq``).
- ``needs``: the kind of graph the pass refuses to work without (``NEEDS``: ``vlm``, ``kv-cache``);
  the pass's own checks raise the ``UserInputError`` (they read its config), the declaration says
  which passes do (the test harness reads it).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar
from collections.abc import Callable, Mapping
from types import MappingProxyType

import onnx_graphsurgeon as gs

if TYPE_CHECKING:
    from edgeq.calib.session import Calibrator
    from edgeq.graph.facts import Fact


class Exactness(enum.Enum):
    """What a pass promises about outputs (see the docs: how a pass proves itself)."""

    EXACT = "exact"  # bitwise-equal outputs
    FLOAT_EQUIV = "float_equiv"  # equal at infinite precision; fp32 within a stated tolerance
    LOSSY = "lossy"  # quantization; measured by error against float


# fp32 tolerances (absolute, relative to the output's max magnitude) each class is tested at.
FLOAT_EQUIV_RTOL = 1e-4


@dataclass(frozen=True)
class PassConfig:
    """Base of every pass config; subclasses add typed fields with defaults."""


class Reason(enum.Enum):
    """Why a pass did not apply (typed, so reports and recipes can act on it)."""

    ALREADY_APPLIED = "already-applied"  # its marker is on the graph (set by the pipeline)
    STRUCTURE_NOT_FOUND = "structure-not-found"  # the structure it rewrites is not in this graph
    NO_SITES = "no-sites"  # the structure is there but nothing qualifies (no outlier channel, ...)
    PREREQUISITE_DID_NOT_APPLY = "prerequisite-did-not-apply"  # an earlier pass it builds on did not apply


@dataclass(frozen=True)
class NotApplicable:
    reason: Reason
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"reason": self.reason.value, "detail": self.detail}


@dataclass
class PassResult:
    """A pass's outcome. A pass's ``run`` returns one only where it applied: ``PassResult(True,
    summary)``. Every other outcome is the pipeline's, made from a ``PassNotApplicable`` (the pass's,
    or its own ``already-applied`` / ``prerequisite-did-not-apply`` skips: ``PassNotApplicable.result``)
    and carries the typed ``not_applicable``. So ``modified=False`` always comes with a reason: a
    result without one is refused when made (``TypeError``). ``modified=True`` with a reason is the
    pipeline's record of a ``marks_when_not_applicable`` pass that did not apply (it left the marker)."""

    modified: bool
    summary: dict[str, Any] = field(default_factory=dict)
    not_applicable: NotApplicable | None = None

    def __post_init__(self) -> None:
        if not self.modified and self.not_applicable is None:
            raise TypeError("PassResult(modified=False) without a reason: a pass that does not apply raises "
                            "PassNotApplicable(reason, detail, **counts) before rewriting the graph")


class PassNotApplicable(Exception):
    """The one way to say a pass did not apply: raised by its ``run`` (or a method it calls, e.g.
    ``analyze_stream``) with a typed ``reason``, a ``detail`` saying what it looked for and did not
    find, and the counts its summary would have (``**summary``). Raise it before rewriting the graph;
    a pass may leave its own marker first (``rms``, ``massive-split`` and ``muxq`` record the settings
    they ran with where no channel qualifies, so a later run is ``already-applied``). The pipeline
    catches it and records ``result()``: ``modified=False``, the typed ``not_applicable`` in
    report.json, the detail in the summary next to the counts. The pipeline's own skips
    (``already-applied``, ``prerequisite-did-not-apply``) are made the same way."""

    def __init__(self, reason: Reason, detail: str, /, **summary: Any):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.summary = summary

    def result(self) -> PassResult:
        """The record: the detail under the reason's usual key (``already_applied`` or
        ``not_applicable``) in front of the counts, and the typed reason."""
        key = "already_applied" if self.reason is Reason.ALREADY_APPLIED else "not_applicable"
        return PassResult(False, {key: self.detail, **self.summary}, NotApplicable(self.reason, self.detail))


# How 8-bit int8 weights read by uint8 x int8 kernels are quantized (PassContext.int8_weights):
# "u8s8-safe" (default): the pair-bounded grid no CPU kernel can saturate (edgeq.targets.saturation);
# "full-vnni-only": the full int8 grid, which onnxruntime's kernel saturates on CPUs without VNNI.
INT8_WEIGHT_RANGES = ("u8s8-safe", "full-vnni-only")


@dataclass
class PassContext:
    """What a pass may use besides the graph: calibration, and the int8 weight range the
    deployment allows (chosen by the target, never silently). Seeds are pass config (``rotate.seed``)."""

    calibrator: Calibrator | None = None
    int8_weights: str = "u8s8-safe"

    @property
    def u8s8_safe(self) -> bool:
        return self.int8_weights == "u8s8-safe"

    def require_calibrator(self, pass_name: str) -> Calibrator:
        from edgeq.errors import UserInputError

        if self.calibrator is None:
            raise UserInputError(f"pass '{pass_name}' needs calibration data: pass --calib FILE")
        return self.calibrator


# The kinds of graph a pass can need (``needs=``): on a graph of another kind it refuses with a
# ``UserInputError`` saying so (its own check: it reads the pass's config, e.g. msq's mask input).
NEEDS = {"vlm": "a vision-language graph with visual span inputs",
         "kv-cache": "a decoder graph with a KV cache (past_key_values inputs)"}

class Combine(enum.Enum):
    """How one figure of a pass's summary combines over the blocks of a block-wise compile (the
    ``combine=`` declaration, read by ``edgeq.blockwise.merge_records``): a count is summed over the
    blocks, but a model-wide property each block reports alike (``rotate``'s hidden size) is the
    first block's, an extreme the blocks' extreme."""

    SUM = "sum"  # counts (linears quantized, norms folded)
    MAX = "max"
    MIN = "min"
    MEAN = "mean"  # the blocks' unweighted mean
    FIRST = "first"  # the same in every block (the hidden size, the rotation's kind)
    ANY = "any"  # a flag set when any block set it
    CONCAT = "concat"  # lists joined in block order


# class-line keyword -> the attribute the framework reads (``Pass.__init_subclass__``)
_DECLARATIONS = {"name": "name", "exactness": "exactness", "config": "Config", "requires": "requires",
                 "establishes": "establishes", "calibrates": "calibrates", "summary": "summary_line",
                 "marks_when_not_applicable": "marks_when_not_applicable", "per_block": "per_block",
                 "needs": "needs", "combine": "summary_combine"}
# attribute -> keyword: only a class line sets these (``needs_calibration`` is what ``calibrates`` gives)
_LIFECYCLE = {**{attr: key for key, attr in _DECLARATIONS.items()}, "needs_calibration": "calibrates"}


def _check_declared(cls: type, declared: dict[str, Any]) -> None:
    """Each declared value has the type its keyword takes (a typo fails when the class is created)."""
    from edgeq.graph.facts import Fact, JsonFact

    def fail(key: str, expected: str) -> None:
        raise TypeError(f"{cls.__name__}: {key}= must be {expected}, got {declared[key]!r}")

    checks = {"name": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
              "exactness": (lambda v: isinstance(v, Exactness), "an Exactness"),
              "config": (lambda v: isinstance(v, type) and issubclass(v, PassConfig), "a PassConfig subclass"),
              "requires": (lambda v: isinstance(v, tuple) and all(isinstance(r, str) for r in v),
                           "a tuple of pass names"),
              "establishes": (lambda v: v is None or isinstance(v, Fact), "an edgeq.graph.facts fact"),
              "calibrates": (lambda v: isinstance(v, bool) or callable(v), "a bool or a function of the config"),
              "summary": (lambda v: isinstance(v, str), "a string"),
              "marks_when_not_applicable": (lambda v: isinstance(v, bool), "a bool"),
              "per_block": (lambda v: isinstance(v, bool), "a bool"),
              "needs": (lambda v: isinstance(v, tuple) and set(v) <= set(NEEDS), f"a tuple of {sorted(NEEDS)}"),
              "combine": (lambda v: isinstance(v, Mapping) and all(isinstance(k, str) and isinstance(c, Combine)
                                                                   for k, c in v.items()),
                          "a mapping of summary keys to Combine rules")}
    for key in declared:
        ok, expected = checks[key]
        if not ok(declared[key]):
            fail(key, expected)
    if declared.get("marks_when_not_applicable"):
        fact = declared.get("establishes", getattr(cls, "establishes", None))
        if not (isinstance(fact, JsonFact) and fact.reason_key):
            raise TypeError(f"{cls.__name__}: marks_when_not_applicable needs establishes= a JsonFact with a "
                            f"reason_key (the marker records why the pass did not apply)")


# The registry's table, pass name -> class: every class that declares a name is added when it is
# created. ``edgeq.passmanager.registry`` looks names up in it, after importing every module in ``passes/``;
# it lives here, below the registry, so that registering needs no import of the registry.
_PASSES: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Add ``cls`` to the table under its ``name`` (``Pass.__init_subclass__`` does it for every class
    that declares one); another class under a taken name is a ``ValueError``."""
    name = cls.name
    if name in _PASSES and _PASSES[name] is not cls:
        raise ValueError(f"pass name '{name}' registered twice")
    _PASSES[name] = cls
    return cls


class Pass(abc.ABC):
    """Subclass with the declaration in the class line, implement ``run``::

        class RotatePass(Pass, name="rotate", exactness=Exactness.FLOAT_EQUIV, config=RotateConfig,
                         requires=("fuse-norms", "ln-to-rms"), establishes=facts.ROTATED, summary="..."):
            def run(self, graph, ctx): ...

    Keywords: ``name``, ``exactness``, ``config`` (a frozen ``PassConfig`` subclass), ``requires``,
    ``establishes`` (an ``edgeq.graph.facts`` marker), ``calibrates`` (needs calibration data: a bool,
    or a function of the config for passes where that depends on it), ``marks_when_not_applicable``,
    ``per_block`` (block-wise compiles may run it), ``combine`` (how its summary's figures combine over
    blocks, ``Combine``), ``needs`` (kinds of graph, ``NEEDS``), ``summary``
    (the line ``edgeq passes`` prints). The class line is the only place for them: a class that sets
    one of their attributes (``name``, ``exactness``, ``Config``, ``requires``, ``establishes``,
    ``needs_calibration``, ``calibrates``, ``per_block``, ``summary_combine``, ``summary_line``,
    ``marks_when_not_applicable``, ``needs``) in its body is refused (``TypeError``). A class that
    declares a ``name`` is registered (``register_pass``; ``edgeq.passmanager.registry`` looks it up) when it is
    created; abstract bases that share code between passes (``StaticQDQ``, ``GptqRewrite``,
    ``SideBranchPass``) declare nothing, so each registered pass states its whole declaration (a
    registered pass subclassing another inherits what it does not restate).
    """

    name: ClassVar[str]
    exactness: ClassVar[Exactness]
    Config: ClassVar[type[PassConfig]] = PassConfig
    # Needs calibration data: a bool, or a function of the config (read through ``needs_calibration``).
    calibrates: ClassVar[bool | Callable[[Any], bool]] = False
    summary_line: ClassVar[str] = ""
    # Passes that must have run before this one (MLIR-style declared requirements): recipes are
    # checked against it, the pipeline against markers and this run's outcomes, the harness runs them first.
    requires: ClassVar[tuple[str, ...]] = ()
    # The marker this pass leaves (an edgeq.graph.facts fact); present -> the pipeline skips the pass.
    establishes: ClassVar[Fact | None] = None
    # True when the marker is left even where the pass does not apply (the pipeline writes it, with
    # the reason), so its absence means the pass never ran: passes requiring it are refused instead
    # of skipped, and skipped with the recorded reason where it did not apply.
    marks_when_not_applicable: ClassVar[bool] = False
    # True when the pass gives the same result on each decoder block of a model, compiled one block
    # at a time between the model's prologue and epilogue (``edgeq.blockwise``), as on the whole
    # model: it rewrites within a block and keys nothing on the block's position. Declared only
    # for passes tested that way (tests/test_blockwise.py).
    per_block: ClassVar[bool] = False
    # The kinds of graph (``NEEDS``) the pass refuses to work without.
    needs: ClassVar[tuple[str, ...]] = ()
    # How the top-level figures of its summary combine over blocks (``Combine``), for a per_block pass;
    # a figure not listed: counts summed, ``max_*``/``*_max`` (min, mean) their extreme (mean), lists joined
    # (``edgeq.blockwise.merge_records``).
    summary_combine: ClassVar[Mapping[str, Combine]] = MappingProxyType({})

    def __init_subclass__(cls, **declared: Any) -> None:
        unknown = sorted(set(declared) - set(_DECLARATIONS))
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown pass declaration(s) {unknown} (known: {sorted(_DECLARATIONS)})")
        in_body = sorted(attr for attr in _LIFECYCLE if attr in cls.__dict__)
        if in_body:
            raise TypeError(f"{cls.__name__}: {', '.join(in_body)} set in the class body; declare "
                            f"{', '.join(sorted({_LIFECYCLE[a] + '=' for a in in_body}))} in the class line instead")
        if declared and "name" not in declared and not hasattr(cls, "name"):
            raise TypeError(f"{cls.__name__}: declares {sorted(declared)} but no name: a shared base declares "
                            f"nothing, the registered pass (name=...) declares it all")
        _check_declared(cls, declared)
        super().__init_subclass__()
        for key, value in declared.items():
            setattr(cls, _DECLARATIONS[key], staticmethod(value) if key == "calibrates" and callable(value) else value)
        if "name" in declared:  # the declaration is the registration: one registry, no decorator to forget
            if not isinstance(getattr(cls, "exactness", None), Exactness):
                raise TypeError(f"{cls.__name__}: a registered pass declares its exactness= in the class line")
            register_pass(cls)

    @property
    def needs_calibration(self) -> bool:
        """Whether this configured instance needs calibration data (the ``calibrates`` declaration)."""
        calibrates = type(self).calibrates
        return bool(calibrates(self.config)) if callable(calibrates) else calibrates

    def marker_fields(self) -> dict[str, Any]:
        """What a ``marks_when_not_applicable`` pass's marker records beside the reason where the pass
        does not apply (default: nothing)."""
        return {}

    def __init__(self, config: PassConfig | None = None):
        self.config = config if config is not None else self.Config()
        if not isinstance(self.config, self.Config):
            raise TypeError(f"{self.name}: config must be {self.Config.__name__}")

    @abc.abstractmethod
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        """Rewrite ``graph`` in place and return ``PassResult(True, summary)``; where the pass does
        not apply, raise ``PassNotApplicable(reason, detail, **counts)`` before rewriting it (the
        pipeline refuses any other result)."""

    @property
    def output_exactness(self) -> Exactness:
        """What this configured instance promises. ``exactness`` is the class of the rewrite
        itself; a pass whose config also quantizes part of it (e.g. a W8A8 side branch) is LOSSY."""
        return self.exactness

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "exactness": self.output_exactness.value, "config": dataclasses.asdict(self.config)}
