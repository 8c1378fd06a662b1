"""The value layouts beside VisualKVAttention's channel-wise V: the global-V ablation
(``v_alpha`` / ``v_scale`` [B, KVH, 1, 1] into ``edgeq::VisualKVAttention``) and KIVI's per-token
values (``edgeq::VisualKVAttentionKIVI``, [B, KVH, Nv, 1]). For bits 1, 2, 4 and 8, GQA and plain
multi-head, S = 1 and S = 3 with masks, calibration on and off: the numpy reference equals
onnxruntime running the function body (optimizations off and default), onnx's ReferenceEvaluator
running the body, and (bit-exact) the ReferenceEvaluator running the numpy op; the reference
equals a float64 attention over the explicitly dequantized cache; ``quantize_pertoken``; the KIVI
body is VisualKVAttention's but the value nodes; schema entry, node helper and validation.

Tolerances as in ``test_visual_kv_attention_op.py`` (atol = 1e-5 * max|y|; observed here at most
1.8e-6 * max|y|, 3.3e-5 absolute).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from test_visual_kv_attention_op import (
    CONFIGS,
    LEVELS,
    TAUS,
    _assert_close,
    _cache,
    _check_dequantize_then_attend,
    _feeds,
    _model,
    _ort,
    _reference,
)

from edgeq.runtime_ops import (
    DOMAIN,
    SCHEMAS,
    VISUAL_KV_ATTENTION,
    VISUAL_KV_ATTENTION_KIVI,
    reference_evaluator_ops,
)
from edgeq.runtime_ops.visual_kv_attention import (
    INPUTS,
    OP_TYPE,
    OP_TYPE_KIVI,
    channelwise_value_nodes,
    make_visual_kv_attention_node,
    visual_kv_attention_function,
    visual_kv_attention_kivi_reference,
    visual_kv_attention_reference,
)
from edgeq.runtime_ops.visual_kv_attention_kivi import pertoken_value_nodes, visual_kv_attention_kivi_function
from edgeq.runtime_ops.visual_kv_codes import (
    SUPPORTED_BITS,
    dequantize_channelwise,
    pack_codes,
    quantize_channelwise,
    quantize_pertoken,
    unpack_codes,
)

LAYOUTS = ["global", "token"]  # "token" = VisualKVAttentionKIVI


def test_quantize_pertoken():
    """alpha = min and scale = (max - min) / (2^b - 1) per token over the channels; error within
    half a step; each token's extremes are exact; a constant token gets scale 0, codes 0 and
    dequantizes exactly."""
    rng = np.random.default_rng(9)
    x = _cache(rng, (2, 3, 10, 16))
    x[1, 2, 4, :] = -0.25
    for bits in SUPPORTED_BITS:
        codes, alpha, scale = quantize_pertoken(x, bits)
        assert codes.dtype == np.uint8 and codes.shape == x.shape and codes.max() <= 2 ** bits - 1
        assert alpha.shape == scale.shape == (2, 3, 10, 1) and alpha.dtype == scale.dtype == np.float32
        np.testing.assert_array_equal(alpha, x.min(axis=-1, keepdims=True))
        np.testing.assert_allclose(scale, (x.max(-1, keepdims=True) - x.min(-1, keepdims=True)) / (2 ** bits - 1), rtol=1e-6)
        deq = dequantize_channelwise(codes, alpha, scale)
        assert (np.abs(deq - x) <= scale / 2 * (1 + 1e-5) + 1e-6).all()
        assert scale[1, 2, 4, 0] == 0 and not codes[1, 2, 4].any() and (deq[1, 2, 4] == -0.25).all()
        live = scale[..., 0] > 0
        np.testing.assert_array_equal(np.take_along_axis(codes, np.argmax(x, -1)[..., None], -1)[..., 0][live], 2 ** bits - 1)
        np.testing.assert_array_equal(np.take_along_axis(codes, np.argmin(x, -1)[..., None], -1), 0)
        # per token = channel-wise of the transpose
        ct, at, st = quantize_channelwise(np.swapaxes(x, -1, -2), bits)
        np.testing.assert_array_equal(codes, np.swapaxes(ct, -1, -2))
        np.testing.assert_array_equal(scale, np.swapaxes(st, -1, -2))
    with pytest.raises(ValueError, match="quantize_pertoken"):
        quantize_pertoken(np.zeros((2, 3, 0), np.float32), 2)
    with pytest.raises(ValueError, match="bits 3"):
        quantize_pertoken(x, 3)


@pytest.mark.parametrize("calibrate", [1, 0], ids=["calibrated", "uncalibrated"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("v_layout", LAYOUTS)
def test_all_ways_agree(v_layout, bits, config, calibrate):
    feeds = _feeds(**CONFIGS[config], bits=bits, seed=bits, v_layout=v_layout)
    model, node = _model(feeds, bits, tau1=TAUS[0], tau2=TAUS[1], calibrate=bool(calibrate),
                         v_per_token=v_layout == "token")
    assert node.op_type == (OP_TYPE_KIVI if v_layout == "token" else OP_TYPE)
    onnx.checker.check_model(model, full_check=True)
    ref = _reference(feeds, node)
    c = CONFIGS[config]
    assert ref.shape == (c["B"], c["H"], c["S"], c["D"]) and ref.dtype == np.float32 and np.isfinite(ref).all()
    for level in LEVELS:
        _assert_close(_ort(model, feeds, level), ref, err_msg=level)
    _assert_close(ReferenceEvaluator(model).run(None, feeds)[0], ref)
    np.testing.assert_array_equal(ReferenceEvaluator(model, new_ops=reference_evaluator_ops()).run(None, feeds)[0], ref)


@pytest.mark.parametrize("calibrate", [1, 0], ids=["calibrated", "uncalibrated"])
@pytest.mark.parametrize("config", ["mha_s1", "gqa_s1_padding", "gqa_s3_causal"])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("v_layout", LAYOUTS)
def test_equals_dequantize_then_attend(v_layout, bits, config, calibrate):
    """Post-scaled keys and the layout's value formula equal float64 attention over the
    dequantized cache (global: codes * scale + alpha with one range per head; per token:
    c_v[n] * v_scale[n] + v_alpha[n])."""
    _check_dequantize_then_attend(bits, config, calibrate, v_layout)


def test_kivi_values_by_hand():
    """One visual token, no text: p_vis = 1, so y = v_scale[0] * c_v[0] + v_alpha[0], read off
    the output of every runner (bits 4 and 8 unpack through the same body)."""
    for bits, codes in [(4, [3, 10, 15, 0, 5, 12, 0, 15]), (8, [200, 7, 255, 0, 128, 1, 66, 129])]:
        d = len(codes)
        packed = pack_codes(codes, bits).reshape(1, 1, 1, -1)
        feeds = dict(
            q=np.random.default_rng(0).standard_normal((1, 1, 1, d)).astype(np.float32),
            k_codes=packed, k_alpha=np.zeros((1, 1, 1, d), np.float32), k_scale=np.ones((1, 1, 1, d), np.float32),
            v_codes=packed, v_alpha=np.full((1, 1, 1, 1), 0.5, np.float32), v_scale=np.full((1, 1, 1, 1), 2.0, np.float32),
            k_text=np.zeros((1, 1, 0, d), np.float32), v_text=np.zeros((1, 1, 0, d), np.float32),
        )
        expected = (2.0 * np.array(codes, np.float32) + 0.5).reshape(1, 1, 1, d)
        for v_per_token in (True, False):  # [1, 1, 1, 1] is both a per-token (Nv = 1) and a global range
            model, node = _model(feeds, bits, v_per_token=v_per_token)
            for level in LEVELS:
                np.testing.assert_array_equal(_ort(model, feeds, level), expected, err_msg=f"{bits} {level}")
            np.testing.assert_array_equal(ReferenceEvaluator(model).run(None, feeds)[0], expected)
            np.testing.assert_array_equal(_reference(feeds, node), expected)


def test_layouts_differ():
    """The three value layouts of the same cache give different outputs (the ranges reach the
    numbers), and KIVI's per-token values of a cache whose tokens are constant rows are exact."""
    c = CONFIGS["gqa_s1_padding"]
    outs = {}
    for layout in ("channel", "global", "token"):
        feeds = _feeds(**c, bits=2, seed=3, v_layout=layout)
        outs[layout] = _reference(feeds, _model(feeds, 2, v_per_token=layout == "token")[1])
    assert np.abs(outs["channel"] - outs["global"]).max() > 1e-2
    assert np.abs(outs["channel"] - outs["token"]).max() > 1e-2
    rng = np.random.default_rng(1)
    v = np.repeat(rng.standard_normal((1, 2, 6, 1)).astype(np.float32), 16, axis=-1)
    vc, va, vs = quantize_pertoken(v, 1)
    np.testing.assert_array_equal(dequantize_channelwise(vc, va, vs), v)


def test_kivi_body_shares_all_but_the_values():
    """The KIVI function body is VisualKVAttention's with the value nodes swapped."""
    for opset in (18, 21):
        vk, kivi = visual_kv_attention_function(opset), visual_kv_attention_kivi_function(opset)
        n_vk, n_kivi = len(channelwise_value_nodes()), len(pertoken_value_nodes())
        i = next(j for j, n in enumerate(vk.node) if n.output[0] == "o_codes")
        assert vk.node[:i] == kivi.node[:i] and vk.node[i + n_vk:] == kivi.node[i + n_kivi:]
        assert list(kivi.node[i:i + n_kivi]) == pertoken_value_nodes()
        assert (kivi.domain, kivi.name) == (DOMAIN, OP_TYPE_KIVI) and list(kivi.input) == list(INPUTS)
        assert list(kivi.attribute) == list(vk.attribute) and kivi.attribute_proto == vk.attribute_proto


def test_schema_and_node_helper():
    assert (VISUAL_KV_ATTENTION, VISUAL_KV_ATTENTION_KIVI) == (OP_TYPE, OP_TYPE_KIVI) == ("VisualKVAttention", "VisualKVAttentionKIVI")
    vk, kivi = SCHEMAS[OP_TYPE], SCHEMAS[OP_TYPE_KIVI]
    fn = kivi.function_builder(18)
    assert [i.name for i in kivi.inputs] == list(fn.input) == list(INPUTS) == [i.name for i in vk.inputs]
    assert [o.name for o in kivi.outputs] == list(fn.output) == ["y"]
    assert kivi.attributes == vk.attributes and kivi.min_opset == vk.min_opset == 18 and kivi.domain == DOMAIN
    assert kivi.reference is visual_kv_attention_kivi_reference and "1, 2, 4 or 8" in kivi.attributes[0].doc
    node, inits = make_visual_kv_attention_node(*INPUTS[:9], "out", 4, tau1=1, tau2=3, calibrate=False, v_per_token=True)
    assert (node.op_type, node.domain) == (OP_TYPE_KIVI, DOMAIN) and list(node.input[:9]) == list(INPUTS[:9])
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == dict(bits=4, tau1=1.0, tau2=3.0, calibrate=0)
    assert node.input[9] == "out_no_mask" and len(inits) == 1
    assert make_visual_kv_attention_node(*INPUTS[:9], "out", 8)[0].op_type == OP_TYPE
    with pytest.raises(ValueError, match=f"{OP_TYPE_KIVI}: bits 3"):
        make_visual_kv_attention_node(*INPUTS[:9], "out", 3, v_per_token=True)
    # ensure_functions adds the KIVI body (and only the bodies the graph uses)
    feeds = _feeds(**CONFIGS["mha_s1"], bits=8, seed=0, v_layout="token")
    model, _ = _model(feeds, 8, v_per_token=True)
    assert [(f.domain, f.name) for f in model.functions] == [(DOMAIN, OP_TYPE_KIVI)]
    with pytest.raises(ValueError, match="opset >= 18"):
        _model(feeds, 8, opset=17, v_per_token=True)


def _args(v_layout, **over):
    feeds = _feeds(B=1, H=4, KVH=2, S=1, D=16, Nv=5, Nt=2, mask=None, bits=4, v_layout=v_layout)
    feeds.update(over)
    return [feeds[n] for n in INPUTS[:9]]


def test_value_shape_validation():
    """Each op takes its own value layouts only; v_alpha and v_scale must agree; keys stay
    channel-wise in both."""
    channel, global_, token = _args("channel"), _args("global"), _args("token")
    for args in (channel, global_):
        visual_kv_attention_reference(*args, bits=4)
    visual_kv_attention_kivi_reference(*token, bits=4)
    for args in (channel, global_):
        with pytest.raises(ValueError, match=f"{OP_TYPE_KIVI}: v_alpha .* must both be \\(1, 2, 5, 1\\)"):
            visual_kv_attention_kivi_reference(*args, bits=4)
    with pytest.raises(ValueError, match=f"{OP_TYPE}: v_alpha .* must both be"):
        visual_kv_attention_reference(*token, bits=4)
    mixed = channel[:5] + [global_[5], channel[6]] + channel[7:]  # global alpha, channel-wise scale
    with pytest.raises(ValueError, match="v_alpha"):
        visual_kv_attention_reference(*mixed, bits=4)
    per_token_keys = token[:2] + [token[5], token[6]] + token[4:]  # k_alpha / k_scale [B, KVH, Nv, 1]
    with pytest.raises(ValueError, match="k_alpha"):
        visual_kv_attention_kivi_reference(*per_token_keys, bits=4)
    with pytest.raises(ValueError, match=f"{OP_TYPE_KIVI}: bits 3"):
        visual_kv_attention_kivi_reference(*token, bits=3)
    with pytest.raises(ValueError, match="calibrate"):
        visual_kv_attention_kivi_reference(*token, bits=4, calibrate=2)
    with pytest.raises(ValueError, match="k_codes"):
        visual_kv_attention_kivi_reference(*token, bits=8)  # 4-bit packing read as 8-bit: width mismatch
    assert unpack_codes(token[4], 4, 16).shape == (1, 2, 5, 16)
