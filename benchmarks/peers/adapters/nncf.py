"""Peer adapter: Intel NNCF (with OpenVINO) on the SmolLM2 fp32 ONNX model.

Runs with ``.venvs/nncf/bin/python`` (pins: the ``[nncf]`` table of benchmarks/peers/pins.toml);
imports only that venv's packages (nncf, openvino, onnx, onnxruntime, numpy) and the standard
library. Subcommands (the contract of benchmarks/peers.py):

    settings
    quantize --setting S --model FP32_ONNX --calib-ids CALIB.npy --out DIR
    evaluate --model DIR --eval-ids EVAL.npy --latency-tokens 512 --repeats 7   (openvino outputs)

Settings follow NNCF's / OpenVINO's own recommendations for LLMs:

* w8a8: ``nncf.quantize`` (post-training static INT8) with ``model_type=nncf.ModelType.TRANSFORMER``
  (NNCF's transformer scheme; its preset is MIXED: symmetric per-channel INT8 weights, asymmetric
  per-tensor INT8 activations) and SmoothQuant on MatMuls (``AdvancedSmoothQuantParameters``,
  alpha 0.95 = NNCF's default for MatMul), fast bias correction (default), on all 16 calibration
  windows. Once on the ONNX model with NNCF's ONNX backend (QDQ ONNX), once on the OpenVINO model
  converted from the same ONNX file with ``openvino.convert_model`` (FakeQuantize OpenVINO IR).
* w4: ``nncf.compress_weights`` INT4_ASYM (the accuracy-oriented 4-bit mode of the docs), group
  size 64 (a recommended size; 128 does not divide this model's hidden size 576), ratio 1.0 (every
  Linear layer in 4 bit), data-aware AWQ + scale estimation on the calibration windows.
  Embeddings and the last MatMul (lm_head) stay in NNCF's backup mode INT8_ASYM (its default,
  all_layers=False). On the OpenVINO model, and on the ONNX model (NNCF's ONNX backend writes
  com.microsoft MatMulNBits for opset < 21; this model is opset 18).

What NNCF 3.4's ONNX backend needs on this model (each is recorded in the quantize notes):

* SmolLM2 ties lm_head to the embedding table, so the exported lm_head MatMul reads
  Transpose(embed_tokens.weight). Both nncf.quantize (SmoothQuant) and nncf.compress_weights
  crash on such a weight, so the ONNX settings first store the transposed table as its own
  initializer (same function).
* NNCF's TRANSFORMER RoPE ignored pattern (MatMul -> Transpose -> Concat -> Cos/Sin) does not
  match this export because its Concat takes the same tensor twice, so out of the box the RoPE
  MatMul (positions 0..511 x inv_freq) gets a per-tensor INT8 input quantizer and perplexity
  doubles. ``ptq-sq-onnx`` keeps that out-of-the-box result; ``ptq-sq-onnx-rope-ignored`` adds
  the RoPE MatMul to ignored_scope, which is what the pattern intends (the OpenVINO backend's
  pattern does match).
* INT4_ASYM MatMulNBits are written with unpacked uint8 zero points [N, n_blocks], which
  onnxruntime rejects at session creation; ``int4-awq-se-onnx`` checks this on a one-MatMul probe
  first and fails in seconds with onnxruntime's error, and ``int4sym-awq-se-onnx`` (INT4_SYM, no
  zero points) is the ONNX w4 result.

Evaluate (OpenVINO outputs, CPU plugin): perplexity over the evaluation windows (logits of
positions 0..510 predict tokens 1..511; ppl = exp(total NLL / total predicted tokens)) and the
median latency of one 512-token forward pass, batch 1, after 2 warm-ups. The main numbers use
INFERENCE_PRECISION_HINT=f32 and no dynamic activation quantization, so that the arithmetic is
the setting's own (fp32 non-quantized ops, float activations for w4) and comparable with the fp32
ONNX reference; the OpenVINO CPU defaults (bf16 inference precision on CPUs with AVX512_BF16/AMX,
dynamic int8 quantization of activations for weight-compressed layers) are reported beside them
under "runtime_defaults".
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from _peer_contract import fail, model_inputs, quantize_inputs, subcommands  # (before the folder leaves sys.path)

# This file is named nncf.py: drop its own folder from sys.path so that "import nncf" finds the
# NNCF package of the venv, not this adapter.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

import numpy as np  # noqa: E402

DOCS_PTQ = ("https://docs.openvino.ai/2025/openvino-workflow/model-optimization-guide/"
            "quantizing-models-post-training/basic-quantization-flow.html")
DOCS_SQ = "https://openvinotoolkit.github.io/nncf/autoapi/nncf/quantization/advanced_parameters/index.html"
DOCS_WC = ("https://docs.openvino.ai/2025/openvino-workflow/model-optimization-guide/"
           "weight-compression/4-bit-weight-quantization.html")
DOCS_WC_NNCF = ("https://github.com/openvinotoolkit/nncf/blob/develop/docs/usage/"
                "post_training_compression/weights_compression/Usage.md")

SQ_ALPHA = 0.95        # NNCF's default SmoothQuant alpha for MatMul (AdvancedSmoothQuantParameters)
W4_GROUP = 64          # recommended sizes are 128, 64, 32; 128 does not divide hidden size 576
W4_RATIO = 1.0         # every Linear layer in 4 bit (embeddings / lm_head: INT8_ASYM backup)

_W8A8_DESC = ("nncf.quantize static INT8, model_type=TRANSFORMER (MIXED preset: sym per-channel "
              "weights, asym per-tensor activations, sym at activation x activation MatMuls), "
              f"SmoothQuant alpha {SQ_ALPHA} on MatMul, fast bias correction, 16 calibration windows")
_W4_DESC = (f"nncf.compress_weights INT4_ASYM group {W4_GROUP} ratio {W4_RATIO}, data-aware AWQ + "
            "scale estimation on 16 calibration windows; embeddings and lm_head INT8_ASYM (backup)")

# calib_windows / group_size / lm_head_bits / embedding_bits as benchmarks/peers.py's rows state them
# (for ONNX outputs the orchestrator reads the last three off the graph; OpenVINO IR rows keep these)
_W8 = {"category": "w8a8", "weight_bits": 8, "activation_bits": 8, "calib_windows": 16, "group_size": None,
       "lm_head_bits": 8, "embedding_bits": 32}
_W4 = {"category": "w4", "weight_bits": 4, "activation_bits": 32, "calib_windows": 16, "group_size": W4_GROUP,
       "lm_head_bits": 8, "embedding_bits": 8}
SETTINGS = [
    {"setting": "ptq-sq-onnx", **_W8, "format": "onnx",
     "description": _W8A8_DESC + "; NNCF ONNX backend -> QDQ ONNX", "docs": DOCS_PTQ},
    {"setting": "ptq-sq-onnx-rope-ignored", **_W8, "format": "onnx", "ignore_rope": True,
     "description": _W8A8_DESC + "; RoPE MatMul in ignored_scope (what NNCF's TRANSFORMER RoPE pattern intends "
                    "but misses on this export); NNCF ONNX backend -> QDQ ONNX", "docs": DOCS_PTQ},
    {"setting": "ptq-sq-openvino", **_W8, "format": "openvino",
     "description": _W8A8_DESC + "; on the OpenVINO model from openvino.convert_model -> OpenVINO IR",
     "docs": DOCS_PTQ},
    {"setting": "int4-awq-se-openvino", **_W4, "format": "openvino",
     "description": _W4_DESC + "; OpenVINO model -> OpenVINO IR", "docs": DOCS_WC},
    {"setting": "int4-awq-se-openvino-all-layers", **_W4, "lm_head_bits": 4, "embedding_bits": 4,
     "format": "openvino", "all_layers": True,
     "description": _W4_DESC.replace("embeddings and lm_head INT8_ASYM (backup)", "all_layers=True: embeddings "
                                     "and lm_head INT4_ASYM too") + "; OpenVINO model -> OpenVINO IR",
     "docs": DOCS_WC},
    {"setting": "int4-awq-se-onnx", **_W4, "format": "onnx",
     "description": _W4_DESC + "; NNCF ONNX backend -> MatMulNBits ONNX", "docs": DOCS_WC_NNCF},
    {"setting": "int4sym-awq-se-onnx", **_W4, "format": "onnx",
     "mode": "INT4_SYM",
     "description": _W4_DESC.replace("INT4_ASYM", "INT4_SYM") + "; NNCF ONNX backend -> MatMulNBits ONNX "
                    "(INT4_SYM: NNCF's ONNX INT4_ASYM output does not load in onnxruntime)", "docs": DOCS_WC_NNCF},
]
BY_NAME = {s["setting"]: s for s in SETTINGS}


def versions() -> str:
    import nncf
    import openvino as ov
    return f"nncf {nncf.__version__}, openvino {ov.get_version()}"


CONTRACT_KEYS = ("setting", "category", "weight_bits", "activation_bits", "format", "calib_windows", "group_size",
                 "lm_head_bits", "embedding_bits", "description", "docs")


def cmd_settings(_args) -> int:
    print(json.dumps([{k: s[k] for k in CONTRACT_KEYS} for s in SETTINGS]))
    return 0


def _onnx_summary(model) -> str:
    from collections import Counter
    ops = Counter(n.op_type for n in model.graph.node)
    return (f"result: {ops.get('QuantizeLinear', 0)} QuantizeLinear, {ops.get('DequantizeLinear', 0)} "
            f"DequantizeLinear, {ops.get('MatMulNBits', 0)} MatMulNBits, {ops.get('MatMul', 0)} MatMul")


def _ov_summary(model) -> str:
    from collections import Counter
    ops = Counter(op.get_type_name() for op in model.get_ordered_ops())
    consts = Counter(op.get_element_type().get_type_name() for op in model.get_ordered_ops()
                     if op.get_type_name() == "Constant" and op.get_output_size() == 1
                     and op.get_output_partial_shape(0).rank.get_length() >= 2
                     and op.get_output_partial_shape(0).is_static
                     and int(np.prod(list(op.get_output_shape(0)))) >= 4096)
    return (f"result: {ops.get('FakeQuantize', 0)} FakeQuantize, {ops.get('MatMul', 0)} MatMul; large "
            f"constants by type {dict(sorted(consts.items()))}")


def _dataset(calib: np.ndarray):
    import nncf
    return nncf.Dataset([calib[i] for i in range(calib.shape[0])], model_inputs)


def _ptq_kwargs(n: int) -> dict:
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters
    return dict(model_type=nncf.ModelType.TRANSFORMER, subset_size=n, fast_bias_correction=True,
                advanced_parameters=AdvancedQuantizationParameters(
                    smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=SQ_ALPHA)))


def _wc_kwargs(n: int, mode: str = "INT4_ASYM", all_layers: bool = False) -> dict:
    import nncf
    return dict(mode=getattr(nncf.CompressWeightsMode, mode), group_size=W4_GROUP, ratio=W4_RATIO,
                awq=True, scale_estimation=True, subset_size=n, all_layers=all_layers)


def _ort_error(model_or_path) -> str | None:
    """None if onnxruntime (CPU) can create a session for the model, else its error in one line."""
    import onnxruntime as ort
    try:
        src = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
        ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001
        return " ".join(str(exc).split())
    return None


def _probe_onnx_int4(mode: str) -> str | None:
    """Compress a one-MatMul ONNX model [576 x 64] the way the real run will (data-free, same mode and
    group size) and load it in onnxruntime: a few seconds instead of minutes on the real model to
    learn that the output format is one onnxruntime rejects. Returns onnxruntime's error or None."""
    import nncf
    from onnx import TensorProto, helper, numpy_helper
    k, nout = 576, 64
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, nout)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, nout])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    q = nncf.compress_weights(model, mode=getattr(nncf.CompressWeightsMode, mode), group_size=W4_GROUP,
                              ratio=1.0, all_layers=True)
    return _ort_error(q)


def _fold_transposed_weights(model) -> list[str]:
    """Materialize MatMul weights that reach the MatMul through a Transpose of an initializer.

    SmolLM2 ties lm_head to the embedding table, so the exported lm_head MatMul reads
    Transpose(model.embed_tokens.weight). NNCF 3.4's ONNX SmoothQuant looks the weight up by the
    Transpose's output name, finds no initializer and crashes ("'NoneType' object has no attribute
    'shape'" in _process_weight_statistics). Storing the transposed table as its own initializer
    computes the same function (the embedding Gather keeps the original table). Returns the
    MatMuls changed.
    """
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    changed, dead = [], []
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2:
            continue
        tr = producer.get(node.input[1])
        if tr is None or tr.op_type != "Transpose" or tr.input[0] not in inits:
            continue
        perm = next((list(a.ints) for a in tr.attribute if a.name == "perm"), None)
        value = numpy_helper.to_array(inits[tr.input[0]])
        name = tr.input[0] + ".transposed_for_" + node.name.strip("/").replace("/", "_")
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value.transpose(perm)), name))
        consumers[node.input[1]] -= 1
        if consumers[node.input[1]] == 0:
            dead.append(tr)
        node.input[1] = name
        changed.append(node.name)
    for tr in dead:
        model.graph.node.remove(tr)
    return changed


def _rope_matmuls(model) -> list[str]:
    """MatMuls that feed a Cos or Sin within three hops (the RoPE positions x inv_freq product)."""
    consumers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    found = []
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        frontier, hit = [node], False
        for _ in range(3):
            frontier = [c for f in frontier for o in f.output for c in consumers.get(o, [])]
            if any(c.op_type in ("Cos", "Sin") for c in frontier):
                hit = True
                break
        if hit:
            found.append(node.name)
    return found


def _save_onnx(model, out: Path) -> None:
    import onnx
    path = out / "model.onnx"
    for stale in (path, out / "model.onnx.data"):
        if stale.exists():
            stale.unlink()
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)


def _save_ov(model, out: Path) -> None:
    import openvino as ov
    # compress_to_fp16=False: weights NNCF left in float stay fp32, like the fp32 ONNX reference.
    ov.save_model(model, str(out / "openvino_model.xml"), compress_to_fp16=False)


def cmd_quantize(args) -> int:
    spec, calib, out = quantize_inputs(args, BY_NAME)
    try:
        import nncf
        import onnx
        import openvino as ov
    except Exception as exc:  # noqa: BLE001 - report any import problem in one line
        fail(f"cannot import nncf/openvino/onnx: {type(exc).__name__}: {exc}")
    nncf.set_log_level(30)  # WARNING: keep stdout for the result line
    n = int(calib.shape[0])
    data = _dataset(calib)
    notes = []
    if spec["format"] == "onnx" and spec["category"] == "w4":
        try:
            err = _probe_onnx_int4(spec.get("mode", "INT4_ASYM"))
        except Exception as exc:  # noqa: BLE001
            err = None
            notes.append(f"format probe skipped ({type(exc).__name__}: {exc})")
        if err:
            import onnxruntime as ort
            fail(f"{args.setting}: NNCF {nncf.__version__}'s ONNX backend writes {spec.get('mode', 'INT4_ASYM')} "
                 "MatMulNBits zero points unpacked (uint8 [N, n_blocks]); onnxruntime "
                 f"{ort.__version__} rejects them (checked on a 576x64 MatMul compressed the same way): {err}")
    t0 = time.perf_counter()
    try:
        if spec["format"] == "onnx":
            model = onnx.load(args.model)  # with its external data (NNCF's ONNX backend needs the weights)
            folded = _fold_transposed_weights(model)
            if folded:
                notes.append(
                    f"tied lm_head weight (Transpose of the embedding table) stored as its own transposed "
                    f"initializer for {', '.join(folded)} (same function, one more copy of the table): on the "
                    "model as exported NNCF 3.4's ONNX backend fails on a weight behind a Transpose (quantize: "
                    "SmoothQuant AttributeError 'NoneType' object has no attribute 'shape'; compress_weights: "
                    "ValidationError There is no tensor with the name model.embed_tokens.weight_transposed)")
            if spec["category"] == "w8a8":
                kwargs = _ptq_kwargs(n)
                if spec.get("ignore_rope"):
                    rope = _rope_matmuls(model)
                    if not rope:
                        fail(f"{args.setting}: no RoPE MatMul (MatMul -> ... -> Cos/Sin) found to ignore")
                    kwargs["ignored_scope"] = nncf.IgnoredScope(names=rope)
                    notes.append(f"ignored_scope={rope} (the RoPE MatMul positions x inv_freq)")
                else:
                    notes.append("NNCF's TRANSFORMER RoPE ignored pattern does not match this export (its Concat "
                                 "takes the same tensor twice), so the RoPE MatMul input (positions 0..511 as "
                                 "float) gets a per-tensor INT8 quantizer; see the -rope-ignored setting")
                q = nncf.quantize(model, data, **kwargs)
            else:
                q = nncf.compress_weights(model, dataset=data, **_wc_kwargs(n, spec.get("mode", "INT4_ASYM")))
            notes.append(_onnx_summary(q))
            _save_onnx(q, out)
            err = _ort_error(str(out / "model.onnx"))
            if err:
                fail(f"{args.setting}: the quantized model does not load in onnxruntime: {err}")
        else:
            model = ov.convert_model(args.model)
            if spec["category"] == "w8a8":
                q = nncf.quantize(model, data, **_ptq_kwargs(n))
            else:
                q = nncf.compress_weights(model, dataset=data, **_wc_kwargs(n, all_layers=spec.get("all_layers", False)))
            notes.append(_ov_summary(q))
            _save_ov(q, out)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - contract: one-line reason, non-zero exit
        fail(f"{args.setting}: {type(exc).__name__}: {exc}")
    secs = time.perf_counter() - t0
    if spec["category"] == "w8a8":
        notes.append(f"SmoothQuant alpha {SQ_ALPHA} (NNCF default for MatMul, not tuned; {DOCS_SQ})")
    else:
        notes.append(f"group {W4_GROUP} because 128 does not divide hidden size 576; "
                     + ("embeddings and lm_head INT4_ASYM too (all_layers=True)" if spec.get("all_layers") else
                        "embeddings and lm_head stay INT8_ASYM (NNCF default all_layers=False)"))
    if spec["format"] == "openvino":
        notes.append("ONNX converted with openvino.convert_model; IR saved with compress_to_fp16=False")
    notes.append(f"{n} calibration windows of {calib.shape[1]} tokens; nncf call + save {secs:.1f}s")
    print(json.dumps({"version": versions(), "notes": "; ".join(notes)}))
    return 0


def _compile(core, model_dir: Path, config: dict):
    xml = model_dir / "openvino_model.xml" if model_dir.is_dir() else model_dir
    if not xml.exists():
        fail(f"no OpenVINO model at {xml}")
    return core.compile_model(core.read_model(str(xml)), "CPU", config)


def _ppl(compiled, windows: np.ndarray) -> float:
    out = compiled.outputs[0]
    req = compiled.create_infer_request()
    nll, count = 0.0, 0
    for w in windows:
        logits = np.asarray(req.infer(model_inputs(w))[out], dtype=np.float64)[0, :-1]  # [n-1, vocab]
        m = logits.max(axis=-1, keepdims=True)
        logz = np.log(np.exp(logits - m).sum(axis=-1)) + m[:, 0]
        tgt = np.asarray(w[1:], dtype=np.int64)
        nll += float((logz - logits[np.arange(tgt.size), tgt]).sum())
        count += int(tgt.size)
    return float(np.exp(nll / count))


def _latency(compiled, ids: np.ndarray, repeats: int) -> float:
    req = compiled.create_infer_request()
    feed = model_inputs(ids)
    for _ in range(2):
        req.infer(feed)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        req.infer(feed)
        times.append((time.perf_counter() - t) * 1e3)
    return float(statistics.median(times))


def cmd_evaluate(args) -> int:
    try:
        import openvino as ov
        import openvino.properties.hint as hints
    except Exception as exc:  # noqa: BLE001
        fail(f"cannot import openvino: {type(exc).__name__}: {exc}")
    windows = np.load(args.eval_ids)
    ntok = args.latency_tokens
    lat_ids = np.resize(windows.reshape(-1), ntok) if windows.size < ntok else windows.reshape(-1)[:ntok]
    core = ov.Core()
    model_dir = Path(args.model)
    exact = {hints.inference_precision: ov.Type.f32, "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
    try:
        compiled = _compile(core, model_dir, exact)
        result = {"ppl": _ppl(compiled, windows), "latency_ms": _latency(compiled, lat_ids, args.repeats)}
        del compiled
        dflt = _compile(core, model_dir, {})
        result["runtime_defaults"] = {
            "ppl": _ppl(dflt, windows) if not args.skip_defaults_ppl else None,
            "latency_ms": _latency(dflt, lat_ids, args.repeats),
            "inference_precision": dflt.get_property(hints.inference_precision).get_type_name(),
            "dynamic_quantization_group_size": int(dflt.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")),
        }
        threads = int(dflt.get_property("INFERENCE_NUM_THREADS"))
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001
        fail(f"evaluate: {type(exc).__name__}: {exc}")
    result["runtime"] = (f"openvino {ov.get_version()} (CPU, inference_precision f32, dynamic quantization "
                         f"off, {threads} threads)")
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap, sub, _ = subcommands(__doc__)
    e = sub.add_parser("evaluate")
    e.add_argument("--model", required=True, help="folder with openvino_model.xml")
    e.add_argument("--eval-ids", required=True)
    e.add_argument("--latency-tokens", type=int, default=512)
    e.add_argument("--repeats", type=int, default=7)
    e.add_argument("--skip-defaults-ppl", action="store_true",
                   help="with the OpenVINO CPU defaults measure latency only (halves the time)")
    args = ap.parse_args(argv)
    return {"settings": cmd_settings, "quantize": cmd_quantize, "evaluate": cmd_evaluate}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
