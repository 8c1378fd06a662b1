"""``fp16-safe-norms``: RMSNorm that cannot overflow in fp16 (target lowering for QNN's HTP).

Qualcomm's HTP runs float ops in fp16 (largest finite value 65504). An exported RMSNorm computes
``x * 1 / sqrt(mean(x^2) + eps)``; on SmolLM2's residual stream, whose massive activations
rotation spreads over every channel but does not shrink (a rotation keeps ``sum(x^2)``), the
sum of squares the HTP accumulates passes 65504, and the norm's output is garbage. Measured
through onnxruntime-qnn 2.7.0 before this pass: the mquant-w8a8 pair's logits on the HTP were
off by up to 22 (of 27) from onnxruntime CPU's on the same graph, top-1 changed.

The rewrite feeds the norm ``x' = x * 2^-k`` instead of ``x``, in both the square and the final
product, and ``eps * 4^-k`` for ``eps``::

    x' / sqrt(mean(x'^2) + eps 4^-k) = x 2^-k / (2^-k sqrt(mean(x^2) + eps)) = x / sqrt(mean(x^2) + eps)

Scaling by a power of two is exact in binary floating point, so the graph computes the same
values in fp32 (FLOAT_EQUIV: exact barring subnormals). ``k`` per norm, from calibration: the
smallest that keeps the largest ``sum(x^2)`` over the hidden axis (what the HTP accumulates)
under ``limit`` (default 8192, 8x below fp16's largest value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.calib.observers import Observer
from edgeq.passmanager.passbase import Exactness, Pass, PassConfig, PassContext, PassNotApplicable, PassResult, Reason


@dataclass(frozen=True)
class Fp16SafeNormsConfig(PassConfig):
    limit: float = 8192.0  # the largest sum of squares left for fp16 (65504 is fp16's largest value)


class SumOfSquaresObserver(Observer):
    """The largest sum of squares over the last axis (one norm's accumulation) seen in any row."""

    kind = "sum-of-squares"

    def __init__(self):
        self.hi = 0.0

    def update(self, x):
        if x.size:
            self.hi = max(self.hi, float(np.max(np.sum(np.square(x.astype(np.float64)), axis=-1))))

    def state(self):
        return {"hi": np.array(self.hi)}

    @classmethod
    def from_state(cls, state):
        obs = cls()
        obs.hi = float(state["hi"])
        return obs

    def range(self):
        return 0.0, self.hi


@dataclass
class _Norm:
    x: gs.Tensor  # the norm's input, read by the square and by the final product
    square: gs.Node
    mean: gs.Node
    add_eps: gs.Node
    product: gs.Node


class Fp16SafeNormsPass(Pass, name="fp16-safe-norms", per_block=True, exactness=Exactness.FLOAT_EQUIV, config=Fp16SafeNormsConfig,
                        calibrates=True,
                        summary="RMSNorm fed x * 2^-k (eps * 4^-k) so its sum of squares fits fp16 (QNN's HTP computes "
                                "float ops in fp16; target lowering)"):
    config: Fp16SafeNormsConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        norms = [n for n in (_match(index, node) for node in graph.nodes if node.op == "ReduceMean") if n is not None]
        if not norms:
            raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, "no RMSNorm (x * 1/sqrt(mean(x^2) + eps))")
        observers = ctx.require_calibrator(self.name).observe(
            graph, {n.x.name: SumOfSquaresObserver for n in norms}, "fp16-safe-norms:sum-of-squares")
        worst_before = worst_after = 0.0
        rescaled = 0
        for norm in norms:
            _, total = observers[norm.x.name].range()
            k = max(0, math.ceil(0.5 * math.log2(total / self.config.limit))) if total > self.config.limit else 0
            worst_before = max(worst_before, total)
            worst_after = max(worst_after, total / 4.0 ** k)
            if k == 0:
                continue
            scale = gs.Constant(ir.unique_name(index, f"{norm.mean.name}_fp16_scale"), np.array(2.0 ** -k, np.float32))
            xs = gs.Variable(ir.unique_name(index, f"{norm.x.name}_fp16_scaled"), dtype=np.float32, shape=norm.x.shape)
            graph.nodes.append(gs.Node("Mul", f"{norm.mean.name}_fp16_scale", {}, [norm.x, scale], [xs]))
            for node in (norm.square, norm.product):
                node.inputs[node.inputs.index(norm.x)] = xs
            slot, eps = cast("tuple[int, np.ndarray]", _eps(index, norm.add_eps))  # found (_match)
            norm.add_eps.inputs[slot] = gs.Constant(ir.unique_name(index, f"{norm.add_eps.name}_eps_fp16"),
                                                    np.asarray(eps * np.float32(4.0 ** -k), np.float32))
            rescaled += 1
        if not rescaled:
            raise PassNotApplicable(Reason.NO_SITES, f"every RMSNorm's sum of squares is under {self.config.limit:g}",
                                    norms=len(norms), max_sum_of_squares=worst_before)
        return PassResult(True, {"norms": len(norms), "rescaled": rescaled, "max_sum_of_squares_before": worst_before,
                                 "max_sum_of_squares_after": worst_after})


def _eps(index: ir.GraphIndex, add: gs.Node) -> tuple[int, np.ndarray] | None:
    """(input slot, value) of the Add's constant operand (an initializer or a Constant node's output)."""
    for slot, tensor in enumerate(add.inputs):
        value = index.constant_value(tensor)
        if value is not None:
            return slot, np.asarray(value, np.float32)
    return None


def _match(index: ir.GraphIndex, mean: gs.Node) -> _Norm | None:
    """x -> Pow(x, 2) -> ReduceMean(last axis) -> Add(eps) -> Sqrt -> Div(1, .) | Reciprocal -> Mul(x, .)."""
    square = index.producer(mean.inputs[0].name)
    if square is None or square.op != "Pow" or index.constant_value(square.inputs[1]) is None:
        return None
    if float(np.asarray(index.constant_value(square.inputs[1])).reshape(-1)[0]) != 2.0:
        return None
    x = square.inputs[0]
    chain = [mean]
    for op in ("Add", "Sqrt"):
        nxt = index.consumers(chain[-1].outputs[0].name)
        if len(nxt) != 1 or nxt[0].op != op:
            return None
        chain.append(nxt[0])
    add_eps = chain[1]
    if _eps(index, add_eps) is None:
        return None
    inv = index.consumers(chain[-1].outputs[0].name)
    if len(inv) != 1 or inv[0].op not in ("Div", "Reciprocal"):
        return None
    inv = inv[0]
    if inv.op == "Div":
        one = index.constant_value(inv.inputs[0])
        if inv.inputs[1] is not chain[-1].outputs[0] or one is None or np.asarray(one).size != 1 or float(np.asarray(one).reshape(-1)[0]) != 1.0:
            return None
    products = [c for c in index.consumers(inv.outputs[0].name) if c.op == "Mul" and x in c.inputs]
    if len(products) != 1 or len(index.consumers(inv.outputs[0].name)) != 1:
        return None
    return _Norm(x, square, mean, add_eps, products[0])
