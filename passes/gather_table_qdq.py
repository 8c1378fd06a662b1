"""``gather-table-qdq``: store float lookup tables (token embeddings) as 16-bit integers behind a
DequantizeLinear, and quantize the Gather's output on the same grid (target lowering for QNN's HTP).

Measured on onnxruntime-qnn 2.7.0 (probe graphs in ``tests/test_qnn_vendor.py``): the HTP
refuses a Gather of a float32 table when it prepares the graph ("could not create op", graph
finalize fails with QNN_COMMON_ERROR_MEM_ALLOC), and takes the node unit ``DQ(table) -> Gather ->
Q -> DQ``. A Gather only copies rows, so its output lies on the table's grid: quantizing it with
the table's own scale and zero point is exact, and the only loss is the table's rounding to 16
bits per tensor (the summary gives its relative RMS error).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passmanager.passbase import Exactness, Pass, PassConfig, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.quantize.qdq_nodes import QuantizedTensor, ensure_opset, insert_dequantize
from edgeq.quantize.quant import QuantSpec, dequantize, quantize, scale_zero_point
from edgeq.targets.requant import relative_rms

TABLE_DTYPES = ("uint16", "uint8")
_MIN_ROWS = 16  # smaller float Gathers are shape bookkeeping, not lookup tables


@dataclass(frozen=True)
class GatherTableQDQConfig(PassConfig):
    dtype: str = "uint16"  # 8 bits lose too much of an embedding table shared by every token

    def __post_init__(self):
        if self.dtype not in TABLE_DTYPES:
            from edgeq.errors import UserInputError

            raise UserInputError(f"gather-table-qdq: dtype must be one of {', '.join(TABLE_DTYPES)}")


class GatherTableQDQPass(Pass, name="gather-table-qdq", per_block=True, exactness=Exactness.LOSSY, config=GatherTableQDQConfig,
                         summary="float lookup tables (embeddings) -> 16-bit integer table, DQ -> Gather -> Q -> DQ "
                                 "(QNN's HTP takes no float Gather; target lowering)"):
    config: GatherTableQDQConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        sites = [n for n in graph.nodes if n.op == "Gather" and _float_table(n.inputs[0])]
        if not sites:
            raise PassNotApplicable(Reason.NO_SITES, "no Gather of a float constant table")
        spec = QuantSpec(self.config.dtype, symmetric=False)
        ensure_opset(graph, spec)
        tables: dict[str, QuantizedTensor] = {}
        errors = []
        for node in sites:
            table = node.inputs[0]
            if table.name not in tables:
                values = np.asarray(table.values, np.float32)
                scale, zp = scale_zero_point(np.array(values.min()), np.array(values.max()), spec)
                q = quantize(values, scale, zp, spec)
                errors.append(relative_rms(float(np.sum((dequantize(q, scale, zp) - values) ** 2)),
                                           float(np.sum(values.astype(np.float64) ** 2))))
                integer = gs.Constant(ir.unique_name(index, f"{table.name}_quantized"), q)
                s = gs.Constant(ir.unique_name(index, f"{table.name}_scale"), np.asarray(scale, np.float32).reshape(()))
                z = gs.Constant(ir.unique_name(index, f"{table.name}_zero_point"), np.asarray(zp).reshape(()))
                tables[table.name] = QuantizedTensor(integer, s, z, table.name)
            quantized = tables[table.name]
            node.inputs[0] = insert_dequantize(graph, index, quantized, node.name)
            y = node.outputs[0]
            raw = gs.Variable(ir.unique_name(index, f"{y.name}_float"), dtype=np.float32, shape=y.shape)
            node.outputs[0] = raw
            out = gs.Variable(ir.unique_name(index, f"{y.name}_quantized"), dtype=spec.np_dtype, shape=y.shape)
            graph.nodes.append(gs.Node("QuantizeLinear", f"{node.name}_output_QuantizeLinear", {},
                                       [raw, quantized.scale, quantized.zero_point], [out]))
            graph.nodes.append(gs.Node("DequantizeLinear", f"{node.name}_output_DequantizeLinear", {},
                                       [out, quantized.scale, quantized.zero_point], [y]))
        graph.cleanup()
        return PassResult(True, {"gathers_quantized": len(sites), "tables": len(tables), "dtype": spec.dtype,
                                 "table_rel_rms_error_max": float(max(errors))})


def _float_table(tensor: gs.Tensor) -> bool:
    if not isinstance(tensor, gs.Constant):
        return False
    shape = tuple(tensor.shape)
    return np.dtype(tensor.dtype) == np.float32 and len(shape) == 2 and shape[0] >= _MIN_ROWS
