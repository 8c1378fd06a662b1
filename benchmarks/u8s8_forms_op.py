"""One linear, every int8 weight form, on this CPU: what onnxruntime's integer kernel computes and
how long it takes (the operator-level half of docs/cpu-int8-kernels.md).

A SmolLM2-shaped linear (M = 512 tokens; K x N = 576 x 1536 like gate_proj and 1536 x 576 like
down_proj), activations as edgeq writes them (static symmetric uint8, zero point 128), weights
per output channel in four forms: ``full`` (int8 [-127, 127]), ``pair`` (edgeq's pair-bounded
grid), ``7bit`` (int8 [-63, 63]: reduce_range / overflow_fix) and ``u8u8`` (uint8 weights with
zero point 128: MLAS's U8U8 kernel). For each: relative error of onnxruntime's default session
against the exact-QDQ session (the kernel's own error: saturation), the QDQ error against the
float product (the grid's cost), and the median latency of both sessions. Pure onnx + numpy +
onnxruntime, so it also runs on a machine without edgeq's export stack.

Usage: python benchmarks/u8s8_forms_op.py --out benchmarks/results/u8s8-forms-op-DATE-CPU.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgeq.evaluate.machine import machine_info
from edgeq.targets.saturation import quantize_pair_bounded

FORMS = ("full", "pair", "7bit", "u8u8")


def _weight(w: np.ndarray, form: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [K, N], scale [N], zero point [N]) of ``w`` in one form."""
    amax = np.maximum(np.abs(w).max(axis=0), 1e-12)
    if form == "pair":
        q, scale = quantize_pair_bounded(w)
        return q.astype(np.int8), scale.astype(np.float32), np.zeros(w.shape[1], np.int8)
    limit = 63 if form == "7bit" else 127
    scale = (amax / limit).astype(np.float32)
    q = np.clip(np.round(w / scale), -limit, limit)
    if form == "u8u8":
        return (q + 128).astype(np.uint8), scale, np.full(w.shape[1], 128, np.uint8)
    return q.astype(np.int8), scale, np.zeros(w.shape[1], np.int8)


def _model(x: np.ndarray, w: np.ndarray, form: str) -> bytes:
    q, scale, zp = _weight(w, form)
    a_scale = np.float32(np.abs(x).max() / 127)
    inits = [numpy_helper.from_array(np.array(a_scale), "a_scale"), numpy_helper.from_array(np.array(np.uint8(128)), "a_zp"),
             numpy_helper.from_array(q, "w_q"), numpy_helper.from_array(scale, "w_scale"), numpy_helper.from_array(zp, "w_zp")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "a_scale", "a_zp"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "a_scale", "a_zp"], ["x_dq"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"], axis=1),
             helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"])]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()


def _session(model: bytes, exact: bool, threads: int | None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    if exact:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _median_ms(sessions: list, feeds: dict, repeats: int) -> list[float]:
    for s in sessions:
        s.run(None, feeds)
    times = [[] for _ in sessions]
    for _ in range(repeats):  # interleaved
        for i, s in enumerate(sessions):
            t = time.perf_counter()
            s.run(None, feeds)
            times[i].append(time.perf_counter() - t)
    return [float(np.median(t) * 1000) for t in times]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for name, (k, n) in {"gate_proj-like": (576, 1536), "down_proj-like": (1536, 576)}.items():
        x = rng.standard_normal((a.tokens, k)).astype(np.float32)
        x[:, :4] *= 8.0  # a few wide channels, as after rotation's residue
        w = (rng.standard_t(5, (k, n)) * 0.02).astype(np.float32)
        ref = x @ w
        models = {form: _model(x, w, form) for form in FORMS}
        sessions = [_session(models[f], exact, a.threads) for f in FORMS for exact in (False, True)]
        lat = _median_ms(sessions, {"x": x}, a.repeats)
        for i, form in enumerate(FORMS):
            kern, exact = (sessions[2 * i + j].run(None, {"x": x})[0] for j in (0, 1))
            rows.append({"shape": name, "m": a.tokens, "k": k, "n": n, "form": form,
                         "kernel_vs_exact_rel": float(np.linalg.norm(kern - exact) / np.linalg.norm(exact)),
                         "exact_vs_float_rel": float(np.linalg.norm(exact - ref) / np.linalg.norm(ref)),
                         "latency_ms": round(lat[2 * i], 3), "latency_exact_qdq_ms": round(lat[2 * i + 1], 3)})
            print(json.dumps(rows[-1]), flush=True)
    result = {"machine": machine_info(), "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
