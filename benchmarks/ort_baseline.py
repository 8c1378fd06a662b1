"""onnxruntime's own static quantizer, configured as in the project's baselines.

QDQ format, MatMul only, per-channel symmetric int8 weights, static per-tensor symmetric int8
activations, MinMax calibration on the same token windows edgeq calibrates on. Run as a script so
the benchmark can time it (and its memory) in a separate process, side by side with edgeq.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import onnxruntime as ort
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                      quantize_static)

from edgeq.textdata import feeds_for_windows, token_windows


class _WindowReader(CalibrationDataReader):
    def __init__(self, feeds):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)


def run(model: Path, out: Path, calib_text: Path, tokenizer: Path, windows: int, seq_len: int) -> float:
    start = time.perf_counter()
    specs = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).get_inputs()
    ids = token_windows(calib_text, tokenizer, seq_len=seq_len, windows=windows)
    feeds = [feeds_for_windows(specs, ids[i:i + 1]) for i in range(len(ids))]
    out.parent.mkdir(parents=True, exist_ok=True)
    quantize_static(
        str(model), str(out), _WindowReader(feeds),
        quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"], per_channel=True,
        weight_type=QuantType.QInt8, activation_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax, use_external_data_format=True,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model", type=Path)
    p.add_argument("-o", "--out", type=Path, required=True)
    p.add_argument("--calib", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    a = p.parse_args(argv)
    seconds = run(a.model, a.out, a.calib, a.tokenizer, a.windows, a.seq_len)
    print(f"quantize_static: {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
