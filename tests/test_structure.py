"""Structure recognition: exact counts on the tiny exports and SmolLM2, and hand-built graphs for
the weight layouts (Transpose-behind, Gemm transB, Identity, Constant node, DequantizeLinear), tied
embeddings (shared and copied) and every norm form."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeq.graph.ir import load_model, to_graph
from edgeq.structure import analyze, find_blocks, find_linears, find_norms, find_residual_adds, format_structure

F = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _init(name, shape=None, value=None):
    arr = value if value is not None else RNG.standard_normal(shape).astype(np.float32)
    return numpy_helper.from_array(np.asarray(arr), name)


def _graph(nodes, inits, inputs, outputs, opset=18, extra_opsets=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
    return to_graph(helper.make_model(graph, opset_imports=opsets))


def _vi(name, shape, dtype=F):
    return helper.make_tensor_value_info(name, dtype, shape)


def _by_node(linears):
    return {lin.node: lin for lin in linears}


# ---------------------------------------------------------------- tiny exports

# arch -> (linears, role counts, norms by (kind, fused), attention, mlp, residual adds, head tied)
TINY_EXPECTED = {
    "llama": (15, {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "gate_proj": 2, "up_proj": 2,
                   "down_proj": 2, "lm_head": 1}, {("rms", False): 5}, 2, 2, 4, False),
    "qwen2": (15, {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "gate_proj": 2, "up_proj": 2,
                   "down_proj": 2, "lm_head": 1}, {("rms", False): 5}, 2, 2, 4, False),
    "qwen3": (15, {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "gate_proj": 2, "up_proj": 2,
                   "down_proj": 2, "lm_head": 1}, {("rms", False): 9}, 2, 2, 4, False),  # + per-head q/k norms
    "gemma2": (15, {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "gate_proj": 2, "up_proj": 2,
                    "down_proj": 2, "lm_head": 1}, {("rms", False): 9}, 2, 2, 4, True),  # sandwich norms
    "gemma3": (15, {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "gate_proj": 2, "up_proj": 2,
                    "down_proj": 2, "lm_head": 1}, {("rms", False): 13}, 2, 2, 4, True),  # sandwich + q/k norms
    "phi3": (9, {"qkv": 2, "o_proj": 2, "gate_up_proj": 2, "down_proj": 2, "lm_head": 1}, {("rms", False): 5},
             2, 2, 4, False),
    "opt": (13, {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "fc1": 2, "fc2": 2, "lm_head": 1},
            {("layer", True): 5}, 2, 2, 4, False),
    "phi": (13, {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "fc1": 2, "fc2": 2, "lm_head": 1},
            {("layer", True): 3}, 2, 2, 4, False),  # parallel block: one norm, one add of two branches
    "gpt2": (9, {"qkv": 2, "o_proj": 2, "fc1": 2, "fc2": 2, "lm_head": 1}, {("layer", True): 5}, 2, 2, 4, True),
    "bert": (14, {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "fc1": 2, "fc2": 2, "linear": 1,
                  "lm_head": 1}, {("layer", True): 6}, 2, 2, 4, True),
    "vit": (13, {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "fc1": 2, "fc2": 2, "classifier": 1},
            {("layer", True): 5}, 2, 2, 4, None),
}


@pytest.fixture(scope="module")
def tiny_structures(tiny_models):
    graphs = {arch: to_graph(load_model(path)) for arch, path in tiny_models.items()}
    return {arch: (graph, analyze(graph)) for arch, graph in graphs.items()}


@pytest.mark.parametrize("arch", sorted(TINY_EXPECTED))
def test_tiny_counts(tiny_structures, arch):
    _, s = tiny_structures[arch]
    n_lin, roles, norms, n_attn, n_mlp, n_res, tied = TINY_EXPECTED[arch]
    assert len(s.linears) == n_lin
    assert s.role_counts() == roles
    assert dict(Counter((n.kind, n.fused) for n in s.norms)) == norms
    assert len(s.attention_blocks) == n_attn
    assert len(s.mlp_blocks) == n_mlp
    assert s.num_layers == 2
    assert len(s.residual_adds) == n_res
    assert all(lin.role_source == "structure" for lin in s.linears if lin.role != "linear")
    heads = [lin for lin in s.linears if lin.role in ("lm_head", "classifier")]
    assert len(heads) == 1
    if tied is not None:
        assert (heads[0].tied_embedding is not None) is tied


@pytest.mark.parametrize("arch", sorted(TINY_EXPECTED))
def test_tiny_blocks_are_consistent(tiny_structures, arch):
    """Every block has its input norm, attention blocks see q/k/v/o, MLP blocks up and down, and
    each layer's residual adds come from that layer's blocks."""
    _, s = tiny_structures[arch]
    by_node = _by_node(s.linears)
    for block in s.blocks:
        assert block.norm is not None, block
        assert block.norm.kind == ("rms" if arch in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3") else "layer")
        for name in block.linears:
            assert by_node[name].block == block.name and by_node[name].layer == block.layer
        if block.kind == "attention":
            assert block.softmax and block.qk_matmul and block.pv_matmul
            assert block.roles[-1] == "o_proj"
        else:
            assert block.roles[-1] in ("down_proj", "fc2")
    assert Counter((r.block, r.kind) for r in s.residual_adds) == Counter(
        (b.name, b.kind) for b in s.blocks)


@pytest.mark.parametrize("arch,activation,gated", [
    ("llama", "silu", True), ("qwen2", "silu", True), ("qwen3", "silu", True), ("gemma2", "gelu_tanh", True),
    ("gemma3", "gelu_tanh", True), ("phi3", "silu", True), ("opt", "relu", False), ("phi", "gelu_tanh", False),
    ("gpt2", "gelu_tanh", False),
    ("bert", "gelu", False), ("vit", "gelu", False)])
def test_tiny_mlp_activation(tiny_structures, arch, activation, gated):
    _, s = tiny_structures[arch]
    assert {(b.activation, b.gated) for b in s.mlp_blocks} == {(activation, gated)}


def test_tiny_shapes_and_bias(tiny_structures):
    """K x N follow the tiny configs (hidden 64, ffn 128, 4 heads / 2 KV heads, vocab 256)."""
    _, llama = tiny_structures["llama"]
    dims = {lin.role: (lin.k, lin.n) for lin in llama.linears}
    assert dims == {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
                    "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64), "lm_head": (64, 256)}
    assert all(lin.bias is None for lin in llama.linears)
    _, qwen2 = tiny_structures["qwen2"]
    assert {lin.role for lin in qwen2.linears if lin.bias is not None} == {"q_proj", "k_proj", "v_proj"}
    _, gpt2 = tiny_structures["gpt2"]
    gemms = [lin for lin in gpt2.linears if lin.op == "Gemm"]
    assert len(gemms) == 8 and all(lin.bias is not None and lin.bias_add is None for lin in gemms)
    head = next(lin for lin in gpt2.linears if lin.role == "lm_head")
    assert head.weight_transposed and (head.k, head.n) == (64, 256)


def test_format_structure_lists_blocks(tiny_structures):
    _, s = tiny_structures["llama"]
    text = format_structure(s)
    assert "linears: 15" in text and "norms: 5" in text and "residual adds: 4" in text
    assert "layers.1   attention" in text
    assert "gate_proj 64x128" in text
    assert len(text.splitlines()) == 6 + 4 + 1  # header (with 1 embedding), 4 blocks, the lm_head


def test_find_wrappers_agree_with_analyze(tiny_structures):
    graph, s = tiny_structures["qwen2"]
    assert find_linears(graph) == list(s.linears)
    assert find_norms(graph) == list(s.norms)
    assert find_blocks(graph) == list(s.blocks)
    assert find_residual_adds(graph) == list(s.residual_adds)


def _qdq_everything(graph, linears):
    """What the QDQ pass leaves behind: Q/DQ on each linear's input, an int8 weight behind DQ."""
    import onnx_graphsurgeon as gs

    nodes = {n.name: n for n in graph.nodes}
    for i, lin in enumerate(linears):
        node = nodes[lin.node]
        scale, zero = gs.Constant(f"s{i}", np.array(0.1, np.float32)), gs.Constant(f"z{i}", np.array(0, np.int8))
        q, dq, wdq = gs.Variable(f"q{i}", np.int8), gs.Variable(f"dq{i}", np.float32), gs.Variable(f"wdq{i}", np.float32)
        wq = gs.Constant(f"wq{i}", np.ones((lin.k, lin.n), np.int8))
        graph.nodes += [gs.Node("QuantizeLinear", f"Q{i}", inputs=[node.inputs[0], scale, zero], outputs=[q]),
                        gs.Node("DequantizeLinear", f"DQ{i}", inputs=[q, scale, zero], outputs=[dq]),
                        gs.Node("DequantizeLinear", f"WDQ{i}", inputs=[wq, scale, zero], outputs=[wdq])]
        node.inputs[0], node.inputs[1] = dq, wdq


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_structure_survives_qdq(tiny_models, arch):
    """After quantization every linear is still found (flagged, and hidden from the default
    ``find_linears``) with the same role, block and norm; nodes appended out of order are fine."""
    graph = to_graph(load_model(tiny_models[arch]))
    before = analyze(graph)
    _qdq_everything(graph, before.linears)
    after = analyze(graph)
    assert find_linears(graph) == []
    assert all(lin.quantized for lin in after.linears)
    assert [(a.node, a.role, a.block) for a in after.linears] == [(b.node, b.role, b.block) for b in before.linears]
    assert [(b.kind, b.roles, b.norm.name) for b in after.blocks] == [(b.kind, b.roles, b.norm.name) for b in before.blocks]
    assert len(after.residual_adds) == len(before.residual_adds)


# ---------------------------------------------------------------- hand-built linears


def test_weight_layouts():
    """Plain, Transpose-behind, Identity-behind, Constant-node, Gemm transB and Gemm behind a
    Transpose with transB (the two cancel); activation-only and integer MatMuls are not linears."""
    w_kn, w_nk = RNG.standard_normal((8, 4)).astype(np.float32), RNG.standard_normal((4, 8)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W_kn"], ["a"], name="plain"),
        helper.make_node("Transpose", ["W_nk"], ["W_nk_t"], name="tr", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "W_nk_t"], ["b"], name="behind_transpose"),
        helper.make_node("Identity", ["W_kn"], ["W_id"], name="id"),
        helper.make_node("MatMul", ["x", "W_id"], ["c"], name="behind_identity"),
        helper.make_node("Constant", [], ["W_const"], name="const", value=numpy_helper.from_array(w_kn)),
        helper.make_node("MatMul", ["x", "W_const"], ["d"], name="constant_node"),
        helper.make_node("Gemm", ["x", "W_nk", "bias4"], ["e"], name="gemm_transB", transB=1),
        helper.make_node("Gemm", ["x", "W_nk_t", "bias8"], ["f"], name="gemm_transpose_transB", transB=1),
        helper.make_node("MatMul", ["x", "y"], ["g"], name="two_activations"),
        helper.make_node("MatMul", ["xi", "W_int"], ["h"], name="integer"),
    ]
    inits = [_init("W_kn", value=w_kn), _init("W_nk", value=w_nk), _init("bias4", (4,)), _init("bias8", (8,)),
             numpy_helper.from_array(np.ones((8, 4), np.int32), "W_int")]
    inputs = [_vi("x", [2, 8]), _vi("y", [8, 3]), _vi("xi", [2, 8], TensorProto.INT32)]
    outputs = [_vi(n, None) for n in "abcdefg"] + [_vi("h", None, TensorProto.INT32)]
    lins = _by_node(find_linears(_graph(nodes, inits, inputs, outputs)))
    assert set(lins) == {"plain", "behind_transpose", "behind_identity", "constant_node", "gemm_transB",
                         "gemm_transpose_transB"}
    expect = {  # node -> (weight, weight_transposed, k, n, bias)
        "plain": ("W_kn", False, 8, 4, None),
        "behind_transpose": ("W_nk", True, 8, 4, None),
        "behind_identity": ("W_kn", False, 8, 4, None),
        "constant_node": ("W_const", False, 8, 4, None),
        "gemm_transB": ("W_nk", True, 8, 4, "bias4"),
        "gemm_transpose_transB": ("W_nk", False, 4, 8, "bias8"),
    }
    for name, (weight, transposed, k, n, bias) in expect.items():
        lin = lins[name]
        assert (lin.weight, lin.weight_transposed, lin.k, lin.n, lin.bias) == (weight, transposed, k, n, bias), name
    assert lins["behind_transpose"].weight_input == "W_nk_t"
    assert lins["behind_identity"].weight_input == "W_id"


def test_matmul_bias_add_and_quantized_weight():
    """A following Add of a [N] constant is the bias; a DequantizeLinear weight is reported only
    on request and flagged ``quantized``."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"], name="mm"),
        helper.make_node("Add", ["b", "mm"], ["out"], name="bias_add"),
        helper.make_node("DequantizeLinear", ["Wq", "s", "zp"], ["Wdq"], name="dq", axis=1),
        helper.make_node("MatMul", ["x", "Wdq"], ["q_out"], name="quantized_mm"),
    ]
    inits = [_init("W", (8, 4)), _init("b", (4,)), numpy_helper.from_array(np.ones((8, 4), np.int8), "Wq"),
             _init("s", value=np.full((4,), 0.1, np.float32)), numpy_helper.from_array(np.zeros(4, np.int8), "zp")]
    graph = _graph(nodes, inits, [_vi("x", [2, 8])], [_vi("out", None), _vi("q_out", None)])
    default = find_linears(graph)
    assert [lin.node for lin in default] == ["mm"]
    assert (default[0].bias, default[0].bias_add, default[0].output) == ("b", "bias_add", "out")
    everything = _by_node(find_linears(graph, include_quantized=True))
    assert everything["quantized_mm"].quantized and everything["quantized_mm"].weight == "Wq"
    assert (everything["quantized_mm"].k, everything["quantized_mm"].n) == (8, 4)


def _lm_graph(head_weight_nodes, head_input, inits):
    """ids -> Gather(E) -> h; logits = h @ head: the smallest tied-embedding graph."""
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"), *head_weight_nodes,
             helper.make_node("MatMul", ["h", head_input], ["logits"], name="head")]
    return _graph(nodes, inits, [_vi("ids", [1, 3], TensorProto.INT64)], [_vi("logits", None)])


def test_tied_embedding_shared_table():
    table = RNG.standard_normal((32, 8)).astype(np.float32)
    graph = _lm_graph([helper.make_node("Transpose", ["E"], ["Et"], name="tr")], "Et", [_init("E", value=table)])
    (head,) = find_linears(graph)
    assert (head.role, head.tied_embedding, head.tied_copy) == ("lm_head", "embed", False)
    assert (head.weight, head.weight_transposed, head.k, head.n) == ("E", True, 8, 32)


def test_tied_embedding_value_copy_and_untied():
    table = RNG.standard_normal((32, 8)).astype(np.float32)
    copy = _lm_graph([], "H", [_init("E", value=table), _init("H", value=table.T.copy() + 1e-6)])
    (head,) = find_linears(copy)
    assert (head.role, head.tied_embedding, head.tied_copy) == ("lm_head", "embed", True)
    untied = _lm_graph([], "H", [_init("E", value=table), _init("H", (8, 32))])
    (head,) = find_linears(untied)
    assert (head.role, head.tied_embedding) == ("lm_head", None)  # N == vocab: still the LM head


def test_classifier_head_and_name_fallback():
    """A head whose N is not the vocabulary is a classifier; a lone inner linear falls back to its
    name only as a hint."""
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="/enc/q_proj/MatMul"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("ReduceSum", ["r"], ["pooled"], name="pool", keepdims=1),
             helper.make_node("Gemm", ["pooled", "W2"], ["logits"], name="cls", transB=1)]
    graph = _graph(nodes, [_init("W1", (8, 8)), _init("W2", (3, 8))], [_vi("x", [2, 8])], [_vi("logits", None)])
    lins = _by_node(find_linears(graph))
    assert (lins["cls"].role, lins["cls"].role_source) == ("classifier", "structure")
    assert (lins["/enc/q_proj/MatMul"].role, lins["/enc/q_proj/MatMul"].role_source) == ("q_proj", "name")


# ---------------------------------------------------------------- hand-built norms


def _rms_nodes(x, out, recip="div", cast=True):
    nodes = [helper.make_node("Pow", [x, "two"], ["sq"], name="pow"),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], name="mean", keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"], name="add_eps"),
             helper.make_node("Sqrt", ["mse"], ["rms"], name="sqrt")]
    if recip == "div":
        nodes.append(helper.make_node("Div", ["one", "rms"], ["inv"], name="inv"))
    else:
        nodes.append(helper.make_node("Reciprocal", ["rms"], ["inv"], name="inv"))
    nodes.append(helper.make_node("Mul", [x, "inv"], ["normed"], name="normalize"))
    if cast:
        nodes.append(helper.make_node("Cast", ["normed"], ["normed_c"], name="cast", to=F))
    nodes.append(helper.make_node("Mul", ["gamma", "normed_c" if cast else "normed"], [out], name="gamma_mul"))
    return nodes


_NORM_INITS = [_init("two", value=np.float32(2.0)), _init("axes", value=np.array([-1], np.int64)),
               _init("eps", value=np.float32(1e-6)), _init("one", value=np.float32(1.0)), _init("gamma", (8,)),
               _init("beta", (8,))]


@pytest.mark.parametrize("recip,cast", [("div", True), ("reciprocal", False)])
def test_decomposed_rms_norm(recip, cast):
    graph = _graph(_rms_nodes("x", "y", recip, cast), _NORM_INITS, [_vi("x", [2, 8])], [_vi("y", None)])
    (norm,) = find_norms(graph)
    assert (norm.kind, norm.fused, norm.input, norm.output, norm.scale, norm.bias) == ("rms", False, "x", "y", "gamma", None)
    assert norm.eps == pytest.approx(1e-6) and norm.axis == -1
    assert norm.nodes[0] == "pow" and norm.nodes[-1] == "gamma_mul" and ("cast" in norm.nodes) == cast
    assert norm.scale_node == "gamma_mul"


def test_decomposed_layer_norm():
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["mu"], name="mean"),
             helper.make_node("Sub", ["x", "mu"], ["d"], name="sub"),
             helper.make_node("Pow", ["d", "two"], ["d2"], name="pow"),
             helper.make_node("ReduceMean", ["d2", "axes"], ["var"], name="var"),
             helper.make_node("Add", ["var", "eps"], ["var_e"], name="add_eps"),
             helper.make_node("Sqrt", ["var_e"], ["std"], name="sqrt"),
             helper.make_node("Div", ["d", "std"], ["normed"], name="div"),
             helper.make_node("Mul", ["normed", "gamma"], ["scaled"], name="gamma_mul"),
             helper.make_node("Add", ["scaled", "beta"], ["y"], name="beta_add")]
    graph = _graph(nodes, _NORM_INITS, [_vi("x", [2, 8])], [_vi("y", None)])
    (norm,) = find_norms(graph)
    assert (norm.kind, norm.fused, norm.input, norm.output) == ("layer", False, "x", "y")
    assert (norm.scale, norm.bias, norm.bias_node) == ("gamma", "beta", "beta_add")
    assert norm.nodes == ("mean", "sub", "pow", "var", "add_eps", "sqrt", "div", "gamma_mul", "beta_add")


def test_fused_norms():
    ms = "com.microsoft"
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["a"], name="ln", epsilon=1e-5),
        helper.make_node("RMSNormalization", ["a", "gamma"], ["b"], name="rms", epsilon=1e-6),
        helper.make_node("SimplifiedLayerNormalization", ["b", "gamma"], ["c"], name="sln", domain=ms, epsilon=1e-6),
        helper.make_node("SkipLayerNormalization", ["c", "x", "gamma", "beta"], ["d"], name="skip_ln", domain=ms),
        helper.make_node("SkipSimplifiedLayerNormalization", ["d", "x", "gamma"], ["e"], name="skip_sln",
                         domain=ms, epsilon=1e-6),
    ]
    graph = _graph(nodes, _NORM_INITS, [_vi("x", [2, 8])], [_vi("e", None)], opset=23, extra_opsets=[(ms, 1)])
    norms = {n.name: n for n in find_norms(graph)}
    assert {k: (n.kind, n.fused, n.op) for k, n in norms.items()} == {
        "ln": ("layer", True, "LayerNormalization"), "rms": ("rms", True, "RMSNormalization"),
        "sln": ("rms", True, "SimplifiedLayerNormalization"), "skip_ln": ("layer", True, "SkipLayerNormalization"),
        "skip_sln": ("rms", True, "SkipSimplifiedLayerNormalization")}
    assert (norms["ln"].scale, norms["ln"].bias, norms["ln"].eps) == ("gamma", "beta", pytest.approx(1e-5))
    assert (norms["skip_ln"].input, norms["skip_ln"].skip, norms["skip_ln"].bias) == ("c", "x", "beta")
    assert norms["skip_sln"].bias is None and norms["skip_sln"].eps == pytest.approx(1e-6)
    assert find_residual_adds(graph) == []  # no block feeds the skips here


# ---------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_smollm2_structure(smollm2_dir):
    graph = to_graph(load_model(smollm2_dir / "model.onnx"))
    start = time.perf_counter()
    s = analyze(graph)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"analyze took {elapsed:.2f}s"
    assert len(s.linears) == 30 * 7 + 1
    roles = {r: 30 for r in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    assert s.role_counts() == {**roles, "lm_head": 1}
    assert len(s.norms) == 61 and all(n.kind == "rms" and not n.fused and n.scale for n in s.norms)
    assert len(s.residual_adds) == 60
    assert (len(s.attention_blocks), len(s.mlp_blocks), s.num_layers) == (30, 30, 30)
    dims = {(lin.role, lin.k, lin.n) for lin in s.linears}
    assert dims == {("q_proj", 576, 576), ("k_proj", 576, 192), ("v_proj", 576, 192), ("o_proj", 576, 576),
                    ("gate_proj", 576, 1536), ("up_proj", 576, 1536), ("down_proj", 1536, 576),
                    ("lm_head", 576, 49152)}
    (head,) = [lin for lin in s.linears if lin.role == "lm_head"]
    assert head.tied_embedding is not None and head.block is None
    # Blocks are numbered by data flow; the exporter's names must agree (a check, not the mechanism).
    for lin in s.linears:
        if lin.block is not None:
            assert f"/{lin.block}/" in lin.node
    assert all(b.norm is not None for b in s.blocks)
