"""The onnxruntime kernels of the edgeq ops (``edgeq.runtime_ops.ort_kernels``): for every op in
``SCHEMAS``, the numpy reference, onnxruntime running the function body, onnxruntime running the
kernel (onnxruntime-extensions), onnxruntime running the rewritten model without the kernels (the
``edgeq.ort`` copies of the function bodies) and, on a CUDA GPU, the Triton kernel where one exists
(OnlineHadamard, VisualKVAttention, W4A8Linear); plus the rewrite ``use_ort_kernels`` itself.

Tolerances: the kernel IS the numpy reference, so kernel vs reference is bit for bit. The body vs
the reference uses each op's own tolerance from its op test: bit for bit for ModalityQDQ and
SubspaceQDQ (float32 operations in the same order); ``atol = 1e-5 * max|ref|`` for OnlineHadamard
and the attention ops (float32 body, float64 reference, see test_runtime_ops.py and
test_visual_kv_attention_op.py); ``rtol = 1e-5, atol = 1e-5 * max|ref|`` for W4A8Linear (the same
FP8 grids, fp32 vs float64 accumulation, see test_w4a8_linear_op.py). The rewritten model without
kernels runs the same body and must equal the original body bit for bit. Triton tolerances are
those of tests/test_kernels_gpu*.py (quoted at each test).

Without onnxruntime-extensions the kernel tests skip with the reason (``make test`` installs the
``ort-kernels`` extra, so CI runs them); the rewrite tests need no extension. Triton is imported
only inside the GPU tests, after CUDA is known to be there: the CPU suite never imports triton.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeq.runtime_ops import (
    DOMAIN,
    SCHEMAS,
    ensure_functions,
    hadamard_matrix_for_fold,
    make_online_hadamard_node,
    make_subspace_qdq_node,
    make_visual_kv_attention_node,
    make_w4a8_linear_node,
)
from edgeq.runtime_ops.ort_kernels import (
    KERNEL_DOMAIN,
    KERNEL_OPS,
    has_ort_kernels,
    ort_kernel_session_options,
    use_ort_kernels,
)
from edgeq.runtime_ops.ort_kernels_spec import EXACT_SUFFIX
from edgeq.runtime_ops.visual_kv_attention import INPUTS as VK_INPUTS
from edgeq.runtime_ops.visual_kv_codes import pack_codes, quantize_channelwise, quantize_pertoken

needs_kernels = pytest.mark.skipif(
    not has_ort_kernels(),
    reason="onnxruntime-extensions is not installed (pip install 'edgeq[ort-kernels]'; make test installs it)")


@dataclasses.dataclass
class Case:
    """A one-op model, its feeds, and how close the body must be to the reference."""

    op: str
    model: onnx.ModelProto
    feeds: dict
    tol: str  # "exact", "max" (atol 1e-5 max|ref|) or "w4a8" (rtol 1e-5 + atol 1e-5 max|ref|)

    def reference(self) -> np.ndarray:
        node = self.model.graph.node[0]
        values = {**{i.name: numpy_helper.to_array(i) for i in self.model.graph.initializer}, **self.feeds}
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        return SCHEMAS[node.op_type].reference(*(values[n] if n else None for n in node.input), **attrs)[0]


def _model(node, inits, feeds: dict, opset: int, symbolic_batch: bool = True, out_shape=None) -> onnx.ModelProto:
    """A one-node model; the output's shape is the reference's unless ``out_shape`` is given."""
    inputs = []
    for name, a in feeds.items():
        dims = list(a.shape)
        if symbolic_batch and dims:
            dims[0] = "batch"
        inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), dims))
    graph = helper.make_graph([node], "g", inputs, [], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    if out_shape is None:
        out_shape = Case(node.op_type, model, feeds, "").reference().shape  # the checker wants a shape
    dims = ["batch", *out_shape[1:]] if symbolic_batch and out_shape else list(out_shape)
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, dims))
    return ensure_functions(model)


def _hadamard(n, lead) -> Case:
    x = (3 * np.random.default_rng(n).standard_normal((*lead, n))).astype(np.float32)
    node, inits = make_online_hadamard_node("x", "y", n)
    return Case("OnlineHadamard", _model(node, inits, {"x": x}, 18), {"x": x}, "max")


def _modality(zp_dtype, rank) -> Case:
    rng = np.random.default_rng(rank)
    shape = (3, 7, 8) if rank == 3 else (3, 7, 2, 4)
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    x[0, :2] *= 30.0
    zp = np.iinfo(zp_dtype).min // 2 + np.iinfo(zp_dtype).max // 2  # 0 for signed, mid-range for unsigned
    inits = [numpy_helper.from_array(np.array(v, t), k) for k, v, t in
             (("sv", 0.5, np.float32), ("zv", zp, zp_dtype), ("st", 0.02, np.float32), ("zt", zp, zp_dtype))]
    node = helper.make_node("ModalityQDQ", ["x", "count", "sv", "zv", "st", "zt"], ["y"], domain=DOMAIN)
    feeds = {"x": x, "count": np.array([2, 0, 7], np.int64)}
    return Case("ModalityQDQ", _model(node, inits, feeds, 21), feeds, "exact")


def _subspace(mode) -> Case:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    x[..., -8:] *= 8.0
    symmetric = mode.endswith("_sym")
    if mode.startswith("dynamic"):
        kwargs = dict(dynamic=True)
    else:
        kwargs = dict(low_scale=0.3, low_zero_point=0 if symmetric else 8, high_scale=0.07,
                      high_zero_point=0 if symmetric else 128)
    node, inits = make_subspace_qdq_node("x", "y", 8, symmetric=symmetric, **kwargs)
    return Case("SubspaceQDQ", _model(node, inits, {"x": x}, 21), {"x": x}, "exact")


def _w4a8(k, block, signed) -> Case:
    rng = np.random.default_rng(k)
    n, groups = 24, -(-k // block)
    w, zp = (rng.integers(-8, 8, (k, n)), np.zeros((groups, n), np.int64)) if signed else \
        (rng.integers(0, 16, (k, n)), rng.integers(3, 13, (groups, n)))
    s8 = 2.0 ** -6
    node, inits = make_w4a8_linear_node("x", "y", w, (rng.uniform(1, 4, (groups, n)) * s8).astype(np.float32), zp, s8,
                                        0.0371, block_size=block, signed=signed)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    return Case("W4A8Linear", _model(node, inits, {"x": x}, 21), {"x": x}, "w4a8")


def _vk(bits, h, kvh, s, nt, v_layout="channel", mask=False, tau=(1.0, 3.0), calibrate=True) -> Case:
    rng = np.random.default_rng(bits * 10 + h)
    b, d, nv = 2, 32, 24

    def cache(n):
        return (rng.standard_normal((b, kvh, n, d)) * np.where(rng.random(d) < 0.2, 6.0, 1.0)).astype(np.float32)

    kc, ka, ks = quantize_channelwise(cache(nv), bits)
    v = cache(nv)
    if v_layout == "token":
        vc, va, vs = quantize_pertoken(v, bits)
    elif v_layout == "global":
        vc, va, vs = quantize_channelwise(v.reshape(b, kvh, -1, 1), bits)
        vc = vc.reshape(v.shape)
    else:
        vc, va, vs = quantize_channelwise(v, bits)
    feeds = dict(q=(1.5 * rng.standard_normal((b, h, s, d))).astype(np.float32), k_codes=pack_codes(kc, bits),
                 k_alpha=ka, k_scale=ks, v_codes=pack_codes(vc, bits), v_alpha=va, v_scale=vs,
                 k_text=cache(nt), v_text=cache(nt))
    if mask:
        m = np.zeros((b, 1, s, nv + nt), np.float32)
        m[1, ..., :3] = -1e9
        feeds["mask"] = m
    node, inits = make_visual_kv_attention_node(*VK_INPUTS[:9], "y", bits, mask="mask" if mask else None,
                                                tau1=tau[0], tau2=tau[1], calibrate=calibrate,
                                                v_per_token=v_layout == "token")
    return Case(node.op_type, _model(node, inits, feeds, 18), feeds, "max")


CASES = {
    "hadamard_1536_rank3": lambda: _hadamard(1536, (2, 3)),
    "hadamard_576_rank2": lambda: _hadamard(576, (5,)),
    "hadamard_64_rank1": lambda: _hadamard(64, ()),
    "modality_int8": lambda: _modality(np.int8, 3),
    "modality_uint8_rank4": lambda: _modality(np.uint8, 4),
    "modality_int16": lambda: _modality(np.int16, 3),
    "subspace_static_sym": lambda: _subspace("static_sym"),
    "subspace_static_asym": lambda: _subspace("static_asym"),
    "subspace_dynamic_sym": lambda: _subspace("dynamic_sym"),
    "subspace_dynamic_asym": lambda: _subspace("dynamic_asym"),
    "w4a8_uint4_short_group": lambda: _w4a8(200, 64, False),
    "w4a8_int4": lambda: _w4a8(256, 128, True),
    "vk_gqa_2bit_mask_odd_taus": lambda: _vk(2, 6, 2, 1, 5, mask=True, tau=(0.1234567, 0.7654321)),
    "vk_mha_1bit_no_text": lambda: _vk(1, 4, 4, 1, 0),
    "vk_4bit_global_v_s3": lambda: _vk(4, 6, 3, 3, 4, v_layout="global", mask=True),
    "vk_8bit_uncalibrated": lambda: _vk(8, 4, 2, 1, 3, calibrate=False),
    "kivi_gqa_2bit": lambda: _vk(2, 6, 2, 1, 5, v_layout="token", mask=True),
    "kivi_4bit_s2": lambda: _vk(4, 4, 1, 2, 3, v_layout="token", tau=(0.3, 2.9)),
}


def _run(model, so=None, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, feeds=None) -> np.ndarray:
    so = so or ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _assert_body_close(y, ref, tol):
    if tol == "exact":
        np.testing.assert_array_equal(y, ref)
    else:
        np.testing.assert_allclose(y, ref, rtol=1e-5 if tol == "w4a8" else 0, atol=1e-5 * float(np.abs(ref).max()))


def test_every_schema_op_has_a_kernel_and_a_case():
    assert set(KERNEL_OPS) == set(SCHEMAS)
    assert {f().op for f in CASES.values()} == set(SCHEMAS)


# ---------------------------------------------------------------------------------------------
# the rewrite (no onnxruntime-extensions needed)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rewrite_moves_every_node_and_keeps_a_valid_model(name):
    case = CASES[name]()
    before = case.model.SerializeToString()
    rewritten = use_ort_kernels(case.model)
    assert case.model.SerializeToString() == before, "use_ort_kernels modified its input"
    assert [n.domain for n in rewritten.graph.node if n.op_type == case.op] == [KERNEL_DOMAIN]
    assert (KERNEL_DOMAIN, case.op) in {(f.domain, f.name) for f in rewritten.functions}
    onnx.checker.check_model(rewritten, full_check=True)
    again = use_ort_kernels(rewritten)
    assert again.SerializeToString() == rewritten.SerializeToString(), "not idempotent"


@pytest.mark.parametrize("name", sorted(CASES))
def test_rewritten_model_without_kernels_runs_the_body(name):
    """No kernel registered: onnxruntime inlines the ``edgeq.ort`` copy of the body."""
    case = CASES[name]()
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        body = _run(case.model, level=level, feeds=case.feeds)
        np.testing.assert_array_equal(_run(use_ort_kernels(case.model), level=level, feeds=case.feeds), body)
        _assert_body_close(body, case.reference(), case.tol)


def test_rewrite_writes_attributes_exactly():
    case = _vk(2, 6, 2, 1, 5, tau=(0.1234567, 0.7654321))
    node = use_ort_kernels(case.model).graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert float(attrs["tau1" + EXACT_SUFFIX]) == float(np.float32(0.1234567)) == attrs["tau1"]
    assert f"{attrs['tau1']:g}" == "0.123457"  # what the extension's own float formatting would keep
    # a node with only its required attribute gets every default written
    node = helper.make_node("SubspaceQDQ", ["x", "", "", "", ""], ["y"], domain=DOMAIN, rank=8, dynamic=1)
    x = np.ones((2, 64), np.float32)
    rewritten = use_ort_kernels(_model(node, [], {"x": x}, 21))
    attrs = {a.name: helper.get_attribute_value(a) for a in rewritten.graph.node[0].attribute}
    assert attrs == {"rank": 8, "dynamic": 1, "low_bits": 4, "high_bits": 8, "symmetric": 1}
    assert "" not in rewritten.graph.node[0].input


def test_rewrite_leaves_what_the_kernels_cannot_take():
    # float64 OnlineHadamard (the kernel is float32)
    node, inits = make_online_hadamard_node("x", "y", 64, dtype=np.float64)
    m = _model(node, inits, {"x": np.ones((2, 64))}, 18)
    assert use_ort_kernels(m).graph.node[0].domain == DOMAIN
    # static SubspaceQDQ with an absent scale (invalid; the body would quantize with scale 1)
    node = helper.make_node("SubspaceQDQ", ["x", "", "", "", ""], ["y"], domain=DOMAIN, rank=8)
    m = _model(node, [], {"x": np.ones((2, 64), np.float32)}, 21, out_shape=(2, 64))
    assert use_ort_kernels(m).graph.node[0].domain == DOMAIN
    # VisualKVAttention without its required bits
    case = _vk(2, 4, 2, 1, 3)
    del case.model.graph.node[0].attribute[:]
    assert use_ort_kernels(case.model).graph.node[0].domain == DOMAIN
    # ops not selected; unknown ops refused
    case = _hadamard(64, (2,))
    assert use_ort_kernels(case.model, ops=["SubspaceQDQ"]).graph.node[0].domain == DOMAIN
    with pytest.raises(ValueError, match="no onnxruntime kernel"):
        use_ort_kernels(case.model, ops=["Conv"])


def _in_if_branch(case: Case) -> onnx.ModelProto:
    """The case's node inside the then-branch of an If on a bool input, after a Relu whose output
    has no value_info (its type comes from shape inference)."""
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    node = model.graph.node[0]
    node.input[0] = "x_relu"
    dims = [d.dim_param or d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    then = helper.make_graph([node], "then", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["y_else"])], "else", [],
                              [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, dims)])
    del model.graph.node[:]
    model.graph.node.extend([helper.make_node("Relu", ["x"], ["x_relu"]),
                             helper.make_node("If", ["flag"], ["y"], then_branch=then, else_branch=other)])
    model.graph.input.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
    return model


def test_rewrite_reaches_subgraphs_and_intermediate_tensors():
    model = _in_if_branch(_hadamard(576, (3,)))
    rewritten = use_ort_kernels(model)
    branch = next(a.g for a in rewritten.graph.node[1].attribute if a.name == "then_branch")
    assert branch.node[0].domain == KERNEL_DOMAIN
    onnx.checker.check_model(rewritten, full_check=True)


def test_w4a8_rewrite_casts_the_4bit_tensors():
    rewritten = use_ort_kernels(_w4a8(200, 64, False).model)
    casts = [n for n in rewritten.graph.node if n.op_type == "Cast"]
    assert len(casts) == 2 and all(helper.get_attribute_value(c.attribute[0]) == TensorProto.INT8 for c in casts)
    assert rewritten.graph.node[-1].input[1] == casts[0].output[0]


# ---------------------------------------------------------------------------------------------
# the kernels in onnxruntime


@needs_kernels
@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_body_kernel_agree(name):
    """The three ways on CPU: numpy reference, onnxruntime body (both levels), onnxruntime kernel."""
    case = CASES[name]()
    ref = case.reference()
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        _assert_body_close(_run(case.model, level=level, feeds=case.feeds), ref, case.tol)
        kernel = _run(use_ort_kernels(case.model), ort_kernel_session_options(), level=level, feeds=case.feeds)
        assert kernel.dtype == ref.dtype and kernel.shape == ref.shape
        np.testing.assert_array_equal(kernel, ref)


@needs_kernels
def test_kernel_wins_over_the_function_of_the_same_name():
    """The rewritten model carries a FunctionProto and a kernel is registered for the same
    (domain, op): onnxruntime runs the kernel. Shown by replacing the copy's body with Identity."""
    case = _hadamard(64, (3,))
    rewritten = use_ort_kernels(case.model)
    fn = next(f for f in rewritten.functions if f.domain == KERNEL_DOMAIN)
    del fn.node[:]
    fn.node.append(helper.make_node("Identity", ["x"], ["y"]))
    x = case.feeds["x"]
    np.testing.assert_array_equal(_run(rewritten, feeds=case.feeds), x)  # no kernel: the (tampered) body
    np.testing.assert_array_equal(_run(rewritten, ort_kernel_session_options(), feeds=case.feeds), case.reference())
    _assert_body_close(x @ hadamard_matrix_for_fold(64), case.reference(), "max")  # and it is the Hadamard


@needs_kernels
def test_kernel_in_a_subgraph():
    case = _hadamard(576, (3,))
    model = _in_if_branch(case)
    feeds = {**case.feeds, "flag": np.array(True)}
    x = case.feeds["x"]
    y = _run(use_ort_kernels(model), ort_kernel_session_options(), feeds=feeds)
    np.testing.assert_array_equal(y, SCHEMAS["OnlineHadamard"].reference(
        np.maximum(x, 0), *(numpy_helper.to_array(i) for i in model.graph.initializer))[0])


@needs_kernels
def test_session_options_are_reused_and_other_python_ops_still_run():
    """``so`` comes back with its settings; the replaced invocation hook still serves Python ops
    that are not edgeq's (through the extension's own hook)."""
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    onnx_op(op_type="EdgeqTestNegate", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])(lambda x: -x)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    assert ort_kernel_session_options(so) is so and so.intra_op_num_threads == 1
    node = helper.make_node("EdgeqTestNegate", ["x"], ["y"], domain="ai.onnx.contrib")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.contrib", 1)],
                              ir_version=10)
    x = np.array([1.0, -2.0, 3.5], np.float32)
    np.testing.assert_array_equal(_run(model, ort_kernel_session_options(), feeds={"x": x}), -x)


# ---------------------------------------------------------------------------------------------
# the fourth way: the Triton kernels (CUDA only; triton imported inside the tests)


def _cuda():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the Triton kernels need a GPU")
    pytest.importorskip("triton", reason="triton is not installed")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("n,lead", [(1536, (2, 3)), (576, (5,))])
def test_triton_hadamard_matches_the_op(n, lead):
    """fp32: atol 1e-5 * max|y| (test_kernels_gpu.py)."""
    torch = _cuda()
    from edgeq.kernels.hadamard_triton import hadamard_transform

    case = _hadamard(n, lead)
    y, info = hadamard_transform(torch.from_numpy(case.feeds["x"]).cuda(), return_info=True)
    assert info["used_triton"]
    ref = case.reference()
    np.testing.assert_allclose(y.cpu().numpy(), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("bits,h,kvh", [(1, 4, 4), (2, 6, 2)])
def test_triton_calibquant_matches_the_op(bits, h, kvh):
    """The Triton decode attention covers the op's visual part: S = 1, no text tokens, no mask,
    channel-wise V. fp32 q: 2^-8 * (|v_alpha| + (2^b - 1) |v_scale|) per output channel, plus
    2^-8 |ref| and 1e-6 (test_kernels_gpu_calibquant.py's bound for its roundings)."""
    torch = _cuda()
    from edgeq.kernels.calibquant_triton import calibquant_decode_attention

    case = _vk(bits, h, kvh, 1, 0, tau=(1.0, 2.0))
    f = {k: torch.from_numpy(v).cuda() for k, v in case.feeds.items()}
    squeeze = lambda t: t[:, :, 0]  # noqa: E731  [B, KVH, 1, D] -> [B, KVH, D]
    y = calibquant_decode_attention(squeeze(f["q"]), f["k_codes"], squeeze(f["k_alpha"]), squeeze(f["k_scale"]),
                                    f["v_codes"], squeeze(f["v_alpha"]), squeeze(f["v_scale"]), bits, 1.0, 2.0, True)
    ref = case.reference()[:, :, 0]
    rep = h // kvh
    span = np.repeat(np.abs(case.feeds["v_alpha"]) + (2 ** bits - 1) * np.abs(case.feeds["v_scale"]), rep, axis=1)[:, :, 0]
    tol = 2.0 ** -8 * span + 2.0 ** -8 * np.abs(ref) + 1e-6
    err = np.abs(y.float().cpu().numpy().astype(np.float64) - ref)
    assert (err <= tol).all(), f"error / tolerance reaches {(err / tol).max():.3f}"


@pytest.mark.gpu
@pytest.mark.parametrize("symmetric", [False, True])
def test_triton_w4a8_matches_the_op(symmetric):
    """DPQ weight [N, K] -> the op's inputs: w = nibbles^T (uint4, or int4 = nibble - 8 when
    symmetric), w_scale = group_scales * s8 (exact: s8 is a power of two). bf16 output:
    |y - ref| <= 2^-8 |ref| + 2^-12 * sum|terms| (test_kernels_gpu_w4a8.py)."""
    torch = _cuda()
    from edgeq.kernels.w4a8_gemm_ref import (activation_scale, quantize_activation_fp8, quantize_dpq, unpack_int4,
                                             w4a8_abs_terms)
    from edgeq.kernels.w4a8_gemm_triton import w4a8_gemm

    n, k, m = 256, 384, 16
    g = torch.Generator("cuda").manual_seed(3)
    q = quantize_dpq(torch.randn(n, k, device="cuda", generator=g) * 0.02, symmetric=symmetric, scale_dtype=torch.float32)
    x = torch.randn(m, k, device="cuda", generator=g)
    sa = activation_scale(x)
    x8 = quantize_activation_fp8(x, sa)
    y = w4a8_gemm(x8, sa, q.packed, q.group_scales, q.s8, zeros=q.zeros)
    nibbles = unpack_int4(q.packed).T.cpu().numpy().astype(np.int64)  # [K, N]
    zp = np.zeros((k // 128, n), np.int64) if symmetric else q.zeros.cpu().numpy().astype(np.int64)
    w = nibbles - 8 if symmetric else nibbles
    w_scale = (q.group_scales.float().cpu().numpy() * q.s8).astype(np.float32)
    ref = SCHEMAS["W4A8Linear"].reference(x.cpu().numpy(), w, w_scale, zp, np.float32(q.s8), np.float32(sa),
                                          block_size=128)[0]
    terms = w4a8_abs_terms(x8, sa, q.packed, q.group_scales, q.s8, zeros=q.zeros).cpu().numpy()
    err = np.abs(y.double().cpu().numpy() - ref)
    tol = 2.0 ** -8 * np.abs(ref) + 2.0 ** -12 * terms + 1e-30
    assert (err <= tol).all(), f"error / tolerance reaches {(err / tol).max():.3f}"
