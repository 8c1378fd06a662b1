"""The structural check at load (``edgeq.graph.modelcheck``, issue 30): a graph it finds invalid (a
cycle, an unknown operator or domain, a wrong input count or type, initializer bytes that do not fit
its type and dims, a name that is not UTF-8) is refused by the one loader every command uses, exit 2
and one line; the domains edgeq knows load. Other bad input: tests/test_input_validation.py.
"""

from __future__ import annotations


import onnx
import pytest
from onnx import TensorProto, helper

from edgeq.graph import ir
from input_cases import COMPILE, _quiet, _refused, _run, _save, _set_initializer, _embedded, _node, toy  # noqa: F401 (fixtures used by name)


# -- 9. the structural check at load (edgeq.graph.modelcheck), one loader for every command ----------------


def _self_loop(m):
    _node(m, "act").input[0] = "h2"


def _two_node_cycle(m):
    _node(m, "fc1").input[0] = "h2"


def _two_writers(m):
    _node(m, "fc1").output[0] = "h0"


def _unknown_op(m):
    _node(m, "act").op_type = "Nope"


def _unknown_domain(m):
    m.opset_import.append(helper.make_opsetid("com.example.nope", 1))
    _node(m, "fc1").domain = "com.example.nope"


def _one_input_quantize(m):
    _node(m, "act").op_type = "QuantizeLinear"


def _type_error(m):  # fc1 -> QuantizeLinear(h0, w1): uint8 into Relu
    _node(m, "fc1").op_type = "QuantizeLinear"


def _output_type(m):  # lm_head -> QuantizeLinear: uint8 where the graph declares float logits
    _node(m, "lm_head").op_type = "QuantizeLinear"


def _init_type(value):
    def mutate(m):
        next(t for t in m.graph.initializer if t.name == "w1").data_type = value
    return mutate


def _init_dims(m):
    t = next(t for t in m.graph.initializer if t.name == "embed")
    del t.dims[:]
    t.dims.extend([1, 2, 3])


@pytest.mark.parametrize("mutate, match", [
    (_self_loop, "node 'act' reads its own output 'h2'"),
    (_two_node_cycle, "the graph has a cycle through node"),
    (_two_writers, "tensor 'h0' is written by two nodes ('embed_gather' and 'fc1')"),
    (_unknown_op, "node 'act' has op_type 'Nope', which is not an operator of the default ONNX domain at opset 18"),
    (_unknown_domain, "node 'fc1' (MatMul) is in domain 'com.example.nope', which neither onnxruntime nor edgeq knows"),
    (_one_input_quantize, "node 'act' (QuantizeLinear) has 1 inputs; QuantizeLinear-13 takes 2 to 3"),
    (_type_error, "the graph does not type-check:"),
    (_output_type, "the graph does not type-check:"),
    (_init_type(99), "initializer 'w1' has data type 99, which is not an ONNX tensor type"),
    (_init_type(0), "initializer 'w1' has data type 0, which is not an ONNX tensor type"),
    (_init_type(TensorProto.DOUBLE), "initializer 'w1' holds 1024 bytes, but DOUBLE [16, 16] needs 2048"),
    (_init_type(TensorProto.STRING), "initializer 'w1' of type STRING has raw_data"),
    (_init_dims, "initializer 'embed' holds 4096 bytes, but FLOAT [1, 2, 3] needs 24"),
], ids=["self-loop", "cycle", "two-writers", "unknown-op", "unknown-domain", "input-count", "input-type",
        "output-type", "dtype-99", "dtype-0", "dtype-bytes", "string-raw", "dims-bytes"])
def test_an_invalid_graph_is_refused_at_load(toy, tmp_path, capsys, mutate, match):
    """What used to get past loading and fail inside a pass or onnxruntime with exit 1."""
    model, calib = toy
    proto = ir.load_model(model)
    mutate(proto)
    path = _embedded(proto, tmp_path / "bad")
    _refused(capsys, "inspect", path, match=match)
    _refused(capsys, "compile", path, *COMPILE, "--calib", calib, "-o", tmp_path / "out", match=match)
    assert not (tmp_path / "out").exists()


def test_external_data_of_the_wrong_length_is_refused(toy, capsys):
    model, _ = toy
    proto = onnx.load_model(str(model), load_external_data=False)
    w1 = next(t for t in proto.graph.initializer if t.name == "w1")
    next(e for e in w1.external_data if e.key == "length").value = "512"  # 16 x 16 floats are 1024 bytes
    onnx.save_model(proto, str(model))
    _refused(capsys, "inspect", model, match="external data of 'w1' in model.onnx.data is 512 bytes long, but its "
                                             "dims [16, 16] and data type need 1024")


def test_a_name_that_is_not_utf8_is_refused(toy, tmp_path, capsys):
    """A flipped byte that still parses: protobuf hands the name back as bytes, not a str."""
    model, calib = toy
    proto = ir.load_model(model)
    _node(proto, "fc1").name = "NAMEX"
    data = proto.SerializeToString().replace(b"NAMEX", b"\xe8AMEX")
    (tmp_path / "bad").mkdir()
    path = tmp_path / "bad" / "model.onnx"
    path.write_bytes(data)
    match = "a NodeProto.name is not valid UTF-8 (b'\\xe8AMEX'): the file is damaged"
    _refused(capsys, "inspect", path, match=match)
    _refused(capsys, "compile", path, *COMPILE, "--calib", calib, "--tokenizer", model.parent, "-o", tmp_path / "out",
             match=match)


def test_every_command_loads_through_the_checked_loader(toy, tmp_path, capsys):
    """eval ppl / compare and generate hand the file to onnxruntime: it is checked first (a graph
    without outputs was an IndexError in eval ppl)."""
    model, calib = toy
    proto = ir.load_model(model)
    del proto.graph.output[:]
    path = _embedded(proto, tmp_path / "no_out")
    match = "the graph has no outputs"
    text = ["--text", calib, "--tokenizer", model.parent, "--seq-len", "16", "--windows", "1"]
    _refused(capsys, "eval", "ppl", path, *text, match=match)
    _refused(capsys, "eval", "ppl", path.parent, *text, match=match)
    _refused(capsys, "eval", "compare", model, path, "--random", "1", match=match)
    _refused(capsys, "eval", "compare", path, model, "--random", "1", "--layers", match=match)
    _refused(capsys, "generate", path.parent, "--prompt", "w1 w2", "--max-new-tokens", "1", match=match)
    _refused(capsys, "check", path, "--target", "generic-qdq", match=match)


def test_domains_edgeq_knows_stay_accepted(tmp_path):
    """com.microsoft (onnxruntime's contrib ops) and edgeq's own ops pass the load check."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
    graph = helper.make_graph([helper.make_node("FastGelu", ["x"], ["y"], domain="com.microsoft", name="gelu")],
                              "ms", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=9)
    (tmp_path / "ms").mkdir()
    onnx.save_model(model, str(tmp_path / "ms" / "model.onnx"))
    assert ir.load_model(tmp_path / "ms" / "model.onnx").graph.node[0].op_type == "FastGelu"
