"""The edgeq custom-op domain: schema table, function bodies in onnxruntime and the reference
evaluator, and the OnlineHadamard graph helpers.

Tolerance: the op runs in fp32 (two matmuls of depth K and P); outputs are compared with the
float64 x @ H at atol = 1e-5 * max|y| (observed errors are about 20x smaller; a wrong H or a
wrong layout gives errors of order max|y|).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from edgeq.graph import ir
from edgeq.runtime_ops import (
    DOMAIN,
    ONLINE_HADAMARD,
    SCHEMAS,
    ensure_functions,
    get_schema,
    hadamard_matrix_for_fold,
    insert_online_hadamard,
    make_online_hadamard_node,
    online_hadamard_constants,
    online_hadamard_reference,
    reference_evaluator_ops,
)

LEVELS = {
    "disable_all": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "default": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def _hadamard_model(n: int, dims: list, opset: int = 17, dtype=np.float32) -> onnx.ModelProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node, inits = make_online_hadamard_node("x", "y", n, dtype=dtype)
    graph = helper.make_graph(
        [node], "online_hadamard",
        [helper.make_tensor_value_info("x", elem, [*dims, n])],
        [helper.make_tensor_value_info("y", elem, [*dims, n])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    return ensure_functions(model)


def _ort(model: onnx.ModelProto, level: str, feeds: dict, optimized_path=None) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = LEVELS[level]
    so.log_severity_level = 3
    if optimized_path:
        so.optimized_model_filepath = str(optimized_path)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _close(y: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


CASES = [  # (n, symbolic dims of the model input, concrete input shapes fed to one session)
    (64, ["batch", "seq"], [(2, 3), (1, 17)]),
    (576, ["batch", "seq"], [(2, 5), (3, 1)]),
    (1536, ["batch", "seq"], [(1, 4), (2, 7)]),
    (576, ["tokens"], [(9,), (1,)]),
    (1536, ["tokens"], [(6,), (2,)]),
]


@pytest.mark.parametrize("level", sorted(LEVELS))
@pytest.mark.parametrize("n,dims,shapes", CASES)
def test_online_hadamard_in_onnxruntime(n, dims, shapes, level):
    model = _hadamard_model(n, dims)
    onnx.checker.check_model(model, full_check=True)
    H = hadamard_matrix_for_fold(n)
    hk, hp = online_hadamard_constants(n)
    rng = np.random.default_rng(n)
    for lead in shapes:
        x = (3.0 * rng.standard_normal((*lead, n))).astype(np.float32)
        y = _ort(model, level, {"x": x})
        assert y.shape == x.shape and y.dtype == np.float32
        dense = x.astype(np.float64) @ H
        _close(y, dense)
        _close(y, online_hadamard_reference(x, hk, hp)[0])


@pytest.mark.parametrize("n,dims,shapes", CASES[:3])
def test_reference_evaluator_function_and_custom_reference(n, dims, shapes):
    model = _hadamard_model(n, dims)
    x = np.random.default_rng(0).standard_normal((*shapes[0], n)).astype(np.float32)
    dense = x.astype(np.float64) @ hadamard_matrix_for_fold(n)
    by_function = ReferenceEvaluator(model).run(None, {"x": x})[0]
    by_reference = ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, {"x": x})[0]
    _close(by_function, dense)
    _close(by_reference, dense)


@pytest.mark.parametrize("opset", [ir.MIN_OPSET, 21])
def test_function_follows_model_opset(opset):
    model = _hadamard_model(576, ["b", "s"], opset=opset)
    (fn,) = model.functions
    assert {i.domain: i.version for i in fn.opset_import}[""] == opset
    x = np.ones((1, 2, 576), np.float32)
    _close(_ort(model, "disable_all", {"x": x}), x @ hadamard_matrix_for_fold(576))
    # a pass raising the model's opset later: ensure_functions rebuilds the body to match
    model.opset_import[0].version = 21 if opset != 21 else 19
    ensure_functions(model)
    assert {i.domain: i.version for i in model.functions[0].opset_import}[""] == model.opset_import[0].version


def test_float64_input():
    model = _hadamard_model(576, ["b"], dtype=np.float64)
    x = np.random.default_rng(1).standard_normal((4, 576))
    np.testing.assert_allclose(_ort(model, "default", {"x": x}), x @ hadamard_matrix_for_fold(576), atol=1e-12)


@pytest.mark.parametrize("n", [576, 1536])
def test_no_dense_n_by_n_matmul(n, tmp_path):
    """Neither the function body, the model nor onnxruntime's optimized graph holds an n x n
    matrix: the op costs O(n (K + P)) per row, not O(n^2)."""
    model = _hadamard_model(n, ["b", "s"])
    (fn,) = model.functions
    body_ops = [node.op_type for node in fn.node]
    assert body_ops.count("MatMul") == 2
    for node in fn.node:
        if node.op_type == "Constant":  # only the int64 shape helpers
            assert onnx.numpy_helper.to_array(node.attribute[0].t).size == 1
    sizes = sorted(int(np.prod(t.dims)) for t in model.graph.initializer)
    k, p = {576: (36, 16), 1536: (12, 128)}[n]
    assert sizes == sorted([k * k, p * p])
    _ort(model, "default", {"x": np.ones((1, 1, n), np.float32)}, optimized_path=tmp_path / "opt.onnx")
    optimized = onnx.load(str(tmp_path / "opt.onnx"))
    assert all(int(np.prod(t.dims)) < n * n for t in optimized.graph.initializer)
    assert not any(node.domain == DOMAIN for node in optimized.graph.node)  # inlined by onnxruntime


def test_ensure_functions_idempotent_and_strict():
    model = _hadamard_model(64, ["b"])
    before = model.SerializeToString()
    ensure_functions(model)
    assert model.SerializeToString() == before
    assert [(i.domain, i.version) for i in model.opset_import].count((DOMAIN, 1)) == 1
    plain = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    ensure_functions(plain)
    assert not plain.functions and DOMAIN not in {i.domain for i in plain.opset_import}
    model.graph.node.append(helper.make_node("NoSuchOp", ["y"], ["z"], domain=DOMAIN))
    with pytest.raises(KeyError, match="NoSuchOp"):
        ensure_functions(model)


def test_schema_table_consistent():
    assert ONLINE_HADAMARD in SCHEMAS and get_schema(ONLINE_HADAMARD).domain == DOMAIN
    ops = {cls.__name__: cls for cls in reference_evaluator_ops()}
    assert set(ops) == set(SCHEMAS)
    for name, schema in SCHEMAS.items():
        fn = schema.function_builder(17)
        assert (fn.domain, fn.name) == (schema.domain, name)
        assert list(fn.input) == [i.name for i in schema.inputs]
        assert list(fn.output) == [o.name for o in schema.outputs]
        assert ops[name].op_domain == DOMAIN
    with pytest.raises(KeyError):
        get_schema("Nope")


def test_reference_rejects_wrong_size():
    hk, hp = online_hadamard_constants(576)
    with pytest.raises(ValueError, match="K \\* P"):
        online_hadamard_reference(np.zeros((2, 512), np.float32), hk, hp)


def _linear_model(n: int, out: int) -> tuple[onnx.ModelProto, np.ndarray]:
    w = np.random.default_rng(7).standard_normal((n, out)).astype(np.float32) / np.sqrt(n)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="down_proj")], "lin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", out])],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), w


@pytest.mark.parametrize("n", [64, 1536])
def test_graphsurgeon_insert_and_fold(n):
    """What the online-Hadamard pass does: x -> OnlineHadamard -> MatMul(H^T W) equals x W."""
    import onnx_graphsurgeon as gs

    model, w = _linear_model(n, 48)
    graph = ir.to_graph(model)
    matmul = next(node for node in graph.nodes if node.op == "MatMul")
    rotated = insert_online_hadamard(graph, matmul.inputs[0], name_prefix="down_proj_had")
    matmul.inputs[0] = rotated
    H = hadamard_matrix_for_fold(n)
    matmul.inputs[1] = gs.Constant("w_folded", (H.T @ w.astype(np.float64)).astype(np.float32))
    graph.cleanup().toposort()
    out = ensure_functions(ir.to_model(graph))
    onnx.checker.check_model(out, full_check=True)
    assert sum(node.domain == DOMAIN for node in out.graph.node) == 1
    x = np.random.default_rng(2).standard_normal((2, 3, n)).astype(np.float32)
    ref = x.astype(np.float64) @ w
    for level in LEVELS:
        _close(_ort(out, level, {"x": x}), ref)
    # a graphsurgeon round trip keeps the function and the domain import
    again = ir.to_model(ir.to_graph(out))
    assert [f.name for f in again.functions] == [ONLINE_HADAMARD]
    _close(_ort(again, "default", {"x": x}), ref)


def test_graphsurgeon_constants_shared_per_size():
    model, _ = _linear_model(1536, 8)
    graph = ir.to_graph(model)
    x = graph.inputs[0]
    a = insert_online_hadamard(graph, x, name_prefix="h1")
    b = insert_online_hadamard(graph, a, name_prefix="h2")
    consts = {t.name for node in graph.nodes if node.op == ONLINE_HADAMARD for t in node.inputs[1:]}
    assert consts == {"edgeq_hadamard_h_k_12_float32", "edgeq_hadamard_h_p_128_float32"}
    assert b.shape == x.shape and b.dtype == x.dtype
