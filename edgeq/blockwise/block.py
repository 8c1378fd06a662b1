"""One block as a model of its own: prologue -> layer i -> epilogue, its weights read straight from
the external data file into numpy, small stand-ins for the vocabulary tables it does not use."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from edgeq.graph import facts
from edgeq.blockwise.partition import Partition
from edgeq.errors import UserInputError
from edgeq.graph.protowalk import upstream

# prologue/epilogue tables at least this large get a stand-in between the first and last blocks
STUB_ELEMENTS = 1 << 20
STUB_ROWS = 64


def read_array(tensor: TensorProto, base_dir: Path) -> np.ndarray:
    """The values of an initializer, read straight from its external file into numpy (no bytes
    copy on the way) when it has one."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return onnx.numpy_helper.to_array(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    count = int(np.prod(tensor.dims, dtype=np.int64))
    path = base_dir / info["location"]
    values = np.fromfile(path, dtype=dtype, count=count, offset=int(info.get("offset", 0)))
    if values.size != count:
        offset = int(info.get("offset", 0))
        raise UserInputError(f"external data file {path.name} is truncated: tensor '{tensor.name}' needs bytes "
                             f"{offset}..{offset + count * dtype.itemsize} but the file has {path.stat().st_size}")
    return values.reshape(tuple(tensor.dims))


def _embedding_side(graph: onnx.GraphProto, stream_in: str) -> set[int]:
    """Positions of the nodes computing the stream's first tensor (the embedding lookup and
    anything between it and the first block)."""
    return upstream(graph.node, [stream_in])


def stand_in(tensor: TensorProto) -> np.ndarray:
    """A small table of the same rank and type: its largest dimension (the vocabulary) cut to
    ``STUB_ROWS``. Seeded, so every block sees the same stand-in."""
    dims = list(tensor.dims)
    axis = int(np.argmax(dims))
    dims[axis] = min(dims[axis], STUB_ROWS)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return (np.random.default_rng(0).standard_normal(dims) * 0.02).astype(dtype)


def _clamp_stand_in_lookups(g: onnx.GraphProto, stand_ins: set[str], embedding_side: set[int], inputs) -> None:
    """An embedding lookup into a stand-in table gets its token ids clamped to the stand-in's rows:
    a block fed the carried states does not use the lookup's values, but a graph may still compute
    it (gemma2 reads the batch and sequence sizes off the embedding's output) and real ids would be
    out of the stand-in's bounds."""
    dtypes = {t.name: t.type.tensor_type.elem_type for t in inputs}
    nodes = []
    for k, node in enumerate(g.node):
        if k in embedding_side and node.op_type == "Gather" and node.input[0] in stand_ins:
            ids = node.input[1]
            limit = f"{node.name or ids}__stand_in_last_row"
            dtype = dtypes.get(ids, TensorProto.INT64)
            g.initializer.append(onnx.numpy_helper.from_array(
                np.array(STUB_ROWS - 1, onnx.helper.tensor_dtype_to_np_dtype(dtype)), limit))
            clamped = onnx.helper.make_node("Min", [ids, limit], [f"{limit}__ids"], name=f"{limit}__clamp")
            nodes.append(clamped)
            node.input[1] = clamped.output[0]
        nodes.append(node)
    copies = [onnx.NodeProto.FromString(n.SerializeToString()) for n in nodes]
    del g.node[:]
    g.node.extend(copies)


def _declared(name: str, data_type: int, dims) -> TensorProto:
    """An initializer with its name, type and shape but no data (the graph gets numpy values)."""
    t = TensorProto()
    t.name, t.data_type = name, data_type
    t.dims.extend(dims)
    return t


def _tensor_numel(tensor: TensorProto) -> int:
    return int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1


def block_graph(skeleton: onnx.ModelProto, part: Partition, i: int, base_dir: Path):
    """``block_model`` imported into graphsurgeon, each weight read once, into numpy."""
    from edgeq.graph import ir

    model, values = block_model(skeleton, part, i, base_dir)
    graph = ir.to_graph(model)
    for name, tensor in graph.tensors().items():
        if name in values:
            tensor.values = values.pop(name)
    return graph


def block_model(skeleton: onnx.ModelProto, part: Partition, i: int, base_dir: Path) -> tuple[onnx.ModelProto, dict]:
    """Layer ``i`` between the prologue and the epilogue, as a one-layer model whose initializers
    are declared without data, and their values by name (stand-ins for the large
    prologue/epilogue tables where this block does not use them)."""
    graph = skeleton.graph
    nodes = graph.node
    last = part.num_layers - 1
    layer, epi = set(part.layers[i]), set(part.epilogue)
    chosen = sorted(set(part.prologue) | set(part.support[i]) | layer | epi)
    model = onnx.ModelProto()
    model.ir_version = skeleton.ir_version
    model.producer_name, model.producer_version = skeleton.producer_name, skeleton.producer_version
    model.opset_import.extend(skeleton.opset_import)
    model.metadata_props.extend(skeleton.metadata_props)
    model.functions.extend(skeleton.functions)
    g = model.graph
    g.name = graph.name
    rename_in = {part.stream[i]: part.stream[0]} if i > 0 else {}
    rename_out = {part.stream[-1]: part.stream[i + 1]} if i < last else {}
    used = set()
    for k in chosen:
        node = g.node.add()
        node.CopyFrom(nodes[k])
        mapping = rename_in if k in layer else rename_out if k in epi else {}
        for j, name in enumerate(node.input):
            if name in mapping:
                node.input[j] = mapping[name]
        used.update(node.input)
    # Large tables read only by the prologue/epilogue (embedding, head) get small stand-ins where
    # this block's result does not use them: the head before the last block, the embedding after
    # the first (later blocks are fed the carried states). A tied table read on both sides is
    # split: the side that keeps it reads the real one, the other a stand-in of its own name.
    inner_reads = {name for k in set(part.support[i]) | layer for name in nodes[k].input}
    tables = {t.name for t in graph.initializer if t.name in used and t.name not in inner_reads
              and _tensor_numel(t) >= STUB_ELEMENTS}
    real_side = "both" if last == 0 else "embedding" if i == 0 else "head" if i == last else "none"
    stand_ins: dict[str, str] = {}
    if tables and real_side != "both":
        embedding_side = _embedding_side(g, part.stream[0])
        for k, node in enumerate(g.node):
            side = "embedding" if k in embedding_side else "head"
            if side == real_side:
                continue
            for j, name in enumerate(node.input):
                if name in tables:
                    node.input[j] = stand_ins.setdefault(name, name if real_side == "none" else f"{name}__stand_in")
        _clamp_stand_in_lookups(g, set(stand_ins.values()), embedding_side, graph.input)
    values: dict[str, np.ndarray] = {}
    data_types: dict[str, int] = {}
    read_now = {name for n in g.node for name in n.input}
    for t in graph.initializer:
        if t.name not in used:
            continue
        if t.name in stand_ins:
            values[stand_ins[t.name]] = stand_in(t)
            data_types[stand_ins[t.name]] = t.data_type
        if t.name in read_now and stand_ins.get(t.name) != t.name:  # (a split tied table: both)
            values[t.name] = read_array(t, base_dir)
            data_types[t.name] = t.data_type
    for name, value in values.items():
        g.initializer.append(_declared(name, data_types[name], value.shape))
    real_shapes = {stand_ins[t.name]: list(t.dims) for t in graph.initializer if t.name in stand_ins}
    if real_shapes:  # structure analysis sees the vocabulary through the stand-ins (a head stays lm_head)
        model.metadata_props.add(key=facts.STAND_INS.key, value=facts.STAND_INS.encode(real_shapes))
    g.input.extend(graph.input)
    others = {o for j, outs in enumerate(part.layer_outputs) if j != i for o in outs}
    for out in graph.output:
        if out.name in others:  # another layer's KV-cache entries: not computed here
            continue
        vi = g.output.add()
        vi.CopyFrom(out)
        if real_side in ("none", "embedding") and stand_ins:  # the stand-in head's width is not the vocabulary
            vi.type.tensor_type.ClearField("shape")
    return model, values
