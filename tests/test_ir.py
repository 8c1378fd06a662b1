"""IR helpers: validated loading, external data, atomic outputs, metadata preservation."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeq.graph import ir
from edgeq.files import output_dir
from edgeq.errors import UserInputError


def _model(opset=18):
    w = numpy_helper.from_array(np.arange(64 * 4, dtype=np.float32).reshape(64, 4), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    m.metadata_props.add(key="author", value="test")
    return m


def test_save_uses_external_data_and_round_trips(tmp_path):
    m = _model()
    path = ir.save_model(m, tmp_path / "m" / "model.onnx")
    assert (tmp_path / "m" / "model.onnx.data").stat().st_size == 64 * 4 * 4
    assert m.graph.initializer[0].raw_data  # the caller's proto keeps its data
    back = ir.load_model(path)
    np.testing.assert_array_equal(numpy_helper.to_array(back.graph.initializer[0]), numpy_helper.to_array(m.graph.initializer[0]))


def test_graph_round_trip_keeps_metadata_and_ir_version():
    m = _model()
    back = ir.to_model(ir.to_graph(m))
    assert {p.key: p.value for p in back.metadata_props} == {"author": "test"}
    assert back.ir_version == 9
    assert ir.default_opset(back) == 18


def test_missing_file(tmp_path):
    with pytest.raises(UserInputError, match="not found"):
        ir.load_model(tmp_path / "nope.onnx")


def test_not_onnx(tmp_path):
    p = tmp_path / "x.onnx"
    p.write_text("hello, I am not a model")
    with pytest.raises(UserInputError):
        ir.load_model(p)


def test_truncated(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save_model(_model(), str(p))
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserInputError):
        ir.load_model(p)


def test_missing_external_data(tmp_path):
    path = ir.save_model(_model(), tmp_path / "model.onnx")
    (tmp_path / "model.onnx.data").unlink()
    with pytest.raises(UserInputError, match="missing external data"):
        ir.load_model(path)


def test_external_data_escaping_folder(tmp_path):
    m = _model()
    (tmp_path / "sub").mkdir()
    ir.save_model(m, tmp_path / "model.onnx")
    bad = onnx.load_model(str(tmp_path / "model.onnx"), load_external_data=False)
    for e in bad.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = "../model.onnx.data"
    onnx.save_model(bad, str(tmp_path / "sub" / "model.onnx"))
    with pytest.raises(UserInputError, match="outside"):
        ir.load_model(tmp_path / "sub" / "model.onnx")


def test_opset_check():
    with pytest.raises(UserInputError, match="opset 11"):
        ir.check_opset(_model(opset=11))
    assert ir.check_opset(_model()) == 18


def test_atomic_output_dir_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with output_dir.atomic_output_dir(out) as tmp:
            (tmp / "half.txt").write_text("x")
            raise RuntimeError("boom")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_dir_replaces_on_success(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with output_dir.atomic_output_dir(out, force=True) as tmp:  # (not edgeq's: replaced only when forced)
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_graph_index_lookups():
    g = ir.to_graph(_model())
    idx = ir.GraphIndex(g)
    assert idx.producer("y").name == "mm"
    assert [n.name for n in idx.consumers("x")] == ["mm"]
    assert idx.constant_value(idx.tensors["w"]).shape == (64, 4)
    assert idx.constant_value(idx.tensors["x"]) is None


def test_graph_session_hands_large_constants_over_through_a_file(monkeypatch):
    """Numpy constants and in-memory tensor protos above 1 KB reach onnxruntime as external data
    written from their own buffers; the session computes what the exported model computes and the
    graph keeps its values (the same objects)."""
    import onnx_graphsurgeon as gs
    from onnx_graphsurgeon.ir.tensor import LazyValues

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 300)).astype(np.float32)  # 75 KB numpy
    lazy = LazyValues(numpy_helper.from_array(rng.standard_normal(300).astype(np.float32), "b"))  # 1.2 KB proto
    small = rng.standard_normal((1, 1)).astype(np.float32)  # under the threshold: inline
    x = gs.Variable("x", np.float32, (2, 64))
    y = gs.Variable("y", np.float32, None)
    mm, added = gs.Variable("mm", np.float32, None), gs.Variable("added", np.float32, None)
    w_c, b_c, s_c = gs.Constant("w", w), gs.Constant("b", lazy), gs.Constant("s", small)
    graph = gs.Graph(nodes=[gs.Node("MatMul", inputs=[x, w_c], outputs=[mm]),
                            gs.Node("Add", inputs=[mm, b_c], outputs=[added]),
                            gs.Node("Add", inputs=[added, s_c], outputs=[y])],
                     inputs=[x], outputs=[y], opset=17)
    import contextlib

    written, real = [], ir.constants_as_external_data

    @contextlib.contextmanager
    def spy(graph_, data_path, *args):
        with real(graph_, data_path, *args):
            yield
            written.append(data_path.stat().st_size)

    monkeypatch.setattr(ir, "constants_as_external_data", spy)
    feeds = {"x": rng.standard_normal((2, 64)).astype(np.float32)}
    got = ir.graph_session(graph).run(["y"], feeds)[0]
    assert written and w.nbytes + 1200 <= written[0] < w.nbytes + 1200 + 256  # both large ones, not the small one
    want = ir.make_session(ir.to_model(graph)).run(["y"], feeds)[0]
    np.testing.assert_array_equal(got, want)
    assert w_c._values is w and b_c._values is lazy and s_c._values is small
