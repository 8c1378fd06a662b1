"""``--max-context-mb``: a static graph cut into parts along its residual stream (``edgeq.static.split``).

- the parts, run in sequence on CPU, give the whole graph's outputs exactly (same float ops, same
  order: compared at zero tolerance) for both graphs of the pair, cut at the same tensors;
- each part's weights fit the budget, and a budget one block does not fit is a one-line error
  naming the block;
- cuts take the quantized hidden state where the stream has one (uint16 between parts on the HTP);
- a graph with no single tensor carrying the stream (not a decoder) cannot be split: one line.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgeq.errors import UserInputError
from edgeq.generation.part_chain import PartChain
from edgeq.static.split import boundaries_of, initializer_bytes, split_graph


@pytest.fixture(scope="module")
def tiny_pair(tiny_past, tmp_path_factory):
    """The tiny llama's static pair, compiled with the default recipe for the HTP (CPU only here)."""
    from edgeq.cli import main

    out = tmp_path_factory.mktemp("split") / "pair"
    assert main(["compile", str(tiny_past / "model" / "model.onnx"), "--recipe", "mquant-w8a8", "--calib",
                 str(tiny_past / "calib.txt"), "--seq-len", "32", "--calib-windows", "2", "--no-cache",
                 "--static", "prefill=8,context=48", "--target", "qnn-htp", "-o", str(out)]) == 0
    return out


def _feeds(session) -> dict:
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 200, size=i.shape).astype(np.int64)
        elif "int64" in i.type:
            feeds[i.name] = np.ones(i.shape, np.int64)
        else:
            feeds[i.name] = (rng.standard_normal(i.shape) * 0.1).astype(np.float32)
    return feeds


def _session(model: onnx.ModelProto, folder) -> ort.InferenceSession:
    path = folder / f"{model.graph.name}.onnx"
    onnx.save_model(model, str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _read_once(model: onnx.ModelProto) -> set[str]:
    """Initializers exactly one node reads (a weight's integers); a table several nodes read (the
    online Hadamard matrix every down_proj shares) is held by each part that needs it."""
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    return {t.name for t in model.graph.initializer if readers.get(t.name) == 1}


@pytest.mark.parametrize("budget_kb", [100, 150])
def test_parts_in_sequence_equal_the_whole_graph(tiny_pair, budget_kb):
    cuts = None
    for role in ("prefill", "decode"):
        model = onnx.load(str(tiny_pair / f"{role}.onnx"), load_external_data=False)
        parts = split_graph(model, budget_kb * 1024, role, cuts)
        cuts = boundaries_of(parts)
        assert len(parts) >= 2 and all(p.weight_bytes <= budget_kb * 1024 for p in parts), [p.weight_bytes for p in parts]
        whole = ort.InferenceSession(str(tiny_pair / f"{role}.onnx"), providers=["CPUExecutionProvider"])
        chain = PartChain([_session(p.model, tiny_pair) for p in parts], [p.model.graph.name for p in parts])
        assert sorted(i.name for i in chain.get_inputs()) == sorted(i.name for i in whole.get_inputs())
        assert [o.name for o in chain.get_outputs()] != [] and {o.name for o in chain.get_outputs()} == {
            o.name for o in whole.get_outputs()}
        feeds = _feeds(whole)
        names = [o.name for o in whole.get_outputs()]
        for name, got, want in zip(names, chain.run(names, feeds), whole.run(names, feeds)):
            np.testing.assert_array_equal(got, want, err_msg=f"{role} {name}")
        # every weight is held by exactly one part, but those several blocks read
        large = {t.name for t in model.graph.initializer if initializer_bytes(t) >= 4096}
        held = [{t.name for t in p.model.graph.initializer} & large for p in parts]
        assert set().union(*held) == large
        once = large & _read_once(model)
        assert sum(len(h & once) for h in held) == len(once)
        # each part names the blocks whose weights it holds: in order, block 0 first, the last block
        # (1) last, a block cut in two shared by the neighbours (the embedding and head are no block)
        spans = [[int(b) for b in p.blocks.split("-")] if p.blocks else [] for p in parts]
        ends = [(s[0], s[-1]) for s in spans if s]
        assert ends[0][0] == 0 and ends[-1][1] == 1, [p.blocks for p in parts]
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), [p.blocks for p in parts]


def test_a_block_larger_than_the_budget_is_named(tiny_pair):
    model = onnx.load(str(tiny_pair / "prefill.onnx"), load_external_data=False)
    with pytest.raises(UserInputError, match=r"--max-context-mb 0\.05: block 0 holds .* KB of weights"):
        split_graph(model, int(0.05 * 2**20), "prefill")


def test_cuts_take_the_quantized_hidden_state_when_there_is_one():
    """embedding -> [Q -> DQ -> MatMul(W) -> Add(residual)] x 3 -> logits: the stream between blocks is the
    QuantizeLinear's uint16 output, and that is what the parts hand on."""
    nodes, inits, x = [], [], "embed"
    inits.append(helper.make_tensor("table", TensorProto.FLOAT, [8, 32], np.linspace(-1, 1, 256).tolist()))
    inits += [helper.make_tensor("s", TensorProto.FLOAT, [], [0.01]), helper.make_tensor("z", TensorProto.UINT16, [], [32768])]
    nodes.append(helper.make_node("Gather", ["table", "input_ids"], ["embed"], name="/model/embed_tokens/Gather"))
    for i in range(3):
        w = np.random.default_rng(i).standard_normal((32, 32)).astype(np.float32)
        inits.append(helper.make_tensor(f"w{i}", TensorProto.FLOAT, [32, 32], w.ravel().tolist()))
        nodes += [helper.make_node("QuantizeLinear", [x, "s", "z"], [f"q{i}"], name=f"/model/layers.{i}/Q"),
                  helper.make_node("DequantizeLinear", [f"q{i}", "s", "z"], [f"d{i}"], name=f"/model/layers.{i}/DQ"),
                  helper.make_node("MatMul", [f"d{i}", f"w{i}"], [f"m{i}"], name=f"/model/layers.{i}/MatMul"),
                  helper.make_node("Add", [f"d{i}", f"m{i}"], [f"r{i}"], name=f"/model/layers.{i}/Add")]
        x = f"r{i}"
    nodes.append(helper.make_node("Identity", [x], ["logits"], name="/lm_head"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4, 32])], inits)
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    parts = split_graph(model, 5000, "prefill")  # the 1 KB table, then one 4 KB weight per part
    assert boundaries_of(parts) == ["q0", "q1", "q2"]
    assert [p.weight_bytes for p in parts] == [1024 + 6] + [4096 + 6] * 3  # (+ the activation scale and zero point)
    assert parts[1].model.graph.input[0].type.tensor_type.elem_type == TensorProto.UINT16
    # a part's blocks are those whose weights it holds (the next block's QuantizeLinear it ends on holds none)
    assert [p.blocks for p in parts] == ["", "0", "1", "2"]


def test_a_graph_without_a_single_stream_cannot_be_split():
    """Two branches from input_ids that meet only at the output: no tensor carries everything."""
    inits = [helper.make_tensor("t", TensorProto.FLOAT, [16, 4], np.ones(64).tolist())]
    nodes = [helper.make_node("Gather", ["t", "input_ids"], ["a"]), helper.make_node("Gather", ["t", "input_ids"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 2])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 2, 4])], inits)
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    with pytest.raises(UserInputError, match="cannot be split"):
        split_graph(model, 10, "prefill")
