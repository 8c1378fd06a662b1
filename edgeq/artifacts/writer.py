"""The one writer of a compile's output folder: ``write(result)`` for every route.

A route of ``edgeq.compiler`` (in memory, block-wise, ``--static``, ``--target ort-genai``)
returns a ``CompileResult``: the report, the encodings, what the manifest records, and its graphs
as a small per-kind writer (``ModelGraphs``, ``StaticGraphs``, ``edgeq.genai.write.GenaiGraphs``)
that puts them into the folder. ``write`` does the rest, the same for all of them.

Everything lands in a temporary folder next to the destination, renamed over it only when all of
it is written (``output_dir.atomic_output_dir``), in this order: the graphs (for one model ``model.onnx`` +
``model.onnx.data``; an onnxruntime session on the saved model: the output must load; the same
session measures the uint8 x int8 kernels' saturation risk for ``report.json``; after a
block-wise compile the weights file is moved in as it is, and the session only proves that the
model loads, the risk having been taken block by block); then ``write_records``:
``encodings.json`` (from the encodings the compiler read once); ``aimet_encodings.json``;
``report.json``; ``manifest.json`` last, so that it hashes the final file set, from the recipe
and input hashes recorded at the start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import onnx

from edgeq.graph import ir
from edgeq.graph.ir import check_loads
from edgeq.files import output_dir
from edgeq.artifacts.aimet import aimet_unsupported, write_aimet
from edgeq.artifacts.encodings import json_safe, strict_json, write_strict_json
from edgeq.artifacts.manifest import write_manifest
from edgeq.artifacts.report import CompileReport, OutputRecord, OutputStageRecord
from edgeq.runtime.peak_rss import peak_rss_mb


class Graphs(Protocol):
    def write_into(self, tmp: Path, report: CompileReport) -> int:
        """Write the graphs (and the files beside them) into ``tmp``, fill the report's sections
        that writing them measures (``u8s8``; a static pair's weights and context binaries; genai's
        check); returns the bytes of the graphs written (report.json's ``output_size_mb``)."""


class OutputStage(Protocol):
    """A named step that makes files from the written graphs inside the staging folder (a target's:
    ``edgeq.targets.qnn_htp``'s parts and context binaries, ``edgeq.genai.qnn_config``'s pipeline),
    filling its report section; ``write`` runs each in turn and records it (``output_stages``)."""

    name: str

    def run(self, folder: Path, report: CompileReport) -> None: ...


@dataclass
class CompileResult:
    """What a compile route hands to ``write``: nothing is written before."""

    out_dir: Path
    graphs: Graphs  # ModelGraphs | StaticGraphs | GenaiGraphs
    report: CompileReport  # the writer fills what it measures (sizes, time, peak RSS, u8s8)
    encodings: dict
    recipe: object  # the loaded Recipe (manifest: name, origin, sha256)
    input_model: dict  # manifest record of the input's files
    target: str | None
    started: float
    force: bool = False
    inputs: tuple = ()  # what must not be replaced (output_dir.check_output_dir)
    stages: list[OutputStage] = field(default_factory=list)  # run in order once the graphs are written


def write(result: CompileResult) -> CompileReport:
    """Write ``result``'s output folder atomically; returns the completed report."""
    with output_dir.atomic_output_dir(result.out_dir, force=result.force, inputs=result.inputs) as tmp:
        output_bytes = result.graphs.write_into(tmp, result.report)
        for stage in result.stages:
            output_bytes += run_output_stage(stage, tmp, result.report)
        write_records(tmp, result.report, result.encodings, result.recipe, result.input_model, result.target,
                      result.started, output_bytes)
    return result.report


def run_output_stage(stage: OutputStage, folder: Path, report: CompileReport) -> int:
    """Run ``stage`` in ``folder``; its record (seconds, the files it added with their bytes) goes
    into ``report.output_stages``; returns the bytes of graphs and weights it added at the top of
    the folder (counted in ``output_size_mb`` like the graphs')."""
    before = _files(folder)
    started = time.perf_counter()
    stage.run(folder, report)
    seconds = round(time.perf_counter() - started, 2)
    added = {name: size for name, size in _files(folder).items() if name not in before}
    report.output_stages.append(OutputStageRecord(stage.name, seconds, dict(sorted(added.items()))))
    return sum(size for name, size in added.items() if "/" not in name and Path(name).suffix in (".onnx", ".data"))


def _files(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


@dataclass
class ModelGraphs:
    """One ``model.onnx`` (+ ``model.onnx.data``).

    ``external_data``: the weights are already written (a block-wise compile streams them into
    this file as it goes, and ``model`` references them as ``model.onnx.data``): the file is moved
    in and only the graph is saved; ``u8s8`` then holds the risk measured block by block."""

    model: onnx.ModelProto
    u8s8: dict
    probe_feeds: dict | None = None
    external_data: Path | None = None

    def write_into(self, tmp: Path, report: CompileReport) -> int:
        model = self.model
        if self.external_data is not None and any(True for _ in ir.external_data_locations(model)):
            data = tmp / ("model.onnx" + ir.EXTERNAL_DATA_SUFFIX)
            Path(self.external_data).replace(data)
            output_dir.honour_umask(data)
            model_path = tmp / "model.onnx"
            onnx.save_model(model, str(model_path))
        else:
            model_path = ir.save_model(model, tmp / "model.onnx")
        if self.external_data is not None:  # block-wise: the bound came block by block; only prove it loads
            check_loads(model_path)
            report.u8s8 = self.u8s8
        else:
            report.u8s8 = _u8s8_report(model_path, self.probe_feeds, self.u8s8)
        return model_bytes(model_path)


@dataclass
class StaticGraphs:
    """The static pair (``compile --static``): ``prefill.onnx`` and ``decode.onnx`` over one
    ``weights.data`` (``edgeq.static.shared_weights``), each proven to load; the tokenizer files
    (``extra_files``) so that ``edgeq generate`` runs on the folder alone. What a target makes of
    the written pair (parts, QNN context binaries: ``edgeq.targets.qnn_htp``) are the result's
    output stages, run after these are written; ``models`` are left as written (their weights
    pointing at ``weights.data``) for them."""

    models: dict[str, onnx.ModelProto]
    u8s8: dict
    extra_files: list[Path] = field(default_factory=list)
    weights_dir: Path | None = None  # where initializers still stored as external data are (block-wise)

    def write_into(self, tmp: Path, report: CompileReport) -> int:
        from edgeq.static.shared_weights import save_sharing_weights

        weights = save_sharing_weights(self.models, tmp, source_dir=self.weights_dir)
        report.static = {**(report.static or {}), "weights": weights}
        first = tmp / next(iter(self.models))
        if self.weights_dir is not None:  # block-wise: the u8s8 records came block by block; only prove it loads
            report.u8s8 = self.u8s8
            check_loads(first)
        else:
            report.u8s8 = _u8s8_report(first, None, self.u8s8)  # (the worst-case bound; the same weights in both)
        for name in list(self.models)[1:]:
            check_loads(tmp / name)
        for file in self.extra_files:
            (tmp / file.name).write_bytes(file.read_bytes())
        return graph_bytes(tmp)


def graph_bytes(folder: Path) -> int:
    """The bytes of the graphs and weights files at the top of ``folder`` (report.json's ``output_size_mb``)."""
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".onnx", ".data"))


def write_records(tmp: Path, report: CompileReport, encodings: dict, recipe, input_model: dict, target: str | None,
                  started: float, output_bytes: int) -> None:
    """What every output folder gets after its graphs: encodings (ours and AIMET's), report (with
    time, peak RSS and sizes; serialized here, once) and, last, the manifest hashing the final file set."""
    write_strict_json(tmp / "encodings.json", encodings, encodings)
    write_aimet(tmp / "aimet_encodings.json", encodings, version="1.0.0", strict=False)
    report.output = OutputRecord(
        quantized_tensors={"activations": len(encodings["activations"]), "weights": len(encodings["weights"])},
        aimet_unsupported=aimet_unsupported(encodings, "1.0.0"),
        seconds_total=round(time.perf_counter() - started, 2),
        peak_rss_mb=peak_rss_mb(),
        input_size_mb=round(sum(f["size"] for f in input_model["files"].values()) / 2**20, 1),
        output_size_mb=round(output_bytes / 2**20, 1),
    )
    (tmp / "report.json").write_text(strict_json(json_safe(report.to_json(), default=_json_default)))
    write_manifest(input_model, recipe, target, tmp)
def model_bytes(path: Path) -> int:
    """The model file plus its external data files."""
    path = Path(path)
    total = path.stat().st_size
    for sibling in path.parent.glob(path.name + "*"):
        if sibling != path and sibling.is_file():
            total += sibling.stat().st_size
    return total


def _u8s8_report(model_path: Path, feeds: dict | None, u8s8: dict) -> dict:
    """What report.json says about onnxruntime's uint8 x int8 kernels: the weight range chosen,
    the guard's record, and per linear the worst-case pair bound and the VPMADDUBSW model's
    saturation rates on one calibration batch (without ``feeds``: the bound only). Either way an
    onnxruntime session is built on the saved model: it must load."""
    import onnx_graphsurgeon as gs

    from edgeq.targets.u8s8_sites import find_u8s8_sites, probe_saturation, static_risk

    out = dict(u8s8)
    model = onnx.load_model(str(model_path))
    if feeds is not None:
        out.update(probe_saturation(model, feeds))
        return out
    sites = find_u8s8_sites(gs.import_onnx(model))
    risk, linears = static_risk(sites), len(sites)
    del model, sites
    check_loads(model_path)
    out.update({"linears": linears, "linears_at_risk": len(risk), "saturation_free": not risk, "at_risk": risk,
                "note": "no calibration data: worst-case bound only, no saturation rates"})
    return out


def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


