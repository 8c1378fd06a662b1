"""``edgeq::OnlineHadamard``: ``y = x @ H`` over the last axis at runtime, H = H_K (x) H_P.

Why an op and not a MatMul: the Hadamard before down_proj (QuaRot, MQuant) must run on the
activation at inference time, and a dense n x n MatMul costs about as much as down_proj itself
(n = 1536 for SmolLM2). With ``n = K * P``, ``P = 2^m``, and the row viewed as a ``[K, P]``
matrix X, ``x @ kron(A, B) == vec(A^T X B)``: two small matmuls, O(n (K + P)) instead of O(n^2),
and a native kernel can run the P part as a fast Walsh-Hadamard transform and ignore ``h_p``.

The op carries its ONNX function body (Reshape, MatMul by ``h_p``, MatMul by ``h_k^T``, Reshape),
so onnxruntime, which inlines model-local functions, runs it with no custom kernel. The body
takes K and P from the shapes of ``h_k`` and ``h_p`` and the leading dims from ``Shape(x)``: one
FunctionProto serves every n and every rank, with symbolic batch and sequence dims.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from edgeq.runtime_ops.domain import DOMAIN, DOMAIN_VERSION
from edgeq.runtime_ops.hadamard import hadamard_matrix, normalized_hadamard_factors

OP_TYPE = "OnlineHadamard"
INPUTS = ("x", "h_k", "h_p")
OUTPUTS = ("y",)


def online_hadamard_function(opset: int) -> onnx.FunctionProto:
    """The function body, importing the default domain at ``opset`` (the model's own: onnx wants
    a model's functions to agree with the model on each domain's version)."""
    const = lambda name, values: helper.make_node(  # noqa: E731
        "Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values)
    )
    nodes = [
        const("zero", [0]),
        const("one", [1]),
        const("minus_one", [-1]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Slice", ["x_shape", "zero", "minus_one"], ["lead"]),
        helper.make_node("Shape", ["h_k"], ["k_shape"]),
        helper.make_node("Slice", ["k_shape", "zero", "one"], ["k"]),
        helper.make_node("Shape", ["h_p"], ["p_shape"]),
        helper.make_node("Slice", ["p_shape", "zero", "one"], ["p"]),
        helper.make_node("Concat", ["lead", "k", "p"], ["split_shape"], axis=0),
        helper.make_node("Reshape", ["x", "split_shape"], ["x_kp"]),
        helper.make_node("MatMul", ["x_kp", "h_p"], ["z"]),  # [..., K, P] @ [P, P]
        helper.make_node("Transpose", ["h_k"], ["h_k_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["h_k_t", "z"], ["y_kp"]),  # [K, K] @ [..., K, P]
        helper.make_node("Reshape", ["y_kp", "x_shape"], ["y"]),
    ]
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUTS),
        list(OUTPUTS),
        nodes,
        [helper.make_opsetid("", opset)],
        doc_string=__doc__.split("\n\n")[0],
    )


def online_hadamard_reference(x: np.ndarray, h_k: np.ndarray, h_p: np.ndarray) -> tuple[np.ndarray]:
    """Numpy reference: the same factorized product, in float64, cast back to x's dtype."""
    K, P = h_k.shape[0], h_p.shape[0]
    if x.shape[-1] != K * P:
        raise ValueError(f"OnlineHadamard: last dim {x.shape[-1]} != K * P = {K} * {P}")
    xr = np.asarray(x, dtype=np.float64).reshape(*x.shape[:-1], K, P)
    y = h_k.astype(np.float64).T @ (xr @ h_p.astype(np.float64))
    return (y.reshape(x.shape).astype(x.dtype),)


def hadamard_matrix_for_fold(n: int) -> np.ndarray:
    """The dense float64 orthogonal H the op computes (``y = x @ H``), for folding ``H^T`` into the
    next weight: ``(x @ H) @ (H^T @ W) == x @ W``. Raises ValueError when n has no construction."""
    return hadamard_matrix(n) / np.sqrt(n)


def hadamard_times(w: np.ndarray, transpose: bool = False) -> np.ndarray:
    """``H @ w`` (``H^T @ w`` with ``transpose``) in float64 for the H of ``hadamard_matrix_for_fold``
    (n = w's first dim), through its Kronecker factors: ``kron(A, B) @ W`` is ``A`` on the K axis
    and ``B`` on the P axis of W viewed as [K, P, N]. Two arrays of w's size instead of the dense
    n x n H (at a 1.5B model's down_proj, n = 8960: 0.6 GB, and more while kron builds it).
    Raises ValueError when n has no construction."""
    n = w.shape[0]
    hk, hp = normalized_hadamard_factors(n)
    if transpose:
        hk, hp = hk.T, hp.T
    w3 = np.asarray(w, np.float64).reshape(hk.shape[0], hp.shape[0], -1)
    z = np.matmul(hp, w3)  # B on the P axis, for each K
    del w3
    out = (hk @ z.reshape(hk.shape[0], -1)).reshape(w.shape)  # A on the K axis
    return out


def online_hadamard_constants(n: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The op's ``h_k`` and ``h_p`` inputs for size n (normalized factors, cast to ``dtype``)."""
    hk, hp = normalized_hadamard_factors(n)
    return hk.astype(dtype), hp.astype(dtype)


def make_online_hadamard_node(
    x_name: str, y_name: str, n: int, name: str | None = None, dtype=np.float32
) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """An OnlineHadamard NodeProto plus its two initializers, for code that edits protos directly.
    Initializer names carry K, P and the dtype so layers of the same size can share them."""
    hk, hp = online_hadamard_constants(n, dtype)
    suffix = np.dtype(dtype).name
    hk_name = f"edgeq_hadamard_h_k_{hk.shape[0]}_{suffix}"
    hp_name = f"edgeq_hadamard_h_p_{hp.shape[0]}_{suffix}"
    node = helper.make_node(
        OP_TYPE, [x_name, hk_name, hp_name], [y_name], name=name or f"{y_name}_node", domain=DOMAIN
    )
    inits = [onnx.numpy_helper.from_array(hk, hk_name), onnx.numpy_helper.from_array(hp, hp_name)]
    return node, inits


def insert_online_hadamard(graph, tensor, n: int | None = None, name_prefix: str | None = None):
    """Add ``y = OnlineHadamard(tensor)`` to a graphsurgeon graph and return y (a gs.Variable).

    Consumers of ``tensor`` are not rewired: the pass decides which ones read y. The constants
    are shared between calls of the same size and dtype (looked up by name in the graph). n
    defaults to the static last dim of ``tensor``; the constants take ``tensor``'s float dtype
    (float32 when unknown). After export, ``edgeq.runtime_ops.ensure_functions(model)`` adds the
    function body and the ``edgeq`` opset import.
    """
    import onnx_graphsurgeon as gs  # graphsurgeon only where a pass uses it

    if n is None:
        n = tensor.shape[-1] if tensor.shape else None
        if not isinstance(n, (int, np.integer)):
            raise ValueError(f"insert_online_hadamard: the last dim of {tensor.name} is not static; pass n")
    n = int(n)
    dtype = np.dtype(tensor.dtype) if tensor.dtype is not None else np.dtype(np.float32)
    if dtype.kind != "f":
        raise ValueError(f"insert_online_hadamard: {tensor.name} has non-float dtype {dtype}")
    hk, hp = online_hadamard_constants(n, dtype)
    existing = graph.tensors()
    consts = []
    for label, value in (("h_k", hk), ("h_p", hp)):
        cname = f"edgeq_hadamard_{label}_{value.shape[0]}_{dtype.name}"
        const = existing.get(cname)
        if const is None:
            const = gs.Constant(cname, value)
        elif not isinstance(const, gs.Constant) or not np.array_equal(const.values, value):
            raise ValueError(f"insert_online_hadamard: tensor {cname} exists and is not this constant")
        consts.append(const)
    prefix = name_prefix or f"{tensor.name}_online_hadamard"
    out = gs.Variable(f"{prefix}_out", dtype=tensor.dtype, shape=tensor.shape)
    node = gs.Node(op=OP_TYPE, name=prefix, domain=DOMAIN, inputs=[tensor, *consts], outputs=[out])
    graph.nodes.append(node)
    return out


__all__ = [
    "DOMAIN",
    "DOMAIN_VERSION",
    "OP_TYPE",
    "hadamard_matrix_for_fold",
    "hadamard_times",
    "insert_online_hadamard",
    "make_online_hadamard_node",
    "online_hadamard_constants",
    "online_hadamard_function",
    "online_hadamard_reference",
]
