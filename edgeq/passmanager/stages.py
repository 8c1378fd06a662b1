"""Named stages: the rewrites a route makes outside the recipe's passes (the static specialization's
steps, a VLM's fixed layout, the onnxruntime-kernels rewrite, genai's emission), each run with a
record as a pass has one, and under ``--dump-each`` / ``--verify`` like a pass.

A pass is a recipe's unit (configured, calibrated, idempotent, registered); a stage is a fixed step
of a route that always runs there. Both leave a record in report.json: a stage's is a
``StageRecord`` (time, ops added and removed, ``verified`` under ``--verify``), listed under the
graph it ran on (``static.stages`` for the pair's specialization, ``route_stages`` for the others).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from edgeq.errors import PassFailure
from edgeq.graph import ir


@dataclass
class StageRecord:
    """One named stage run on one graph (what a pass record says of a pass: time, ops added and
    removed, and ``verified`` under ``--verify``)."""

    name: str
    seconds: float
    ops_added: dict[str, int]
    ops_removed: dict[str, int]
    verified: bool | None = None
    graph: str | None = None  # the graph it ran on, where the list holds several graphs' stages

    @classmethod
    def between(cls, name: str, started: float, before: collections.Counter, after: collections.Counter,
                graph: str | None = None) -> StageRecord:
        """The record of a stage that began at ``started`` with ops ``before`` and left ``after``."""
        return cls(name, round(time.perf_counter() - started, 3), dict(sorted((after - before).items())),
                   dict(sorted((before - after).items())), graph=graph)

    def to_json(self) -> dict:
        out: dict = {} if self.graph is None else {"graph": self.graph}
        out.update({"name": self.name, "seconds": self.seconds, "ops_added": self.ops_added,
                    "ops_removed": self.ops_removed})
        if self.verified is not None:
            out["verified"] = self.verified
        return out


@dataclass(frozen=True)
class StageOptions:
    """``--dump-each`` and ``--verify`` for stages: each stage's graph saved as
    ``DIR/<prefix>-NN_<stage>.onnx`` and checked (onnx checker, onnxruntime session). Graphs whose
    weights stay in a block-wise compile's weights file are neither dumped nor verified stage by
    stage (their check is the writer's load-back)."""

    dump_each: Path | None = None
    verify: bool = False

    @property
    def active(self) -> bool:
        return self.verify or self.dump_each is not None


def check_stage_output(model: onnx.ModelProto, name: str, label: str, options: StageOptions, index: int) -> bool | None:
    """``--dump-each``: ``model`` saved as ``DIR/<label>-NN_<name>.onnx``; ``--verify``: the onnx
    checker and an onnxruntime session on it (a failure is the stage's, exit 1). None where not
    verified (no ``--verify``, or weights in a block-wise compile's file)."""
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return None  # (weights in a block-wise compile's file: see StageOptions)
    if options.dump_each is not None:
        ir.save_model(model, Path(options.dump_each) / f"{label}-{index:02d}_{name}.onnx")
    if not options.verify:
        return None
    try:
        onnx.checker.check_model(model)
        ir.make_session(model)
    except Exception as exc:  # noqa: BLE001 (any failure is the stage's)
        raise PassFailure(f"{name} ({label})", f"output graph does not verify: {exc}") from exc
    return True


@dataclass
class ModelStages:
    """Runs named stages on whole models (``onnx.ModelProto`` -> ``onnx.ModelProto``) and records
    each (``records``); ``--dump-each`` files are named ``route-NN_<stage>.onnx``."""

    options: StageOptions = field(default_factory=StageOptions)
    records: list[StageRecord] = field(default_factory=list)

    def run(self, name: str, graph: str, model: onnx.ModelProto,
            step: Callable[[onnx.ModelProto], onnx.ModelProto]) -> onnx.ModelProto:
        """``step(model)`` as the stage ``name`` on the graph named ``graph`` (``model.onnx``,
        ``vision.onnx``, ...); returns what it returned."""
        before = _ops(model)
        started = time.perf_counter()
        out = step(model)
        record = StageRecord.between(name, started, before, _ops(out), graph)
        if self.options.active:
            record.verified = check_stage_output(out, name, "route", self.options, len(self.records) + 1)
        self.records.append(record)
        return out

    def to_json(self) -> list[dict]:
        return [r.to_json() for r in self.records]


def _ops(model: onnx.ModelProto) -> collections.Counter:
    """The model's top-level nodes by op, named with their domain where it is not ONNX's own
    (``edgeq.ort:OnlineHadamard``: the kernels rewrite moves ops between domains)."""
    return collections.Counter(f"{n.domain}:{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                               for n in model.graph.node)
