"""The one writer of a compile's output folder.

Everything lands in a temporary folder next to the destination, renamed over it only when all of
it is written (``ir.atomic_output_dir``), in this order: ``model.onnx`` + ``model.onnx.data``; an
onnxruntime session on the saved model (the output must load; the same session measures the
uint8 x int8 kernels' saturation risk for ``report.json``; after a block-wise compile the weights
file is moved in as it is, and the session only proves that the model loads, the risk having been
taken block by block); ``encodings.json`` (from the
encodings the compiler read once); ``aimet_encodings.json``; ``report.json``; ``manifest.json``
last, so that it hashes the final file set, from the recipe and input hashes recorded at the start.
"""

from __future__ import annotations

import time
from pathlib import Path

import onnx

from edgeq import ir
from edgeq.artifacts.aimet import aimet_unsupported, write_aimet
from edgeq.artifacts.encodings import json_safe, strict_json
from edgeq.artifacts.manifest import write_manifest
from edgeq.peak_rss import peak_rss_mb


def write_outputs(out_dir: Path, model: onnx.ModelProto, report: dict, *, encodings: dict, recipe, input_model: dict,
                  target: str | None, u8s8: dict, probe_feeds: dict | None, started: float,
                  external_data: Path | None = None, force: bool = False, inputs: tuple = ()) -> dict:
    """Write every output file; returns the completed report.

    ``external_data``: the weights are already written (a block-wise compile streams them into
    this file as it goes, and ``model`` references them as ``model.onnx.data``): the file is moved
    in and only the graph is saved. ``force``, ``inputs``: what may be replaced (``ir.check_output_dir``)."""
    with ir.atomic_output_dir(out_dir, force=force, inputs=inputs) as tmp:
        if external_data is not None and any(True for _ in ir.external_data_locations(model)):
            data = tmp / ("model.onnx" + ir.EXTERNAL_DATA_SUFFIX)
            Path(external_data).replace(data)
            ir.honour_umask(data)
            model_path = tmp / "model.onnx"
            onnx.save_model(model, str(model_path))
        else:
            model_path = ir.save_model(model, tmp / "model.onnx")
        if external_data is not None:  # block-wise: the bound came block by block; only prove it loads
            _check_loads(model_path)
            report["u8s8"] = u8s8
        else:
            report["u8s8"] = _u8s8_report(model_path, probe_feeds, u8s8)
        _write_rest(tmp, report, encodings, recipe, input_model, target, started, model_bytes(model_path))
    return report


def _write_rest(tmp: Path, report: dict, encodings: dict, recipe, input_model: dict, target: str | None,
                started: float, output_bytes: int) -> None:
    """What every output folder gets after its graphs: encodings (ours and AIMET's), report (with
    time, peak RSS and sizes) and, last, the manifest hashing the final file set."""
    (tmp / "encodings.json").write_text(strict_json(encodings, encodings))
    report["quantized_tensors"] = {"activations": len(encodings["activations"]), "weights": len(encodings["weights"])}
    write_aimet(tmp / "aimet_encodings.json", encodings, version="1.0.0", strict=False)
    report["aimet_unsupported"] = aimet_unsupported(encodings, "1.0.0")
    report["seconds_total"] = round(time.perf_counter() - started, 2)
    report["peak_rss_mb"] = peak_rss_mb()
    report["input_size_mb"] = round(sum(f["size"] for f in input_model["files"].values()) / 2**20, 1)
    report["output_size_mb"] = round(output_bytes / 2**20, 1)
    (tmp / "report.json").write_text(strict_json(json_safe(report, default=_json_default)))
    write_manifest(input_model, recipe, target, tmp)


def model_bytes(path: Path) -> int:
    """The model file plus its external data files."""
    path = Path(path)
    total = path.stat().st_size
    for sibling in path.parent.glob(path.name + "*"):
        if sibling != path and sibling.is_file():
            total += sibling.stat().st_size
    return total


def _check_loads(model_path: Path) -> None:
    """An onnxruntime session on the saved model, built the cheapest way (no graph optimizations,
    no weight prepacking): the output must load, and a large one must not be held twice to show it."""
    import onnxruntime as ort

    so = ir.session_options(optimize=False)
    so.add_session_config_entry("session.disable_prepacking", "1")
    ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])


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
    _check_loads(model_path)
    out.update({"linears": linears, "linears_at_risk": len(risk), "saturation_free": not risk, "at_risk": risk,
                "note": "no calibration data: worst-case bound only, no saturation rates"})
    return out


def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def write_static_outputs(out_dir: Path, models: dict[str, onnx.ModelProto], report: dict, *, encodings: dict, recipe,
                         input_model: dict, target: str | None, u8s8: dict, started: float,
                         extra_files: list[Path] = (), force: bool = False, inputs: tuple = (),
                         after_graphs=None) -> dict:
    """The folder of a static pair (``compile --static``): ``prefill.onnx`` and ``decode.onnx``
    over one ``weights.data`` (``edgeq.static.shared_weights``), each proven to load; one
    ``encodings.json`` (the two graphs carry the same quantization parameters, checked by the
    caller); the tokenizer files (``extra_files``) so that ``edgeq generate`` runs on the folder
    alone; report and manifest as for one model. ``after_graphs(folder)``: more outputs made from
    the written graphs (QNN context binaries), before the report and the manifest list them."""
    from edgeq.static.shared_weights import save_sharing_weights

    with ir.atomic_output_dir(out_dir, force=force, inputs=inputs) as tmp:
        report["static"]["weights"] = save_sharing_weights(models, tmp)
        first = tmp / next(iter(models))
        report["u8s8"] = _u8s8_report(first, None, u8s8)  # (the worst-case bound; the same weights in both)
        for name in list(models)[1:]:
            _check_loads(tmp / name)
        for file in extra_files:
            (tmp / file.name).write_bytes(file.read_bytes())
        graphs = sum(f.stat().st_size for f in tmp.iterdir() if f.suffix in (".onnx", ".data"))
        if after_graphs is not None:
            after_graphs(tmp)
        _write_rest(tmp, report, encodings, recipe, input_model, target, started, graphs)
    return report
