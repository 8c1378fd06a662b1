"""Peer adapter: Qualcomm AIMET-ONNX (``aimet_onnx.QuantizationSimModel``) on the SmolLM2 fp32 ONNX model.

Runs with ``.venvs/aimet-onnx/bin/python`` (pins: the ``[aimet-onnx]`` table of
benchmarks/peers/pins.toml); imports only that venv's packages (aimet_onnx, onnx, onnxruntime,
numpy) and the standard library. Subcommands (the contract of benchmarks/peers.py):

    settings
    quantize --setting S --model FP32_ONNX --calib-ids CALIB.npy --out DIR
    quantize --setting S --model FP32_ONNX --calib-feeds FEEDS.npz --out DIR

``--calib-feeds`` (instead of ``--calib-ids``) calibrates on recorded input dicts instead of token
windows: a static graph's runs (a static pair's ``prefill.onnx``, 128-token chunks with the KV
cache as inputs), as a Qualcomm user quantizes the prompt graph of AI Hub's LLM export; the file
format is ``_peer_contract.RecordedFeeds`` (``benchmarks/aimet_htp.py`` writes it).
``--model-type`` is the ``model_type`` AIMET's ``analyze_llm_topology`` gets (``llama`` for SmolLM2,
``gemma3_text`` for Gemma 3, which AIMET reads by its active norms); only the inputs the graph has
are fed (Gemma 3's export takes no ``position_ids``). ``--release-session`` drops the sim's
onnxruntime session before ``to_onnx_qdq`` (memory only: Gemma 3's first attempt without it was
stopped during the export at 15.4 GB, when the shared 24 GB machine ran out; with it the export
completed at a 17.3 GB peak).

AIMET-ONNX is Qualcomm's own quantizer for the HTP (Hexagon NPU), the tool a Qualcomm user would
pick instead of edgeq for the NPU path, so its settings are its documented LLM flows for the HTP
(AIMET's ``Examples/onnx`` LLM recipes, Qualcomm AI Hub's LLM export), all on the same fp32 graph
and the same calibration windows as every peer:

* ``QuantizationSimModel(model, param_type="int8", activation_type="int16",
  quant_scheme=QuantScheme.min_max, config_file="htp_v81")``: 16-bit activations on every tensor
  the HTP config quantizes (exported as uint16), symmetric per-channel int8 weights for
  MatMul/Gemm (the htp_v81 config turns per-channel on for those op types; ``htp_v81`` is the
  config AIMET's LLM examples name, v85 also ships in 2.42.0), RMSNorm weights as AIMET's
  config and exception rules set them.
* ``sim.compute_encodings(windows)``: min/max calibration over every window.
* ``w8a16``: exactly that, AIMET's flow out of the box. On this export it is broken, and the row
  says so: the graph masks attention by adding ``Where(causal, 0, -inf)`` to the scores
  (``self_attn/Constant_64`` = -inf, ``Where_2``, ``Add_2`` in every layer). AIMET's min/max
  encoding of those tensors spans float32's lowest value to the largest score: a 16-bit step of
  5e33, so every real score rounds to 0 and attention becomes uniform over the prefix. A 16-bit
  grid needs a finite mask; the other rows make the shared graph's mask finite:
* ``-finite-mask``: before the sim is built, every float Constant that is all -inf (on this graph
  only the 30 mask constants) is set to -1000. The function is unchanged in float32 (the softmax
  weight of a masked position is exp(-1000 - max) = 0 either way), and min/max calibration then
  gives the masked-score tensors the range [-1000, max score] (a 16-bit step of ~0.016).
* ``w4a16-pcq-finite-mask``: AIMET 2.42's LLM helper ``configure_llm(sim,
  analyze_llm_topology(model, "llama"), backbone_weight_type=int4, lm_head_weight_type=int8)``:
  per-channel int4 for every MatMul/Gemm/Conv weight but lm_head, lm_head int8 per-channel (AI
  Hub's ``_set_lm_head_to_8b``). ``w4a16-lpbq-finite-mask``: the same, then LPBQ (per-block int4
  with 4-bit integer block scales under one float scale per channel) for every MatMul/Gemm but
  lm_head: ``set_grouped_blockwise_quantization_for_weights(sim, op_types=("Gemm", "MatMul"),
  bitwidth=4, decompressed_bw=8, block_size=64, nodes_to_exclude=[lm_head])``, called through
  its non-deprecated name ``set_lpbq_for_params`` (the same QSpec.lpbq) when present.
* ``w4a16-lpbq-seqmse-finite-mask``: then ``apply_seq_mse(sim, windows, num_candidates=20)``
  (Sequential MSE: per-layer weight-range search, AIMET's ``lpbq_seqmse`` recipe; AI Hub calls it
  slow). Marked ``slow``: benchmarks/peers.py runs it only with ``--slow``; the adapter's
  ``--seqmse-windows`` caps the windows it uses and the row's notes say how many it ran on.
* ``w4a16-pcq-spinquant-finite-mask``: ``apply_spinquant(model, topology=...)`` (R1 folded into the
  weights, AIMET's SpinQuant port) on the float graph, then as ``w4a16-pcq-finite-mask``.

Output: ``sim.to_onnx_qdq(prequantize_constants=True)``: a QDQ ONNX graph with integer weights
behind DequantizeLinear (LPBQ as two chained DequantizeLinear: uint8 per-block scales, then the
int4 weight), the form onnxruntime-qnn takes and onnxruntime CPU runs (opset raised to 21 by
AIMET for int4/int16). Saved as ``DIR/model.onnx`` + ``model.onnx.data``.

What this export needs (recorded in the quantize notes):

* A static prompt graph (``--calib-feeds``; edgeq's static pair, ``benchmarks/aimet_htp.py``)
  carries the same -inf mask as 30 float *initializers* (``self_attn/Constant_6x_output_0``)
  rather than Constant nodes: ``-finite-mask`` sets both kinds. Where ``analyze_llm_topology``
  cannot read a graph, the W4 settings fall back to naming lm_head (``/lm_head/MatMul``): int8
  per channel on it, int4 per channel on every other MatMul/Gemm/Conv (what ``configure_llm``
  sets), without its KV-cache quantizer tying; the notes say which route ran.

* SmolLM2 ties lm_head to the embedding table (the embedding Gather and, through a Transpose, the
  lm_head MatMul read one initializer). AIMET refuses a weight shared by consumers that want
  different encodings ("Found shared parameter(s) with conflicting consumer types") and says to
  call ``aimet_onnx.utils.duplicate_shared_initializers(model.graph)`` first, which the adapter
  does (same function, one more copy of the table).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _peer_contract import RecordedFeeds, fail, model_inputs, quantize_inputs, subcommands  # (before the folder leaves sys.path)

# This file is named aimet_onnx.py: drop its own folder from sys.path so that "import aimet_onnx"
# finds the package of the venv, not this adapter.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

import numpy as np  # noqa: E402  (after the path is cleaned above)

DOCS_QUANTSIM = "https://quic.github.io/aimet-pages/releases/latest/apiref/onnx/quantsim.html"
DOCS_LLM = "https://github.com/quic/ai-hub-models/blob/main/qai_hub_models/models/_shared/llm/model.py"
DOCS_SEQMSE = "https://quic.github.io/aimet-pages/releases/latest/apiref/onnx/seq_mse.html"
DOCS_SPINQUANT = "https://github.com/quic/aimet/tree/develop/TrainingExtensions/onnx/src/python/aimet_onnx/spinquant"

CONFIG = "htp_v81"        # quantsim config alias shipped in aimet-onnx 2.42.0 (htp_quantsim_config_v81.json)
LPBQ_BLOCK = 64           # block along K (input features), AIMET's and AI Hub's LLM default
LPBQ_DECOMPRESSED_BW = 8  # per-block integer scales of decompressed_bw - bitwidth = 4 bits
SEQMSE_CANDIDATES = 20    # apply_seq_mse default num_candidates
LM_HEAD = "/lm_head/MatMul"

MASK_VALUE = -1000.0     # the finite value that replaces the -inf attention-mask constants (exp(-1000) is 0 in float32)

_BASE = (f"QuantizationSimModel(param_type=int8, activation_type=int16, quant_scheme=min_max, config_file={CONFIG}) "
         "(symmetric per-channel MatMul/Gemm weights, uint16 activations on every tensor the config quantizes), "
         "compute_encodings on the calibration windows")
_MASK = (f"; the graph's -inf attention-mask constants set to {MASK_VALUE:g} before the sim is built (same "
         "function in float32)")
_W4_CFG = ("; configure_llm(topology=analyze_llm_topology(model, llama), backbone_weight_type=int4, "
       "lm_head_weight_type=int8): per-channel int4 for every weighted MatMul/Gemm but lm_head, lm_head int8")
_LPBQ = (f"; LPBQ on every MatMul/Gemm but lm_head: set_grouped_blockwise_quantization_for_weights(op_types=(Gemm, "
         f"MatMul), bitwidth=4, decompressed_bw={LPBQ_DECOMPRESSED_BW}, block_size={LPBQ_BLOCK}, "
         f"nodes_to_exclude=[{LM_HEAD}])")
_EXPORT = "; sim.to_onnx_qdq(prequantize_constants=True) -> QDQ ONNX (opset 21)"

# the fields every benchmarks/peers.py row states (for ONNX outputs the orchestrator reads
# group_size / lm_head_bits / embedding_bits / accuracy_level off the graph; these are the intent)
# (the htp_v81 config quantizes the embedding table too: uint16 per tensor in the export)
_W8 = {"category": "w8a16", "weight_bits": 8, "activation_bits": 16, "calib_windows": 16, "group_size": None,
       "lm_head_bits": 8, "embedding_bits": 16, "accuracy_level": None, "htp_ppl": None}
_W4 = {**_W8, "category": "w4a16", "weight_bits": 4}
SETTINGS = [
    {"setting": "w8a16", **_W8, "format": "onnx",
     "description": _BASE + _EXPORT + " (AIMET out of the box: the -inf attention mask gives the masked-score "
                    "tensors a 16-bit step of 5e33)", "docs": DOCS_QUANTSIM},
    {"setting": "w8a16-finite-mask", **_W8, "format": "onnx", "finite_mask": True,
     "description": _BASE + _MASK + _EXPORT, "docs": DOCS_QUANTSIM},
    {"setting": "w4a16-pcq-finite-mask", **_W4, "format": "onnx", "w4": True, "finite_mask": True,
     "description": _BASE + _W4_CFG + _MASK + _EXPORT, "docs": DOCS_LLM},
    {"setting": "w4a16-lpbq-finite-mask", **_W4, "group_size": LPBQ_BLOCK, "format": "onnx", "w4": True,
     "lpbq": True, "finite_mask": True, "description": _BASE + _W4_CFG + _LPBQ + _MASK + _EXPORT, "docs": DOCS_LLM},
    {"setting": "w4a16-lpbq-seqmse-finite-mask", **_W4, "group_size": LPBQ_BLOCK, "format": "onnx", "w4": True,
     "lpbq": True, "finite_mask": True, "seqmse": True,
     "slow": "Sequential MSE sweeps 20 candidate ranges per linear layer through the sim (AI Hub: hours for a 3B "
             "model); run with --slow",
     "description": _BASE + _W4_CFG + _LPBQ + _MASK
     + f"; apply_seq_mse(num_candidates={SEQMSE_CANDIDATES}) on the calibration windows" + _EXPORT,
     "docs": DOCS_SEQMSE},
    {"setting": "w4a16-pcq-spinquant-finite-mask", **_W4, "format": "onnx", "w4": True, "finite_mask": True,
     "spinquant": True,
     "description": "apply_spinquant(R1 folded into the weights, topology analyze_llm_topology(model, llama)) on the "
                    "float graph, then " + _BASE + _W4_CFG + _MASK + _EXPORT,
     "docs": DOCS_SPINQUANT},
]
BY_NAME = {s["setting"]: s for s in SETTINGS}
CONTRACT_KEYS = ("setting", "category", "weight_bits", "activation_bits", "format", "calib_windows", "group_size",
                 "lm_head_bits", "embedding_bits", "accuracy_level", "htp_ppl", "description", "docs")


def versions() -> str:
    import aimet_onnx
    import onnxruntime as ort
    return f"aimet-onnx {aimet_onnx.__version__}, onnxruntime {ort.__version__}"


def cmd_settings(_args) -> int:
    out = []
    for s in SETTINGS:
        row = {k: s[k] for k in CONTRACT_KEYS}
        if s.get("slow"):
            row["slow"] = s["slow"]
        out.append(row)
    print(json.dumps(out))
    return 0


def _param_summary(sim) -> str:
    """What the sim does with each parameter, counted by consumer op type: bits and granularity."""
    kinds: Counter = Counter()
    for op in sim.connected_graph.ordered_ops:
        _, _, params = sim.get_op_quantizers(op)
        for role, q in params.items():
            if q is None:
                continue
            if not q.enabled:
                kinds[f"{op.type}.{role}: off"] += 1
                continue
            info = q.quant_info
            gran = (f"block{info.blockSize}" if info.usePerChannelMode and info.blockSize else
                    "channel" if info.usePerChannelMode else "tensor")
            kinds[f"{op.type}.{role}: int{q.bitwidth} {gran}"] += 1
    return "param quantizers " + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))


def _activation_summary(sim) -> str:
    bits = Counter(q.bitwidth for name, q in sim.qc_quantize_op_dict.items()
                   if name not in sim.param_names and q.enabled)
    return "activation quantizers " + ", ".join(f"{b}-bit x{n}" for b, n in sorted(bits.items()))


def _set_lpbq(sim) -> str:
    """LPBQ on every MatMul/Gemm weight but lm_head; returns which API did it."""
    from aimet_onnx import quantsim

    if hasattr(quantsim, "set_lpbq_for_params"):
        # aimet-onnx >= 2.x: the non-deprecated spelling of the same QSpec.lpbq (scale bits = 4)
        quantsim.set_lpbq_for_params(sim, bitwidth=4, block_size=LPBQ_BLOCK, op_types={"Gemm", "MatMul"},
                                     nodes_to_exclude={LM_HEAD})
        return "set_lpbq_for_params(bitwidth=4, block_size=64, op_types={Gemm, MatMul}, nodes_to_exclude={lm_head})"
    quantsim.set_grouped_blockwise_quantization_for_weights(
        sim, op_types=("Gemm", "MatMul"), bitwidth=4, decompressed_bw=LPBQ_DECOMPRESSED_BW, block_size=LPBQ_BLOCK,
        nodes_to_exclude=[LM_HEAD])
    return "set_grouped_blockwise_quantization_for_weights(...)"


def _finite_mask(model) -> int:
    """Set every float Constant or initializer whose values are all -inf to MASK_VALUE; returns how
    many (the dynamic export holds its mask values in Constant nodes, edgeq's static pair, whose
    constants are folded, in initializers).

    The exported graph masks attention with ``scores + Where(causal, 0, -inf)``. AIMET's min/max
    encoding of a range reaching -inf spans float32's lowest value (a 16-bit step of 5e33, every
    real score rounds to 0). With -1000 the softmax weight of a masked position is still exactly 0
    in float32, and the encoding covers [-1000, max score]."""
    from onnx import numpy_helper

    changed = 0
    for node in model.graph.node:
        if node.op_type != "Constant":
            continue
        for attr in node.attribute:
            if attr.name != "value" or attr.t.data_type != 1:  # float tensors only
                continue
            value = numpy_helper.to_array(attr.t)
            if value.size and np.all(np.isneginf(value)):
                attr.t.CopyFrom(numpy_helper.from_array(np.full_like(value, MASK_VALUE), attr.t.name))
                changed += 1
    for init in model.graph.initializer:
        if init.data_type != 1 or init.data_location == 1 or np.prod(init.dims) > 1024:
            continue  # float, stored in the file, small: the mask constants (weights are not all -inf)
        value = numpy_helper.to_array(init)
        if value.size and np.all(np.isneginf(value)):
            init.CopyFrom(numpy_helper.from_array(np.full_like(value, MASK_VALUE), init.name))
            changed += 1
    return changed


def _static_input_shapes(model) -> dict[str, tuple[int, ...]]:
    """Graph input name -> its shape, for inputs whose every dim is a fixed number (a static graph)."""
    shapes = {}
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            shapes[vi.name] = tuple(d.dim_value for d in dims)
    return shapes


def _topology(model, notes: list[str], model_type: str = "llama"):
    """AIMET's analyze_llm_topology(model, model_type), or None (with the reason in the notes) when it
    cannot read the graph: the caller then names lm_head itself."""
    from aimet_onnx.llm_topology import analyze_llm_topology
    try:
        return analyze_llm_topology(model, model_type=model_type)
    except Exception as exc:  # noqa: BLE001 - recorded, then the by-name fallback
        notes.append(f"analyze_llm_topology(model, {model_type}) failed ({type(exc).__name__}: "
                     f"{' '.join(str(exc).split())[:300]}); lm_head set by name ({LM_HEAD})")
        return None


def _configure_by_name(sim) -> None:
    """What configure_llm sets for backbone int4 / lm_head int8, with lm_head named rather than found
    by AIMET's topology (no KV-cache quantizer tying: that needs the topology)."""
    from aimet_onnx import int4, int8
    from aimet_onnx.quantsim import set_param_type
    set_param_type(sim, int8, nodes_to_include=[LM_HEAD])
    set_param_type(sim, int4, op_types=("Gemm", "MatMul", "Conv"), nodes_to_exclude={LM_HEAD}, strict=False)
    sim._apply_exception_rules()  # as configure_llm does


def _onnx_summary(model) -> str:
    ops = Counter(n.op_type for n in model.graph.node)
    return (f"result: {ops.get('QuantizeLinear', 0)} QuantizeLinear, {ops.get('DequantizeLinear', 0)} "
            f"DequantizeLinear, {ops.get('MatMul', 0)} MatMul, opset "
            f"{next((o.version for o in model.opset_import if o.domain in ('', 'ai.onnx')), '?')}")


def _save_onnx(model, out: Path) -> None:
    import onnx
    path = out / "model.onnx"
    for stale in (path, out / "model.onnx.data"):
        if stale.exists():
            stale.unlink()
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)


def _ort_error(path: Path) -> str | None:
    """None if onnxruntime (CPU) can create a session for the model, else its error in one line."""
    import onnxruntime as ort
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001
        return " ".join(str(exc).split())[:600]
    return None


def cmd_quantize(args) -> int:
    if bool(args.calib_ids) == bool(args.calib_feeds):
        fail("quantize takes exactly one of --calib-ids and --calib-feeds")
    if args.calib_feeds:
        if args.setting not in BY_NAME:
            fail(f"unknown setting {args.setting!r}; known: {', '.join(BY_NAME)}")
        spec, calib, out = BY_NAME[args.setting], None, Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    else:
        spec, calib, out = quantize_inputs(args, BY_NAME)
    try:
        import onnx
        from aimet_onnx import int4, int8
        from aimet_onnx.common.defs import QuantScheme
        from aimet_onnx.llm_configurator import configure_llm
        from aimet_onnx.llm_topology import analyze_llm_topology
        from aimet_onnx.quantsim import QuantizationSimModel
        from aimet_onnx.utils import duplicate_shared_initializers
    except Exception as exc:  # noqa: BLE001 - report any import problem in one line
        fail(f"cannot import aimet_onnx: {type(exc).__name__}: {exc}")
    notes, timings = [], {}
    if calib is not None:
        header = onnx.load(args.model, load_external_data=False)
        graph_inputs = {vi.name for vi in header.graph.input}
        del header
        # only the inputs the graph has (Gemma 3's export takes no position_ids)
        windows = [{k: v for k, v in model_inputs(w).items() if k in graph_inputs} for w in calib]
    else:
        try:
            header = onnx.load(args.model, load_external_data=False)
            windows = RecordedFeeds(args.calib_feeds, _static_input_shapes(header))
            del header
        except Exception as exc:  # noqa: BLE001
            fail(f"--calib-feeds {args.calib_feeds}: {type(exc).__name__}: {exc}")
        notes.append(f"calibration: {len(windows)} recorded feeds of the graph ({args.calib_feeds}; cache inputs "
                     "zero-padded to the graph's static shape)")
    t0 = time.perf_counter()
    try:
        model = onnx.load(args.model)  # with its external data: the sim needs the weights
        dup = duplicate_shared_initializers(model.graph)
        if dup:
            notes.append(f"duplicate_shared_initializers: {dup} shared initializer(s) copied (SmolLM2's tied "
                         "embedding / lm_head table; AIMET refuses one weight read by Gather and MatMul)")
        if spec.get("finite_mask"):
            n_mask = _finite_mask(model)
            if not n_mask:
                fail(f"{args.setting}: no all -inf float Constant (the attention mask) found to make finite")
            notes.append(f"{n_mask} -inf attention-mask constants (Constant nodes or initializers) set to {MASK_VALUE:g} "
                         "(same function in float32)")
        topology = _topology(model, notes, args.model_type) if spec.get("w4") or spec.get("spinquant") else None
        if spec.get("spinquant") and topology is None:
            fail(f"{args.setting}: apply_spinquant needs AIMET's topology of the graph")
        if spec.get("spinquant"):
            from aimet_onnx.spinquant import apply_spinquant
            t = time.perf_counter()
            apply_spinquant(model, topology=topology)
            timings["spinquant_s"] = round(time.perf_counter() - t, 1)
            notes.append("apply_spinquant(enable_r1=True) on the float graph (R2/R3 off: AIMET's defaults)")
            topology = analyze_llm_topology(model, model_type=args.model_type)  # of the rotated graph the sim is built on
        with tempfile.TemporaryDirectory(prefix="aimet-sim-", dir=out) as tmp:
            t = time.perf_counter()
            sim = QuantizationSimModel(model, param_type="int8", activation_type="int16",
                                       quant_scheme=QuantScheme.min_max, config_file=CONFIG, path=tmp)
            del model
            if spec.get("w4") and topology is None:
                _configure_by_name(sim)
            elif spec.get("w4"):
                if topology.lm_head != [LM_HEAD]:
                    fail(f"{args.setting}: AIMET's topology names lm_head {topology.lm_head}, expected [{LM_HEAD}]")
                configure_llm(sim, topology, backbone_weight_type=int4, lm_head_weight_type=int8)
                notes.append(f"configure_llm with AIMET's topology ({len(topology.blocks)} blocks, lm_head "
                             f"{topology.lm_head}, {len(topology.past_key_input_names)} key / "
                             f"{len(topology.past_value_input_names)} value cache inputs tied to their outputs)")
            if spec.get("lpbq"):
                notes.append("LPBQ via " + _set_lpbq(sim))
            timings["sim_build_s"] = round(time.perf_counter() - t, 1)
            notes.append(_param_summary(sim))
            notes.append(_activation_summary(sim))
            t = time.perf_counter()
            sim.compute_encodings(windows)
            timings["compute_encodings_s"] = round(time.perf_counter() - t, 1)
            if spec.get("seqmse"):
                from aimet_onnx import apply_seq_mse
                n_seq = min(len(windows), args.seqmse_windows) if args.seqmse_windows else len(windows)
                t = time.perf_counter()
                apply_seq_mse(sim, list(windows)[:n_seq], num_candidates=SEQMSE_CANDIDATES)
                timings["seq_mse_s"] = round(time.perf_counter() - t, 1)
                notes.append(f"apply_seq_mse on {n_seq} of the {len(windows)} calibration windows "
                             f"(num_candidates={SEQMSE_CANDIDATES}); activation encodings from all {len(windows)}")
            if args.release_session:
                import gc
                sim.session = None  # (AIMET itself does this before rebuilding a session)
                gc.collect()
                notes.append("the sim's onnxruntime session (weights and activation arena) released before "
                             "to_onnx_qdq (--release-session: memory only, the encodings are the sim's)")
            t = time.perf_counter()
            qdq = sim.to_onnx_qdq(prequantize_constants=True)
            timings["to_onnx_qdq_s"] = round(time.perf_counter() - t, 1)
            del sim
        notes.append(_onnx_summary(qdq))
        _save_onnx(qdq, out)
        del qdq
        err = _ort_error(out / "model.onnx")
        if err:
            fail(f"{args.setting}: the QDQ export does not load in onnxruntime: {err}")
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - contract: one-line reason, non-zero exit
        fail(f"{args.setting}: {type(exc).__name__}: {exc}")
    secs = time.perf_counter() - t0
    what = (f"{len(windows)} calibration windows of {calib.shape[1]} tokens" if calib is not None
            else f"{len(windows)} recorded calibration feeds")
    notes.append(f"{what}; load + aimet + export + save "
                 f"{secs:.1f}s ({', '.join(f'{k} {v}' for k, v in timings.items())})")
    print(json.dumps({"version": versions(), "notes": "; ".join(notes), "timings": timings}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap, _, q = subcommands(__doc__, calib_ids_required=False)
    q.add_argument("--release-session", action="store_true",
                   help="drop the sim's onnxruntime session before the QDQ export (lower peak memory; Gemma 3)")
    q.add_argument("--model-type", default="llama",
                   help="model_type for AIMET's analyze_llm_topology (llama: SmolLM2; gemma3_text: Gemma 3)")
    q.add_argument("--calib-feeds", default=None,
                   help="calibrate on recorded input dicts (an .npz of <feed>/<input> arrays, _peer_contract."
                        "RecordedFeeds) instead of --calib-ids token windows: a static graph's runs")
    q.add_argument("--seqmse-windows", type=int, default=None,
                   help="Sequential MSE on only the first N calibration windows (default: all of them)")
    args = ap.parse_args(argv)
    return {"settings": cmd_settings, "quantize": cmd_quantize}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
