"""Function body vs onnxruntime kernel, per edgeq op, side by side in one run.

For each op, one model on realistic shapes runs in two onnxruntime CPU sessions: the edgeq model
as compiled (onnxruntime inlines the function bodies) and ``use_ort_kernels(model)`` with
``ort_kernel_session_options()`` (onnxruntime-extensions Python kernels running the numpy
references). Shapes: SmolLM2-135M (hidden 576, intermediate 1536) on 512 tokens; the visual
KV-cache attention at decode (B=1, H=9, KVH=3, D=64, Nv=196 visual and Nt=64 text tokens, S=1),
30 attention nodes in one graph (one per SmolLM2 layer). Prints the median time of a session.run
of each and the ratio body / kernel (> 1: the kernel is faster), and the largest output difference.

Usage: ``python benchmarks/ort_kernels.py [--repeat 20] [--threads 1]``. ``--threads`` sets
onnxruntime's intra-op threads and, for the kernels' numpy, OMP/OpenBLAS/MKL threads (set before
numpy is imported, so this script imports numpy inside ``main``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from edgeq.evaluate.machine import machine_info

SMOL_TOKENS, SMOL_HIDDEN, SMOL_INTER = 512, 576, 1536
VK = dict(B=1, H=9, KVH=3, D=64, Nv=196, Nt=64, S=1, layers=30, bits=2)


def _model(nodes, inits, inputs: dict, outputs: list, opset: int):
    """A model over ``nodes`` with graph inputs named after ``inputs`` (arrays; leading dims kept)."""
    import onnx
    from onnx import helper

    from edgeq.runtime_ops import ensure_functions

    vis = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
           for k, v in inputs.items()]
    outs = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in outputs]
    graph = helper.make_graph(nodes, "bench", vis, outs, inits)
    return ensure_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10))


def _cases(rng):
    """name -> (model, feeds)."""
    import numpy as np
    from onnx import helper, numpy_helper

    from edgeq.runtime_ops import (make_online_hadamard_node, make_subspace_qdq_node, make_visual_kv_attention_node,
                                   make_w4a8_linear_node)
    from edgeq.runtime_ops.visual_kv_attention import INPUTS as VK_INPUTS
    from edgeq.runtime_ops.visual_kv_codes import pack_codes, quantize_channelwise, quantize_pertoken

    cases = {}
    for n in (SMOL_INTER, SMOL_HIDDEN):
        x = rng.standard_normal((1, SMOL_TOKENS, n)).astype(np.float32)
        node, inits = make_online_hadamard_node("x", "y", n)
        cases[f"OnlineHadamard n={n}"] = (_model([node], inits, {"x": x}, ["y"], 18), {"x": x})
    x = (3 * rng.standard_normal((1, SMOL_TOKENS, SMOL_HIDDEN))).astype(np.float32)
    count = np.array([196], np.int64)
    inits = [numpy_helper.from_array(np.array(v, t), k) for k, v, t in
             (("sv", 0.05, np.float32), ("zv", 0, np.int8), ("st", 0.02, np.float32), ("zt", 0, np.int8))]
    node = helper.make_node("ModalityQDQ", ["x", "count", "sv", "zv", "st", "zt"], ["y"], domain="edgeq")
    cases["ModalityQDQ"] = (_model([node], inits, {"x": x, "count": count}, ["y"], 18), {"x": x, "count": count})
    for dynamic in (False, True):
        static = {} if dynamic else dict(low_scale=0.4, low_zero_point=0, high_scale=0.03, high_zero_point=0)
        node, inits = make_subspace_qdq_node("x", "y", 64, dynamic=dynamic, **static)
        cases[f"SubspaceQDQ {'dynamic' if dynamic else 'static'}"] = (_model([node], inits, {"x": x}, ["y"], 18), {"x": x})
    k, n, block = SMOL_HIDDEN, SMOL_INTER, 128
    node, inits = make_w4a8_linear_node(
        "x", "y", w=rng.integers(0, 16, (k, n)), w_scale=rng.uniform(1, 4, (-(-k // block), n)).astype(np.float32) / 64,
        w_zero_point=rng.integers(3, 13, (-(-k // block), n)), w_fp8_scale=2.0 ** -6, x_scale=0.0371, block_size=block)
    cases["W4A8Linear 576x1536"] = (_model([node], inits, {"x": x}, ["y"], 21), {"x": x})
    c = VK
    for per_token in (False, True):
        quant_v = quantize_pertoken if per_token else quantize_channelwise
        kc, ka, ks = quantize_channelwise(rng.standard_normal((c["B"], c["KVH"], c["Nv"], c["D"])).astype(np.float32), c["bits"])
        vc, va, vs = quant_v(rng.standard_normal((c["B"], c["KVH"], c["Nv"], c["D"])).astype(np.float32), c["bits"])
        feeds = dict(q=rng.standard_normal((c["B"], c["H"], c["S"], c["D"])).astype(np.float32),
                     k_codes=pack_codes(kc, c["bits"]), k_alpha=ka, k_scale=ks,
                     v_codes=pack_codes(vc, c["bits"]), v_alpha=va, v_scale=vs,
                     k_text=rng.standard_normal((c["B"], c["KVH"], c["Nt"], c["D"])).astype(np.float32),
                     v_text=rng.standard_normal((c["B"], c["KVH"], c["Nt"], c["D"])).astype(np.float32))
        nodes, inits = [], []
        for layer in range(c["layers"]):
            node, layer_inits = make_visual_kv_attention_node(*VK_INPUTS[:9], f"y{layer}", c["bits"], tau1=1.0, tau2=3.0,
                                                              v_per_token=per_token)
            nodes.append(node)
            inits += layer_inits
        nodes.append(helper.make_node("Sum", [f"y{i}" for i in range(c["layers"])], ["y"]))
        name = f"VisualKVAttention{'KIVI' if per_token else ''} x{c['layers']}"
        cases[name] = (_model(nodes, inits, feeds, ["y"], 18), feeds)
    return cases


def _time(session, feeds, repeat: int) -> float:
    for _ in range(3):
        session.run(None, feeds)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    a = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    import numpy as np
    import onnxruntime as ort

    from edgeq.runtime_ops.ort_kernels import has_ort_kernels, ort_kernel_session_options, use_ort_kernels

    if not has_ort_kernels():
        raise SystemExit("onnxruntime-extensions is not installed: pip install 'edgeq[ort-kernels]'")
    print(f"onnxruntime {ort.__version__}, {a.threads} thread(s), median of {a.repeat} runs")
    print(f"{'op':34s} {'body ms':>9s} {'kernel ms':>10s} {'body/kernel':>12s} {'max |diff|':>11s}")
    table = {}
    for name, (model, feeds) in _cases(np.random.default_rng(0)).items():
        kernel_model = use_ort_kernels(model)
        assert all(n.domain != "edgeq" for n in kernel_model.graph.node), f"{name}: a node kept its body"
        sessions = []
        for m, so in ((model, ort.SessionOptions()), (kernel_model, ort_kernel_session_options())):
            so.intra_op_num_threads = a.threads
            so.log_severity_level = 3
            sessions.append(ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]))
        body, kernel = (_time(s, feeds, a.repeat) for s in sessions)
        diff = np.abs(sessions[0].run(None, feeds)[0] - sessions[1].run(None, feeds)[0]).max()
        print(f"{name:34s} {body * 1e3:9.3f} {kernel * 1e3:10.3f} {body / kernel:11.2f}x {diff:11.2e}")
        table[name] = {"body_ms": round(body * 1e3, 3), "kernel_ms": round(kernel * 1e3, 3),
                       "body_over_kernel": round(body / kernel, 3), "max_abs_diff": float(diff)}
    if a.out:
        import json
        from pathlib import Path

        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"machine": machine_info(), "onnxruntime": ort.__version__, "threads": a.threads, "repeat": a.repeat,
                                           "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
