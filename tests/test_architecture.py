"""ARCHITECTURE.md's example pass is real code: it registers, runs in the pipeline, is exact, and the
framework's lifecycle applies to it (a second run finds nothing and says why, typed)."""

import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeq import ir
from edgeq.passbase import PassContext, Reason
from edgeq.pipeline import Pipeline, PipelineOptions
from edgeq.registry import _PASSES, all_passes

DOC = Path(__file__).resolve().parents[1] / "ARCHITECTURE.md"


def _example_source() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1
    return blocks[0]


def _model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "w")
    nodes = [helper.make_node("Identity", ["x"], ["x_id"]), helper.make_node("MatMul", ["x_id", "w"], ["y0"]),
             helper.make_node("Identity", ["y0"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_the_documented_example_pass_works():
    source = _example_source()
    assert len(source.strip().splitlines()) <= 40
    namespace: dict = {}
    try:
        exec(compile(source, str(DOC), "exec"), namespace)  # noqa: S102 (our own documentation)
        cls = namespace["DropIdentityPass"]
        assert all_passes()["drop-identity"] is cls
        model = _model()
        x = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}
        ref = ir.make_session(model).run(None, x)[0]
        out, records = Pipeline([cls()], PipelineOptions(verify=True)).run(model, PassContext())
        assert records[0]["modified"] and records[0]["summary"] == {"removed": 1}  # the output Identity stays
        assert [n.op_type for n in out.graph.node] == ["MatMul", "Identity"]
        np.testing.assert_array_equal(ir.make_session(out).run(None, x)[0], ref)
        again, rec2 = Pipeline([cls()]).run(out, PassContext())
        assert not rec2[0]["modified"] and rec2[0]["not_applicable"] == {"reason": Reason.NO_SITES.value,
                                                                         "detail": "no Identity node"}
    finally:
        _PASSES.pop("drop-identity", None)
