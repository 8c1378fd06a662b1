"""Where onnxruntime's CPU provider will run a uint8 x int8 integer kernel in a QDQ graph.

The pattern its QDQ transformers fuse into ``MatMulIntegerToFloat`` / ``QLinearMatMul`` / ``QGemm``:
a MatMul (or Gemm) whose first input is a DequantizeLinear of an 8-bit integer activation (uint8,
or int8 which onnxruntime shifts to uint8 on x86) and whose second is a DequantizeLinear of a
constant int8 weight, per tensor or per output channel (2-D). Those are the linears whose int8
codes decide whether VPMADDUBSW can saturate (``edgeq.targets.saturation``). uint8 weights take
the exact U8U8 kernel and are not listed; 16-bit activations are not fused into integer kernels.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.targets.requant import WeightDQ, integer_dtype, read_constant, weight_dequantizers

_LINEAR_OPS = ("MatMul", "Gemm")


@dataclass
class U8S8Site:
    """One linear onnxruntime runs as uint8 activation x int8 weight."""

    node: gs.Node  # the MatMul / Gemm
    activation: gs.Tensor  # the 8-bit integer activation (the activation DequantizeLinear's input)
    activation_zero_point: int
    activation_signed: bool  # int8 (shifted to uint8 by onnxruntime on x86) or uint8
    weight: WeightDQ
    k_axis: int  # the weight's reduction axis (0 for MatMul, 1 for Gemm with transB)

    def weight_kn(self) -> np.ndarray:
        """The weight's integer codes as [K, N]."""
        return np.moveaxis(self.weight.q, self.k_axis, 0)


def _activation_dq(index: ir.GraphIndex, tensor: gs.Tensor) -> tuple[gs.Tensor, int, bool] | None:
    """(integer input, zero point, signed) when ``tensor`` is a DequantizeLinear of a non-constant 8-bit tensor."""
    node = index.producer(tensor.name)
    if node is None or node.op != "DequantizeLinear" or isinstance(node.inputs[0], gs.Constant):
        return None
    zp_t = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
    zp = read_constant(index, zp_t) if zp_t is not None else np.zeros((), np.uint8)
    if zp is None or np.size(zp) != 1 or integer_dtype(np.asarray(zp)) not in ("int8", "uint8"):
        return None
    return node.inputs[0], int(np.asarray(zp).reshape(())), integer_dtype(np.asarray(zp)) == "int8"


def find_u8s8_sites(graph: gs.Graph, index: ir.GraphIndex | None = None) -> list[U8S8Site]:
    """Every uint8 x int8 linear of the main graph, in graph order."""
    index = index or ir.GraphIndex(graph)
    by_output = {}
    for found in weight_dequantizers(graph, index):
        if found.spec.dtype == "int8" and not found.spec.block_size and found.q.ndim == 2:
            by_output[found.node.outputs[0].name] = found
    sites = []
    for node in graph.nodes:
        if node.op not in _LINEAR_OPS or len(node.inputs) < 2:
            continue
        wdq = by_output.get(node.inputs[1].name)
        if wdq is None:
            continue
        act = _activation_dq(index, node.inputs[0])
        if act is None:
            continue
        k_axis = 1 if node.op == "Gemm" and node.attrs.get("transB", 0) else 0
        if wdq.spec.axis is not None and wdq.spec.axis == k_axis:
            continue  # scales along K: not a per-output-channel weight onnxruntime fuses
        sites.append(U8S8Site(node, act[0], act[1], act[2], wdq, k_axis))
    return sites


def u8s8_weights(graph: gs.Graph, index: ir.GraphIndex | None = None) -> list[tuple[WeightDQ, int]]:
    """(weight, K axis) of every uint8 x int8 linear."""
    return [(s.weight, s.k_axis) for s in find_u8s8_sites(graph, index)]


def static_risk(sites: list[U8S8Site]) -> dict[str, int]:
    """Linear name -> its worst adjacent-pair ``|q0| + |q1|`` where that exceeds 128 (may saturate)."""
    from edgeq.targets.saturation import PAIR_LIMIT, worst_pair

    out = {}
    for site in sites:
        worst = int(worst_pair(site.weight_kn()).max(initial=0))
        if worst > PAIR_LIMIT:
            out[site.node.name] = worst
    return out


def probe_saturation(model: onnx.ModelProto, feeds: dict[str, np.ndarray], rows: int = 32) -> dict:
    """Per uint8 x int8 linear: the worst-case bound of its weight codes and what the VPMADDUBSW
    model (``edgeq.targets.saturation``) predicts on real activation codes (``rows`` token rows,
    evenly spaced, of one run on ``feeds``). The model runs in onnxruntime without graph
    optimizations (exact QDQ), with the integer activations as its outputs. Also proves that the
    model loads in onnxruntime."""
    per_linear, _ = probe_linears(model, feeds, rows=rows)
    return summarize_probe(per_linear, rows)


def probe_linears(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, nodes: set[str] | None = None,
                  stream: tuple[str | None, str] | None = None, stream_value: np.ndarray | None = None,
                  rows: int = 32) -> tuple[dict[str, dict], np.ndarray | None]:
    """``probe_saturation``'s per-linear records, for the linears named in ``nodes`` (all when
    None), and the value of a stream tensor: ``stream = (cut, capture)`` makes ``cut`` an input
    fed ``stream_value`` (None: computed as usual) and returns ``capture``'s value. A block-wise
    compile probes block by block this way, carrying the compiled model's hidden states, so the
    records are those of the whole compiled model's run on ``feeds``."""
    from edgeq.targets.saturation import simulate_linear, worst_pair

    graph = gs.import_onnx(model)  # (its weights stay the model's tensors until exported)
    sites = [s for s in find_u8s8_sites(graph) if nodes is None or s.node.name in nodes]
    tensors = graph.tensors()
    fetch = []
    for name in sorted({s.activation.name for s in sites}):
        signed = next(s.activation_signed for s in sites if s.activation.name == name)
        tensors[name].dtype = np.int8 if signed else np.uint8
        fetch.append(tensors[name])
    cut, capture = stream if stream is not None else (None, None)
    if capture is not None:
        tensors[capture].dtype = tensors[capture].dtype or np.float32
        fetch.append(tensors[capture])
    if cut is not None:
        tensors[cut].inputs.clear()
        tensors[cut].dtype = np.float32
        graph.inputs.append(tensors[cut])
    graph.outputs = fetch or graph.outputs  # (no linear to probe: the session still proves the model loads)
    graph.cleanup()  # only what the fetched tensors need (not the vocabulary head after its input)
    session = ir.graph_session(graph)
    del graph, tensors, fetch
    accepted = {i.name for i in session.get_inputs()}
    run_feeds: dict[str, np.ndarray | None] = {k: v for k, v in feeds.items() if k in accepted}
    if cut is not None:
        run_feeds[cut] = stream_value
    names = [o.name for o in session.get_outputs()]
    fetched = dict(zip(names, session.run(names, run_feeds))) if sites or capture is not None else {}
    del session
    per_linear = {}
    for site in sites:
        q_kn = site.weight_kn()
        codes = fetched[site.activation.name].reshape(-1, q_kn.shape[0])
        pick = np.unique(np.linspace(0, codes.shape[0] - 1, min(rows, codes.shape[0])).astype(np.int64))
        stats = simulate_linear(codes[pick], site.activation_zero_point, q_kn, site.weight.zero_point)
        per_linear[site.node.name] = {"worst_pair": int(worst_pair(q_kn).max(initial=0)), "rows_probed": len(pick),
                                      **stats.to_dict()}
    return per_linear, fetched.get(capture) if capture is not None else None


def summarize_probe(per_linear: dict[str, dict], rows: int = 32) -> dict:
    """The whole model's saturation summary from per-linear probe records."""
    from edgeq.targets.saturation import PAIR_LIMIT

    if not per_linear:
        return {"linears": 0}
    worst = max(v["worst_pair"] for v in per_linear.values())
    return {
        "linears": len(per_linear),
        "pair_limit": PAIR_LIMIT,
        "worst_pair": worst,
        "saturation_free": worst <= PAIR_LIMIT,
        "linears_at_risk": sum(v["worst_pair"] > PAIR_LIMIT for v in per_linear.values()),
        "rows_probed": max(v["rows_probed"] for v in per_linear.values()),
        "max_pair_rate": max(v["pair_rate"] for v in per_linear.values()),
        "max_rel_error": max(v["rel_error"] for v in per_linear.values()),
        "per_linear": {k: {f: x for f, x in v.items() if f != "rows_probed"} for k, v in per_linear.items()},
    }


# onnxruntime's integer linears after its QDQ fusion -> the input index of their second operand
# (QGemm's may be transposed: transB)
_FUSED_INTEGER_LINEARS = {"MatMulIntegerToFloat": 1, "MatMulInteger": 1, "DynamicQuantizeMatMul": 1,
                          "QLinearMatMul": 3, "QGemm": 3}


def ort_fused_u8s8(model_path: str | os.PathLike) -> dict[str, dict]:
    """Ask onnxruntime rather than assume: build a CPU session with default optimizations on the
    saved model, read back the graph it will run, and list every integer linear with an int8
    second operand (the VPMADDUBSW-prone form: uint8 x int8, or int8 x int8, which x86 shifts to
    uint8). Per fused node: ``constant`` (its int8 weight is an initializer), ``worst_pair`` (the
    same-sign adjacent-pair bound along K) and ``saturation_free``; both None when the second
    operand is computed at run time (its codes, and so its risk, are unknown here). This is the ground truth that ``find_u8s8_sites`` predicts from our QDQ
    graph; the two must agree."""
    import tempfile
    from pathlib import Path

    import onnxruntime as ort
    from onnx import numpy_helper

    from edgeq.targets.saturation import PAIR_LIMIT, worst_pair

    with tempfile.TemporaryDirectory(prefix="edgeq-ortopt-") as tmp:
        opts = ir.session_options(optimize=True)
        opts.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
        optimized = onnx.load(opts.optimized_model_filepath)
    initializers = {t.name: t for t in optimized.graph.initializer}
    fused = {}
    for node in optimized.graph.node:
        slot = _FUSED_INTEGER_LINEARS.get(node.op_type)
        if slot is None or len(node.input) <= slot:
            continue
        b = initializers.get(node.input[slot])
        if b is None:
            fused[node.name] = {"op": node.op_type, "constant": False, "worst_pair": None, "saturation_free": None}
            continue
        if b.data_type != onnx.TensorProto.INT8:
            continue  # uint8 weights: the exact U8U8 kernel
        q = numpy_helper.to_array(b)
        transposed = node.op_type == "QGemm" and any(a.name == "transB" and a.i for a in node.attribute)
        q_kn = q.T if transposed else q
        worst = int(worst_pair(q_kn.reshape(q_kn.shape[0], -1)).max(initial=0))
        fused[node.name] = {"op": node.op_type, "constant": True, "worst_pair": worst, "saturation_free": worst <= PAIR_LIMIT}
    return fused
