"""The pass manager: runs passes in order under instruments (MLIR-style).

Every pass is timed, and its record has the process's peak RSS so far (``peak_rss_mb``: the
high-water mark after the pass, so the pass that raised it is the first with the new value).
Optional instruments, each after every pass:
- ``dump_each``: save the graph as ``NN_<pass>.onnx`` (external data) in a folder;
- ``verify``: onnx checker plus an onnxruntime session on the new graph (and first on the input:
  an input that does not verify is the user's, exit 2, not the first pass's failure);
- ``check_numerics``: run the graph on one reference sample and log the drift of every output
  against the input model's (max abs error, SQNR in dB).
A pass that raises ``PassNotApplicable`` did not apply: its record gets the typed
``not_applicable`` (reason, detail), the only way a record says ``modified: false``. Any other
exception, a ``run`` that returns anything but an applied ``PassResult(True, summary)``, or an
output that fails verification, becomes a ``PassFailure`` naming the pass (exit 1); a
``UserInputError`` from a pass passes through unchanged (exit 2). The pass lifecycle
(``Pass.establishes`` markers, ``Pass.requires`` read against the markers and the outcomes this run
recorded, ``marks_when_not_applicable``) is enforced here: see ``edgeq.passmanager.passbase``; so is
the recipe's ``essential`` mark: an essential pass that does not apply stops the run at once
(``EssentialPassNotApplied``, exit 4) unless ``allow_partial``, which records it and goes on.
"""

from __future__ import annotations

import collections
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.errors import EdgeqError, EssentialPassNotApplied, PassFailure, UserInputError
from edgeq.graph.facts import JsonFact
from edgeq.passmanager.passbase import NotApplicable, Pass, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.passmanager.records import PassRecord
from edgeq.runtime.peak_rss import peak_rss_mb
from edgeq.passmanager.registry import get_pass
from edgeq.quantize.sqnr import sqnr_db


@dataclass(frozen=True)
class PipelineOptions:
    dump_each: Path | None = None
    verify: bool = False
    check_numerics: bool = False
    essential: frozenset[int] = frozenset()  # positions of the passes the recipe cannot do without
    allow_partial: bool = False  # record an essential pass that did not apply instead of stopping
    recipe: str = ""  # named in the essential-pass error
    collect_garbage: bool = False  # after each pass (block-wise: a rewritten weight's old graph is cyclic garbage)


def output_drift(ref: list[np.ndarray], out: list[np.ndarray], names: list[str]) -> dict[str, dict[str, float | bool]]:
    drift: dict[str, dict[str, float | bool]] = {}
    for name, r, o in zip(names, ref, out):
        if not np.issubdtype(np.asarray(r).dtype, np.floating):
            drift[name] = {"equal": bool(np.array_equal(r, o))}
            continue
        diff = np.abs(np.asarray(r, np.float64) - np.asarray(o, np.float64))
        drift[name] = {"max_abs": float(diff.max(initial=0.0)), "mean_abs": float(diff.mean()) if diff.size else 0.0,
                       "sqnr_db": sqnr_db(r, o)}
    return drift


class Pipeline:
    def __init__(self, passes: list[Pass], options: PipelineOptions | None = None):
        self.passes = passes
        self.options = options or PipelineOptions()

    def run(self, model: onnx.ModelProto, ctx: PassContext, sample: dict[str, np.ndarray] | None = None,
            consume: bool = False):
        """Run every pass on ``model``; returns (new model, list of per-pass records).

        ``consume=True`` clears ``model`` once it is imported, so the weights are not held twice
        while passes run (the compiler does this; callers that reuse their proto do not). ``model``
        may also be a graphsurgeon graph already imported (block-wise compiles).
        """
        opts = self.options
        reference = None
        if opts.check_numerics:
            if sample is None:
                raise ValueError("check_numerics needs a sample input")
            ref_session = ir.make_session(model)
            out_names = [o.name for o in ref_session.get_outputs()]
            reference = ref_session.run(out_names, sample)
            del ref_session
        if opts.dump_each is not None:
            Path(opts.dump_each).mkdir(parents=True, exist_ok=True)
        input_problem = None
        if isinstance(model, gs.Graph):  # already imported (block-wise compiles build it from numpy)
            graph = model
        else:
            if opts.verify:  # a failure below that the input already had is the input's fault, not the pass's
                input_problem = self._verify(model)
            graph = ir.to_graph(model)
            if consume:
                model.Clear()
        records: list[PassRecord] = []
        outcomes: dict[str, PassResult] = {}  # pass name -> its outcome in this run (what ``requires`` reads)
        for i, p in enumerate(self.passes):
            ops_before = collections.Counter(n.op for n in graph.nodes)
            start = time.perf_counter()
            if ctx.calibrator is not None:
                ctx.calibrator.begin_pass(i)
            try:
                result = self._run_pass(p, graph, ctx, outcomes)
                outcomes[p.name] = result
                graph.cleanup().toposort()
                if ctx.calibrator is not None:
                    ctx.calibrator.end_pass(i, graph, p.needs_calibration, result.modified)
                if opts.collect_garbage:
                    gc.collect()
            except EdgeqError:
                raise
            except Exception as exc:  # noqa: BLE001 (any other exception is a bug in the pass)
                raise PassFailure(p.name, f"{type(exc).__name__}: {exc}") from exc
            seconds = time.perf_counter() - start
            ops_after = collections.Counter(n.op for n in graph.nodes)
            record = PassRecord(**p.describe(), seconds=round(seconds, 3), peak_rss_mb=peak_rss_mb(),
                                modified=result.modified, summary=result.summary,
                                ops_added=_counter_delta(ops_after, ops_before),
                                ops_removed=_counter_delta(ops_before, ops_after))
            if opts.verify or opts.dump_each is not None or opts.check_numerics:
                current = ir.to_model(graph)
                if opts.dump_each is not None:
                    ir.save_model(current, Path(opts.dump_each) / f"{i:02d}_{p.name}.onnx")
                if opts.verify:
                    problem = self._verify(current)
                    if problem is not None and input_problem is not None:
                        # (an input a pass can repair, e.g. edgeq ops without their function bodies
                        # before expand-functions, verifies after it; one it does not repair is the user's)
                        raise UserInputError(f"the input model does not verify: {input_problem}")
                    if problem is not None:
                        raise PassFailure(p.name, f"output graph does not verify: {problem}")
                    input_problem = None
                    record.verified = True
                if reference is not None:
                    session = ir.make_session(current)
                    out = session.run(out_names, sample)
                    record.numerics = output_drift(reference, out, out_names)
            if result.not_applicable is not None:
                record.not_applicable = result.not_applicable.to_dict()
            if i in opts.essential:
                self._require_applied(p, result, record)
            records.append(record)
        return ir.to_model(graph), records

    def _require_applied(self, p: Pass, result: PassResult, record: PassRecord) -> None:
        """An essential pass must have applied (or found its work already done); else stop here,
        before the passes after it run on a model the recipe cannot serve. A pass that did not
        apply has said why (``result.not_applicable``: ``PassResult`` has no other way)."""
        missed = result.not_applicable
        if missed is None or missed.reason is Reason.ALREADY_APPLIED:
            return
        if not self.options.allow_partial:
            raise EssentialPassNotApplied(self.options.recipe, p.name, missed.reason.value, missed.detail)
        record.not_applicable = missed.to_dict()
        record.essential_not_applied = True

    @staticmethod
    def _run_pass(p: Pass, graph, ctx: PassContext, outcomes: dict[str, PassResult]) -> PassResult:
        """The framework's side of a pass's lifecycle: skip it when its marker is on the graph;
        check what it requires against their markers and ``outcomes`` (the passes run earlier in
        this run: ``_unmet``); else run it. A pass that raises ``PassNotApplicable`` (before changing
        the graph) is recorded as skipped with its reason; one that ``marks_when_not_applicable``
        gets its marker, with the reason, wherever it does not apply. ``run`` returns only an applied
        result (``PassResult(True, summary)``): anything else is refused (``TypeError``, which
        ``run`` reports as the pass's ``PassFailure``)."""
        marker = p.establishes
        if marker is not None and marker.present(graph):
            return PassNotApplicable(Reason.ALREADY_APPLIED, marker.text(graph) or "").result()
        result = Pipeline._unmet(p, graph, outcomes)
        if result is None:
            try:
                result = p.run(graph, ctx)
            except PassNotApplicable as why:
                result = why.result()
            else:
                return _applied(p, result)
        if p.marks_when_not_applicable:  # the reason is left on the graph for the passes that require it
            # (the class declaration checks such a pass establishes a JsonFact; a result not applied carries why)
            cast(JsonFact, marker).set_not_applied(graph, cast(NotApplicable, result.not_applicable).detail,
                                                   **p.marker_fields())
            result.modified = True
        return result

    @staticmethod
    def _unmet(p: Pass, graph, outcomes: dict[str, PassResult]) -> PassResult | None:
        """None when every pass ``p`` requires is satisfied; a skip when one did not apply; raises
        ``UserInputError`` when one never ran (rules: ``edgeq.passmanager.passbase``). Recipes list them earlier
        (checked when parsed)."""
        never_ran, skip = [], None
        for name in p.requires:
            required = get_pass(name)
            needed = required.establishes
            if needed is None:  # no marker: this run's outcome is the only record that it ran
                outcome = outcomes.get(name)
                if outcome is None:
                    never_ran.append((name, f"{name} did not run earlier in this pipeline"))
                elif (missed := outcome.not_applicable) is not None and missed.reason is Reason.PREREQUISITE_DID_NOT_APPLY:
                    skip = skip or PassNotApplicable(Reason.PREREQUISITE_DID_NOT_APPLY,
                                                     f"{name} did not apply: {missed.detail}").result()
            elif not needed.present(graph):
                if required.marks_when_not_applicable:  # no marker at all: it never ran
                    never_ran.append((name, f"the graph has no '{needed.key}' marker: {needed.meaning}"))
                else:
                    skip = skip or PassNotApplicable(
                        Reason.PREREQUISITE_DID_NOT_APPLY,
                        f"{name} did not apply to this graph (no '{needed.key}' marker: {needed.meaning})").result()
            elif (why := needed.not_applied(graph)) is not None:
                skip = skip or PassNotApplicable(Reason.PREREQUISITE_DID_NOT_APPLY, f"{name} did not apply: {why}").result()
        if never_ran:
            raise UserInputError(f"{p.name}: put {', '.join(n for n, _ in never_ran)} before {p.name} "
                                 f"({'; '.join(why for _, why in never_ran)})")
        return skip

    @staticmethod
    def _verify(model: onnx.ModelProto) -> str | None:
        """onnx's checker and an onnxruntime session on ``model``: None, or the first line of what failed."""
        try:
            if model.ByteSize() < 1_800_000_000:
                onnx.checker.check_model(model)
            ir.make_session(model)
        except Exception as exc:  # noqa: BLE001
            return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None


def _applied(p: Pass, result: Any) -> PassResult:
    """``result`` when ``p.run`` returned an applied result; else a ``TypeError`` (an internal error:
    "did not apply" is said by raising ``PassNotApplicable``, never by a returned result)."""
    if isinstance(result, PassResult) and result.modified and result.not_applicable is None:
        return result
    got = (f"PassResult(modified={result.modified}, not_applicable={result.not_applicable})"
           if isinstance(result, PassResult) else type(result).__name__)
    raise TypeError(f"{p.name}: run returned {got}; a pass returns PassResult(True, summary) where it applied "
                    f"and raises PassNotApplicable(reason, detail, **counts) where it did not")


def _counter_delta(a: collections.Counter, b: collections.Counter) -> dict[str, int]:
    return {k: v for k, v in sorted((a - b).items())}
