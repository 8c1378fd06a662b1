"""``edgeq::ModalityQDQ`` (MSQ's two static scales): onnxruntime running the function body, the
ReferenceEvaluator running the body, and the numpy reference agree, for batches whose rows have
different visual counts (0 and the whole row included), int8 and uint8 zero points, rank 3 and 4."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from edgeq.graph import ir
from edgeq.runtime_ops.domain import DOMAIN
from edgeq.runtime_ops.modality_qdq import OP_TYPE, modality_qdq_reference
from edgeq.runtime_ops.schema import ensure_functions, reference_evaluator_ops


def _model(rank: int, zp_type: int, opset: int = 21) -> onnx.ModelProto:
    dims = ["b", "s", 8] if rank == 3 else ["b", "s", 2, 4]
    node = helper.make_node(OP_TYPE, list(("x", "count", "sv", "zv", "st", "zt")), ["y"], domain=DOMAIN)
    inits = [helper.make_tensor("sv", TensorProto.FLOAT, [], [0.5]), helper.make_tensor("zv", zp_type, [], [0 if zp_type == TensorProto.INT8 else 128]),
             helper.make_tensor("st", TensorProto.FLOAT, [], [0.02]), helper.make_tensor("zt", zp_type, [], [0 if zp_type == TensorProto.INT8 else 128])]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims),
                                            helper.make_tensor_value_info("count", TensorProto.INT64, ["b"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)], inits)
    return ensure_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9))


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("zp_type", [TensorProto.INT8, TensorProto.UINT8])
def test_three_ways_agree(rank, zp_type):
    model = _model(rank, zp_type)
    rng = np.random.default_rng(rank)
    shape = (3, 7, 8) if rank == 3 else (3, 7, 2, 4)
    x = (rng.standard_normal(shape) * np.array([40.0, 1.0, 3.0]).reshape(3, *[1] * (rank - 1))).astype(np.float32)
    x[0, :2] *= 30.0  # visual-like magnitudes in the first rows
    count = np.array([2, 0, 7], np.int64)
    feeds = {"x": x, "count": count}
    (ort_y,) = ir.make_session(model).run(None, feeds)
    (body_y,) = ReferenceEvaluator(model).run(None, feeds)
    (ref_op_y,) = ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, feeds)
    zp = np.int8(0) if zp_type == TensorProto.INT8 else np.uint8(128)
    (numpy_y,) = modality_qdq_reference(x, count, np.float32(0.5), zp, np.float32(0.02), zp)
    for y in (ort_y, body_y, ref_op_y):
        np.testing.assert_array_equal(y, numpy_y)
    # row 1 has no visual tokens: every token uses the text scale (0.02), saturating at +-127 steps
    assert np.abs(ort_y[1]).max() <= 0.02 * 128 + 1e-6
    # the visual rows of row 0 keep their large values on the 0.5 grid
    np.testing.assert_allclose(ort_y[0, :2] / 0.5, np.round(ort_y[0, :2] / 0.5), atol=1e-4)


def test_body_runs_in_onnxruntime_at_opset_18():
    """SmolLM2-style exports are opset 18 (onnx's ReferenceEvaluator has no opset-18 Q/DQ, so
    this one is onnxruntime against the numpy reference only)."""
    model = _model(3, TensorProto.UINT8, opset=18)
    x = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32) * 4
    count = np.array([3, 1], np.int64)
    (y,) = ir.make_session(model).run(None, {"x": x, "count": count})
    (ref,) = modality_qdq_reference(x, count, np.float32(0.5), np.uint8(128), np.float32(0.02), np.uint8(128))
    np.testing.assert_array_equal(y, ref)
