"""``edgeq::VisualKVAttention`` (CalibQuant's attention over a 1/2/4/8-bit visual KV cache): the
packing bit order by hand, ``quantize_channelwise``, and agreement of onnxruntime running the
function body (graph optimizations off and at the default level), onnx's ReferenceEvaluator
running the body and running the numpy reference (``reference_evaluator_ops``) with
``visual_kv_attention_reference``, for bits 1, 2, 4 and 8, GQA and plain multi-head, S = 1 and
S = 3 with padding / causal / full masks, calibration on and off; post-scaling against a float64
dequantize-then-attend computation; the calibration's [gamma, delta] -> [gamma - tau1, delta - tau2]
read back from the op's output; validation errors. The global-V layout and the KIVI sibling
(``test_visual_kv_attention_kivi_op.py``) reuse the helpers here (``v_layout``).

Tolerance: the body runs in float32 (MatMuls of depth D <= 64 and Nv + Nt <= 29, a softmax), the
numpy reference in float64 rounded once to float32. Post-scaling cancels: y = v_scale * (p . c_v)
+ v_alpha * sum(p) subtracts two terms as large as the value cache (|v| up to ~50 here, outlier
channels included) to give outputs up to ~20, so float32 errors scale with the cache, not with y.
Outputs are compared at atol = 1e-5 * max|y| (observed: at most 1.3e-6 * max|y|, 2.7e-5
absolute, in onnxruntime at both levels and in the ReferenceEvaluator running the body; the
ReferenceEvaluator running the numpy op is bit-exact). A wrong bit order, a wrong GQA head mapping
or a missing calibration changes outputs by 1e-2 to 1 (checked: calibration on vs off differs by
more than 1e-2 in every case here). The post-scaling identity is checked at float32 rounding of
the output (both sides float64 inside).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from edgeq.runtime_ops import DOMAIN, SCHEMAS, ensure_functions, reference_evaluator_ops
from edgeq.runtime_ops.visual_kv_attention import (
    INPUTS,
    MIN_OPSET,
    OP_TYPE,
    calibrate_logits,
    make_visual_kv_attention_node,
    visual_kv_attention_function,
    visual_kv_attention_reference,
)
from edgeq.runtime_ops.visual_kv_codes import (
    SUPPORTED_BITS,
    dequantize_channelwise,
    pack_codes,
    quantize_channelwise,
    quantize_pertoken,
    unpack_codes,
)

LEVELS = {
    "disable_all": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "default": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
TAUS = (1.0, 3.0)  # the paper grid-searches {0, 1, 2, 3}; both non-zero so each end moves
CONFIGS = {
    "mha_s1": dict(B=2, H=4, KVH=4, S=1, D=64, Nv=24, Nt=5, mask=None),
    "gqa_s1_padding": dict(B=2, H=8, KVH=2, S=1, D=32, Nv=24, Nt=5, mask="padding"),
    "gqa_s3_causal": dict(B=2, H=6, KVH=2, S=3, D=64, Nv=16, Nt=6, mask="causal"),
    "mha_s3_full": dict(B=1, H=3, KVH=3, S=3, D=16, Nv=12, Nt=4, mask="full"),
}


def _cache(rng, shape) -> np.ndarray:
    """Gaussian entries with a per-channel spread (a few 6x outlier channels) and offset, the
    structure that makes channel-wise quantization pay off."""
    d = shape[-1]
    spread = np.ones(d, np.float32)
    spread[rng.choice(d, max(1, d // 8), replace=False)] = 6.0
    return (rng.standard_normal(shape) * spread + rng.standard_normal(d) * 0.5).astype(np.float32)


def _mask(kind, B, H, S, Nv, Nt, rng):
    """None; padding [B, 1, 1, N] (batch row 1 drops 2 visual and 1 text token); causal
    [1, 1, S, N] (the S queries are the last S text tokens, -inf above the diagonal); full
    [B, H, S, N] (a random additive bias plus the causal part, -1e9)."""
    if kind is None:
        return None
    n = Nv + Nt
    if kind == "padding":
        m = np.zeros((B, 1, 1, n), np.float32)
        m[1, ..., :2] = -1e9
        m[1, ..., Nv] = -1e9
        return m
    causal = np.zeros((1, 1, S, n), np.float32)
    for s in range(S):
        causal[..., s, Nv + (Nt - S + s) + 1:] = -np.inf
    if kind == "causal":
        return causal
    return (rng.standard_normal((B, H, S, n)) + np.maximum(causal, -1e9)).astype(np.float32)


def _quantize_values(v, bits, v_layout):
    """Visual values as (codes [B, KVH, Nv, D], alpha, scale): "channel" (VisualKVAttention's
    [B, KVH, 1, D]), "global" (one range per batch row and KV head, [B, KVH, 1, 1]) or "token"
    (KIVI's per-token [B, KVH, Nv, 1])."""
    if v_layout == "channel":
        return quantize_channelwise(v, bits)
    if v_layout == "global":
        codes, alpha, scale = quantize_channelwise(v.reshape(*v.shape[:2], -1, 1), bits)
        return codes.reshape(v.shape), alpha, scale
    assert v_layout == "token", v_layout
    return quantize_pertoken(v, bits)


def _feeds(B, H, KVH, S, D, Nv, Nt, mask, bits, seed=0, v_layout="channel") -> dict:
    rng = np.random.default_rng(seed)
    k_codes, k_alpha, k_scale = quantize_channelwise(_cache(rng, (B, KVH, Nv, D)), bits)
    v_codes, v_alpha, v_scale = _quantize_values(_cache(rng, (B, KVH, Nv, D)), bits, v_layout)
    feeds = dict(
        q=(rng.standard_normal((B, H, S, D)) * 1.5).astype(np.float32),
        k_codes=pack_codes(k_codes, bits), k_alpha=k_alpha, k_scale=k_scale,
        v_codes=pack_codes(v_codes, bits), v_alpha=v_alpha, v_scale=v_scale,
        k_text=_cache(rng, (B, KVH, Nt, D)), v_text=_cache(rng, (B, KVH, Nt, D)),
    )
    m = _mask(mask, B, H, S, Nv, Nt, rng)
    if m is not None:
        feeds["mask"] = m
    return feeds


def _model(feeds: dict, bits: int, opset: int = 18, symbolic: bool = True, **attrs):
    """A one-node model over ``feeds`` (B, S, Nv, Nt symbolic when ``symbolic``); ``v_per_token=True``
    in ``attrs`` makes it VisualKVAttentionKIVI."""
    node, inits = make_visual_kv_attention_node(*INPUTS[:9], "y", bits, mask="mask" if "mask" in feeds else None, **attrs)
    sym = {0: "batch", 2: {"q": "seq", "k_codes": "nv", "v_codes": "nv", "k_text": "nt", "v_text": "nt"}}
    if attrs.get("v_per_token"):
        sym[2] |= {"v_alpha": "nv", "v_scale": "nv"}
    inputs = []
    for name, a in feeds.items():
        dims = list(a.shape)
        if symbolic and name != "mask":
            dims[0] = "batch"
            dims[2] = sym[2].get(name, dims[2])
        inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), dims))
    q = feeds["q"]
    out_dims = ["batch", q.shape[1], "seq", q.shape[3]] if symbolic else list(q.shape)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_dims)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return ensure_functions(model), node


def _reference(feeds: dict, node: onnx.NodeProto) -> np.ndarray:
    """The numpy reference of the node's op (VisualKVAttention or its KIVI sibling)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return SCHEMAS[node.op_type].reference(*(feeds[n] for n in INPUTS[:9]), mask=feeds.get("mask"), **attrs)[0]


def _assert_close(actual, ref, err_msg=""):
    """float32 body vs float64 reference: atol = 1e-5 * max|ref| (see the module docstring)."""
    np.testing.assert_allclose(actual, ref, rtol=0, atol=1e-5 * float(np.abs(ref).max()), err_msg=err_msg)


def _ort(model, feeds, level="disable_all", optimized_path=None) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = LEVELS[level]
    if optimized_path:
        so.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


# ---------------------------------------------------------------------------------------------
# packing and quantization


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_unpack_round_trip(bits):
    rng = np.random.default_rng(bits)
    for shape in [(2, 3, 5, 64), (16,), (1, 1, 0, 8)]:
        codes = rng.integers(0, 2 ** bits, shape).astype(np.uint8)
        packed = pack_codes(codes, bits)
        assert packed.dtype == np.uint8 and packed.shape == (*shape[:-1], shape[-1] * bits // 8)
        np.testing.assert_array_equal(unpack_codes(packed, bits, shape[-1]), codes)
    # every byte value decodes and re-encodes to itself
    every = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(pack_codes(unpack_codes(every, bits, 256 * 8 // bits), bits), every)


def test_bit_order_by_hand():
    """MSB first (CalibQuant A.1): entry i of a group sits at shift 8 - b * (i + 1)."""
    np.testing.assert_array_equal(pack_codes([3, 0, 1, 2, 0, 1, 2, 3], 2), [0b11_00_01_10, 0b00_01_10_11])
    assert pack_codes([3, 0, 1, 2], 2).tolist() == [198]
    assert pack_codes([1, 0, 1, 1, 0, 0, 0, 1], 1).tolist() == [0b10110001] == [177]
    assert pack_codes([1, 0, 0, 0, 0, 0, 0, 0], 1).tolist() == [128]
    assert pack_codes([0, 0, 0, 0, 0, 0, 0, 1], 1).tolist() == [1]
    assert unpack_codes(np.array([0b01_00_00_00], np.uint8), 2, 4).tolist() == [1, 0, 0, 0]
    assert unpack_codes(np.array([0b00_00_00_11], np.uint8), 2, 4).tolist() == [0, 0, 0, 3]
    assert unpack_codes(np.array([0b01000000, 0b00000001], np.uint8), 1, 16).tolist() == [0, 1] + [0] * 13 + [1]
    # b = 4: the first entry in the high nibble; b = 8: one code per byte
    assert pack_codes([3, 10], 4).tolist() == [0x3A] == [58]
    assert pack_codes([15, 0, 0, 15], 4).tolist() == [0xF0, 0x0F]
    assert unpack_codes(np.array([0x3A, 0x5C], np.uint8), 4, 4).tolist() == [3, 10, 5, 12]
    assert pack_codes([200, 7, 255, 0], 8).tolist() == [200, 7, 255, 0]
    assert unpack_codes(np.array([129, 66], np.uint8), 8, 2).tolist() == [129, 66]


@pytest.mark.parametrize("bits,packed,codes", [
    (2, [0b11_00_01_10, 0b00_01_10_11], [3, 0, 1, 2, 0, 1, 2, 3]),
    (1, [0b10110001], [1, 0, 1, 1, 0, 0, 0, 1]),
    (4, [0x3A, 0xF0, 0x5C, 0x0F], [3, 10, 15, 0, 5, 12, 0, 15]),
    (8, [200, 7, 255, 0, 128, 1, 66, 129], [200, 7, 255, 0, 128, 1, 66, 129]),
])
def test_function_body_bit_order(bits, packed, codes):
    """The body's BitShift/BitwiseAnd unpacking, read straight off the output: one visual token,
    no text (Nt = 0), v_scale = 1, v_alpha = 0 gives y = the unpacked value codes."""
    d = len(codes)
    rng = np.random.default_rng(0)
    ones, zeros = np.ones((1, 1, 1, d), np.float32), np.zeros((1, 1, 1, d), np.float32)
    feeds = dict(
        q=rng.standard_normal((1, 1, 1, d)).astype(np.float32),
        k_codes=np.array(packed, np.uint8).reshape(1, 1, 1, -1), k_alpha=zeros, k_scale=ones,
        v_codes=np.array(packed, np.uint8).reshape(1, 1, 1, -1), v_alpha=zeros, v_scale=ones,
        k_text=np.zeros((1, 1, 0, d), np.float32), v_text=np.zeros((1, 1, 0, d), np.float32),
    )
    model, node = _model(feeds, bits)
    expected = np.array(codes, np.float32).reshape(1, 1, 1, d)
    for level in LEVELS:
        np.testing.assert_array_equal(_ort(model, feeds, level), expected, err_msg=level)
    np.testing.assert_array_equal(ReferenceEvaluator(model).run(None, feeds)[0], expected)
    np.testing.assert_array_equal(_reference(feeds, node), expected)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_quantize_channelwise(bits):
    """alpha = min and scale = (max - min) / (2^b - 1) per (batch, head, channel) over the
    tokens; error within half a step; the extremes are exact; a constant channel gets scale 0,
    codes 0 and dequantizes exactly."""
    rng = np.random.default_rng(7)
    x = _cache(rng, (2, 3, 10, 16))
    x[1, 2, :, 5] = 0.75
    codes, alpha, scale = quantize_channelwise(x, bits)
    assert codes.dtype == np.uint8 and codes.shape == x.shape and codes.max() <= 2 ** bits - 1
    assert alpha.shape == scale.shape == (2, 3, 1, 16) and alpha.dtype == scale.dtype == np.float32
    np.testing.assert_array_equal(alpha, x.min(axis=2, keepdims=True))
    np.testing.assert_allclose(scale, (x.max(axis=2, keepdims=True) - x.min(axis=2, keepdims=True)) / (2 ** bits - 1), rtol=1e-6)
    deq = dequantize_channelwise(codes, alpha, scale)
    assert (np.abs(deq - x) <= scale / 2 * (1 + 1e-5) + 1e-6).all()
    assert scale[1, 2, 0, 5] == 0 and not codes[1, 2, :, 5].any() and (deq[1, 2, :, 5] == 0.75).all()
    top = np.argmax(x, axis=2)  # the max of each channel maps to the top code, the min to 0
    np.testing.assert_array_equal(np.take_along_axis(codes, top[:, :, None], 2)[..., 0, :][scale[..., 0, :] > 0], 2 ** bits - 1)
    np.testing.assert_array_equal(np.take_along_axis(codes, np.argmin(x, axis=2)[:, :, None], 2), 0)


# ---------------------------------------------------------------------------------------------
# the op


@pytest.mark.parametrize("calibrate", [1, 0], ids=["calibrated", "uncalibrated"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_all_ways_agree(bits, config, calibrate):
    feeds = _feeds(**CONFIGS[config], bits=bits, seed=bits)
    model, node = _model(feeds, bits, tau1=TAUS[0], tau2=TAUS[1], calibrate=bool(calibrate))
    onnx.checker.check_model(model, full_check=True)
    ref = _reference(feeds, node)
    c = CONFIGS[config]
    assert ref.shape == (c["B"], c["H"], c["S"], c["D"]) and ref.dtype == np.float32 and np.isfinite(ref).all()
    for level in LEVELS:
        _assert_close(_ort(model, feeds, level), ref, err_msg=level)
    _assert_close(ReferenceEvaluator(model).run(None, feeds)[0], ref)
    np.testing.assert_array_equal(ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, feeds)[0], ref)
    # the calibration attribute reaches the numbers (tau = (1, 3) moves them by far more than the tolerance)
    other = visual_kv_attention_reference(*(feeds[n] for n in INPUTS[:9]), mask=feeds.get("mask"), bits=bits,
                                          tau1=TAUS[0], tau2=TAUS[1], calibrate=1 - calibrate)[0]
    assert np.abs(other - ref).max() > 1e-2


def _float_attention(q, k, v, k_text, v_text, mask, tau1, tau2, calibrate) -> np.ndarray:
    """float64 attention over a float K/V: visual part first, head j reading KV head j // (H / KVH)
    by an explicit loop, calibration on the visual logits, float64 output."""
    B, H, S, D = q.shape
    kvh, nv = k.shape[1], k.shape[2]
    y = np.zeros((B, H, S, D))
    for j in range(H):
        g = j // (H // kvh)
        keys = np.concatenate([k[:, g], k_text[:, g]], axis=1).astype(np.float64)  # [B, N, D]
        vals = np.concatenate([v[:, g], v_text[:, g]], axis=1).astype(np.float64)
        logits = np.einsum("bsd,bnd->bsn", q[:, j].astype(np.float64), keys) / np.sqrt(D)
        logits[..., :nv] = calibrate_logits(logits[..., :nv], tau1, tau2, calibrate)
        if mask is not None:
            logits = logits + np.broadcast_to(mask, (B, H, S, logits.shape[-1]))[:, j]
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        y[:, j] = np.einsum("bsn,bnd->bsd", p, vals)
    return y


def _check_dequantize_then_attend(bits, config, calibrate, v_layout="channel"):
    """The op (numpy reference and onnxruntime) against ``_float_attention`` over the dequantized
    cache codes * scale + alpha (float64, formed explicitly; any of the ``v_layout`` layouts)."""
    feeds = _feeds(**CONFIGS[config], bits=bits, seed=11, v_layout=v_layout)
    model, node = _model(feeds, bits, tau1=TAUS[0], tau2=TAUS[1], calibrate=bool(calibrate),
                         v_per_token=v_layout == "token")
    d = feeds["q"].shape[-1]
    k = dequantize_channelwise(unpack_codes(feeds["k_codes"], bits, d), feeds["k_alpha"], feeds["k_scale"])
    v = dequantize_channelwise(unpack_codes(feeds["v_codes"], bits, d), feeds["v_alpha"], feeds["v_scale"])
    expected = _float_attention(feeds["q"], k, v, feeds["k_text"], feeds["v_text"], feeds.get("mask"), *TAUS, calibrate)
    np.testing.assert_allclose(_reference(feeds, node), expected, rtol=1e-6, atol=1e-7)
    _assert_close(_ort(model, feeds, "default"), expected)


@pytest.mark.parametrize("calibrate", [1, 0], ids=["calibrated", "uncalibrated"])
@pytest.mark.parametrize("config", ["gqa_s1_padding", "gqa_s3_causal", "mha_s3_full"])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_post_scaling_equals_dequantize_then_attend(bits, config, calibrate):
    """((q * scale) . codes + q . alpha) and scale * (p . codes) + alpha * sum(p) equal attention
    over the dequantized cache codes * scale + alpha."""
    _check_dequantize_then_attend(bits, config, calibrate)


@pytest.mark.parametrize("calibrate", [1, 0])
def test_calibration_maps_range(calibrate):
    """g maps [gamma, delta] onto [gamma - tau1, delta - tau2] linearly, read back from the op:
    with visual values one-hot (codes = I, scale 1, alpha 0) in channels 0..7 and the one text
    value e_8, y[:8] = p_vis and y[8] = p_txt, so log(y[:8] / y[8]) + l_txt = g(l_vis)."""
    nv, d, bits = 8, 16, 1
    rng = np.random.default_rng(5)
    v_visual = np.zeros((1, 1, nv, d), np.float32)
    v_visual[0, 0, :, :nv] = np.eye(nv)
    v_codes, v_alpha, v_scale = quantize_channelwise(v_visual, bits)
    assert (v_scale[..., :nv] == 1).all() and (v_alpha == 0).all()
    k_codes, k_alpha, k_scale = quantize_channelwise(_cache(rng, (1, 1, nv, d)), bits)
    v_text = np.zeros((1, 1, 1, d), np.float32)
    v_text[..., nv] = 1.0
    feeds = dict(q=rng.standard_normal((1, 1, 1, d)).astype(np.float32),
                 k_codes=pack_codes(k_codes, bits), k_alpha=k_alpha, k_scale=k_scale,
                 v_codes=pack_codes(v_codes, bits), v_alpha=v_alpha, v_scale=v_scale,
                 k_text=_cache(rng, (1, 1, 1, d)), v_text=v_text)
    tau1, tau2 = TAUS
    model, _ = _model(feeds, bits, tau1=tau1, tau2=tau2, calibrate=bool(calibrate))
    y = _ort(model, feeds, "default")[0, 0, 0].astype(np.float64)
    q = feeds["q"][0, 0, 0].astype(np.float64)
    k = dequantize_channelwise(k_codes, k_alpha, k_scale)[0, 0]
    l_vis = k @ q / np.sqrt(d)
    l_txt = feeds["k_text"][0, 0, 0].astype(np.float64) @ q / np.sqrt(d)
    g = np.log(y[:nv] / y[nv]) + l_txt
    gamma, delta = l_vis.min(), l_vis.max()
    assert delta - gamma > 0.5
    if calibrate:
        assert abs(g[l_vis.argmin()] - (gamma - tau1)) < 1e-4 and abs(g[l_vis.argmax()] - (delta - tau2)) < 1e-4
        np.testing.assert_allclose(g, (delta - gamma + tau1 - tau2) / (delta - gamma) * (l_vis - gamma) + gamma - tau1, atol=1e-4)
    else:
        np.testing.assert_allclose(g, l_vis, atol=1e-4)
    np.testing.assert_allclose(g, calibrate_logits(l_vis, tau1, tau2, calibrate), atol=1e-4)


def test_calibrate_logits():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 2, 9)) * 3
    x[1, 1] = 2.5  # a constant row: identity
    g = calibrate_logits(x, 2.0, 0.5)
    gamma, delta = x.min(-1), x.max(-1)
    live = delta > gamma
    np.testing.assert_allclose(g.min(-1)[live], (gamma - 2.0)[live])
    np.testing.assert_allclose(g.max(-1)[live], (delta - 0.5)[live])
    np.testing.assert_array_equal(g[1, 1], x[1, 1])
    np.testing.assert_array_equal(np.argsort(g[0, 0]), np.argsort(x[0, 0]))  # increasing while delta - gamma + tau1 - tau2 > 0
    # affine with slope (delta - gamma + tau1 - tau2) / (delta - gamma) on every live row
    slope = (g[live][:, 1:] - g[live][:, :1]) / (x[live][:, 1:] - x[live][:, :1])
    np.testing.assert_allclose(slope, np.broadcast_to(((delta - gamma + 1.5)[live] / (delta - gamma)[live])[:, None], slope.shape))
    np.testing.assert_array_equal(calibrate_logits(x, 2.0, 0.5, calibrate=0), x)
    np.testing.assert_allclose(calibrate_logits(x, 0.0, 0.0), x, rtol=1e-12, atol=1e-12)


def test_opsets_and_static_shapes():
    """The body at opset 18 (SmolLM2-style exports) and 21, static and symbolic shapes; older
    models are refused."""
    feeds = _feeds(**CONFIGS["gqa_s3_causal"], bits=2, seed=4)
    ref = None
    for opset in (18, 21):
        for symbolic in (True, False):
            model, node = _model(feeds, 2, opset=opset, symbolic=symbolic, tau1=1.0, tau2=2.0)
            onnx.checker.check_model(model, full_check=True)
            ref = _reference(feeds, node) if ref is None else ref
            for level in LEVELS:
                _assert_close(_ort(model, feeds, level), ref, err_msg=f"{opset} {symbolic} {level}")
    with pytest.raises(ValueError, match="opset >= 18"):
        _model(feeds, 2, opset=17)


def test_attribute_defaults():
    """A node carrying only ``bits`` runs with tau1 = tau2 = 0, calibrate = 1 in onnxruntime
    (function attribute defaults) and in the numpy op (the schema's defaults); with zero taus
    the calibration is the identity up to rounding."""
    feeds = _feeds(**CONFIGS["gqa_s1_padding"], bits=1, seed=2)
    model, node = _model(feeds, 1)
    ref = _reference(feeds, node)
    for a in list(node.attribute):
        if a.name != "bits":
            node.attribute.remove(a)
    model.graph.node[0].CopyFrom(node)
    _assert_close(_ort(model, feeds), ref)
    np.testing.assert_array_equal(ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, feeds)[0], ref)
    uncalibrated = visual_kv_attention_reference(*(feeds[n] for n in INPUTS[:9]), mask=feeds["mask"], bits=1, calibrate=0)[0]
    np.testing.assert_allclose(ref, uncalibrated, rtol=1e-6, atol=1e-7)


def test_no_repeated_kv_and_no_custom_nodes_left(tmp_path):
    """onnxruntime inlines the body; the KV cache is never tiled per query head (GQA is a reshape
    of q) and the unpacking is BitShift + BitwiseAnd on uint8."""
    feeds = _feeds(**CONFIGS["gqa_s1_padding"], bits=2, seed=1)
    model, _ = _model(feeds, 2)
    path = tmp_path / "opt.onnx"
    _ort(model, feeds, "disable_all", optimized_path=path)
    nodes = onnx.load(str(path)).graph.node
    ops = [n.op_type for n in nodes]
    assert not any(n.domain == DOMAIN for n in nodes)
    assert ops.count("BitShift") >= 2 and ops.count("BitwiseAnd") == 2
    assert "Tile" not in ops and "Expand" not in ops


def test_no_mask_forms():
    """No mask: the node helper's scalar 0 equals the numpy reference's mask=None; an empty name
    works in the numpy op under ReferenceEvaluator but onnxruntime refuses to inline it (the
    module docstring says why no opset <= 21 body can take it; if this starts passing, the
    docstring and the helper can switch to empty names)."""
    feeds = _feeds(**CONFIGS["gqa_s1_padding"] | {"mask": None}, bits=2, seed=6)
    model, node = _model(feeds, 2, tau1=1.0, tau2=3.0)
    assert node.input[9] == "y_no_mask"
    ref = _reference(feeds, node)
    _assert_close(_ort(model, feeds, "default"), ref)
    model.graph.node[0].input[9] = ""
    del model.graph.initializer[:]
    np.testing.assert_array_equal(ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, feeds)[0], ref)
    with pytest.raises(Exception, match="empty string"):
        _ort(model, feeds)


# ---------------------------------------------------------------------------------------------
# schema and validation


def test_schema():
    schema = SCHEMAS[OP_TYPE]
    fn = schema.function_builder(18)
    assert [i.name for i in schema.inputs] == list(fn.input) == list(INPUTS)
    assert [o.name for o in schema.outputs] == list(fn.output) == ["y"]
    assert [a.name for a in schema.attributes] == ["bits", "tau1", "tau2", "calibrate"]
    assert {a.name: a.default for a in schema.attributes} == {"bits": None, "tau1": 0.0, "tau2": 0.0, "calibrate": 1}
    assert schema.min_opset == MIN_OPSET == 18 and schema.domain == DOMAIN
    assert list(fn.attribute) == ["bits"] and {a.name for a in fn.attribute_proto} == {"tau1", "tau2", "calibrate"}
    assert {"BitShift", "BitwiseAnd"} <= {n.op_type for n in visual_kv_attention_function(21).node}
    node, inits = make_visual_kv_attention_node(*INPUTS[:9], "out", 2, tau1=1, tau2=3, calibrate=False)
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == dict(bits=2, tau1=1.0, tau2=3.0, calibrate=0)
    assert node.input[9] == "out_no_mask" and len(inits) == 1 and inits[0].data_type == TensorProto.FLOAT
    assert onnx.numpy_helper.to_array(inits[0]).shape == () and onnx.numpy_helper.to_array(inits[0]) == 0
    node, inits = make_visual_kv_attention_node(*INPUTS[:9], "out", 1, mask="m")
    assert node.input[9] == "m" and inits == []


def _args(**over):
    feeds = _feeds(B=1, H=4, KVH=2, S=1, D=16, Nv=5, Nt=2, mask=None, bits=2)
    feeds.update(over)
    return [feeds[n] for n in INPUTS[:9]]


@pytest.mark.parametrize("bad,match", [
    (dict(bits=3), "bits 3"),
    (dict(bits=16), "bits 16"),
    (dict(bits=0), "bits 0"),
    (dict(bits=None), "bits attribute is required"),
    (dict(calibrate=2), "calibrate"),
    (dict(tau1=float("nan")), "tau1"),
])
def test_attribute_validation(bad, match):
    kwargs = dict(bits=2) | bad
    with pytest.raises(ValueError, match=match):
        visual_kv_attention_reference(*_args(), **kwargs)
    if "calibrate" not in bad:
        with pytest.raises(ValueError, match=match):
            make_visual_kv_attention_node(*INPUTS[:9], "y", **kwargs)


def test_shape_validation():
    ok = _args()
    visual_kv_attention_reference(*ok, bits=2)
    q, kc, ka, ks, vc, va, vs, kt, vt = ok
    cases = [
        ((np.zeros((1, 3, 1, 16), np.float32), *ok[1:]), "not a multiple of KVH"),
        ((q, kc[..., :2], *ok[2:]), "k_codes"),
        ((*ok[:4], vc.astype(np.int8), *ok[5:]), "must be uint8"),
        ((q, kc, ka[..., :8], *ok[3:]), "k_alpha"),
        ((*ok[:7], kt[:, :, :1], vt), "k_text"),
        ((q, kc[:, :, :0], ka, ks, vc[:, :, :0], va, vs, kt, vt), "at least one visual token"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            visual_kv_attention_reference(*args, bits=2)
    with pytest.raises(ValueError, match="k_codes"):
        visual_kv_attention_reference(*ok, bits=1)  # 2-bit packing read as 1-bit: width mismatch
    with pytest.raises(ValueError, match="multiple of 8"):
        visual_kv_attention_reference(np.zeros((1, 4, 1, 12), np.float32), *ok[1:], bits=1)
    with pytest.raises(ValueError, match="not broadcastable"):
        visual_kv_attention_reference(*ok, mask=np.zeros((1, 4, 1, 8), np.float32), bits=2)
    with pytest.raises(ValueError, match="not broadcastable"):
        visual_kv_attention_reference(*ok, mask=np.zeros((2, 1, 1, 7), np.float32), bits=2)
    visual_kv_attention_reference(*ok, mask=np.zeros((1, 1, 7), np.float32), bits=2)  # lower rank broadcasts
    with pytest.raises(ValueError, match="outside"):
        pack_codes([0, 1, 2, 3, 4, 0, 0, 0], 2)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_codes([0, 1, 0], 1)
    with pytest.raises(ValueError, match="does not hold"):
        unpack_codes(np.zeros(3, np.uint8), 2, 16)
