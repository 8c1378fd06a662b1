"""Does edgeq's ``aimet_encodings.json`` mean in AIMET-ONNX what it means in edgeq's own graph?

edgeq writes ``aimet_encodings.json`` beside every compiled model so that Qualcomm's tools take
edgeq's grid instead of calibrating again (``qnn-onnx-converter --quantization_overrides``, or
AIMET-ONNX's ``load_encodings_to_sim``). This script checks that claim with Qualcomm's own loader:

1. The float graph the file describes: edgeq's compiled graph with every activation
   QuantizeLinear -> DequantizeLinear pair removed and every weight DequantizeLinear folded into a
   float initializer named after its output (edgeq keys weights by that name, see
   edgeq/artifacts/aimet.py; for recipes that rewrite the model, rotations and all, this is the
   only float graph whose weights are edgeq's).
2. ``QuantizationSimModel`` on that graph (int8 params, int16 activations, min/max, the HTP config
   AIMET's LLM flows use), then ``load_encodings_to_sim(sim, aimet_encodings.json, strict=False)``:
   every quantizer named in the file takes edgeq's scale/offset/bitwidth/symmetry, every other
   quantizer is disabled (AIMET's ``disable_missing_quantizers``). strict=False because AIMET's
   sim starts with a quantizer on every activation, edgeq quantizes only some; the mismatches it
   reports are recorded, and any encoding AIMET cannot place fails the run.
3. The same inputs through AIMET's sim (its own QcQuantizeOp kernels in onnxruntime) and through
   edgeq's compiled graph in onnxruntime CPU with exact QDQ (Q/DQ evaluated as written): at every
   quantized activation, the two dequantized tensors must agree within one quantization step of
   that tensor's encoding (max |difference| / scale <= 1); the logits are compared too (relative
   L2, top-1 agreement). The same comparison against onnxruntime's default session (integer
   kernels) is reported beside it.
4. With ``--float MODEL.onnx`` (the original fp32 graph the model was compiled from) the file is
   also loaded into a sim built on that graph, and the result (loaded, or AIMET's exact error) is
   recorded: that is the "same graph" a user who never saw edgeq's compiled model would try.

Runs with ``.venvs/aimet-onnx/bin/python`` (benchmarks/peers/venvs.py builds it from
benchmarks/peers/pins.toml); imports only aimet_onnx, onnx, onnxruntime, numpy. Inputs are either
``--npz`` (arrays named like the model's inputs, [samples, 1, seq], as ``edgeq compile --calib``
takes) or ``--ids`` (a [windows, tokens] .npy of token ids, e.g. benchmarks/peers.py's
eval-40x512.npy, fed with an all-ones mask and positions 0..n-1).

    .venvs/aimet-onnx/bin/python benchmarks/aimet_interop.py --compiled OUT_DIR --ids EVAL.npy \\
        --windows 2 [--float FP32.onnx] --out benchmarks/results/aimet-interop-DATE.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STEP_LIMIT = 1  # agreement required: within one quantization step of each tensor's encoding


def steps(diff: np.ndarray, scale) -> np.ndarray:
    """|difference| in whole quantization steps: both sides lie on the same grid, so the quotient is
    an integer up to float32 rounding of the dequantized values (which grows with |q|, ~1e-3 of a
    step at |q| ~ 1e4 for int16), hence rounded to the nearest integer."""
    return np.rint(np.abs(diff) / scale)


def machine() -> dict:
    """edgeq.evaluate.machine.machine_info() (CPU model, ISA flags, cores), loaded from its file:
    that module needs only the standard library, while importing the edgeq package would need
    edgeq's own dependencies, which the aimet-onnx venv does not have."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "edgeq" / "evaluate" / "machine.py"
    spec = importlib.util.spec_from_file_location("_edgeq_machine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.machine_info()


def feeds_from_args(args) -> list[dict[str, np.ndarray]]:
    if args.npz:
        data = np.load(args.npz)
        n = next(iter(data.values())).shape[0]
        samples = [{k: np.asarray(v[i]) for k, v in data.items()} for i in range(n)]
    else:
        ids = np.load(args.ids)
        samples = []
        for w in ids:
            w = np.asarray(w, np.int64).reshape(1, -1)
            samples.append({"input_ids": w, "attention_mask": np.ones_like(w),
                            "position_ids": np.arange(w.shape[1], dtype=np.int64)[None]})
    return samples[: args.windows] if args.windows else samples


def float_graph_of(compiled):
    """edgeq's compiled graph without its quantization: activation Q->DQ pairs removed (consumers
    read the float tensor again) and weight DequantizeLinear folded into a float initializer that
    carries the DequantizeLinear's output name (the name edgeq's aimet_encodings.json uses).
    Returns (model, activation sites {float tensor: its DQ output in the compiled graph}, the
    folded weight names, {float tensor: (scale, zero point) of its QuantizeLinear})."""
    import onnx
    from onnx import numpy_helper

    model = onnx.ModelProto()
    model.CopyFrom(compiled)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    rename, drop, sites, folded, qparams = {}, [], {}, [], {}

    def const(name):
        return numpy_helper.to_array(inits[name]) if name and name in inits else None

    for node in graph.node:
        if node.op_type != "DequantizeLinear":
            continue
        src = producer.get(node.input[0])
        if src is not None and src.op_type == "QuantizeLinear":  # activation Q -> DQ
            rename[node.output[0]] = src.input[0]
            sites[src.input[0]] = node.output[0]
            zp = const(src.input[2]) if len(src.input) > 2 else np.zeros((), np.uint8)
            qparams[src.input[0]] = (const(src.input[1]), zp)
            drop += [src.output[0], node.output[0]]  # one Q may feed several DQs: a set below
        elif node.input[0] in inits:  # weight: integer initializer -> DQ
            q = const(node.input[0]).astype(np.float64)
            scale = const(node.input[1]).astype(np.float64)
            zp = const(node.input[2]) if len(node.input) > 2 else None
            zp = np.zeros_like(scale) if zp is None else zp.astype(np.float64)
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
            if scale.ndim == 0:
                w = (q - zp) * scale
            elif block:
                w = (q - np.repeat(zp, block, axis=axis)) * np.repeat(scale, block, axis=axis)
            else:
                shape = [1] * q.ndim
                shape[axis] = -1
                w = (q - zp.reshape(shape)) * scale.reshape(shape)
            graph.initializer.append(numpy_helper.from_array(w.astype(np.float32), node.output[0]))
            folded.append(node.output[0])
            drop.append(node.output[0])
        else:
            raise SystemExit(f"DequantizeLinear {node.name} reads {node.input[0]}, neither a QuantizeLinear nor an "
                             "initializer: this script does not know that form")
    drop = set(drop)
    kept = [n for n in graph.node if n.output[0] not in drop]
    del graph.node[:]
    graph.node.extend(kept)
    for n in graph.node:
        for i, name in enumerate(n.input):
            if name in rename:
                n.input[i] = rename[name]
    for out in graph.output:
        if out.name in rename:
            raise SystemExit(f"graph output {out.name} is a DequantizeLinear output; not handled")
    used = {i for n in graph.node for i in n.input}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return model, sites, folded, qparams


def onnx_qdq(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
    """ONNX QuantizeLinear -> DequantizeLinear, per tensor, as onnxruntime evaluates it: x / scale in
    float32, rounded half to even, plus the zero point, saturated to the zero point's type."""
    info = np.iinfo(zero_point.dtype)
    q = np.rint(x.astype(np.float32) / np.float32(scale)).astype(np.float64) + float(zero_point)
    q = np.clip(q, info.min, info.max)
    return ((q - float(zero_point)) * np.float32(scale)).astype(np.float32)

def build_sim(model, workdir: str):
    from aimet_onnx.common.defs import QuantScheme
    from aimet_onnx.quantsim import QuantizationSimModel
    from aimet_onnx.utils import duplicate_shared_initializers

    duplicate_shared_initializers(model.graph)  # tied embedding / lm_head tables (AIMET's own advice)
    return QuantizationSimModel(model, param_type="int8", activation_type="int16", quant_scheme=QuantScheme.min_max,
                                config_file="htp_v81", path=workdir)


def load(sim, encodings_path: Path) -> dict:
    """load_encodings_to_sim, strict=False; what AIMET reported, summarised."""
    from aimet_onnx.quantsim import load_encodings_to_sim

    mismatches = load_encodings_to_sim(sim, str(encodings_path), strict=False)
    kinds: dict[str, int] = {}
    examples: dict[str, str] = {}
    for m in mismatches:
        for field in ("enabled_mismatch", "dtype_mismatch", "bitwidth_mismatch", "is_symmetric_mismatch",
                      "is_strict_symmetric_mismatch", "is_unsigned_symmetric_mismatch", "enc_type_mismatch"):
            value = getattr(m, field, None)
            if value:
                kinds[field] = kinds.get(field, 0) + 1
                examples.setdefault(field, f"{m.quantizer_name}: {value}")
    enabled = sum(1 for q in sim.qc_quantize_op_dict.values() if q.enabled)
    return {"mismatches_reported": len(mismatches), "by_kind": kinds, "examples": examples,
            "quantizers_in_sim": len(sim.qc_quantize_op_dict), "quantizers_enabled_after_load": enabled}


def sim_outputs(sim, feeds: dict, names: list[str], params: list[str]) -> dict[str, np.ndarray]:
    """The sim's logits; for each activation name its quantizer's input (``NAME``) and output
    (``NAME_updated``); for each parameter name its quantizer's output (``NAME_qdq``)."""
    from aimet_onnx.utils import (
        OrtInferenceSession,
        add_hook_to_get_activation,
        remove_activation_hooks,
    )

    wanted = [*names, *(f"{n}_updated" for n in names), *(f"{p}_qdq" for p in params)]
    hooks = [add_hook_to_get_activation(sim.model.model, n) for n in wanted]
    try:
        sess = OrtInferenceSession(sim.model.model, ["CPUExecutionProvider"],
                                   session_options=sim._ort_session_options,  # the sim's own options: its custom ops
                                   path=sim._path, save_as_external_data=True)
        outs = sess.run(None, feeds)
        order = [o.name for o in sess.get_outputs()]
    finally:
        remove_activation_hooks(sim.model.model, hooks)
    got = dict(zip(order, outs))
    # the sim's first output is the model's logits (renamed logits_updated when AIMET put an output
    # quantizer there, disabled or not); the hooks come after it
    return {"logits": got[order[0]], **{n: got[n] for n in wanted}}


def edgeq_outputs(compiled_path: Path, sites: dict[str, str], feeds: dict, exact: bool) -> dict[str, np.ndarray]:
    """edgeq's compiled graph in onnxruntime CPU: logits and every activation site's DQ output."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(compiled_path))
    for dq_out in sites.values():
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(dq_out))
    opts = ort.SessionOptions()
    if exact:
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    return {"logits": outs["logits"], **{a: outs[d] for a, d in sites.items()}}


def scales_of(encodings: dict) -> dict[str, float]:
    return {e["name"]: float(max(e["scale"])) for e in encodings["activation_encodings"]}


def local_steps(sim_out: dict, qparams: dict, names: list[str]) -> dict[str, tuple[int, int, int]]:
    """Per activation site, on the same input (the float tensor entering AIMET's quantizer): AIMET's
    quantizer output against ONNX Q/DQ with edgeq's scale and zero point: (max steps, elements that
    differ, elements). AIMET rounds exact halves away from zero where ONNX rounds them to even, so a
    difference of one step at a tie is expected."""
    out = {}
    for n in names:
        scale, zp = qparams[n]
        ref = onnx_qdq(sim_out[n], scale, zp)
        d = steps(sim_out[f"{n}_updated"].astype(np.float64) - ref, float(scale))
        out[n] = (int(d.max()), int(np.count_nonzero(d)), int(d.size))
    return out


def weight_steps(sim_out: dict, float_model, encodings: dict, params: list[str]) -> dict[str, int]:
    """Per weight: AIMET's param quantizer output (edgeq's encoding loaded) against the folded
    weight, which lies on edgeq's grid, in steps of each output channel's scale."""
    from onnx import numpy_helper

    inits = {t.name: t for t in float_model.graph.initializer}
    enc = {e["name"]: e for e in encodings["param_encodings"]}
    out = {}
    for p in params:
        w = numpy_helper.to_array(inits[p]).astype(np.float64)
        scale = np.asarray(enc[p]["scale"], np.float64)
        if enc[p]["enc_type"] == "PER_CHANNEL" and w.ndim == 2 and scale.size == w.shape[1]:
            scale = scale.reshape(1, -1)  # MatMul weight [K, N]: one scale per output column
        else:
            scale = scale.max()
        out[p] = int(steps(sim_out[f"{p}_qdq"].astype(np.float64) - w, scale).max())
    return out


def compare(a: dict, b: dict, scale: dict[str, float]) -> dict:
    """End to end: AIMET's sim (a) and edgeq's graph (b) each run the whole model, so a site sees
    whatever rounding differences arose upstream; steps per site, then the logits."""
    per_site = {}
    for name, s in scale.items():
        if f"{name}_updated" in a and name in b:
            per_site[name] = int(steps(a[f"{name}_updated"].astype(np.float64) - b[name].astype(np.float64), s).max())
    la, lb = a["logits"].astype(np.float64), b["logits"].astype(np.float64)
    worst = max(per_site, key=per_site.get) if per_site else None
    return {"max_steps": max(per_site.values()) if per_site else None, "worst_site": worst,
            "sites_over_one_step": sorted(n for n, v in per_site.items() if v > STEP_LIMIT),
            "sites_exactly_equal": sum(1 for v in per_site.values() if v == 0), "sites": len(per_site),
            "logits_rel_l2": float(np.linalg.norm(la - lb) / np.linalg.norm(lb)),
            "logits_max_abs": float(np.max(np.abs(la - lb))),
            "top1_agreement": float(np.mean(la.argmax(-1) == lb.argmax(-1)))}


def merge(results: list[dict]) -> dict:
    """Worst case over windows for step and logits figures, mean top-1 agreement."""
    return {"max_steps": max(r["max_steps"] for r in results),
            "sites_over_one_step": sorted({n for r in results for n in r["sites_over_one_step"]}),
            "worst_site": max(results, key=lambda r: r["max_steps"])["worst_site"],
            "sites": results[0]["sites"],
            "sites_exactly_equal_min": min(r["sites_exactly_equal"] for r in results),
            "logits_rel_l2_max": max(r["logits_rel_l2"] for r in results),
            "logits_max_abs_max": max(r["logits_max_abs"] for r in results),
            "top1_agreement_mean": float(np.mean([r["top1_agreement"] for r in results]))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--compiled", type=Path, required=True, help="edgeq compile's output folder")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--npz", type=Path, help="model inputs, [samples, 1, seq] per input name")
    src.add_argument("--ids", type=Path, help="[windows, tokens] token ids (.npy)")
    ap.add_argument("--windows", type=int, default=None, help="use only the first N samples")
    ap.add_argument("--float", dest="float_model", type=Path, help="the original fp32 graph: also try loading there")
    ap.add_argument("--label", default=None, help="name of this case in the results file")
    ap.add_argument("--out", type=Path, required=True, help="results JSON (a case is added or replaced)")
    ap.add_argument("--setup", action="append", default=[], metavar="COMMAND",
                    help="a command that produced --compiled (recorded in the case; repeat for several)")
    args = ap.parse_args(argv)

    import aimet_onnx
    import onnx
    import onnxruntime as ort

    encodings_path = args.compiled / "aimet_encodings.json"
    encodings = json.loads(encodings_path.read_text())
    compiled_path = args.compiled / "model.onnx"
    feeds = feeds_from_args(args)
    case = {"label": args.label or args.compiled.name, "compiled": str(args.compiled),
            "encodings_version": encodings.get("version"),
            "encodings": {"activation": len(encodings["activation_encodings"]),
                          "param": len(encodings["param_encodings"])},
            "samples": len(feeds), "input_shape": list(feeds[0]["input_ids"].shape),
            "versions": {"aimet-onnx": aimet_onnx.__version__, "onnxruntime": ort.__version__, "onnx": onnx.__version__},
            "step_limit": STEP_LIMIT}
    t0 = time.perf_counter()
    compiled = onnx.load(str(compiled_path))
    float_model, sites, folded, qparams = float_graph_of(compiled)
    del compiled
    named = {e["name"] for e in encodings["activation_encodings"]} | {e["name"] for e in encodings["param_encodings"]}
    case["float_graph"] = {"activation_sites": len(sites), "folded_weights": len(folded),
                           "encoding_names_not_in_graph": sorted(
                               named - set(sites) - set(folded)
                               - {t.name for t in float_model.graph.initializer}
                               - {o for n in float_model.graph.node for o in n.output}
                               - {i.name for i in float_model.graph.input})[:20]}
    with tempfile.TemporaryDirectory(prefix="aimet-interop-") as tmp:
        sim = build_sim(float_model, tmp)
        try:
            case["load"] = load(sim, encodings_path)
        except Exception as exc:  # noqa: BLE001 - the finding is the error itself
            case["load"] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:1500]}"}
        if "error" not in case["load"]:
            act_names = [e["name"] for e in encodings["activation_encodings"] if e["name"] in sites]
            params = [e["name"] for e in encodings["param_encodings"] if e["name"] in folded]
            scale = {n: s for n, s in scales_of(encodings).items() if n in sites}
            exact, default, local, weights = [], [], {}, {}
            for i, f in enumerate(feeds):
                got = sim_outputs(sim, f, act_names, params if i == 0 else [])
                for n, (worst, differ, size) in local_steps(got, qparams, act_names).items():
                    old = local.get(n, (0, 0, 0))
                    local[n] = (max(old[0], worst), old[1] + differ, old[2] + size)
                if i == 0:
                    weights = weight_steps(got, float_model, encodings, params)
                exact.append(compare(got, edgeq_outputs(compiled_path, sites, f, exact=True), scale))
                default.append(compare(got, edgeq_outputs(compiled_path, sites, f, exact=False), scale))
            case["per_site_same_input"] = {
                "what": "AIMET's quantizer output vs ONNX Q/DQ with edgeq's scale/zero point on the same input, steps",
                "max_steps": max(v[0] for v in local.values()),
                "sites_over_one_step": sorted(n for n, v in local.items() if v[0] > STEP_LIMIT),
                "sites_exactly_equal": sum(1 for v in local.values() if v[1] == 0), "sites": len(local),
                "elements_differing": sum(v[1] for v in local.values()),
                "elements": sum(v[2] for v in local.values())}
            case["weights"] = {
                "what": "AIMET's param quantizer output (edgeq's encoding loaded) vs the folded weight, steps",
                "max_steps": max(weights.values()) if weights else None,
                "weights_exactly_equal": sum(1 for v in weights.values() if v == 0), "weights": len(weights)}
            case["aimet_sim_vs_edgeq_exact_qdq"] = merge(exact)
            case["aimet_sim_vs_edgeq_ort_default"] = merge(default)
            # the claim: AIMET, given edgeq's file, quantizes every tensor edgeq quantizes onto the same
            # grid (same input -> within one step), the weights included
            case["agree_within_one_step"] = bool(case["per_site_same_input"]["max_steps"] <= STEP_LIMIT and (
                not weights or case["weights"]["max_steps"] <= STEP_LIMIT))
        del sim, float_model
    if args.float_model:
        with tempfile.TemporaryDirectory(prefix="aimet-interop-float-") as tmp:
            try:
                sim = build_sim(onnx.load(str(args.float_model)), tmp)
                case["load_on_original_float_graph"] = load(sim, encodings_path)
                del sim
            except Exception as exc:  # noqa: BLE001
                case["load_on_original_float_graph"] = {
                    "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:1500]}"}
    case["seconds"] = round(time.perf_counter() - t0, 1)
    case["setup"] = args.setup
    case["command"] = " ".join([".venvs/aimet-onnx/bin/python", "benchmarks/aimet_interop.py",
                                *(sys.argv[1:] if argv is None else argv)])

    result = json.loads(args.out.read_text()) if args.out.is_file() else {
        "benchmark": "aimet-interop", "machine": machine(), "cases": []}
    result["date"] = time.strftime("%Y-%m-%d")
    result["cases"] = [c for c in result["cases"] if c["label"] != case["label"]] + [case]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: case.get(k) for k in ("label", "load", "agree_within_one_step", "per_site_same_input", "weights",
                                                 "aimet_sim_vs_edgeq_exact_qdq", "load_on_original_float_graph")},
                     indent=1))
    return 0 if case.get("agree_within_one_step") else 1


if __name__ == "__main__":
    sys.exit(main())
