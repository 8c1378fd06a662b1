"""``resq-qdq``: ResQ's mixed-precision quantization (paper 002, section 4.1 and appendix C) of a
graph ``resq`` has projected.

At each linear input whose basis has a high-variance subspace (the last r channels), the
activation goes through ``edgeq::SubspaceQDQ``: the low subspace at ``low_bits`` (4), the high
one at ``high_bits`` (8), each with its own scale: per token at run time (``activations =
"dynamic"``, asymmetric: the paper's setting) or static per tensor from calibration ("static",
asymmetric: the NPU form). The weight rows of the high subspace are quantized at
``weight_high_bits`` (8) and the others at ``weight_low_bits`` (4), per output channel and
symmetric, with GPTQ compensating through both grids (``edgeq.passes.methods.gptq``'s ``subsets``): two
DequantizeLinear initializers concatenated along K. o_proj reads the heads side by side, each
head's high channels last, so its input is gathered (all low channels, then all high ones) and
its weight rows permuted alike. down_proj (behind the online Hadamard U_D) is uniform at
``down_proj_bits`` as in the paper; queries stay in float; K (after U_C) and V (after U_B) are
quantized where a KV cache would store them, mixed per head (``kv_low_bits``/``kv_high_bits``:
per token and head when dynamic). With ``resq``'s ``basis = "hadamard"`` there are no subspaces
and every site is uniform at ``low_bits`` (the QuaRot-like baseline). The vocab head stays in
float (``skip_roles``), as in ResQ, QuaRot and SpinQuant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.calib.observers import ChannelMinMaxObserver, HessianObserver
from edgeq.errors import UserInputError
from edgeq.passes.methods.gptq import IntColumns, gptq_quantize
from edgeq.passmanager.passbase import Exactness, Pass, PassConfig, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.quantize.qdq_nodes import (check_weights_finite, ensure_opset, insert_dequantize, insert_quantize,
                              insert_token_fake_quant_asymmetric, insert_weight_dequantize)
from edgeq.quantize.quant import QuantSpec, quantize_weight, scale_zero_point
from edgeq.runtime_ops.domain import DOMAIN
from edgeq.structure import find_linears
from edgeq.structure.linears import Linear



@dataclass(frozen=True)
class ResqQDQConfig(PassConfig):
    activations: str = "dynamic"  # dynamic (per-token asymmetric, the paper) | static (per-tensor asymmetric, NPU)
    low_bits: int = 4
    high_bits: int = 8
    weight_low_bits: int = 4
    weight_high_bits: int = 8
    down_proj_bits: int = 4  # activations at the down_proj input (uniform behind U_D; its weight: weight_low_bits)
    kv: bool = True
    kv_low_bits: int = 4
    kv_high_bits: int = 8
    u_c_bits: int = 8  # the online key projection U_C: its input (q, k after RoPE) and weight (0: float)
    weights: str = "gptq"  # gptq | rtn
    damp: float = 0.01
    order: str = "act_order"  # per-channel scales: any GPTQ order is free at run time
    full_range: bool = True  # symmetric weights use all 2^b levels (signed scales)
    mse: bool = False  # search a shrunk range per output channel minimizing the rounding MSE (QuaRot's w_clip)
    sink_weight: float = 1.0  # times each sequence's first token counts in the attention Hessians
    skip_roles: tuple[str, ...] = ("lm_head",)
    # subspace: edgeq::SubspaceQDQ + one MatMul on the concatenated weight (the NPU hand-off form);
    # integer (static only): each linear split into a low and a high GEMM, each with a standard
    # static Q/DQ and an int8-stored weight (4-bit values), which onnxruntime fuses into two
    # MatMulIntegerToFloat; the same integers, so the same outputs
    lowering: str = "subspace"

    def __post_init__(self):
        if self.activations not in ("dynamic", "static"):
            raise UserInputError(f"resq-qdq: activations must be dynamic or static, got '{self.activations}'")
        if self.weights not in ("gptq", "rtn"):
            raise UserInputError(f"resq-qdq: weights must be gptq or rtn, got '{self.weights}'")
        for key in ("low_bits", "high_bits", "weight_low_bits", "weight_high_bits", "down_proj_bits", "kv_low_bits", "kv_high_bits"):
            if not 2 <= getattr(self, key) <= 8:
                raise UserInputError(f"resq-qdq: {key} must be in [2, 8], got {getattr(self, key)}")
        if self.lowering not in ("subspace", "integer"):
            raise UserInputError(f"resq-qdq: lowering must be subspace or integer, got '{self.lowering}'")
        if self.lowering == "integer" and self.activations != "static":
            raise UserInputError("resq-qdq: lowering 'integer' needs static activations (activations = \"static\")")
        if self.u_c_bits and not 2 <= self.u_c_bits <= 8:
            raise UserInputError(f"resq-qdq: u_c_bits must be 0 (float) or in [2, 8], got {self.u_c_bits}")
        if not self.sink_weight >= 1.0:
            raise UserInputError(f"resq-qdq: sink_weight must be >= 1, got {self.sink_weight}")


@dataclass(frozen=True)
class _Site:
    """How one linear input is quantized: ``rank`` high channels last (0: uniform at ``bits``),
    after an optional channel gather ``perm``."""

    rank: int
    bits: int
    high_bits: int = 8
    perm: tuple[int, ...] | None = None


def _weight_spec(bits: int, int8_storage: bool = False) -> QuantSpec:
    """Per-output-channel symmetric weights: int4 storage up to 4 bits, int8 above (or int8
    storage for every width, which onnxruntime's integer GEMM takes)."""
    dtype = "int4" if bits <= 4 and not int8_storage else "int8"
    return QuantSpec(dtype, True, axis=1, value_bits=0 if (bits == 8 or (bits == 4 and dtype == "int4")) else bits)


def _act_spec(bits: int) -> QuantSpec:
    return QuantSpec("uint8", False, value_bits=0 if bits == 8 else bits)


class ResqQDQPass(Pass, name="resq-qdq", exactness=Exactness.LOSSY, config=ResqQDQConfig,
                  requires=("fuse-norms", "ln-to-rms", "resq"), establishes=facts.RESQ_QDQ,
                  calibrates=lambda cfg: cfg.weights == "gptq" or cfg.activations == "static",
                  summary="ResQ mixed precision: SubspaceQDQ activations (4-bit low / 8-bit high subspace), 4/8-bit GPTQ weight rows, K/V"):
    config: ResqQDQConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: ResqQDQConfig = self.config
        layout = facts.RESQ.get(graph)  # resq applied: where it did not, the pipeline skipped this pass (requires)
        keep_float = facts.KEEP_FLOAT.names(graph)
        linears = [lin for lin in find_linears(graph) if lin.role not in cfg.skip_roles and lin.node not in keep_float]
        if not linears:
            raise PassNotApplicable(Reason.NO_SITES, "no linear left to quantize (every linear is kept float or in "
                                    "skip_roles)", linears_quantized=0)
        check_weights_finite(ir.GraphIndex(graph), linears)
        self._split_cache: dict[str, list] = {}
        sites = {lin.node: self._site(lin, layout) for lin in linears}
        kv_sites = self._kv_sites(layout) if cfg.kv else {}
        inputs = {lin.input: sites[lin.node] for lin in linears}
        hessians: dict[str, HessianObserver] = {}
        ranges: dict[str, ChannelMinMaxObserver] = {}
        if cfg.weights == "gptq":
            hessians = cast("dict[str, HessianObserver]", ctx.require_calibrator(self.name).observe(
                graph, {t: HessianObserver for t in inputs}, "gptq:hessian+sink"))
        nodes = {n.name: n for n in graph.nodes}
        u_c = [nodes[name] for layer in layout["layers"] for name in layer.get("u_c_nodes", []) if name in nodes] if cfg.u_c_bits else []
        if cfg.activations == "static":
            ranges = cast("dict[str, ChannelMinMaxObserver]", ctx.require_calibrator(self.name).observe(
                graph, {t: ChannelMinMaxObserver for t in [*inputs, *kv_sites, *(n.inputs[0].name for n in u_c)]},
                "resq:channel-minmax"))
        ensure_opset(graph, QuantSpec("int4", True, axis=1), QuantSpec("uint8", False))
        graph.opset = max(graph.opset, 21)
        index = ir.GraphIndex(graph)
        nodes = {n.name: n for n in graph.nodes}
        weight_bits: list[tuple[int, int]]  # (bits, weights at those bits)
        act_bits: list[float]
        weight_bits, act_bits = [], []
        for lin in linears:
            site = sites[lin.node]
            obs = hessians.get(lin.input) if hessians else None
            h = None
            if obs is not None:
                h = obs.hessian_with_sink(cfg.sink_weight if lin.role in ("q_proj", "k_proj", "v_proj", "o_proj") else 1.0)
            node = nodes[lin.node]
            parts = self._weight(graph, index, lin, site, h, weight_bits)
            node.inputs[1] = parts[0] if len(parts) == 1 or cfg.lowering == "integer" else self._concat(graph, index, lin, parts)
            if lin.op == "Gemm":
                node.attrs["transB"] = 0
            if len(parts) == 2 and cfg.lowering == "integer":
                self._split_gemm(graph, index, node, lin, site, parts[1], ranges[lin.input], act_bits)
        quantized: dict[str, gs.Variable] = {}
        for lin in linears:
            site = sites[lin.node]
            if site.rank and cfg.lowering == "integer":
                continue  # wired by _split_gemm
            if lin.input not in quantized:
                quantized[lin.input] = self._activation(graph, index, index.tensors[lin.input], site, ranges.get(lin.input) if ranges else None)
                act_bits.append(self._mean_bits(site, lin.k))
            node = nodes[lin.node]
            node.inputs[0] = quantized[lin.input]
        for node in u_c:  # ResQ: U_C and its activations at 8 bits; the projected queries stay float
            self._quantize_u_c(graph, index, node, ranges.get(node.inputs[0].name) if ranges else None)
        for name, site in kv_sites.items():
            tensor = index.tensors[name]
            consumers = list(index.consumers(name))
            out = self._activation(graph, index, tensor, site, ranges.get(name) if ranges else None)
            for node in consumers:
                for i, t in enumerate(node.inputs):
                    if t is tensor:
                        node.inputs[i] = out
        facts.RESQ_QDQ.set(graph, {"activations": cfg.activations})
        uniform = sum(1 for s in sites.values() if s.rank == 0)
        return PassResult(True, {
            "linears_quantized": len(linears), "mixed_sites": len(sites) - uniform, "uniform_sites": uniform,
            "kv_sites": len(kv_sites), "u_c_quantized": len(u_c), "activations": f"{cfg.activations} asymmetric " + ("per-token" if cfg.activations == "dynamic" else "per-tensor"),
            "weights": f"{cfg.weights} per-channel symmetric", "basis": layout["basis"],
            "mean_weight_bits": round(float(np.sum([b * k for b, k in weight_bits]) / np.sum([k for _, k in weight_bits])), 3),
            "mean_activation_bits": round(float(np.mean(act_bits)), 3),
        })

    # -- site classification --------------------------------------------------------------------
    def _site(self, lin: Linear, layout: dict) -> _Site:
        cfg: ResqQDQConfig = self.config
        if lin.role in ("down_proj", "fc2"):
            return _Site(0, cfg.down_proj_bits)
        if layout["hidden_rank"] and lin.node in layout["stream_readers"]:
            return _Site(layout["hidden_rank"], cfg.low_bits, cfg.high_bits)
        for layer in layout["layers"]:
            if layer["o_proj"] == lin.node and layout["hidden_rank"]:
                d, r, heads = layer["head_dim"], layer["rank"], layer["heads"]
                low = [j * d + c for j in range(heads) for c in range(d - r)]
                high = [j * d + c for j in range(heads) for c in range(d - r, d)]
                return _Site(heads * r, cfg.low_bits, cfg.high_bits, tuple(low + high))
        return _Site(0, cfg.low_bits)

    def _kv_sites(self, layout: dict) -> dict[str, _Site]:
        cfg: ResqQDQConfig = self.config
        out = {}
        for layer in layout["layers"]:
            rank = layer["rank"] if layout["hidden_rank"] else 0
            for key in ("k", "v"):
                out[layer[key]] = _Site(rank, cfg.kv_low_bits, cfg.kv_high_bits)
        return out

    def _mean_bits(self, site: _Site, k: int) -> float:
        return (site.bits * (k - site.rank) + site.high_bits * site.rank) / k

    # -- weights ----------------------------------------------------------------------------------
    def _weight(self, graph: gs.Graph, index: ir.GraphIndex, lin: Linear, site: _Site, h: np.ndarray | None,
                bits_log: list) -> list[gs.Variable]:
        """The DequantizeLinear outputs of the linear's low rows and high rows (one if uniform)."""
        cfg: ResqQDQConfig = self.config
        w = np.asarray(index.constant_value(index.tensors[lin.weight]), np.float64)
        w_kn = w.T if lin.weight_transposed else w
        k = w_kn.shape[0]
        if site.perm is not None:
            perm = np.asarray(site.perm)
            w_kn = w_kn[perm]
            h = h[np.ix_(perm, perm)] if h is not None else None
        if site.rank:
            parts = [(np.arange(k - site.rank), cfg.weight_low_bits), (np.arange(k - site.rank, k), cfg.weight_high_bits)]
        else:
            parts = [(np.arange(k), cfg.weight_low_bits)]
        specs = [_weight_spec(bits, cfg.lowering == "integer") for _, bits in parts]
        if h is not None:
            res = gptq_quantize(w_kn, h, specs[0], 0, 128, cfg.damp, order=cfg.order,
                                subsets=[(rows, IntColumns(spec, mse=cfg.mse, full_range=cfg.full_range)) for (rows, _), spec in zip(parts, specs)])
            params = [(res.q[rows], res.scale[g], res.zero_point[g].astype(spec.np_dtype)) for g, ((rows, _), spec) in enumerate(zip(parts, specs))]
        else:
            params = [quantize_weight(w_kn[rows].astype(np.float32), spec) for (rows, _), spec in zip(parts, specs)]
        outs = [insert_weight_dequantize(graph, index, w_kn[rows], spec, f"{lin.weight}_{tag}", p)
                for (rows, _), spec, p, tag in zip(parts, specs, params, ("low", "high"))]
        for (rows, bits) in parts:
            bits_log.append((bits, len(rows) * w_kn.shape[1]))
        return outs

    @staticmethod
    def _concat(graph: gs.Graph, index: ir.GraphIndex, lin: Linear, parts: list[gs.Variable]) -> gs.Variable:
        """``Concat(low rows, high rows)`` along K: the weight SubspaceQDQ's output multiplies."""
        out = gs.Variable(ir.unique_name(index, f"{lin.weight}_mixed"), dtype=np.float32)
        graph.nodes.append(gs.Node("Concat", f"{lin.node}_weight_Concat", {"axis": 0}, parts, [out]))
        return out

    def _split_gemm(self, graph: gs.Graph, index: ir.GraphIndex, node: gs.Node, lin: Linear, site: _Site,
                    w_high: gs.Variable, ranges: ChannelMinMaxObserver, act_bits: list) -> None:
        """``y = DQ(Q(x_low)) W_low + DQ(Q(x_high)) W_high``: the linear keeps the low GEMM, a
        second MatMul and an Add carry the high subspace. The quantized parts of one input are
        shared by the linears reading it (one QuantizeLinear each, one DequantizeLinear per GEMM)."""
        cache = self._split_cache
        if lin.input not in cache:
            x = index.tensors[lin.input]
            d = len(site.perm) if site.perm is not None else len(cast(np.ndarray, ranges.lo))  # observed
            channels = np.asarray(site.perm) if site.perm is not None else np.arange(d)
            if site.perm is not None:
                idx = gs.Constant(ir.unique_name(index, f"{x.name}_subspace_order"), channels.astype(np.int64))
                ordered = gs.Variable(ir.unique_name(index, f"{x.name}_subspace_ordered"), dtype=np.float32)
                graph.nodes.append(gs.Node("Gather", f"{x.name}_subspace_Gather", {"axis": -1}, [x, idx], [ordered]))
                x = ordered
            sizes = gs.Constant(ir.unique_name(index, f"{x.name}_subspace_sizes"), np.asarray([d - site.rank, site.rank], np.int64))
            halves = [gs.Variable(ir.unique_name(index, f"{x.name}_subspace_{p}"), dtype=np.float32) for p in ("low", "high")]
            graph.nodes.append(gs.Node("Split", f"{x.name}_subspace_Split", {"axis": -1}, [x, sizes], halves))
            qs = []
            for half, part, bits in ((halves[0], channels[: d - site.rank], site.bits), (halves[1], channels[d - site.rank:], site.high_bits)):
                lo, hi = ranges.subset_range(part)
                qs.append(insert_quantize(graph, index, half, lo, hi, _act_spec(bits)))
            cache[lin.input] = qs
            act_bits.append(self._mean_bits(site, d))
        q_low, q_high = cache[lin.input]
        node.inputs[0] = insert_dequantize(graph, index, q_low, f"{node.name}_low")
        high_out = gs.Variable(ir.unique_name(index, f"{node.name}_high_output"), dtype=np.float32)
        graph.nodes.append(gs.Node("MatMul", f"{node.name}_high", inputs=[insert_dequantize(graph, index, q_high, f"{node.name}_high"), w_high],
                                   outputs=[high_out]))
        out = node.outputs[0]
        low_out = gs.Variable(ir.unique_name(index, f"{node.name}_low_output"), dtype=out.dtype)
        node.outputs[0] = low_out
        graph.nodes.append(gs.Node("Add", f"{node.name}_subspace_Add", inputs=[low_out, high_out], outputs=[out]))

    def _quantize_u_c(self, graph: gs.Graph, index: ir.GraphIndex, node: gs.Node, ranges: ChannelMinMaxObserver | None) -> None:
        """An online U_C MatMul at ``u_c_bits``: per-channel symmetric weight, its input per token
        (dynamic) or per tensor (static), asymmetric."""
        bits = self.config.u_c_bits
        w = np.asarray(index.constant_value(node.inputs[1]), np.float32)
        node.inputs[1] = insert_weight_dequantize(graph, index, w, _weight_spec(bits, int8_storage=True), node.name)
        x = node.inputs[0]
        if self.config.activations == "dynamic":
            node.inputs[0] = insert_token_fake_quant_asymmetric(graph, index, x, bits)
        else:
            lo, hi = cast(ChannelMinMaxObserver, ranges).range()  # static: run observed every U_C input
            node.inputs[0] = insert_dequantize(graph, index, insert_quantize(graph, index, x, lo, hi, _act_spec(bits)), node.name)

    # -- activations ------------------------------------------------------------------------------
    def _activation(self, graph: gs.Graph, index: ir.GraphIndex, tensor: gs.Tensor, site: _Site,
                    ranges: ChannelMinMaxObserver | None) -> gs.Variable:
        cfg: ResqQDQConfig = self.config
        x = tensor
        if site.perm is not None:
            idx = gs.Constant(ir.unique_name(index, f"{tensor.name}_subspace_order"), np.asarray(site.perm, np.int64))
            x = gs.Variable(ir.unique_name(index, f"{tensor.name}_subspace_ordered"), dtype=np.float32)
            graph.nodes.append(gs.Node("Gather", f"{tensor.name}_subspace_Gather", {"axis": -1}, [tensor, idx], [x]))
        perm = np.asarray(site.perm) if site.perm is not None else None
        d = len(site.perm) if site.perm is not None else (
            len(cast(np.ndarray, ranges.lo)) if ranges is not None else None)
        if site.rank == 0:
            spec = _act_spec(site.bits)
            if cfg.activations == "dynamic":
                return insert_token_fake_quant_asymmetric(graph, index, x, site.bits)
            lo, hi = cast(ChannelMinMaxObserver, ranges).range()  # static: run observed every site
            return insert_dequantize(graph, index, insert_quantize(graph, index, x, lo, hi, spec), f"{tensor.name}_uniform")
        high_bits = site.high_bits
        attrs = {"rank": int(site.rank), "low_bits": int(site.bits), "high_bits": int(high_bits), "symmetric": 0,
                 "dynamic": int(cfg.activations == "dynamic")}
        out = gs.Variable(ir.unique_name(index, f"{tensor.name}_subspace_qdq"), dtype=np.float32)
        if cfg.activations == "dynamic":
            inputs = [x] + [gs.Variable.empty() for _ in range(4)]
        else:  # static: run observed every site, so d is known
            assert ranges is not None and d is not None
            channels = np.arange(d) if perm is None else perm
            inputs = [x]
            for part, bits in ((channels[: d - site.rank], site.bits), (channels[d - site.rank:], high_bits)):
                lo, hi = ranges.subset_range(part)
                s, z = scale_zero_point(np.array(lo), np.array(hi), _act_spec(bits))
                inputs += [gs.Constant(ir.unique_name(index, f"{tensor.name}_subspace_scale"), np.asarray(s, np.float32).reshape(())),
                           gs.Constant(ir.unique_name(index, f"{tensor.name}_subspace_zero_point"), np.asarray(z, np.uint8).reshape(()))]
        graph.nodes.append(gs.Node("SubspaceQDQ", ir.unique_name(index, f"{tensor.name}_SubspaceQDQ"), attrs, inputs, [out], domain=DOMAIN))
        return out
