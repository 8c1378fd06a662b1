"""Write a decoder read by ``edgeq.genai.layers`` in onnxruntime-genai's graph form.

The form is the one onnxruntime-genai's own model builder writes for Llama on the CPU (read from
``onnxruntime_genai/models/builders/base.py``, 0.18.0), because that is what its runtime and
onnxruntime's fused CPU kernels are made for:

* inputs ``input_ids`` [batch, seq] int64, ``attention_mask`` [batch, total] int64,
  ``past_key_values.%d.key|value`` [batch, kv_heads, past, head]; outputs ``logits`` and
  ``present.%d.key|value``. With ``past_present_share_buffer`` (the builder's setting for
  GroupQueryAttention) genai hands each layer one cache buffer of the whole context that the op
  updates in place: no concatenation, no copy per step.
* ``attention_mask`` -> ``seqlens_k = ReduceSum - 1`` and ``total_sequence_length`` (int32), read
  by every ``com.microsoft::GroupQueryAttention`` (rotary embedding inside the op from cos/sin
  caches of ``[max_positions, head / 2]``, grouped heads without repeating the cache).
* ``SkipSimplifiedLayerNormalization`` fuses each residual add with the next RMSNorm.
* each 4-bit linear is ``com.microsoft::MatMulNBits`` with the ``accuracy_level`` asked for
  (4: the CPU kernel quantizes activations to int8 per block and runs an int8 x int4 GEMM; 0: float
  activations), its codes and scales exactly edgeq's (``pack_matmulnbits``); float linears stay
  ``MatMul``; the online ops a rotation put before a linear are replayed in front of it
  (``edgeq::OnlineHadamard`` as plain Reshape/MatMul with constant shapes: no custom op in the folder).
"""

from __future__ import annotations

import json
import math
from typing import cast

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeq.errors import UserInputError
from edgeq.genai.layers import DecoderLayers, LinearWeights, QuantWeight
from edgeq.passes.methods.matmulnbits import pack_matmulnbits

MS = "com.microsoft"
ONNX_OPSET = 21


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.names: set[str] = set()

    def fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.names:
            i += 1
            name = f"{base}_{i}"
        self.names.add(name)
        return name

    def init(self, name: str, value: np.ndarray) -> str:
        name = self.fresh(name)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        name = self.fresh(name)
        outs = [f"{name}/output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain, **attrs))
        return outs

    def skip_norm(self, branch: str, residual: str, gamma: str, name: str, eps: float) -> tuple[str, str]:
        """``SkipSimplifiedLayerNormalization``: (normed, residual + branch). Its mean and inverse
        standard deviation outputs are left unnamed, as genai's builder writes them: named, the
        kernel computes and stores them (0.70 vs 0.46 ms a SmolLM2 decode step for the 60 nodes)."""
        h, _, _, residual = self.node("SkipSimplifiedLayerNormalization", [branch, residual, gamma], name, outputs=4,
                                      domain=MS, epsilon=eps)
        self.nodes[-1].output[1:3] = ["", ""]
        return h, residual


def _rotary_caches(head: int, theta: float, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of ``position * theta^(-2i/head)``, [positions, head / 2] (HF's default rope)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head, 2, dtype=np.float64) / head))
    angles = np.outer(np.arange(positions, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _pack8(w: QuantWeight) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' 8-bit layout: codes ``q + 128`` as B [N, k_blocks, G] (short last block padded
    with 128, which dequantizes to 0), scales [N, k_blocks]; the default zero point is 128."""
    k, n = w.q.shape
    blocks = -(-k // w.group)
    codes = np.full((blocks * w.group, n), 128, np.uint8)
    codes[:k] = (w.q + 128).astype(np.uint8)
    packed = np.ascontiguousarray(codes.reshape(blocks, w.group, n).transpose(2, 0, 1))
    return packed, np.ascontiguousarray(w.scale.reshape(blocks, n).T.astype(np.float32))


def _pack(w: QuantWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    if w.bits == 8:
        return (*_pack8(w), None)
    return pack_matmulnbits(w.q, w.scale, w.zero_point, w.group, w.signed)


def fused_qkv(att: dict[str, LinearWeights]) -> LinearWeights | None:
    """q, k and v as one linear (outputs side by side), as genai's builder writes them: one GEMV
    per step instead of three. Only when the three are 4-bit with the same grid and no online op."""
    lins = [att[r] for r in ("q_proj", "k_proj", "v_proj")]
    ws = [lin.weight for lin in lins]
    if not all(isinstance(w, QuantWeight) for w in ws) or any(lin.chain or lin.bias is not None for lin in lins):
        return None
    qs = cast("list[QuantWeight]", ws)  # (all QuantWeight: checked above)
    if len({(w.group, w.signed, w.bits, w.zero_point is None) for w in qs}) != 1:
        return None
    zp = None if qs[0].zero_point is None else np.concatenate([w.zero_point for w in qs], axis=1)
    fused = QuantWeight(np.concatenate([w.q for w in qs], axis=1), np.concatenate([w.scale for w in qs], axis=1),
                        zp, qs[0].group, qs[0].signed, qs[0].bits)
    return LinearWeights("qkv_proj", lins[0].k, sum(lin.n for lin in lins), fused)


def _online_hadamard(b: _Builder, x: str, h_k: np.ndarray, h_p: np.ndarray, name: str) -> str:
    """``edgeq::OnlineHadamard`` (y = x (H_k kron H_p) on the last axis) written with the shapes
    genai's activations have, [batch, seq, k * p]: Reshape to [batch, seq, k, p], ``@ H_p``, ``H_k^T @``,
    Reshape back. The op's function body reads its shapes at run time (3 Shape, 3 Slice, a Concat and
    a Transpose every call, 30 times a token): 1.5 ms of a 12.6 ms SmolLM2 decode step, measured
    with onnxruntime's profiler; the constant shapes and a pre-transposed H_k leave the two MatMuls."""
    k, p = int(h_k.shape[0]), int(h_p.shape[0])
    split = b.node("Reshape", [x, b.init(f"{name}.shape_kp", np.array([0, 0, k, p], np.int64))], f"{name}/Reshape")[0]
    z = b.node("MatMul", [split, b.init(f"{name}.h_p", h_p.astype(np.float32))], f"{name}/MatMul_p")[0]
    y = b.node("MatMul", [b.init(f"{name}.h_k_t", np.ascontiguousarray(h_k.T.astype(np.float32))), z], f"{name}/MatMul_k")[0]
    return b.node("Reshape", [y, b.init(f"{name}.shape_d", np.array([0, 0, k * p], np.int64))], f"{name}/Reshape_d")[0]


def _linear(b: _Builder, x: str, lin: LinearWeights, name: str, accuracy_level: int) -> str:
    for i, node in enumerate(lin.chain):  # the rotation's online ops, as the compiled graph has them
        extra = []
        for t in node.inputs[1:]:
            if not hasattr(t, "values"):
                raise UserInputError(f"--target ort-genai: {node.name} before {name} reads a computed tensor")
            extra.append(np.asarray(t.values))
        if node.attrs:
            raise UserInputError(f"--target ort-genai: {node.op} before {name} has attributes it cannot copy")
        if node.op == "OnlineHadamard" and node.domain == "edgeq" and len(extra) == 2:
            x = _online_hadamard(b, x, extra[0], extra[1], f"{name}/pre{i}/OnlineHadamard")
            continue
        inits = [b.init(f"{name}.pre{i}.{t.name}", v) for t, v in zip(node.inputs[1:], extra)]
        x = b.node(node.op, [x, *inits], f"{name}/pre{i}/{node.op}", domain=node.domain or "")[0]
    w = lin.weight
    if isinstance(w, QuantWeight):
        packed, scales, zp = _pack(w)
        inputs = [x, b.init(f"{name}.weight.qweight", packed), b.init(f"{name}.weight.scales", scales)]
        if zp is not None:
            inputs.append(b.init(f"{name}.weight.qzeros", zp))
        y = b.node("MatMulNBits", inputs, f"{name}/MatMulNBits", domain=MS, K=lin.k, N=lin.n, bits=w.bits,
                   block_size=w.group, accuracy_level=accuracy_level)[0]
    else:
        y = b.node("MatMul", [x, b.init(f"{name}.weight", w)], f"{name}/MatMul")[0]
    if lin.bias is not None:
        y = b.node("Add", [y, b.init(f"{name}.bias", lin.bias.astype(np.float32))], f"{name}/Add")[0]
    return y


def build_genai_model(dec: DecoderLayers, config: dict, functions: list, opsets: dict[str, int],
                      accuracy_level: int) -> onnx.ModelProto:
    """The genai-form ``model.onnx`` for ``dec`` (weights inline; save with external data)."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head = int(config.get("head_dim") or hidden // heads)
    layers = len(dec.attention)
    positions = int(config.get("max_position_embeddings", 4096))
    b = _Builder()
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", dec.embedding.shape[0]])]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT,
                                                        ["batch_size", kv_heads, "past_sequence_length", head]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT,
                                                         ["batch_size", kv_heads, "total_sequence_length", head]))
    one = b.init("/model/constants/INT64/[1]", np.array([1], np.int64))
    summed = b.node("ReduceSum", ["attention_mask", one], "/model/attn_mask_reformat/ReduceSum", keepdims=0)[0]
    lengths = b.node("Sub", [summed, one], "/model/attn_mask_reformat/Sub")[0]
    seqlens_k = b.node("Cast", [lengths], "/model/attn_mask_reformat/Sub/Cast", to=TensorProto.INT32)[0]
    shape = b.node("Shape", ["attention_mask"], "/model/attn_mask_reformat/Shape")[0]
    total = b.node("Gather", [shape, b.init("/model/constants/INT64/1", np.array(1, np.int64))],
                   "/model/attn_mask_reformat/Gather", axis=0)[0]
    total_len = b.node("Cast", [total], "/model/attn_mask_reformat/Gather/Cast", to=TensorProto.INT32)[0]
    cos, sin = _rotary_caches(head, float(config.get("rope_theta", 10000.0)), positions)
    cos_cache, sin_cache = b.init("cos_cache", cos), b.init("sin_cache", sin)
    x = b.node("Gather", [b.init("model.embed_tokens.weight", dec.embedding), "input_ids"], "/model/embed_tokens/Gather")[0]
    eps = dec.eps
    residual, branch = x, None
    for i in range(layers):
        p = f"/model/layers.{i}"
        gamma = b.init(f"model.layers.{i}.input_layernorm.weight", dec.input_norms[i])
        if branch is None:
            h = b.node("SimplifiedLayerNormalization", [residual, gamma], f"{p}/input_layernorm/LayerNorm",
                       axis=-1, epsilon=eps, stash_type=1)[0]
        else:
            h, residual = b.skip_norm(branch, residual, gamma, f"{p}/input_layernorm/SkipLayerNorm", eps)
        att = dec.attention[i]
        qkv = fused_qkv(att)
        if qkv is not None:  # packed: GroupQueryAttention splits it (key and value inputs left empty)
            q, k, v = _linear(b, h, qkv, f"{p}/attn/qkv_proj", accuracy_level), "", ""
        else:
            q, k, v = (_linear(b, h, att[r], f"{p}/attn/{r}", accuracy_level) for r in ("q_proj", "k_proj", "v_proj"))
        attn = b.node("GroupQueryAttention",
                      [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k, total_len,
                       cos_cache, sin_cache], f"{p}/attn/GroupQueryAttention", domain=MS,
                      num_heads=heads, kv_num_heads=kv_heads, scale=1.0 / math.sqrt(head), do_rotary=1,
                      rotary_interleaved=0, local_window_size=-1, outputs=3)
        b.nodes[-1].output[1:] = [f"present.{i}.key", f"present.{i}.value"]
        o = _linear(b, attn[0], att["o_proj"], f"{p}/attn/o_proj", accuracy_level)
        gamma = b.init(f"model.layers.{i}.post_attention_layernorm.weight", dec.post_attention_norms[i])
        h, residual = b.skip_norm(o, residual, gamma, f"{p}/post_attention_layernorm/SkipLayerNorm", eps)
        mlp = dec.mlp[i]
        gate = _linear(b, h, mlp["gate_proj"], f"{p}/mlp/gate_proj", accuracy_level)
        up = _linear(b, h, mlp["up_proj"], f"{p}/mlp/up_proj", accuracy_level)
        if dec.activation != "silu":
            raise UserInputError(f"--target ort-genai: MLP activation {dec.activation} is not mapped (silu is)")
        sig = b.node("Sigmoid", [gate], f"{p}/mlp/act_fn/Sigmoid")[0]
        act = b.node("Mul", [gate, sig], f"{p}/mlp/act_fn/Mul")[0]
        prod = b.node("Mul", [act, up], f"{p}/mlp/Mul")[0]
        branch = _linear(b, prod, mlp["down_proj"], f"{p}/mlp/down_proj", accuracy_level)
    # (read_decoder sets final_norm and lm_head; branch is the last layer's down_proj)
    gamma = b.init("model.norm.weight", cast(np.ndarray, dec.final_norm))
    h, _ = b.skip_norm(cast(str, branch), residual, gamma, "/model/norm/SkipLayerNorm", eps)
    logits = _linear(b, h, cast(LinearWeights, dec.lm_head), "/lm_head", accuracy_level)
    b.node("Identity", [logits], "/lm_head/Identity")
    b.nodes[-1].output[0] = "logits"
    graph = helper.make_graph(b.nodes, "edgeq-genai", inputs, outputs, b.inits)
    imports = {"": ONNX_OPSET, MS: 1, **{d: v for d, v in opsets.items() if d not in ("", "ai.onnx", MS)}}
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in imports.items()],
                              producer_name="edgeq", ir_version=10)
    model.functions.extend(f for f in functions if any(n.op_type == f.name and n.domain == f.domain for n in b.nodes))
    return model


def genai_config(config: dict, generation: dict, filename: str = "model.onnx") -> dict:
    """``genai_config.json``, with the keys and values onnxruntime-genai's builder writes for a
    Llama on the CPU (``make_genai_config``); search options from generation_config.json."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    context = int(config.get("max_position_embeddings", 4096))
    pick = lambda key, default: generation.get(key, config.get(key, default))  # noqa: E731
    eos = pick("eos_token_id", None)
    pad = pick("pad_token_id", None)
    return {
        "model": {
            "bos_token_id": pick("bos_token_id", None),
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": int(config.get("head_dim") or hidden // heads),
                "hidden_size": hidden,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": heads,
                "num_hidden_layers": int(config["num_hidden_layers"]),
                "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
            },
            "eos_token_id": eos,
            "pad_token_id": pad if pad is not None else (eos[0] if isinstance(eos, list) else eos),
            "type": config.get("model_type", "llama"),  # genai's own type for the family (llama, qwen2)
            "vocab_size": int(config["vocab_size"]),
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": bool(generation.get("do_sample", False)), "early_stopping": True,
            "length_penalty": 1.0, "max_length": context, "min_length": 0, "no_repeat_ngram_size": 0,
            "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": True,
            "repetition_penalty": float(generation.get("repetition_penalty", 1.0)),
            "temperature": float(generation.get("temperature", 1.0)), "top_k": int(generation.get("top_k", 50)),
            "top_p": float(generation.get("top_p", 1.0)),
        },
    }


def dumps(config: dict) -> str:
    return json.dumps(config, indent=4) + "\n"
