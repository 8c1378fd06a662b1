"""``report.json`` as a typed record: one dataclass per section, one serialization.

Why: the report used to be a dict that four modules wrote keys into while the output was being
written, and that the CLI read back by string. Now each section is a field of ``CompileReport``
filled by the part of the compile that owns it, and ``to_json`` is the one place that turns it into
report.json's object (the JSON keys and their order are an interface: tools read them):

- the plan (``edgeq.compiler.build_report``): ``edgeq_version`` ... ``accuracy_warning``;
- the ``--static`` route: ``static`` (its graphs' ``weights`` added by ``StaticGraphs`` when it
  writes the shared weights file); QNN context binaries: ``qnn_context``;
- the ``--target ort-genai`` route: ``genai``;
- the graph writers (``edgeq.artifacts.writer``): ``u8s8``; ``write_records``: the counts, time,
  peak RSS and sizes (``OutputRecord``).

Sections whose contents are records of other modules (a pass's record from the pipeline, a target
check, the u8s8 probe, the static layout) stay JSON objects inside their typed section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgeq.passmanager.records import PassRecord
from edgeq.passmanager.stages import StageRecord
from edgeq.targets.qnn_context import QnnContextSection


@dataclass
class CompilePathSection:
    """``compile_path``: in memory or block-wise, and why."""

    blockwise: bool
    reason: str
    blocks: int | None

    def to_json(self) -> dict:
        return {"blockwise": self.blockwise, "reason": self.reason, "blocks": self.blocks}


@dataclass
class RecipeSection:
    """``recipe``: the recipe as it was read."""

    name: str
    description: str
    calibration: dict

    def to_json(self) -> dict:
        return {"name": self.name, "description": self.description, "calibration": self.calibration}


@dataclass
class TargetSection:
    """``target``: the profile the output was checked against, its lowering passes' records, the
    check (one per graph of a static pair) and the onnxruntime kernels it selected."""

    name: str
    description: str
    lowering: list[PassRecord]
    check: dict | None = None
    ort_kernels: list[str] | None = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "description": self.description,
                               "lowering": [r.to_json() for r in self.lowering], "check": self.check}
        if self.ort_kernels is not None:
            out["ort_kernels"] = self.ort_kernels
        return out


@dataclass
class GenaiSection:
    """``genai``: the onnxruntime-genai folder's graph and whether genai opened it."""

    accuracy_level: int
    linears: dict
    family: str
    nodes: dict
    context_length: int
    opened_by_onnxruntime_genai: str | None = None
    opened: bool = False  # whether the writer ran genai's check (the key is written only then)

    def to_json(self) -> dict:
        out = {"accuracy_level": self.accuracy_level, "linears": self.linears, "family": self.family,
               "nodes": self.nodes, "context_length": self.context_length}
        if self.opened:
            out["opened_by_onnxruntime_genai"] = self.opened_by_onnxruntime_genai
        return out


@dataclass
class OutputRecord:
    """What ``write_records`` measures once the graphs are written."""

    quantized_tensors: dict
    aimet_unsupported: Any
    seconds_total: float
    peak_rss_mb: float
    input_size_mb: float
    output_size_mb: float

    def to_json(self) -> dict:
        return {"quantized_tensors": self.quantized_tensors, "aimet_unsupported": self.aimet_unsupported,
                "seconds_total": self.seconds_total, "peak_rss_mb": self.peak_rss_mb,
                "input_size_mb": self.input_size_mb, "output_size_mb": self.output_size_mb}


@dataclass
class CalibrationSection:
    """``calibration``: the data the compile calibrated on (its description, samples, tokens) and
    what the calibrator did with it (onnxruntime runs, cache hits, seconds, tensors observed and
    every observed range)."""

    data: Any
    samples: int
    tokens: int
    onnxruntime_runs: int | None = None
    cache_hits: int | None = None
    seconds: float | None = None
    tensors_observed: int | None = None
    fingerprint_seconds: float | None = None
    ranges: Any = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"data": self.data, "samples": self.samples, "tokens": self.tokens}
        if self.onnxruntime_runs is not None:
            out.update({"onnxruntime_runs": self.onnxruntime_runs, "cache_hits": self.cache_hits,
                        "seconds": self.seconds, "tensors_observed": self.tensors_observed,
                        "fingerprint_seconds": self.fingerprint_seconds, "ranges": self.ranges})
        return out


@dataclass
class OutputStageRecord:
    """One output stage the writer ran on the written graphs (``edgeq.artifacts.writer.OutputStage``):
    its name, seconds, and each file it added (path in the folder -> bytes)."""

    name: str
    seconds: float
    files: dict[str, int]

    def to_json(self) -> dict:
        return {"name": self.name, "seconds": self.seconds, "files": self.files}


@dataclass
class CompileReport:
    """report.json. ``passes`` are the pipeline's records of the recipe's passes; ``partial`` the
    essential passes that did not apply (``--allow-partial``)."""

    edgeq_version: str
    input_model: str
    input_fingerprint: str
    compile_path: CompilePathSection
    recipe: RecipeSection
    passes: list[PassRecord]
    calibration: CalibrationSection | None
    partial: list[dict] = field(default_factory=list)
    target: TargetSection | None = None
    measured_accuracy: dict | None = None
    accuracy_warning: str | None = None
    static: dict | None = None
    genai: GenaiSection | None = None
    u8s8: dict | None = None
    qnn_context: QnnContextSection | None = None
    route_stages: list[StageRecord] = field(default_factory=list)  # the route's stages outside the passes
    output_stages: list[OutputStageRecord] = field(default_factory=list)
    output: OutputRecord | None = None

    @property
    def lowering(self) -> list[PassRecord]:
        return self.target.lowering if self.target is not None else []

    def to_json(self) -> dict:
        """report.json's object: the keys in the order tools have always read them, optional
        sections only where they apply."""
        out = {"edgeq_version": self.edgeq_version, "input_model": self.input_model,
               "input_fingerprint": self.input_fingerprint, "compile_path": self.compile_path.to_json(),
               "recipe": self.recipe.to_json(), "passes": [r.to_json() for r in self.passes],
               "calibration": self.calibration.to_json() if self.calibration is not None else None}
        optional = {"partial": self.partial or None, "target": self.target, "measured_accuracy": self.measured_accuracy,
                    "accuracy_warning": self.accuracy_warning, "static": self.static, "genai": self.genai,
                    "u8s8": self.u8s8, "qnn_context": self.qnn_context,
                    "route_stages": [r.to_json() for r in self.route_stages] or None,
                    "output_stages": [r.to_json() for r in self.output_stages] or None}
        for key, value in optional.items():
            if value is not None:
                out[key] = value.to_json() if hasattr(value, "to_json") else value
        if self.output is not None:
            out.update(self.output.to_json())
        return out
