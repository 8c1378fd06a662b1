"""Static QDQ of every linear (the body of the ``qdq`` pass, and the base ``msq`` builds on):
activation Q/DQ from calibration, weight DQ.

The pattern is the one onnxruntime's QDQ transformers turn into integer kernels:
``x -> QuantizeLinear -> DequantizeLinear -> MatMul <- DequantizeLinear <- int8 weight``.
onnxruntime fuses it into ``MatMulIntegerToFloat`` (or ``QLinearMatMul`` when the output is
re-quantized by the next linear), and blockwise int4 weights into ``MatMulNBits``. Weights stored
behind a Transpose are pre-transposed so no Transpose sits between the weight DQ and the MatMul
(that would stop the fusion). One QuantizeLinear is shared by all linears reading the same tensor
(q/k/v, gate/up), so the integer activation is computed once, but each linear gets its own
DequantizeLinear: onnxruntime's QDQ selectors only fuse a DQ with a single consumer (measured on
SmolLM2: with shared DQs only o_proj/down_proj/lm_head became integer kernels).

Activation scales are static per tensor (the NPU case), or, for accuracy studies, dynamic per
token (a standard-op quantize-dequantize that onnxruntime runs in float). Narrower bit widths
(e.g. 6-bit activations, 5-bit weights) live inside the int8 storage type with a Clip after the
QuantizeLinear. Weights are per output channel, per group along K (opset 21 ``block_size``), or
per tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.graph import ir
from edgeq.calib.observers import HistogramObserver, MinMaxObserver, Observer
from edgeq.errors import UserInputError
from edgeq.passmanager.passbase import Pass, PassConfig, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.quantize.qdq_nodes import (QuantizedTensor, check_weights_finite, ensure_opset, insert_dequantize, insert_quantize,
                              insert_token_fake_quant, insert_weight_dequantize)
from edgeq.quantize.quant import QuantSpec
from edgeq.structure import Linear, find_linears

_ACT_DTYPES = ("int8", "uint8", "int16", "uint16")
_WEIGHT_DTYPES = ("int8", "int4", "uint8", "uint4")
_GRANULARITIES = ("channel", "group", "tensor")
_OBSERVERS = ("minmax", "percentile", "mse")


@dataclass(frozen=True)
class QDQConfig(PassConfig):
    activation_dtype: str = "int8"
    activation_symmetric: bool = True
    activation_observer: str = "minmax"
    percentile: float = 99.99
    weight_dtype: str = "int8"
    weight_symmetric: bool = True
    weight_granularity: str = "channel"
    group_size: int = 128
    skip_roles: tuple[str, ...] = ()
    exclude_nodes: tuple[str, ...] = ()  # exact node names left in float (sensitivity studies)
    # per-role activation dtype overrides, "role=dtype" (e.g. "down_proj=int16" for NPUs with
    # 16-bit activations at the hardest site); a tensor read by several roles takes the widest
    role_activation_dtypes: tuple[str, ...] = ()
    # per-role weight overrides, "role=dtype", per output channel at that dtype's full width (e.g.
    # "lm_head=int8": Gemma 3's head is 62% of its weights, and int4 blocks there cost it most)
    role_weight_dtypes: tuple[str, ...] = ()
    # narrower value ranges inside the storage types, for bit-width sweeps (0: the type's width)
    activation_bits: int = 0
    weight_bits: int = 0
    # tensor: static per-tensor scales (the NPU case) | token: dynamic per-token symmetric
    # quantize-dequantize in standard ops (accuracy studies; not fused into integer kernels)
    activation_granularity: str = "tensor"

    def __post_init__(self):
        checks = [
            ("activation_dtype", self.activation_dtype, _ACT_DTYPES),
            ("weight_dtype", self.weight_dtype, _WEIGHT_DTYPES),
            ("weight_granularity", self.weight_granularity, _GRANULARITIES),
            ("activation_observer", self.activation_observer, _OBSERVERS),
            ("activation_granularity", self.activation_granularity, ("tensor", "token")),
        ]
        for key, value, allowed in checks:
            if value not in allowed:
                raise UserInputError(f"qdq: {key} must be one of {', '.join(allowed)}, got '{value}'")
        if self.weight_granularity == "group" and (self.group_size < 16 or self.group_size & (self.group_size - 1)):
            raise UserInputError(f"qdq: group_size must be a power of two >= 16, got {self.group_size}")
        if not 0.0 < self.percentile <= 100.0:
            raise UserInputError(f"qdq: percentile must be in (0, 100], got {self.percentile}")
        self.role_dtypes()
        self.role_weights()
        QuantSpec(self.activation_dtype, value_bits=self.activation_bits)  # fits the storage type
        QuantSpec(self.weight_dtype, value_bits=self.weight_bits)
        if self.activation_granularity == "token" and self.role_activation_dtypes:
            raise UserInputError("qdq: role_activation_dtypes apply to static per-tensor activations only")

    def role_dtypes(self) -> dict[str, str]:
        out = {}
        for entry in self.role_activation_dtypes:
            role, sep, dtype = entry.partition("=")
            if not sep or dtype not in _ACT_DTYPES:
                raise UserInputError(f"qdq: role_activation_dtypes entries are role=dtype with dtype in "
                                     f"{', '.join(_ACT_DTYPES)}, got '{entry}'")
            out[role.strip()] = dtype.strip()
        return out


    def role_weights(self) -> dict[str, str]:
        out = {}
        for entry in self.role_weight_dtypes:
            role, sep, dtype = entry.partition("=")
            if not sep or dtype.strip() not in _WEIGHT_DTYPES:
                raise UserInputError(f"qdq: role_weight_dtypes entries are role=dtype with dtype in "
                                     f"{', '.join(_WEIGHT_DTYPES)}, got '{entry}'")
            out[role.strip()] = dtype.strip()
        return out


def static_activations(cfg: QDQConfig) -> bool:
    """Whether a ``QDQConfig`` needs calibration (static scales; per-token ones are dynamic): the
    ``calibrates=`` of the passes built on ``StaticQDQ``."""
    return cfg.activation_granularity == "tensor"


class StaticQDQ(Pass):
    """Not registered and declares nothing: ``edgeq.passes.qdq`` (``qdq``) and ``edgeq.passes.msq``
    (``msq``) subclass it, each declaring itself in its class line (config: a ``QDQConfig``,
    ``calibrates=static_activations``)."""

    config: QDQConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: QDQConfig = self.config
        index = ir.GraphIndex(graph)
        keep_float = facts.KEEP_FLOAT.names(graph)
        weights_done = facts.WEIGHTS_QUANTIZED_FIRST.names(graph)  # gptq's: activations still to quantize
        linears = [
            lin for lin in find_linears(graph, include_quantized=True)
            if (not lin.quantized or lin.node in weights_done) and lin.role not in cfg.skip_roles and lin.node not in keep_float and lin.node not in cfg.exclude_nodes
            and not _is_dequantized(index, lin.input)
        ]
        if not linears:
            raise PassNotApplicable(Reason.NO_SITES, "no float linear left to quantize (every linear is already "
                                    "quantized, kept float, excluded or in skip_roles)", linears_quantized=0)
        check_weights_finite(index, linears)
        act_spec = QuantSpec(cfg.activation_dtype, cfg.activation_symmetric, value_bits=cfg.activation_bits)
        site_specs = self._site_specs(linears, act_spec)
        ensure_opset(graph, self._weight_spec(axis=0), *set(site_specs.values()))
        nodes = {n.name: n for n in graph.nodes}
        act_sites = self._activation_sites(graph, index, ctx, site_specs)
        quantized_weights: dict[tuple[str, bool], gs.Variable] = {}
        for lin in linears:
            node = nodes[lin.node]
            self._wire_input(graph, index, node, act_sites[lin.input])
            if lin.quantized:
                continue  # weights already quantized (gptq), kept as they are
            key = (lin.weight, lin.weight_transposed)
            if key not in quantized_weights:
                quantized_weights[key] = self._quantize_weight(graph, index, lin, ctx.u8s8_safe)
            node.inputs[1] = quantized_weights[key]
            if lin.op == "Gemm":
                node.attrs["transB"] = int(lin.weight_transposed)  # the DQ'd weight keeps the stored layout
        roles: dict[str, int] = {}
        for lin in linears:
            roles[lin.role] = roles.get(lin.role, 0) + 1
        return PassResult(True, {**self._extra_summary(),
            "linears_quantized": len(linears),
            "activation_sites": len(act_sites),
            "weights_quantized": len(quantized_weights),
            "roles": roles,
            "activation": (f"{act_spec.bits}-bit symmetric per-token dynamic" if cfg.activation_granularity == "token" else
                           f"{act_spec.dtype}" + (f" ({act_spec.bits}-bit values)" if act_spec.narrowed else "")
                           + f" {'symmetric' if act_spec.symmetric else 'asymmetric'} per-tensor static ({cfg.activation_observer})")
                          + (f", overrides {dict(cfg.role_dtypes())}" if cfg.role_activation_dtypes else ""),
            "weight": f"{cfg.weight_dtype}" + (f" ({cfg.weight_bits}-bit values)" if cfg.weight_bits else "")
                      + f" {'symmetric' if cfg.weight_symmetric else 'asymmetric'} per-{cfg.weight_granularity}"
                      + (f" (group {cfg.group_size})" if cfg.weight_granularity == "group" else "")
                      + (f", per channel for {dict(cfg.role_weights())}" if cfg.role_weight_dtypes else ""),
        })

    def _activation_sites(self, graph: gs.Graph, index: ir.GraphIndex, ctx: PassContext,
                          site_specs: dict[str, QuantSpec]) -> dict[str, object]:
        """Quantize every activation site: tensor name -> QuantizedTensor (static) or the float
        fake-quantized tensor (per-token). Subclasses (msq) give a site two scales."""
        act_sites: dict[str, object] = {}
        if self.config.activation_granularity == "token":
            for name, spec in sorted(site_specs.items()):
                act_sites[name] = insert_token_fake_quant(graph, index, index.tensors[name], spec)
            return act_sites
        for spec in sorted(set(site_specs.values()), key=lambda sp: (sp.dtype, sp.bits)):
            names = sorted(n for n, sp in site_specs.items() if sp == spec)
            for name, obs in self._calibrate(graph, ctx, names, spec).items():
                lo, hi = obs.range()
                act_sites[name] = _quantize_site(graph, index, index.tensors[name], lo, hi, spec)
        return act_sites

    def _wire_input(self, graph: gs.Graph, index: ir.GraphIndex, node: gs.Node, site) -> None:
        """Make the linear ``node`` read its quantized activation (its own DequantizeLinear)."""
        node.inputs[0] = site if isinstance(site, gs.Variable) else insert_dequantize(graph, index, site, node.name)

    def _extra_summary(self) -> dict:
        return {}

    def _site_specs(self, linears, default: QuantSpec) -> dict[str, QuantSpec]:
        """Activation spec of each quantized tensor: the default, or the widest role override."""
        overrides = self.config.role_dtypes()
        specs: dict[str, QuantSpec] = {}
        for lin in linears:
            dtype = overrides.get(lin.role)
            spec = QuantSpec(dtype, default.symmetric) if dtype else default  # overrides: full width
            if lin.input not in specs or spec.bits > specs[lin.input].bits:
                specs[lin.input] = spec
        return specs

    def _weight_spec(self, axis: int, pair_axis: int | None = None) -> QuantSpec:
        """The weight spec; ``pair_axis``: the K axis, for the u8s8 pair-bounded int8 grid."""
        cfg: QDQConfig = self.config
        if cfg.weight_granularity == "tensor":
            return QuantSpec(cfg.weight_dtype, cfg.weight_symmetric, value_bits=cfg.weight_bits, pair_axis=pair_axis)
        block = cfg.group_size if cfg.weight_granularity == "group" else 0
        return QuantSpec(cfg.weight_dtype, cfg.weight_symmetric, axis=axis, block_size=block, value_bits=cfg.weight_bits,
                         pair_axis=pair_axis)

    def _calibrate(self, graph, ctx: PassContext, names: list[str], spec: QuantSpec, split_by: str | None = None):
        cfg: QDQConfig = self.config
        factory: Callable[[], Observer]
        if cfg.activation_observer == "minmax":
            factory = MinMaxObserver
        else:
            def factory():
                return HistogramObserver(method=cfg.activation_observer, percentile=cfg.percentile, bits=spec.bits)
        # the collected statistics do not depend on the bit width (only the clip chosen from them
        # does), so bit-width sweeps share one calibration run through the cache
        key = f"qdq:{cfg.activation_observer}:{cfg.percentile}"
        observers = ctx.require_calibrator(self.name).observe(graph, {n: factory for n in names}, key, split_by)
        for obs in observers.values():
            for part in (getattr(obs, "visual", None), getattr(obs, "text", None), obs):
                if isinstance(part, HistogramObserver):
                    part.bits = spec.bits
        return observers

    def _quantize_weight(self, graph: gs.Graph, index: ir.GraphIndex, lin: Linear, u8s8_safe: bool = True) -> gs.Variable:
        """Replace a float weight by integer constant -> DequantizeLinear, in the layout the node reads.

        MatMul reads [K, N]: a weight stored transposed is transposed here, offline. Gemm keeps
        its stored layout and ``transB``. Channels are the N axis; groups run along K. With
        ``u8s8_safe`` full-width int8 weights get the pair-bounded grid along K (no-VNNI CPUs).
        """
        w = np.asarray(index.constant_value(index.tensors[lin.weight]), np.float32)
        if lin.op == "MatMul" and lin.weight_transposed:
            w = np.ascontiguousarray(w.T)
        stored_nk = lin.op == "Gemm" and lin.weight_transposed
        n_axis, k_axis = (0, 1) if stored_nk else (1, 0)
        pair_axis = k_axis if u8s8_safe else None
        override = self.config.role_weights().get(lin.role)
        if override is not None:  # per output channel, the override's full width
            spec = QuantSpec(override, self.config.weight_symmetric, axis=n_axis,
                             pair_axis=pair_axis if override == "int8" else None)
        elif self.config.weight_granularity == "group":
            spec = self._weight_spec(axis=k_axis)
        else:
            spec = self._weight_spec(axis=n_axis, pair_axis=pair_axis)
        return insert_weight_dequantize(graph, index, w, spec, lin.weight)


def _quantize_site(graph: gs.Graph, index: ir.GraphIndex, tensor: gs.Tensor, lo: float, hi: float,
                   spec: QuantSpec) -> QuantizedTensor:
    """Static per-tensor Q of an activation site.

    A site that is ``Concat([x, Gather(x, idx, axis=-1)], axis=-1)`` (MUXQ's Body/Aux input) is
    quantized before the concatenation: one QuantizeLinear of x, then the Gather and the Concat
    on the 8-bit tensor. With one per-tensor scale that is the same integer tensor, and it moves
    a quarter of the bytes through the two copies.
    """
    body = _self_concat_body(index, tensor)
    if body is None:
        return insert_quantize(graph, index, tensor, lo, hi, spec)
    concat = tensor.inputs[0]
    gather = concat.inputs[1].inputs[0]
    q = insert_quantize(graph, index, body, lo, hi, spec)
    aux = gs.Variable(ir.unique_name(index, f"{gather.name}_quantized"), dtype=spec.np_dtype)
    graph.nodes.append(gs.Node("Gather", f"{gather.name}_quantized", dict(gather.attrs), [q.integer, gather.inputs[1]], [aux]))
    out = gs.Variable(ir.unique_name(index, f"{tensor.name}_quantized"), dtype=spec.np_dtype)
    graph.nodes.append(gs.Node("Concat", f"{concat.name}_quantized", dict(concat.attrs), [q.integer, aux], [out]))
    return QuantizedTensor(out, q.scale, q.zero_point, tensor.name)


def _self_concat_body(index: ir.GraphIndex, tensor: gs.Tensor) -> gs.Tensor | None:
    """x when ``tensor = Concat([x, Gather(x, ., axis=-1)], axis=-1)`` and nothing else reads the
    Concat's float output but linears (which the caller rewires), else None."""
    concat = index.producer(tensor.name)
    if concat is None or concat.op != "Concat" or len(concat.inputs) != 2 or concat.attrs.get("axis") not in (-1, _rank(tensor) - 1):
        return None
    gather = index.producer(concat.inputs[1].name)
    if gather is None or gather.op != "Gather" or gather.inputs[0] is not concat.inputs[0]:
        return None
    if gather.attrs.get("axis") not in (-1, _rank(tensor) - 1) or index.constant_value(gather.inputs[1]) is None:
        return None
    if any(c.op not in ("MatMul", "Gemm") for c in index.consumers(tensor.name)):
        return None
    return concat.inputs[0]


def _rank(tensor: gs.Tensor) -> int:
    return len(tensor.shape) if tensor.shape is not None else 3


def _is_dequantized(index: ir.GraphIndex, name: str) -> bool:
    producer = index.producer(name)
    return producer is not None and producer.op == "DequantizeLinear"
