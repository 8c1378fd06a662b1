"""Read a compiled with-past decoder back as layers: what the onnxruntime-genai form is written from.

Why read instead of re-export: the recipe's passes (fuse-norms, rotate, GPTQ, ...) already ran on
the with-past graph, so its constants ARE edgeq's result: the (possibly rotated) embedding table,
the norm scales that are left, every linear's 4-bit codes and scales, and the online ops a
rotation put in front of a linear (``edgeq::OnlineHadamard`` before down_proj). Attention itself
is not read from the graph: genai's ``GroupQueryAttention`` computes rotary embedding, the cache
update and the softmax from the model's config (head counts, rope theta), which the recipe passes
allowed here never change (``edgeq.genai.MAPPED_PASSES``).

Weights come out in one form, ``QuantWeight`` or a float ``[K, N]`` array: the graph is first put
into the standard DequantizeLinear + MatMul form (``matmulnbits-to-qdq``), so a MatMulNBits
written by GPTQ's lowering and a per-channel DequantizeLinear read the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.errors import UserInputError
from edgeq.structure import analyze

if TYPE_CHECKING:
    from edgeq.structure.norms import Norm

# ops a rotation may put between a linear's source and the linear (replayed as they are)
CHAIN_OPS = frozenset({"OnlineHadamard", "MatMul"})


@dataclass(frozen=True)
class QuantWeight:
    """A 4- or 8-bit weight ``W[k, n] = (q[k, n] - zero_point[b, n]) * scale[b, n]``, ``b = k // group``."""

    q: np.ndarray  # int64 [K, N], signed [-8, 7] or unsigned [0, 15] (8 bits: signed [-128, 127])
    scale: np.ndarray  # float32 [K // group (rounded up), N]
    zero_point: np.ndarray | None  # same shape as scale, or None for 0
    group: int
    signed: bool
    bits: int = 4


def rtn_int8(w: np.ndarray, group: int = 128) -> QuantWeight:
    """Round-to-nearest symmetric int8 in blocks of ``group`` along K (scale = max|w| / 127): for a
    float lm_head, which onnxruntime-genai would otherwise read as 4 bytes a weight every token.
    Blocks of 128, not 32: onnxruntime's 8-bit MatMulNBits kernel at accuracy level 4 runs
    SmolLM2's [576 x 49152] head in 1.48 ms a decode token at block 128 against 1.73 ms at block 32
    under onnxruntime's profiler (benchmarks/results/genai-profile-2026-11-27.json), and int8
    rounding is far below the 4-bit layers' either way (26.747 against 26.721 perplexity)."""
    k, n = w.shape
    pad = -k % group
    blocks = np.pad(w.astype(np.float32), ((0, pad), (0, 0))).reshape(-1, group, n)
    scale = np.abs(blocks).max(axis=1) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(blocks / scale[:, None, :]), -127, 127).astype(np.int64).reshape(-1, n)[:k]
    return QuantWeight(q, scale.astype(np.float32), None, group, True, bits=8)


@dataclass(frozen=True)
class LinearWeights:
    """One linear: its weight (float [K, N] or ``QuantWeight``), bias, and the nodes a rotation
    put in front of it (``chain``, source side first; each reads the previous one's output)."""

    role: str
    k: int
    n: int
    weight: QuantWeight | np.ndarray
    bias: np.ndarray | None = None
    chain: tuple[gs.Node, ...] = ()


@dataclass
class DecoderLayers:
    """A Llama-form decoder read from a compiled graph."""

    embedding: np.ndarray  # [vocab, hidden]
    input_norms: list[np.ndarray] = field(default_factory=list)  # per layer, [hidden]
    post_attention_norms: list[np.ndarray] = field(default_factory=list)
    attention: list[dict[str, LinearWeights]] = field(default_factory=list)  # q_proj, k_proj, v_proj, o_proj
    mlp: list[dict[str, LinearWeights]] = field(default_factory=list)  # gate_proj, up_proj, down_proj
    final_norm: np.ndarray | None = None
    lm_head: LinearWeights | None = None
    eps: float = 1e-6
    activation: str = "silu"


def _const(graph: gs.Graph, name: str | None) -> np.ndarray | None:
    if name is None:
        return None
    tensor = graph.tensors().get(name)
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    if tensor is not None and len(tensor.inputs) == 1 and tensor.inputs[0].op in ("Identity", "Constant"):
        node = tensor.inputs[0]
        if node.op == "Constant":
            return np.asarray(node.attrs["value"].values)
        return _const(graph, node.inputs[0].name)
    return None


def _quant_weight(node: gs.Node, k: int, n: int) -> QuantWeight:
    """The 4-bit weight behind a linear's DequantizeLinear (block along K or per output channel)."""
    dq = node.inputs[1].inputs[0] if node.inputs[1].inputs else None
    if dq is None or dq.op != "DequantizeLinear" or not isinstance(dq.inputs[0], gs.Constant):
        raise UserInputError(f"--target ort-genai: linear {node.name} reads a quantized weight it cannot map "
                             f"(only DequantizeLinear of a constant [K, N] weight)")
    q = np.asarray(dq.inputs[0].values)
    scale = np.asarray(dq.inputs[1].values, np.float32)
    zp = np.asarray(dq.inputs[2].values) if len(dq.inputs) > 2 and isinstance(dq.inputs[2], gs.Constant) else None
    kind = str(dq.inputs[0].dtype)
    if q.shape != (k, n) or "4" not in kind:
        raise UserInputError(f"--target ort-genai: linear {node.name} has a {kind} weight of shape {q.shape}; "
                             f"onnxruntime-genai's MatMulNBits form is written from 4-bit [K, N] weights")
    signed = "uint" not in kind
    block = int(dq.attrs.get("block_size", 0) or 0)
    group: int | None
    if block:  # [ceil(K/G), N] along axis 0
        group, scale = block, scale.reshape(-1, n)
        zp = None if zp is None else zp.reshape(-1, n)
    else:  # per output channel: one block per column, written as blocks of the largest power of two dividing K
        group = next((g for g in (128, 64, 32, 16) if k % g == 0), None)
        if group is None:
            raise UserInputError(f"--target ort-genai: linear {node.name}: K = {k} is not a multiple of 16")
        scale = np.repeat(scale.reshape(1, n), k // group, axis=0)
        zp = None if zp is None else np.repeat(zp.reshape(1, n), k // group, axis=0)
    if zp is not None and not zp.any():
        zp = None
    return QuantWeight(q.astype(np.int64), scale, None if zp is None else zp.astype(np.int64), group, signed)


def _chain(index: ir.GraphIndex, tensor: gs.Tensor, stop: set[str | None]) -> tuple[tuple[gs.Node, ...], gs.Tensor]:
    """The online ops between a linear and its source: (nodes, source side first; the source tensor)."""
    nodes = []
    while tensor.name not in stop:
        node = index.producer(tensor.name)
        if node is None or node.op not in CHAIN_OPS or (node.op == "MatMul" and not isinstance(node.inputs[1], gs.Constant)):
            break
        nodes.append(node)
        tensor = node.inputs[0]
    return tuple(reversed(nodes)), tensor


def _linear(graph: gs.Graph, index: ir.GraphIndex, nodes: dict[str, gs.Node], lin,
            stop: set[str | None]) -> LinearWeights:
    node = nodes[lin.node]
    weight: QuantWeight | np.ndarray
    if lin.quantized:
        weight = _quant_weight(node, lin.k, lin.n)
    else:
        w = _const(graph, lin.weight)
        if w is None:
            raise UserInputError(f"--target ort-genai: the weight of {lin.node} is not a constant")
        weight = np.ascontiguousarray((w.T if lin.weight_transposed else w).astype(np.float32))
    chain, _ = _chain(index, node.inputs[0], stop)
    return LinearWeights(lin.role, lin.k, lin.n, weight, _const(graph, lin.bias), chain)


def _norm_scale(graph: gs.Graph, norm, hidden: int, where: str) -> np.ndarray:
    if norm is None or norm.kind != "rms":
        raise UserInputError(f"--target ort-genai: {where} is not an RMSNorm (Llama-form decoders only)")
    scale = _const(graph, norm.scale)
    if norm.scale is not None and scale is None:
        raise UserInputError(f"--target ort-genai: the scale of {norm.name} is not a constant")
    return np.ones(hidden, np.float32) if scale is None else np.broadcast_to(scale.astype(np.float32), (hidden,)).copy()


def read_decoder(graph: gs.Graph, hidden: int, layers: int) -> DecoderLayers:
    """Every weight genai's Llama form needs, from a compiled graph in DequantizeLinear form."""
    s = analyze(graph)
    index = ir.GraphIndex(graph)
    nodes = {n.name: n for n in graph.nodes}
    embeddings = [e for e in s.embeddings if e.dim == hidden]
    if len(embeddings) != 1:
        raise UserInputError(f"--target ort-genai: expected one token embedding of width {hidden}, found {len(embeddings)}")
    out = DecoderLayers(embedding=cast(np.ndarray, _const(graph, embeddings[0].table)).astype(np.float32))
    attention = sorted(s.attention_blocks, key=lambda b: b.layer)
    mlps = sorted(s.mlp_blocks, key=lambda b: b.layer)
    if len(attention) != layers or len(mlps) != layers:
        raise UserInputError(f"--target ort-genai: found {len(attention)} attention and {len(mlps)} MLP blocks "
                             f"for {layers} layers")
    by_node = {lin.node: lin for lin in s.linears}
    eps: set[float | None] = set()
    for att, mlp in zip(attention, mlps):
        out.input_norms.append(_norm_scale(graph, att.norm, hidden, f"layer {att.layer}'s input norm"))
        out.post_attention_norms.append(_norm_scale(graph, mlp.norm, hidden, f"layer {mlp.layer}'s MLP norm"))
        # (both norms present: _norm_scale refused a missing one)
        eps.update(n.eps for n in cast("tuple[Norm, Norm]", (att.norm, mlp.norm)))
        if set(att.roles) != {"q_proj", "k_proj", "v_proj", "o_proj"}:
            raise UserInputError(f"--target ort-genai: layer {att.layer}'s attention has linears {list(att.roles)}; "
                                 f"separate q/k/v/o projections are mapped")
        if set(mlp.roles) != {"gate_proj", "up_proj", "down_proj"} or not mlp.gated:
            raise UserInputError(f"--target ort-genai: layer {mlp.layer}'s MLP has linears {list(mlp.roles)}; "
                                 f"a gated gate/up/down MLP is mapped")
        stop = {att.input, mlp.input}
        out.attention.append({r: _linear(graph, index, nodes, by_node[n], stop) for n, r in zip(att.linears, att.roles)})
        out.mlp.append({r: _linear(graph, index, nodes, by_node[n], stop) for n, r in zip(mlp.linears, mlp.roles)})
        out.activation = mlp.activation or "silu"
    heads = [lin for lin in s.linears if lin.role == "lm_head"]
    if len(heads) != 1:
        raise UserInputError(f"--target ort-genai: expected one lm_head, found {len(heads)}")
    out.lm_head = _linear(graph, index, nodes, heads[0], set())
    source = _chain(index, nodes[heads[0].node].inputs[0], set())[1]
    while source.inputs and source.inputs[0].op in ("Cast", "Identity"):  # (fuse-norms leaves a float Cast)
        source = source.inputs[0].inputs[0]
    source = source.name
    final = [n for n in s.norms if n.output == source]
    if len(final) != 1:
        raise UserInputError("--target ort-genai: the norm before lm_head was not found")
    out.final_norm = _norm_scale(graph, final[0], hidden, "the final norm")
    eps.add(final[0].eps)
    eps.discard(None)
    if len(eps) > 1:
        raise UserInputError(f"--target ort-genai: the norms use different epsilons {sorted(cast('set[float]', eps))}")
    out.eps = float(cast(float, eps.pop())) if eps else 1e-6  # (None discarded above)
    return out
