"""Peer adapter: onnxruntime's own quantization tools (``onnxruntime.quantization``).

Runs with the python of ``.venvs/ort-quant/`` (see ``benchmarks/peers/pins.toml``); it imports only
that venv's packages, never edgeq. Subcommands (the contract of ``benchmarks/peers.py``):

    settings                      one JSON list of the settings below
    quantize --setting S --model FP32.onnx --calib-ids CALIB.npy --out DIR
                                  writes DIR/model.onnx (+ DIR/model.onnx.data); last stdout line is
                                  {"version": ..., "notes": ...}; on failure exit 1 with one line on stderr

Every setting starts with ``quant_pre_process`` (symbolic + ONNX shape inference and ORT basic graph
optimization), the pre-processing step onnxruntime's quantization guide puts first. Besides shape
information it constant-folds the Transpose that feeds the tied lm_head, so lm_head has a constant
weight and is quantized like every other projection.

w8a8 (``quantize_static``): QDQ format, static per-tensor activations from MinMax calibration on
exactly the windows of CALIB.npy (batch 1, attention_mask all ones, position_ids arange), int8
per-channel weights, only MatMul inputs quantized and MatMul outputs left in float
(``op_types_to_quantize=["MatMul"]`` and ``OpTypesToExcludeOutputQuantization=["MatMul"]``, as in
onnxruntime's LLaMA static-quantization example). Activations are uint8 (U8S8), which the
``quantize_static`` docstring of onnxruntime 1.32 recommends for x86-64 CPUs, with ``reduce_range``
only for CPUs without VNNI. The ``-rope-excluded`` settings put the rotary-embedding MatMul
(positions as float x inv_freq) in ``nodes_to_exclude``, as NNCF's ``ptq-sq-onnx-rope-ignored`` puts
it in its ignored scope: one uint8 scale cannot hold positions 0..511.

w4 (``MatMulNBitsQuantizer``): RTN and HQQ at block 128 (the comparison size), with lm_head (and
for RTN the embedding Gather) quantized as the tools do by default, and each in a ``-head-float``
variant that puts those nodes in ``nodes_to_exclude``, as edgeq's W4 recipes keep them; HQQ at block 32
(the quantizer CLI default) labelled contaminated; GPTQ at block 128, symmetric (its asymmetric zero-point packing fails on 576 = 4.5 x 128), on the 16 windows.

w4 (``MatMulNBitsQuantizer``): weight-only block quantization to the ``MatMulNBits`` contrib op;
activations stay float (accuracy_level 4 lets the CPU kernel quantize them to int8 per block on the
fly inside the matmul).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
from _peer_contract import subcommands

DOC_GUIDE = "https://onnxruntime.ai/docs/performance/model-optimizations/quantization.html"
DOC_INT4 = DOC_GUIDE + "#quantize-to-int4uint4"
DOC_STATIC_DOCSTRING = (
    "https://github.com/microsoft/onnxruntime/blob/main/onnxruntime/python/tools/quantization/quantize.py"
)
DOC_LLAMA_SQ = (
    "https://github.com/microsoft/onnxruntime-inference-examples/blob/main/quantization/language_model/"
    "llama/smooth_quant/main.py"
)
DOC_LLAMA_WOQ = (
    "https://github.com/microsoft/onnxruntime-inference-examples/blob/main/quantization/language_model/"
    "llama/weight_only_quant/main.py"
)
DOC_NBITS_CLI = (
    "https://github.com/microsoft/onnxruntime/blob/main/onnxruntime/python/tools/quantization/"
    "matmul_nbits_quantizer.py"
)

# SmoothQuant alpha of onnxruntime's LLaMA SmoothQuant example (0.6 for llama-7b; the API default is 0.5).
SQ_ALPHA = 0.6

_STATIC = ("quant_pre_process, then quantize_static QDQ: uint8 per-tensor static activations (MinMax), int8 "
           "per-channel weights, MatMul inputs only (outputs unquantized), reduce_range off (the x86 VNNI recipe)")
_ROPE = ("; the rotary-embedding MatMul (positions x inv_freq) in nodes_to_exclude, as NNCF's ignored_scope "
         "in its -rope-ignored setting")
_HEAD_FLOAT = ("; lm_head MatMul and embedding Gather in nodes_to_exclude (float, as edgeq's W4 recipes keep them)")
_G32 = ("; group 32: SmolLM2's weights come from a Q4_1 GGUF (asymmetric 4-bit blocks of 32 along K), so a "
        "block-32 grid partly recovers that grid (contaminated, not comparable with group 128)")


def _static(setting, description, docs, calib_windows=16):
    return {"setting": setting, "category": "w8a8", "weight_bits": 8, "activation_bits": 8, "format": "onnx",
            "calib_windows": calib_windows, "group_size": None, "description": description, "docs": docs}


def _w4(setting, description, docs, group_size, calib_windows=None):
    return {"setting": setting, "category": "w4", "weight_bits": 4, "activation_bits": 32, "format": "onnx",
            "calib_windows": calib_windows, "group_size": group_size, "description": description, "docs": docs}


SETTINGS = [
    _static("static-u8s8-minmax", _STATIC, DOC_STATIC_DOCSTRING),
    _static("static-u8s8-minmax-rope-excluded", _STATIC + _ROPE, DOC_STATIC_DOCSTRING),
    _static("static-u8s8-smoothquant", f"as static-u8s8-minmax plus extra_options SmoothQuant (alpha {SQ_ALPHA}, "
            "folding on; Intel Neural Compressor's ORTSmoothQuant) before calibration", DOC_LLAMA_SQ),
    _static("static-u8s8-smoothquant-rope-excluded", f"as static-u8s8-smoothquant{_ROPE}", DOC_LLAMA_SQ),
    _static("static-u8s8-minmax-reduce-range", "as static-u8s8-minmax with reduce_range=True (7-bit weights), the "
            "recipe for x86 CPUs without VNNI (AVX2/AVX512) to avoid U8S8 saturation",
            DOC_GUIDE + "#when-to-use-reduce-range-and-per-channel-quantization"),
    _w4("nbits-rtn-b128-sym-acc4", "quant_pre_process, then MatMulNBitsQuantizer DefaultWeightOnlyQuantConfig (RTN) "
        "as in the docs example: int4 symmetric, block 128, accuracy_level 4, MatMul -> MatMulNBits and the embedding "
        "Gather -> GatherBlockQuantized", DOC_INT4, 128),
    _w4("nbits-rtn-b128-sym-acc4-head-float", "as nbits-rtn-b128-sym-acc4" + _HEAD_FLOAT, DOC_INT4, 128),
    _w4("nbits-hqq-b128", "quant_pre_process, then MatMulNBitsQuantizer HQQWeightOnlyQuantConfig: 4 bits, block 128, "
        "asymmetric (HQQ has no symmetric mode), MatMul only (lm_head included), accuracy_level unset", DOC_NBITS_CLI, 128),
    _w4("nbits-hqq-b128-head-float", "as nbits-hqq-b128" + _HEAD_FLOAT, DOC_NBITS_CLI, 128),
    _w4("nbits-hqq-b32", "quant_pre_process, then MatMulNBitsQuantizer HQQWeightOnlyQuantConfig with the quantizer "
        "CLI defaults: 4 bits, block 32, asymmetric, MatMul only (lm_head included), accuracy_level unset" + _G32,
        DOC_NBITS_CLI, 32),
    _w4("nbits-gptq-b128-sym", "quant_pre_process, then MatMulNBitsQuantizer GPTQWeightOnlyQuantConfig calibrated on "
        "CALIB.npy with onnxruntime's LLaMA weight-only example's GPTQ settings (percdamp 0.01, no act-order) but "
        "symmetric, block 128, accuracy_level unset, MatMul only (lm_head included); symmetric because the example's "
        "asymmetric form fails here at block 128 and 64: its zero-point packing assumes an even number of blocks per "
        "column (576 / 128 = 4.5, 576 / 64 = 9: 'cannot reshape array of size 1440 into shape (576,newaxis)'); "
        "16 windows only (its layer-wise ONNX GPTQ took 42 min on 16 windows at block 32 here)", DOC_LLAMA_WOQ, 128,
        calib_windows=16) | {"slow": "onnxruntime's layer-wise ONNX GPTQ (neural-compressor's) reached 18.7% of "
                             "SmolLM2 in 20 min of one core here at block 128 on 16 windows (about 110 min in all)"},
]
BY_NAME = {s["setting"]: s for s in SETTINGS}


class Failure(Exception):
    """A setting that cannot be produced; the message is the one-line reason."""


def quiet_tool_logs() -> None:
    """The quantizers log one INFO line per graph node; keep their warnings, drop that."""
    for name in ("onnxruntime.quantization", "onnxruntime.quantization.matmul_nbits_quantizer",
                 "onnxruntime.quantization.neural_compressor.weight_only", "neural_compressor"):
        logging.getLogger(name).setLevel(logging.WARNING)


def log(msg: str) -> None:
    print(f"[ort-quant] {msg}", file=sys.stderr, flush=True)


class WindowReader:
    """CalibrationDataReader over the rows of CALIB.npy: one window per batch of 1.

    Duck-typed (get_next, __iter__, __len__, set_range) so it also works where onnxruntime deep-copies
    the reader and iterates it (SmoothQuant, GPTQ).
    """

    def __init__(self, ids: np.ndarray):
        self.ids = np.ascontiguousarray(ids, dtype=np.int64)
        self.start, self.end, self.pos = 0, len(self.ids), 0

    def _feed(self, row: np.ndarray) -> dict:
        n = row.shape[0]
        return {
            "input_ids": row[None, :],
            "attention_mask": np.ones((1, n), dtype=np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None, :],
        }

    def get_next(self):
        if self.start + self.pos >= self.end:
            return None
        row = self.ids[self.start + self.pos]
        self.pos += 1
        return self._feed(row)

    def rewind(self):
        self.pos = 0

    def set_range(self, start_index: int, end_index: int):
        self.start, self.end, self.pos = start_index, min(end_index, len(self.ids)), 0

    def __len__(self):
        return len(self.ids)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.get_next()
        if item is None:
            raise StopIteration
        return item

    def __deepcopy__(self, memo):
        other = WindowReader.__new__(WindowReader)
        other.ids, other.start, other.end, other.pos = self.ids, self.start, self.end, 0
        return other


def ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def load_calib(path: str) -> np.ndarray:
    ids = np.load(path)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise Failure(f"calibration ids must be a 2-D integer array, got {ids.dtype} {ids.shape}")
    return ids.astype(np.int64)


def pre_process(model: str, work: Path) -> Path:
    """onnxruntime's quant_pre_process: symbolic shape inference, ORT basic optimization, ONNX shape inference."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out = work / "preprocessed.onnx"
    t0 = time.time()
    quant_pre_process(
        model,
        str(out),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        external_data_location="preprocessed.onnx.data",
    )
    log(f"quant_pre_process: {time.time() - t0:.1f} s")
    return out


def save_model(model_proto, out_dir: Path) -> None:
    import onnx

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("model.onnx", "model.onnx.data"):
        (out_dir / name).unlink(missing_ok=True)
    onnx.save_model(
        model_proto,
        str(out_dir / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=1024,
    )


def rotary_matmuls(pre: Path) -> list[str]:
    """The rotary-embedding MatMul(s) of the pre-processed model (positions as float x inv_freq)."""
    import onnx

    names = [n.name for n in onnx.load(str(pre), load_external_data=False).graph.node
             if n.op_type == "MatMul" and "rotary" in n.name]
    if not names:
        raise Failure("no rotary-embedding MatMul found to exclude (expected a MatMul named *rotary*)")
    return names


def head_and_embedding(pre: Path) -> list[str]:
    """Names of the MatMul that produces the logits and of the Gather that reads input_ids."""
    import onnx

    graph = onnx.load(str(pre), load_external_data=False).graph
    outputs = {o.name for o in graph.output}
    head = [n.name for n in graph.node if n.op_type == "MatMul" and n.output[0] in outputs]
    embed = [n.name for n in graph.node if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == "input_ids"]
    if len(head) != 1 or len(embed) != 1:
        raise Failure(f"expected one lm_head MatMul and one embedding Gather, found {head} and {embed}")
    return head + embed


def quantize_static_setting(setting: str, model: str, ids: np.ndarray, out_dir: Path, work: Path) -> str:
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    quiet_tool_logs()
    pre = pre_process(model, work)
    # (MinMax calibration keeps only per-window ReduceMin/ReduceMax scalars, so all 16 windows fit in
    # memory; CalibMaxIntermediateOutputs must stay unset: in onnxruntime 1.32 MinMaxCalibrater drops the
    # collected outputs without merging them when that limit is hit, then fails with "No data is collected".)
    extra = {"OpTypesToExcludeOutputQuantization": ["MatMul"]}
    reduce_range = setting == "static-u8s8-minmax-reduce-range"
    notes = []
    exclude = rotary_matmuls(pre) if setting.endswith("-rope-excluded") else []
    if exclude:
        notes.append(f"nodes_to_exclude={exclude}")
    if setting.startswith("static-u8s8-smoothquant"):
        try:
            import neural_compressor  # noqa: F401
            from neural_compressor.adaptor.ox_utils.smooth_quant import ORTSmoothQuant  # noqa: F401
        except Exception as exc:  # the exact reason goes into the results row
            raise Failure(
                f"SmoothQuant needs Intel Neural Compressor's neural_compressor.adaptor.ox_utils.smooth_quant: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        extra.update({"SmoothQuant": True, "SmoothQuantAlpha": SQ_ALPHA, "SmoothQuantFolding": True})
        notes.append(f"neural-compressor {neural_compressor.__version__} ORTSmoothQuant, alpha {SQ_ALPHA}")
    tmp_out = work / "quantized.onnx"
    t0 = time.time()
    quantize_static(
        str(pre),
        str(tmp_out),
        calibration_data_reader=WindowReader(ids),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=["MatMul"],
        per_channel=True,
        reduce_range=reduce_range,
        nodes_to_exclude=exclude,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        use_external_data_format=True,
        calibrate_method=CalibrationMethod.MinMax,
        extra_options=extra,
    )
    log(f"quantize_static: {time.time() - t0:.1f} s")
    qmodel = onnx.load(str(tmp_out))
    n_q = sum(1 for n in qmodel.graph.node if n.op_type == "QuantizeLinear")
    dq_source = {n.output[0]: n.input[0] for n in qmodel.graph.node if n.op_type == "DequantizeLinear"}
    inits = {t.name for t in qmodel.graph.initializer}
    # both inputs dequantized activations: neither DequantizeLinear reads a weight initializer
    act_act = [n for n in qmodel.graph.node if n.op_type == "MatMul" and all(i in dq_source for i in n.input)
               and not any(dq_source[i] in inits for i in n.input)]
    rotary = [n.name for n in act_act if "rotary" in n.name]
    save_model(qmodel, out_dir)
    notes.append(
        f"QDQ U8S8 per-channel{' reduce_range' if reduce_range else ''}; {n_q} QuantizeLinear; "
        f"op_types_to_quantize=['MatMul'] also quantizes {len(act_act)} activation x activation MatMuls "
        f"(attention scores and context"
        + (f", and the rotary-embedding MatMul {rotary[0]} whose input is position_ids as float, "
           f"so positions up to {ids.shape[1] - 1} share one uint8 scale" if rotary else "")
        + f"); calibration {len(ids)} windows x {ids.shape[1]} tokens"
    )
    return "; ".join(notes)


def quantize_nbits_setting(setting: str, model: str, ids: np.ndarray, out_dir: Path, work: Path) -> str:
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq
    from onnxruntime.quantization.quant_utils import QuantFormat

    quiet_tool_logs()
    pre = pre_process(model, work)
    exclude = head_and_embedding(pre) if setting.endswith("-head-float") else None
    if setting.startswith("nbits-rtn-b128-sym-acc4"):
        # onnxruntime.ai's "Quantize to Int4/UInt4" example, loaded the way it shows.
        from onnxruntime.quantization import quant_utils

        cfg = mnq.DefaultWeightOnlyQuantConfig(
            block_size=128,
            is_symmetric=True,
            accuracy_level=4,
            quant_format=QuantFormat.QOperator,
            op_types_to_quantize=("MatMul", "Gather"),
            quant_axes=(("MatMul", 0), ("Gather", 1)),
        )
        src = quant_utils.load_model_with_shape_infer(pre)
        quant = mnq.MatMulNBitsQuantizer(src, nodes_to_exclude=exclude, nodes_to_include=None, algo_config=cfg)
    elif setting.startswith("nbits-hqq-"):
        try:
            import torch  # noqa: F401  (HQQ is implemented in torch)
        except Exception as exc:
            raise Failure(f"HQQ needs torch: {type(exc).__name__}: {exc}") from exc
        block = BY_NAME[setting]["group_size"]
        cfg = mnq.HQQWeightOnlyQuantConfig(block_size=block, bits=4, op_types_to_quantize=("MatMul",))
        quant = mnq.MatMulNBitsQuantizer(onnx.load(str(pre)), bits=4, nodes_to_exclude=exclude, algo_config=cfg)
    elif setting == "nbits-gptq-b128-sym":
        cfg = mnq.GPTQWeightOnlyQuantConfig(calibration_data_reader=WindowReader(ids))
        # Pass the loaded model, not its path: given a path under 2 GB, the INC-derived GPTQ code loads it
        # without its external data and then fails to build its calibration session from bytes.
        quant = mnq.MatMulNBitsQuantizer(onnx.load(str(pre)), block_size=128, is_symmetric=True,
                                         accuracy_level=None, algo_config=cfg)
    else:
        raise Failure(f"unknown w4 setting {setting!r}")
    t0 = time.time()
    quant.process()
    log(f"MatMulNBitsQuantizer.process ({cfg.algorithm}): {time.time() - t0:.1f} s")
    qproto = quant.model.model if hasattr(quant.model, "model") else quant.model
    if not isinstance(qproto, onnx.ModelProto):
        raise Failure(f"unexpected quantizer output type {type(qproto).__name__}")
    from onnx.external_data_helper import load_external_data_for_model, uses_external_data

    if any(uses_external_data(t) for t in qproto.graph.initializer):
        # initializers still pointing into the work folder's data file: pull them in before saving
        load_external_data_for_model(qproto, str(pre.parent))
    ops: dict[str, int] = {}
    for n in qproto.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    save_model(qproto, out_dir)
    return (
        (f"nodes_to_exclude={exclude}; " if exclude else "")
        + f"{cfg.algorithm}: {ops.get('MatMulNBits', 0)} MatMulNBits, {ops.get('GatherBlockQuantized', 0)} "
        f"GatherBlockQuantized, {ops.get('MatMul', 0)} float MatMul left"
    )


def cmd_quantize(args) -> int:
    if args.setting not in BY_NAME:
        print(f"unknown setting {args.setting!r}; known: {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    spec = BY_NAME[args.setting]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ortq.", dir=os.environ.get("TMPDIR")))
    # a SIGTERM (the orchestrator's timeout) unwinds through the finally below, removing the work folder
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    # The tools print progress to stdout (GPTQ's "\rProgress: [...]" has no newline); send everything
    # they write to stderr, at the file-descriptor level, so our JSON is alone on the last stdout line.
    sys.stdout.flush()
    saved_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        ids = load_calib(args.calib_ids)
        if spec["category"] == "w8a8":
            notes = quantize_static_setting(args.setting, args.model, ids, out_dir, work)
        else:
            notes = quantize_nbits_setting(args.setting, args.model, ids, out_dir, work)
    except Failure as exc:
        print(f"{args.setting}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - report any tool failure as one line
        traceback.print_exc(file=sys.stderr)
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"{args.setting}: onnxruntime quantization failed: {msg[:500]}", file=sys.stderr)
        return 1
    finally:
        sys.stdout.flush()
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"version": f"onnxruntime {ort_version()}", "notes": notes}))
    return 0


def main(argv=None) -> int:
    ap, _, _ = subcommands(__doc__)
    args = ap.parse_args(argv)
    if args.cmd == "settings":
        print(json.dumps(SETTINGS))
        return 0
    return cmd_quantize(args)


if __name__ == "__main__":
    sys.exit(main())
