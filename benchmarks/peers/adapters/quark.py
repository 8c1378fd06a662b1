"""Peer adapter: AMD Quark for ONNX (``amd-quark``) on the SmolLM2 fp32 ONNX model.

Runs with ``.venvs/quark/bin/python`` (pins: the ``[quark]`` table of benchmarks/peers/pins.toml);
imports only that venv's packages (quark, onnx, onnxruntime, numpy) and the standard library.
Subcommands (the contract of benchmarks/peers.py):

    settings
    quantize --setting S --model FP32_ONNX --calib-ids CALIB.npy --out DIR

All outputs are ONNX (QDQ or com.microsoft MatMulNBits) and run in plain onnxruntime on CPU, so
there is no ``evaluate`` subcommand.

Settings follow Quark's own ONNX LLM recipes, i.e. the worked opt-125m examples of its docs
(``examples/onnx/accuracy_improvement/{smooth_quant,gptq}``), through its ``ModelQuantizer``:

* w8a8 ``int8-transformer``: ``get_default_config("INT8_TRANSFORMER_DEFAULT")`` ("Int8
  configuration for transformer-based models"): QDQ, MinMax calibration with moving average,
  uint8 asymmetric per-tensor activations, int8 symmetric per-tensor weights, only MatMul/Gemm
  with a constant weight quantized (``enable_npu_transformer``); as in the examples, outputs of
  MatMul/Gemm are not quantized (``OpTypesToExcludeOutputQuantization``) and CLE is off.
* w8a8 ``int8-transformer-sq``: the same plus Quark's SmoothQuant (``include_sq``) with alpha 0.5,
  the default of ``SmoothQuantConfig`` and the value of Quark's SmoothQuant docs page.
* w8a8 ``int8-transformer-sq-a0.8``: the same with alpha 0.8, the value the SmoothQuant opt-125m
  example script hard-codes (``SmoothAlpha``). Both are kept: the docs give both. SmoothQuant is the
  algorithm Quark's ONNX docs list for LLMs; its ONNX QuaRot is marked "experimental" and needs a
  hand-written rotation config naming norm/linear nodes whose weight initializers contain "weight"
  (an onnxruntime-genai builder export of Llama), which this torch.onnx export does not have.
* w4 ``int4-rtn``: ``get_default_config("MATMUL_NBITS")``: MatMulNBits int4, block 128,
  symmetric, accuracy_level 1, round-to-nearest (onnxruntime's quantize_matmul_4bits).
* w4 ``int4-gptq``: MATMUL_NBITS with ``Algorithm: GPTQ`` and the GPTQ example's parameters
  (group 128, no act-order, no MSE, accuracy_level 0). Quark's ONNX GPTQ builds its Hessians from
  the first calibration batch only (here window 0, 512 tokens: feeding all 16 windows as one batch
  needs more than 11 GB RSS on this model). It re-quantizes GPTQ's dequantized weights onto a
  fresh symmetric MatMulNBits grid (scale = 2*max|w|/15, zero point 8), a second rounding.
* w4 ``int4-gptq-one-batch``: the same GPTQ with all 16 windows fed as one batch of 16, so that its
  Hessians see every window (peak RSS well above the batch-1 run).
* lm_head stays 4-bit in every w4 setting: Quark 0.13's MATMUL_NBITS path takes no node exclusion
  (``run_matmul_nbits_quantization`` builds its quantizer from ``MatMulNBitsParams`` alone; a
  ``nodes_to_exclude`` in the config was measured to leave all 211 MatMuls, lm_head included, 4-bit).
* w4 ``int4-hqq``: MATMUL_NBITS with ``Algorithm: HQQ`` (data-free half-quadratic quantization).

Quark's ONNX flow has no AWQ. Calibration feeds exactly the windows of CALIB.npy, one window per
batch (batch 1, as in Quark's examples), attention_mask all ones and position_ids arange.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

from _peer_contract import fail, subcommands  # noqa: E402 (before the folder leaves sys.path)

# This file is named quark.py: drop its own folder from sys.path so that "import quark" finds the
# Quark package of the venv, not this adapter.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _HERE]

import numpy as np  # noqa: E402

# Quark JIT-compiles its custom-op library (torch cpp extension) on first import; keep the build in
# the venv so that it belongs to these pins (a rebuilt venv compiles again).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
_JIT_FRESH = not Path(os.environ["TORCH_EXTENSIONS_DIR"]).exists()

DOCS_SQ = "https://quark.docs.amd.com/latest/onnx/example_quark_onnx_smoothquant.html"
DOCS_SQ_ALGO = "https://quark.docs.amd.com/latest/onnx/accuracy_algorithms/sq.html"
DOCS_GPTQ = "https://quark.docs.amd.com/latest/onnx/example_quark_onnx_gptq.html"
DOCS_STRATEGIES = "https://quark.docs.amd.com/latest/onnx/config/quantization_strategies.html"

SQ_ALPHAS = {"int8-transformer-sq": 0.5,        # SmoothQuantConfig default, SmoothQuant docs page
             "int8-transformer-sq-a0.8": 0.8}   # SmoothAlpha of the opt-125m SmoothQuant example
W4_GROUP = 128          # MATMUL_NBITS preset (576 = 4.5 x 128: the last block of each column is padded)

_W8A8 = ("Quark INT8_TRANSFORMER_DEFAULT: QDQ, MinMax calibration with moving average over 16 windows, "
         "uint8 asym per-tensor activations, int8 sym per-tensor weights, only MatMuls with constant "
         "weights (the 210 decoder Linears; lm_head, whose weight is a Transpose of the tied embedding, "
         "stays fp32), MatMul outputs not quantized, CLE off")
_W4 = (f"Quark MATMUL_NBITS: com.microsoft MatMulNBits int4, block {W4_GROUP}, on all 211 MatMuls with "
       "constant weights (incl. lm_head, after Quark folds the embedding Transpose; embedding Gather fp32)")

_Q8 = {"category": "w8a8", "weight_bits": 8, "activation_bits": 8, "format": "onnx", "calib_windows": 16,
       "group_size": None}
_Q4 = {"category": "w4", "weight_bits": 4, "activation_bits": 32, "format": "onnx", "calib_windows": None,
       "group_size": W4_GROUP}
SETTINGS = [
    {"setting": "int8-transformer", **_Q8, "description": _W8A8, "docs": DOCS_SQ},
    {"setting": "int8-transformer-sq", **_Q8,
     "description": _W8A8 + "; SmoothQuant alpha 0.5 (SmoothQuantConfig default; a Mul "
     "inserted before each weight MatMul, its inverse folded into the weight; max |x| over 16 windows)",
     "docs": DOCS_SQ_ALGO},
    {"setting": "int8-transformer-sq-a0.8", **_Q8,
     "description": _W8A8 + "; SmoothQuant alpha 0.8 (the opt-125m example's SmoothAlpha; "
     "a Mul inserted before each weight MatMul, its inverse folded into the weight; max |x| over 16 "
     "windows)", "docs": DOCS_SQ},
    {"setting": "int4-rtn", **_Q4,
     "description": _W4 + ", symmetric round-to-nearest (onnxruntime quantize_matmul_4bits), "
     "accuracy_level 1, data-free", "docs": DOCS_GPTQ},
    {"setting": "int4-gptq", **_Q4, "calib_windows": 1,
     "description": _W4 + ", symmetric GPTQ (group 128, no act-order, no MSE, damp 0.01; Hessians from the first "
     "calibration batch only = window 0, as Quark's ONNX GPTQ does), accuracy_level 0", "docs": DOCS_GPTQ},
    {"setting": "int4-gptq-one-batch", **_Q4, "calib_windows": 16, "batch": 16,
     "description": _W4 + ", symmetric GPTQ as int4-gptq, but the 16 calibration windows fed as one batch of 16 "
     "so that its Hessians see all of them (Quark's ONNX GPTQ reads the first batch only)", "docs": DOCS_GPTQ},
    {"setting": "int4-hqq", **_Q4,
     "description": _W4 + " (HQQ quantizer: asymmetric with zero points), half-quadratic quantization, "
     "data-free", "docs": DOCS_GPTQ},
]
_BY_NAME = {s["setting"]: s for s in SETTINGS}


def _version() -> str:
    from importlib.metadata import version
    return f"amd-quark {version('amd-quark')} (onnxruntime {version('onnxruntime')}, onnx {version('onnx')})"


def _reader(ids: np.ndarray, batch: int = 1):
    """Windows in batches of ``batch``: input_ids, attention_mask (ones), position_ids (arange)."""
    from onnxruntime.quantization import CalibrationDataReader

    n, seq = ids.shape
    feeds = []
    for i in range(0, n, batch):
        b = ids[i:i + batch].astype(np.int64)
        feeds.append({"input_ids": b, "attention_mask": np.ones_like(b),
                      "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int64), b.shape).copy()})

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter(feeds)

        def get_next(self):
            return next(self._it, None)

        def rewind(self):
            self._it = iter(feeds)

        def __len__(self):
            return len(feeds)

    return Reader()


def _config(setting: str):
    from quark.onnx.quantization.config import Config, get_default_config

    if setting.startswith("int8-transformer"):
        cfg = copy.deepcopy(get_default_config("INT8_TRANSFORMER_DEFAULT"))
        cfg.extra_options["OpTypesToExcludeOutputQuantization"] = ["MatMul", "Gemm"]
        cfg.include_cle = False
        if setting in SQ_ALPHAS:
            cfg.include_sq = True
            cfg.extra_options["SmoothAlpha"] = SQ_ALPHAS[setting]
    else:
        cfg = copy.deepcopy(get_default_config("MATMUL_NBITS"))
        params = cfg.extra_options["MatMulNBitsParams"]
        params["GroupSize"] = W4_GROUP
        if setting.startswith("int4-gptq"):
            params["AccuracyLevel"] = 0
            params["Algorithm"] = "GPTQ"
            cfg.extra_options["GPTQParams"] = {"MSE": False, "GroupSize": W4_GROUP, "ActOrder": False,
                                               "PerChannel": True}
        elif setting == "int4-hqq":
            params["Algorithm"] = "HQQ"
        cfg.include_cle = False
    return Config(global_quant_config=cfg)


def _check(path: Path, model_path: Path) -> str:
    """Load the result in plain onnxruntime and compare inputs/outputs with the fp32 model."""
    import onnx
    import onnxruntime as ort
    from collections import Counter

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ref = onnx.load(str(model_path), load_external_data=False)
    want_in = sorted(i.name for i in ref.graph.input)
    want_out = [o.name for o in ref.graph.output]
    got_in = sorted(i.name for i in sess.get_inputs())
    got_out = [o.name for o in sess.get_outputs()]
    if got_in != want_in or got_out != want_out:
        raise RuntimeError(f"inputs/outputs changed: {got_in}->{got_out}, want {want_in}->{want_out}")
    m = onnx.load(str(path), load_external_data=False)
    ops = Counter(n.op_type for n in m.graph.node)
    keep = {k: v for k, v in ops.items() if k in ("QuantizeLinear", "DequantizeLinear", "MatMulNBits",
                                                    "MatMul", "Mul", "MatMulInteger", "QLinearMatMul")}
    return ", ".join(f"{k} {v}" for k, v in sorted(keep.items()))


def cmd_quantize(a: argparse.Namespace) -> None:
    if a.setting not in _BY_NAME:
        fail(f"unknown setting {a.setting!r}; known: {', '.join(_BY_NAME)}")
    model = Path(a.model).resolve()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = np.load(a.calib_ids)
    if ids.ndim != 2:
        fail(f"calibration ids must be [n, seq], got {ids.shape}")

    from quark.onnx import ModelQuantizer

    # Quark writes scratch files (cached models, tensor ranges) into TmpDir / the working dir.
    work = Path(tempfile.mkdtemp(prefix="quark-peer-", dir=str(out)))
    cwd = os.getcwd()
    try:
        os.chdir(work)
        config = _config(a.setting)
        config.global_quant_config.extra_options["TmpDir"] = str(work)
        tmp_out = work / "model.onnx"
        # One window per batch, as in Quark's examples. (Quark's ONNX GPTQ reads the first batch only;
        # feeding all 16 windows as one batch needs > 11 GB RSS on this model, so it sees window 0.)
        reader = _reader(ids, batch=_BY_NAME[a.setting].get("batch", 1))
        result = ModelQuantizer(config).quantize_model(str(model), str(tmp_out), reader)
        if not tmp_out.exists():
            raise RuntimeError(f"Quark wrote no model (quantize_model returned {type(result).__name__})")
        os.chdir(cwd)
        # Re-save as DIR/model.onnx + DIR/model.onnx.data whatever Quark's own layout was.
        import onnx
        m = onnx.load(str(tmp_out), load_external_data=True)
        for f in ("model.onnx", "model.onnx.data"):
            (out / f).unlink(missing_ok=True)
        onnx.save_model(m, str(out / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=1024)
        del m
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - one-line reason for the orchestrator
        os.chdir(cwd)
        traceback.print_exc(file=sys.stderr)
        fail(f"quark {a.setting} failed: {type(exc).__name__}: {exc}")
    finally:
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)

    try:
        ops = _check(out / "model.onnx", model)
    except Exception as exc:  # noqa: BLE001
        fail(f"quark {a.setting}: output does not load in onnxruntime: {type(exc).__name__}: {exc}")
    notes = f"{_BY_NAME[a.setting]['description']}. Graph: {ops}."
    if _JIT_FRESH:
        notes += " Wall time includes Quark's one-time JIT build of its custom-op library (first use of the venv)."
    if a.setting.startswith("int8-transformer"):
        notes += (" Quark's MinMax calibrator keeps every window's full outputs (incl. the 100 MB logits) "
                  "until the end of calibration, hence a peak RSS near 9 GB.")
    if a.setting == "int4-gptq-one-batch":
        notes += f" All {ids.shape[0]} windows in one calibration batch."
    if a.setting == "int4-gptq":
        notes += (f" Quark's ONNX GPTQ reads only the first calibration batch: its Hessians come from window 0 "
                  f"(512 tokens) of the {ids.shape[0]}.")
    print(json.dumps({"version": _version(), "notes": notes}))


def main() -> None:
    p, _, _ = subcommands(__doc__)
    a = p.parse_args()
    if a.cmd == "settings":
        print(json.dumps(SETTINGS))
    elif a.cmd == "quantize":
        cmd_quantize(a)


if __name__ == "__main__":
    main()
