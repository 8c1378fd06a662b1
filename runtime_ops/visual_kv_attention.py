"""``edgeq::VisualKVAttention``: CalibQuant's decode attention over a 1/2/4/8-bit visual KV cache.

CalibQuant (paper 001, sections 4.1-4.2 and appendix A.1) quantizes the visual tokens' keys and
values of a multimodal decoder after prefill, channel-wise (one (alpha, scale) per batch, KV head
and head_dim channel, min/max over the visual tokens) at b = 1 or 2 bits (4 and 8 here too, for
comparisons; the Triton kernels in ``kernels/`` take 1 and 2 only), packs the codes into
uint8 along head_dim, keeps the text tokens in float, and attends with post-scaling (the
dequantized cache is never formed) and a logit calibration of the visual part. Why a custom op:
the packed cache, the post-scaled dot products and the calibration live inside one attention; a
runtime or an NPU SDK with a native (e.g. Triton decode) kernel over packed codes matches
``edgeq::VisualKVAttention`` by domain and name. Why a function body: plain onnxruntime (or any
ONNX runtime) inlines it and runs the same numbers with standard ops.

Inputs (Nv >= 1 visual tokens, Nt >= 0 text tokens, D = head_dim, a multiple of 8 / b):

- ``q`` float32 [B, H, S, D]: S query positions (usually 1), NOT pre-scaled (the op applies
  1 / sqrt(D)).
- ``k_codes`` uint8 [B, KVH, Nv, D * b / 8]; ``k_alpha``, ``k_scale`` float32 [B, KVH, 1, D].
- ``v_codes`` uint8 [B, KVH, Nv, D * b / 8]; ``v_alpha``, ``v_scale`` float32 [B, KVH, 1, D]
  (channel-wise) or [B, KVH, 1, 1] (one range per batch row and KV head over all visual tokens
  and channels: the "without channel-wise V" ablation; ``quantize_channelwise`` of the values
  reshaped to [B, KVH, Nv * D, 1] gives them), both the same shape.
- ``k_text``, ``v_text`` float32 [B, KVH, Nt, D].
- ``mask`` float32, broadcastable to [B, H, S, Nv + Nt]: added to the logits before the softmax
  (padding, causal among the text part; large negative = masked). No mask is a float32 scalar
  0 (``make_visual_kv_attention_node`` writes one). The numpy reference also takes ``mask=None``,
  but in a graph the input must be present (probed with onnxruntime 1.32 / onnx 1.23):
  onnxruntime cannot inline a function whose absent input reaches a non-optional slot ("input 1
  is marked single but has an empty string", also inside an If branch), onnx's function type
  inference rejects ``Optional`` of an absent input ("Input type is null"), and the only opset
  <= 21 optional input that passes a tensor of any shape through, LayerNormalization's B, crashes
  onnxruntime at ORT_ENABLE_EXTENDED when empty (Gemm's C and the RNN states are 2-d / 3-d).

GQA: H % KVH == 0; query head j uses KV head j // (H / KVH).

Attributes: ``bits`` (int, required, 1, 2, 4 or 8), ``tau1`` (float, 0), ``tau2`` (float, 0),
``calibrate`` (int 0/1, 1).

Bit order (CalibQuant A.1, MSB first): each group of G = 8 / b consecutive head_dim entries forms
one byte; entry i of a group (0 <= i < G) is stored shifted left by 8 - b * (i + 1), so the first
entry holds the most significant bits: ``code[g * G + i] = (byte[g] >> (8 - b * (i + 1))) & (2^b - 1)``
(b = 2: codes [3, 0, 1, 2] -> 0b11_00_01_10 = 198; b = 1: [1, 0, 1, 1, 0, 0, 0, 1] -> 0b10110001;
b = 4: [3, 10] -> 0x3A = 58, the first entry in the high nibble; b = 8: one code per byte, shift 0).

Semantics, for each batch row, query head h (KV head h // (H / KVH)) and query position s, with
``c_k``, ``c_v`` the unpacked codes (integers in [0, 2^b - 1]) and ``.`` the dot product over D:

- visual logits by post-scaling, for each visual token n:
  ``l_vis[n] = ((q * k_scale) . c_k[n] + q . k_alpha) / sqrt(D)``
  (= q . (c_k[n] * k_scale + k_alpha) / sqrt(D), the dequantized key, never formed);
- logit calibration over the Nv visual logits of this (batch, head, query): ``gamma = min(l_vis)``,
  ``delta = max(l_vis)`` (all Nv, the mask does not enter them),
  ``g(x) = (delta - gamma + tau1 - tau2) / (delta - gamma) * (x - gamma) + gamma - tau1``,
  which maps [gamma, delta] linearly onto [gamma - tau1, delta - tau2]; g is the identity when
  ``delta == gamma`` or ``calibrate == 0`` (and, up to rounding, when tau1 == tau2 == 0);
- text logits ``l_txt[t] = q . k_text[t] / sqrt(D)``;
- ``p = softmax([g(l_vis), l_txt] + mask)`` over the Nv + Nt positions; ``p_vis``, ``p_txt``
  its two parts (a row masked entirely with -inf gives NaN, as any softmax);
- output ``y = v_scale * (p_vis . c_v) + v_alpha * sum(p_vis) + p_txt . v_text`` (the sums
  over tokens; a [B, KVH, 1, 1] v_alpha / v_scale broadcasts over D), float32 [B, H, S, D].

The body (default-domain opset >= 18: BitwiseAnd, and ReduceMin/ReduceMax/ReduceSum with axes
as an input): unpacking is ``Unsqueeze`` of the packed bytes to [..., D*b/8, 1], ``BitShift``
(RIGHT, uint8) by the G shifts ``8 - b * (i + 1)``, ``BitwiseAnd`` with ``0xFF >> (8 - b)``,
``Reshape`` to [..., D] and ``Cast`` to float (the float code tensor the MatMuls read; a native
kernel unpacks in registers). GQA is a reshape of q to [B, KVH, (H / KVH) * S, D] (the KV cache
is never repeated per query head); the logits are reshaped back to [B, H, S, ·] for the
calibration (ReduceMin/ReduceMax, Where for the identity cases), Concat with the text logits, Add
of the mask and Softmax, then sliced at Nv and reshaped to the grouped layout for the value
MatMuls. Shapes come from ``Shape`` at run time (B, S, Nv, Nt may be symbolic). The body does
not validate shapes or attributes (``bits`` outside {1, 2, 4, 8} gives a wrong unpacking or a
shape error); the node helper and the numpy reference do.

KIVI sibling: ``edgeq::VisualKVAttentionKIVI`` (module ``visual_kv_attention_kivi``) has the same
inputs, attributes and keys, values quantized per token (v_alpha / v_scale [B, KVH, Nv, 1]). Both
bodies come from ``attention_function(op_type, opset, value_nodes, doc)`` and differ only in the
value nodes; both numpy references (``visual_kv_attention_reference``,
``visual_kv_attention_kivi_reference``, defined here) run the shared core ``attend``; the node
helper writes either (``v_per_token``).

In ``visual_kv_codes`` (import them from there): ``pack_codes`` / ``unpack_codes``
(numpy, the bit order above), ``quantize_channelwise`` (the paper's Eq. 3/5: alpha = min,
scale = (max - min) / (2^b - 1) per (batch, head, channel) over the tokens,
codes = clip(round((x - alpha) / scale)), half to even), ``quantize_pertoken`` (the same over the
channels, axis -1: KIVI's values, [..., N, 1] ranges) and ``dequantize_channelwise``
(codes * scale + alpha, float64, for checks; any layout that broadcasts). Defined here:
``calibrate_logits`` (g above, numpy).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

from edgeq.runtime_ops.domain import DOMAIN
from edgeq.runtime_ops.visual_kv_codes import _check_bits, _group, unpack_codes

OP_TYPE = "VisualKVAttention"
OP_TYPE_KIVI = "VisualKVAttentionKIVI"  # values per token: visual_kv_attention_kivi
INPUTS = ("q", "k_codes", "k_alpha", "k_scale", "v_codes", "v_alpha", "v_scale", "k_text", "v_text", "mask")
OUTPUTS = ("y",)
MIN_OPSET = 18  # BitwiseAnd; ReduceMin / ReduceMax / ReduceSum with axes as an input
ATTRIBUTE_DEFAULTS = {"tau1": 0.0, "tau2": 0.0, "calibrate": 1}


# ---------------------------------------------------------------------------------------------
# numpy helper: calibration


def calibrate_logits(logits, tau1: float = 0.0, tau2: float = 0.0, calibrate: int = 1) -> np.ndarray:
    """CalibQuant's g over the last axis (float64): per row, with gamma = min and delta = max,
    ``g(x) = (delta - gamma + tau1 - tau2) / (delta - gamma) * (x - gamma) + gamma - tau1``;
    the identity on rows with delta == gamma, or everywhere when calibrate == 0."""
    x = np.asarray(logits, np.float64)
    if not int(calibrate):
        return x.copy()
    gamma = x.min(axis=-1, keepdims=True)
    delta = x.max(axis=-1, keepdims=True)
    rng = delta - gamma
    positive = rng > 0
    factor = (rng + float(tau1) - float(tau2)) / np.where(positive, rng, 1.0)
    return np.where(positive, factor * (x - gamma) + gamma - float(tau1), x)


# ---------------------------------------------------------------------------------------------
# validation and the numpy reference


def _check_attributes(bits, calibrate, tau1, tau2, op: str = OP_TYPE) -> int:
    bits = _check_bits(bits, op)
    if int(calibrate) not in (0, 1):
        raise ValueError(f"{op}: calibrate must be 0 or 1, got {calibrate}")
    for label, tau in (("tau1", tau1), ("tau2", tau2)):
        if not math.isfinite(float(tau)):
            raise ValueError(f"{op}: {label} must be finite, got {tau}")
    return bits


def _check_shapes(q, k_codes, k_alpha, k_scale, v_codes, v_alpha, v_scale, k_text, v_text, mask, bits, op):
    """Shapes and dtypes of the inputs (v_alpha / v_scale per ``op``'s layout); returns
    (B, H, S, D, KVH, Nv, Nt)."""
    if q.ndim != 4:
        raise ValueError(f"{op}: q must be [B, H, S, D], got {q.shape}")
    b, h, s, d = q.shape
    if d % _group(bits):
        raise ValueError(f"{op}: head_dim {d} is not a multiple of {_group(bits)} (8 / bits, bits = {bits})")
    for label, codes in (("k_codes", k_codes), ("v_codes", v_codes)):
        if codes.dtype != np.uint8:
            raise ValueError(f"{op}: {label} must be uint8, got {codes.dtype}")
        if codes.ndim != 4:
            raise ValueError(f"{op}: {label} must be [B, KVH, Nv, D * bits / 8], got {codes.shape}")
    kvh, nv = k_codes.shape[1], k_codes.shape[2]
    if kvh < 1 or h % kvh:
        raise ValueError(f"{op}: H = {h} query heads is not a multiple of KVH = {kvh} KV heads")
    if nv < 1:
        raise ValueError(f"{op}: at least one visual token is needed, got Nv = {nv}")
    packed = (b, kvh, nv, d * bits // 8)
    for label, codes in (("k_codes", k_codes), ("v_codes", v_codes)):
        if codes.shape != packed:
            raise ValueError(f"{op}: {label} {codes.shape} != {packed} (D = {d} at {bits} bits)")
    for label, arr in (("k_alpha", k_alpha), ("k_scale", k_scale)):
        if arr.shape != (b, kvh, 1, d):
            raise ValueError(f"{op}: {label} {arr.shape} != {(b, kvh, 1, d)}")
    v_shapes = [(b, kvh, nv, 1)] if op == OP_TYPE_KIVI else [(b, kvh, 1, d), (b, kvh, 1, 1)]
    if v_alpha.shape not in v_shapes or v_scale.shape != v_alpha.shape:
        raise ValueError(f"{op}: v_alpha {v_alpha.shape} and v_scale {v_scale.shape} must both be "
                         f"{' or '.join(map(str, v_shapes))}")
    if k_text.ndim != 4 or k_text.shape[:2] != (b, kvh) or k_text.shape[3] != d or v_text.shape != k_text.shape:
        raise ValueError(f"{op}: k_text {k_text.shape} and v_text {v_text.shape} must both be [{b}, {kvh}, Nt, {d}]")
    nt = k_text.shape[2]
    if mask is not None:
        try:
            ok = mask.ndim <= 4 and np.broadcast_shapes(mask.shape, (b, h, s, nv + nt)) == (b, h, s, nv + nt)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{op}: mask {mask.shape} is not broadcastable to [B, H, S, Nv + Nt] = {(b, h, s, nv + nt)}")
    return b, h, s, d, kvh, nv, nt


def attend(op, q, k_codes, k_alpha, k_scale, v_codes, v_alpha, v_scale, k_text, v_text, mask, bits, tau1, tau2,
           calibrate):
    """The numpy reference of ``op`` (OP_TYPE or OP_TYPE_KIVI; they differ in the values only),
    float64 inside, the output rounded once to float32. Returns ``(y,)``."""
    bits = _check_attributes(bits, calibrate, tau1, tau2, op)
    q = np.asarray(q, np.float32)
    k_codes, v_codes = np.asarray(k_codes), np.asarray(v_codes)
    k_alpha, k_scale, v_alpha, v_scale, k_text, v_text = (
        np.asarray(a, np.float32) for a in (k_alpha, k_scale, v_alpha, v_scale, k_text, v_text))
    mask = None if mask is None else np.asarray(mask, np.float32)
    b, h, s, d, kvh, nv, nt = _check_shapes(q, k_codes, k_alpha, k_scale, v_codes, v_alpha, v_scale,
                                            k_text, v_text, mask, bits, op)
    rep = h // kvh

    def per_head(a):  # [B, KVH, ...] -> [B, H, ...]: query head j reads KV head j // rep
        return np.repeat(np.asarray(a, np.float64), rep, axis=1)

    q64 = q.astype(np.float64)
    ck, cv = per_head(unpack_codes(k_codes, bits, d)), per_head(unpack_codes(v_codes, bits, d))
    inv_sqrt_d = 1.0 / math.sqrt(d)
    # post-scaling: (q * k_scale) . codes + q . k_alpha, per visual token
    l_vis = (np.einsum("bhsd,bhnd->bhsn", q64 * per_head(k_scale), ck)
             + np.einsum("bhsd,bhkd->bhsk", q64, per_head(k_alpha))) * inv_sqrt_d
    l_vis = calibrate_logits(l_vis, tau1, tau2, calibrate)
    l_txt = np.einsum("bhsd,bhtd->bhst", q64, per_head(k_text)) * inv_sqrt_d
    logits = np.concatenate([l_vis, l_txt], axis=-1)
    if mask is not None:
        logits = logits + mask.astype(np.float64)
    logits = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    p_vis, p_txt = p[..., :nv], p[..., nv:]
    if op == OP_TYPE_KIVI:  # (p_vis * v_scale^T) . c_v + p_vis . v_alpha
        y_vis = (np.einsum("bhsn,bhnd->bhsd", p_vis * np.swapaxes(per_head(v_scale), -1, -2), cv)
                 + p_vis @ per_head(v_alpha))
    else:  # v_scale * (p_vis . c_v) + v_alpha * sum(p_vis)
        y_vis = (per_head(v_scale) * np.einsum("bhsn,bhnd->bhsd", p_vis, cv)
                 + per_head(v_alpha) * p_vis.sum(axis=-1, keepdims=True))
    y = y_vis + np.einsum("bhst,bhtd->bhsd", p_txt, per_head(v_text))
    return (y.astype(np.float32),)


def visual_kv_attention_reference(q, k_codes, k_alpha, k_scale, v_codes, v_alpha, v_scale, k_text, v_text,
                                  mask=None, bits=None, tau1=0.0, tau2=0.0, calibrate=1):
    """Numpy reference: the module docstring's formulas (post-scaling, the dequantized cache is
    never formed) computed in float64, the output rounded once to float32. ``mask`` may be None
    (no mask; ReferenceEvaluator passes None for an empty input name). Returns ``(y,)``."""
    return attend(OP_TYPE, q, k_codes, k_alpha, k_scale, v_codes, v_alpha, v_scale, k_text, v_text, mask, bits,
                  tau1, tau2, calibrate)


def visual_kv_attention_kivi_reference(q, k_codes, k_alpha, k_scale, v_codes, v_alpha, v_scale, k_text, v_text,
                                       mask=None, bits=None, tau1=0.0, tau2=0.0, calibrate=1):
    """Numpy reference of ``edgeq::VisualKVAttentionKIVI`` (module ``visual_kv_attention_kivi``,
    whose schema uses it; float64 inside, the output rounded once to float32): VisualKVAttention's
    keys, calibration and softmax, then ``(p_vis * v_scale^T) . c_v + p_vis . v_alpha + p_txt .
    v_text`` with v_alpha / v_scale [B, KVH, Nv, 1]. ``mask`` may be None. Returns ``(y,)``."""
    return attend(OP_TYPE_KIVI, q, k_codes, k_alpha, k_scale, v_codes, v_alpha, v_scale, k_text, v_text, mask,
                  bits, tau1, tau2, calibrate)


# ---------------------------------------------------------------------------------------------
# the function body


def _attr_constant(output: str, attr: str, kind: str) -> onnx.NodeProto:
    """``Constant(value_int|value_float=@attr)``: a scalar holding the op's attribute."""
    node = helper.make_node("Constant", [], [output])
    ref_type = AttributeProto.INT if kind == "int" else AttributeProto.FLOAT
    node.attribute.append(helper.make_attribute_ref(f"value_{kind}", ref_type))
    node.attribute[0].ref_attr_name = attr
    return node


def _const(name: str, dtype: int, values, dims=None) -> onnx.NodeProto:
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    dims = [len(values)] if dims is None else dims
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, dtype, dims, values))


def _unpack(prefix: str, codes: str) -> list[onnx.NodeProto]:
    """uint8 [B, KVH, Nv, D*b/8] -> float32 codes [B, KVH, Nv, D] (``{prefix}_codes_f``)."""
    v = lambda s: f"{prefix}_{s}"  # noqa: E731
    return [
        helper.make_node("Unsqueeze", [codes, "last_axis"], [v("bytes")]),                    # [..., P, 1]
        helper.make_node("BitShift", [v("bytes"), "shifts_u8"], [v("shifted")], direction="RIGHT"),  # [..., P, G]
        helper.make_node("BitwiseAnd", [v("shifted"), "code_mask_u8"], [v("codes_u8")]),
        helper.make_node("Reshape", [v("codes_u8"), "keep3_flatten"], [v("codes_flat")]),     # [..., D]
        helper.make_node("Cast", [v("codes_flat")], [v("codes_f")], to=TensorProto.FLOAT),
    ]


def channelwise_value_nodes() -> list[onnx.NodeProto]:
    """VisualKVAttention's visual values, reading ``p_vis_g`` [B, KVH, rep * S, Nv], ``v_codes_f``
    [B, KVH, Nv, D], ``v_scale`` / ``v_alpha`` [B, KVH, 1, D or 1]: ``o_scaled = v_scale * (p_vis .
    c_v)``, ``o_alpha = v_alpha * sum(p_vis)``."""
    n = helper.make_node
    return [
        n("MatMul", ["p_vis_g", "v_codes_f"], ["o_codes"]),
        n("Mul", ["o_codes", "v_scale"], ["o_scaled"]),
        n("ReduceSum", ["p_vis_g", "last_axis"], ["p_vis_sum"], keepdims=1),
        n("Mul", ["p_vis_sum", "v_alpha"], ["o_alpha"]),
    ]


def attention_function(op_type: str, opset: int, value_nodes: list[onnx.NodeProto], doc: str) -> onnx.FunctionProto:
    """The shared function body of ``op_type`` at default-domain ``opset``; ``value_nodes``
    compute ``o_scaled`` and ``o_alpha`` (broadcasting to [B, KVH, rep * S, D]) from the names
    ``channelwise_value_nodes`` reads; y = o_scaled + o_alpha + p_txt . v_text."""
    i64, f32, u8 = TensorProto.INT64, TensorProto.FLOAT, TensorProto.UINT8
    n = helper.make_node
    nodes = [
        _const("last_axis", i64, [-1]),
        _const("zero_1d", i64, [0]),
        _const("int_max_1d", i64, [2 ** 62]),
        _const("keep3_flatten", i64, [0, 0, 0, -1]),
        _const("zero_i", i64, 0, dims=[]), _const("one_i", i64, 1, dims=[]), _const("eight_i", i64, 8, dims=[]),
        _const("ff_u8", u8, 255, dims=[]),
        _const("zero_f", f32, 0.0, dims=[]), _const("one_f", f32, 1.0, dims=[]),
        # unpacking constants from the bits attribute: G = 8 / b codes per byte, the shifts
        # 8 - b * (i + 1) for i in [0, G), and the code mask 0xFF >> (8 - b) = 2^b - 1
        _attr_constant("bits_i", "bits", "int"),
        n("Div", ["eight_i", "bits_i"], ["group_i"]),
        n("Range", ["zero_i", "group_i", "one_i"], ["slot"]),
        n("Add", ["slot", "one_i"], ["slot_plus_1"]),
        n("Mul", ["slot_plus_1", "bits_i"], ["slot_bits"]),
        n("Sub", ["eight_i", "slot_bits"], ["shifts_i"]),
        n("Cast", ["shifts_i"], ["shifts_u8"], to=u8),
        n("Sub", ["eight_i", "bits_i"], ["mask_shift_i"]),
        n("Cast", ["mask_shift_i"], ["mask_shift_u8"], to=u8),
        n("BitShift", ["ff_u8", "mask_shift_u8"], ["code_mask_u8"], direction="RIGHT"),
        # shapes: B, H, S, D from q; KVH, Nv from k_codes; Nt from k_text
        n("Shape", ["q"], ["q_shape"]),
        n("Shape", ["q"], ["bhs"], start=0, end=3),
        n("Shape", ["q"], ["b_1d"], start=0, end=1),
        n("Shape", ["q"], ["h_1d"], start=1, end=2),
        n("Shape", ["q"], ["s_1d"], start=2, end=3),
        n("Shape", ["q"], ["d_1d"], start=3, end=4),
        n("Shape", ["k_codes"], ["kvh_1d"], start=1, end=2),
        n("Shape", ["k_codes"], ["nv_1d"], start=2, end=3),
        n("Shape", ["k_text"], ["nt_1d"], start=2, end=3),
        n("Div", ["h_1d", "kvh_1d"], ["rep_1d"]),
        n("Mul", ["rep_1d", "s_1d"], ["rs_1d"]),
        # grouped layout [B, KVH, (H / KVH) * S, ·]: query head j = kvh * rep + r uses KV head kvh
        n("Concat", ["b_1d", "kvh_1d", "rs_1d", "d_1d"], ["grouped_d"], axis=0),
        n("Concat", ["b_1d", "kvh_1d", "rs_1d", "nv_1d"], ["grouped_nv"], axis=0),
        n("Concat", ["b_1d", "kvh_1d", "rs_1d", "nt_1d"], ["grouped_nt"], axis=0),
        n("Concat", ["bhs", "nv_1d"], ["heads_nv"], axis=0),
        n("Concat", ["bhs", "nt_1d"], ["heads_nt"], axis=0),
        n("Reshape", ["q", "grouped_d"], ["qg"]),
        n("Cast", ["d_1d"], ["d_f"], to=f32),
        n("Sqrt", ["d_f"], ["sqrt_d"]),
    ]
    nodes += _unpack("k", "k_codes") + _unpack("v", "v_codes")
    nodes += [
        # visual logits by post-scaling: ((q * k_scale) . c_k + q . k_alpha) / sqrt(D)
        n("Mul", ["qg", "k_scale"], ["q_scaled"]),
        n("Transpose", ["k_codes_f"], ["k_codes_t"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q_scaled", "k_codes_t"], ["l_codes"]),
        n("Transpose", ["k_alpha"], ["k_alpha_t"], perm=[0, 1, 3, 2]),
        n("MatMul", ["qg", "k_alpha_t"], ["l_alpha"]),
        n("Add", ["l_codes", "l_alpha"], ["l_vis_raw"]),
        n("Div", ["l_vis_raw", "sqrt_d"], ["l_vis_g"]),
        n("Reshape", ["l_vis_g", "heads_nv"], ["l_vis"]),
        # text logits
        n("Transpose", ["k_text"], ["k_text_t"], perm=[0, 1, 3, 2]),
        n("MatMul", ["qg", "k_text_t"], ["l_txt_raw"]),
        n("Div", ["l_txt_raw", "sqrt_d"], ["l_txt_g"]),
        n("Reshape", ["l_txt_g", "heads_nt"], ["l_txt"]),
        # calibration per (b, h, s) over the visual logits
        n("ReduceMin", ["l_vis", "last_axis"], ["gamma"], keepdims=1),
        n("ReduceMax", ["l_vis", "last_axis"], ["delta"], keepdims=1),
        n("Sub", ["delta", "gamma"], ["range"]),
        n("Greater", ["range", "zero_f"], ["range_positive"]),
        n("Where", ["range_positive", "range", "one_f"], ["range_safe"]),
        _attr_constant("tau1", "tau1", "float"),
        _attr_constant("tau2", "tau2", "float"),
        n("Sub", ["tau1", "tau2"], ["tau_diff"]),
        n("Add", ["range", "tau_diff"], ["new_range"]),
        n("Div", ["new_range", "range_safe"], ["factor"]),
        n("Sub", ["l_vis", "gamma"], ["l_centered"]),
        n("Mul", ["factor", "l_centered"], ["l_stretched"]),
        n("Sub", ["gamma", "tau1"], ["new_gamma"]),
        n("Add", ["l_stretched", "new_gamma"], ["l_calibrated"]),
        _attr_constant("calibrate_i", "calibrate", "int"),
        n("Cast", ["calibrate_i"], ["calibrate_b"], to=TensorProto.BOOL),
        n("And", ["range_positive", "calibrate_b"], ["use_calibrated"]),
        n("Where", ["use_calibrated", "l_calibrated", "l_vis"], ["l_vis_final"]),
        # softmax over [visual, text] + mask
        n("Concat", ["l_vis_final", "l_txt"], ["logits"], axis=-1),
        n("Add", ["logits", "mask"], ["logits_masked"]),
        n("Softmax", ["logits_masked"], ["p"], axis=-1),
        n("Slice", ["p", "zero_1d", "nv_1d", "last_axis"], ["p_vis"]),
        n("Slice", ["p", "nv_1d", "int_max_1d", "last_axis"], ["p_txt"]),
        n("Reshape", ["p_vis", "grouped_nv"], ["p_vis_g"]),
        n("Reshape", ["p_txt", "grouped_nt"], ["p_txt_g"]),
    ]
    nodes += value_nodes  # the visual values: o_scaled, o_alpha
    nodes += [
        n("MatMul", ["p_txt_g", "v_text"], ["o_text"]),
        n("Sum", ["o_scaled", "o_alpha", "o_text"], ["y_g"]),
        n("Reshape", ["y_g", "q_shape"], ["y"]),
    ]
    return helper.make_function(
        DOMAIN, op_type, list(INPUTS), list(OUTPUTS), nodes, [helper.make_opsetid("", opset)],
        attributes=["bits"],
        attribute_protos=[helper.make_attribute(k, v) for k, v in ATTRIBUTE_DEFAULTS.items()],
        doc_string=doc,
    )


def visual_kv_attention_function(opset: int) -> onnx.FunctionProto:
    """The function body, importing the default domain at ``opset`` (valid from 18 on; the
    schema table's ``ensure_functions`` refuses older models)."""
    return attention_function(OP_TYPE, opset, channelwise_value_nodes(), __doc__.split("\n\n")[0])


# ---------------------------------------------------------------------------------------------
# node helper


def make_visual_kv_attention_node(
    q: str, k_codes: str, k_alpha: str, k_scale: str, v_codes: str, v_alpha: str, v_scale: str,
    k_text: str, v_text: str, y: str, bits: int, mask: str | None = None, tau1: float = 0.0,
    tau2: float = 0.0, calibrate: bool = True, name: str | None = None, v_per_token: bool = False,
) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """A VisualKVAttention NodeProto (VisualKVAttentionKIVI when ``v_per_token``: v_alpha /
    v_scale [B, KVH, Nv, 1]; domain edgeq, every attribute written: onnx's ReferenceEvaluator
    does not apply function attribute defaults) plus its initializers: none when ``mask`` names a
    tensor, else one float32 scalar 0 named ``{y}_no_mask`` (an empty name cannot reach the body
    in onnxruntime; see the module docstring)."""
    op_type = OP_TYPE_KIVI if v_per_token else OP_TYPE
    bits = _check_attributes(bits, int(bool(calibrate)), tau1, tau2, op_type)
    inits: list[onnx.TensorProto] = []
    if not mask:
        mask = f"{y}_no_mask"
        inits.append(onnx.numpy_helper.from_array(np.zeros((), np.float32), mask))
    node = helper.make_node(
        op_type, [q, k_codes, k_alpha, k_scale, v_codes, v_alpha, v_scale, k_text, v_text, mask], [y],
        name=name or f"{y}_node", domain=DOMAIN,
        bits=bits, tau1=float(tau1), tau2=float(tau2), calibrate=int(bool(calibrate)))
    return node, inits
