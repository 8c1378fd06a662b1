"""``outer-product-to-mul``: a MatMul whose inner dimension is 1 (an outer product, such as RMS's
channel-0 GEMV branch ``x[..., :1] @ W[:1, :]``) becomes a broadcasting Mul with a float row
(target lowering for QNN's HTP).

Measured on onnxruntime-qnn 2.7.0: the emulated HTP's graph preparation of a decode graph (one
token) holding such a K = 1 MatMul with a per-channel weight ran for minutes and took all of the
machine's memory, then failed (QNN_COMMON_ERROR_MEM_ALLOC); without it the same graph prepares
in under a second. ``x @ W`` with K = 1 is ``x * W`` broadcast, exactly, and the one weight row
is stored dequantized (N floats: a single row at 4 bits per output channel was exact anyway).
FLOAT_EQUIV: the product of two floats is the same in both forms.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passmanager.passbase import Exactness, Pass, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.quantize.quant import dequantize


class OuterProductToMulPass(Pass, name="outer-product-to-mul", per_block=True, exactness=Exactness.FLOAT_EQUIV,
                            summary="MatMul with inner dimension 1 -> broadcasting Mul with the dequantized weight row "
                                    "(QNN's HTP fails to prepare it at decode; target lowering)"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        done = 0
        for node in list(graph.nodes):
            if node.op != "MatMul":
                continue
            row = _weight_row(index, node.inputs[1])
            if row is None:
                continue
            const = gs.Constant(ir.unique_name(index, f"{node.name}_row"), row)
            node.op, node.inputs[1] = "Mul", const
            node.name = f"{node.name}_as_Mul"
            done += 1
        if not done:
            raise PassNotApplicable(Reason.NO_SITES, "no MatMul with a constant [1, N] weight")
        graph.cleanup()
        return PassResult(True, {"matmuls_to_mul": done})


def _weight_row(index: ir.GraphIndex, weight: gs.Tensor) -> np.ndarray | None:
    """The float [1, N] weight behind ``weight`` (a constant, or a DequantizeLinear of one), else None."""
    if isinstance(weight, gs.Constant):
        if len(weight.shape or ()) != 2 or weight.shape[0] != 1:
            return None
        values = np.asarray(weight.values)
        return values.astype(np.float32) if values.ndim == 2 and values.shape[0] == 1 and values.dtype == np.float32 else None
    dq = index.producer(weight.name)
    if dq is None or dq.op != "DequantizeLinear" or not all(isinstance(t, gs.Constant) for t in dq.inputs[:3]):
        return None
    shape = tuple(dq.inputs[0].shape or ())
    if len(shape) != 2 or shape[0] != 1:
        return None  # (the shape first: loading a lazy packed int4 constant would unpack it in the graph)
    q = np.asarray(dq.inputs[0].values)
    scale = np.asarray(dq.inputs[1].values, np.float32)
    zp = np.asarray(dq.inputs[2].values) if len(dq.inputs) > 2 else np.zeros((), np.int64)
    if scale.ndim == 1 and scale.size > 1:  # per channel along axis 1 (the only axis of size > 1)
        scale, zp = scale.reshape(1, -1), zp.reshape(1, -1) if zp.size > 1 else zp
    return dequantize(q, scale, zp).astype(np.float32)
