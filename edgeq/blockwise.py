"""Block-wise compile: memory bounded by one decoder block, not by the model.

The in-memory path imports the whole model into graphsurgeon and calibrates with one onnxruntime
session over all of it: about 8x the model's size at peak, so a 1B model does not fit 24 GB. This
path compiles one decoder block at a time instead:

- ``partition`` splits the input graph (read without its weights) into a prologue (embedding, mask
  and rotary computations), one node set per decoder layer, and an epilogue (final norm, head), and
  checks the split by data flow: each layer reads the residual stream from the layer before it
  (one tensor) plus tensors that do not depend on the stream's values (masks, rotary tables), and
  the epilogue reads the last layer's output. A graph that does not split this way is refused
  (``NotPartitionable``) and the compiler uses the in-memory path.
- ``block_model`` builds, for layer i, a one-layer model: prologue -> layer i -> epilogue, its
  weights read from the external data file for that block only. Between the first and the last
  block the embedding and head tables are small stand-ins (the block's calibration feeds the
  carried hidden states to the layer directly, and the stand-ins' rewrites are thrown away).
- the recipe's passes run on that model unchanged (every pass declares ``per_block``); calibration
  feeds the layer with the hidden states the previous block produced, one set per calibration
  request (``edgeq.calib.session.StreamCarry``), so the statistics are the in-memory path's.
- ``Assembler`` takes the block's nodes out of the result (a data-flow walk from the block's output
  back to the prologue's tensors), renames what would clash with earlier blocks, writes the large
  initializers straight into the output's external data file and keeps only the graph. The
  prologue comes from the first block's result, the epilogue from the last's.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
from onnx import TensorProto

from edgeq.errors import UserInputError
from edgeq.protowalk import upstream

# decoder layer index in an exporter's node names (/model/layers.3/..., /transformer/h.3/...)
LAYER_NAME = re.compile(r"/(?:layers|h|layer|blocks)\.(\d+)/")
# ops whose output does not depend on their input's values (shape machinery)
SHAPE_ONLY = frozenset({"Shape", "Size"})
# initializers at least this large go to the external data file as soon as their block is done
# (the encodings and target checks read them back from it; shape tensors stay inline, as
# onnxruntime's shape inference needs them in the graph)
SPILL_BYTES = 1 << 16
# prologue/epilogue tables at least this large get a stand-in between the first and last blocks
STUB_ELEMENTS = 1 << 20
STUB_ROWS = 64
ALIGN = 4096
DATA_LOCATION = "model.onnx.data"


class NotPartitionable(Exception):
    """The graph does not split into prologue, decoder layers and epilogue (the reason why)."""


@dataclass
class Partition:
    """Node positions (in the input graph's topological order) of each part, and the stream:
    ``stream[i]`` is layer i's input, ``stream[L]`` the epilogue's."""

    prologue: list[int]
    layers: list[list[int]]
    epilogue: list[int]
    stream: list[str]
    support: list[list[int]]  # per layer: nodes of other layers it reads from (rotary tables)
    prologue_outputs: list[str]  # prologue tensors read by layers or epilogue
    exported_support: list[set[str]]  # per layer: its tensors that other layers read

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def partition(model: onnx.ModelProto) -> Partition:
    graph = model.graph
    nodes = list(graph.node)
    inits = {t.name for t in graph.initializer}
    inputs = {t.name for t in graph.input}
    layer_of: list[int | None] = []
    for node in nodes:
        m = LAYER_NAME.search(node.name)
        layer_of.append(int(m.group(1)) if m else None)
    indices = sorted({x for x in layer_of if x is not None})
    if not indices:
        raise NotPartitionable("no decoder layers found in node names (/layers.N/)")
    if indices != list(range(len(indices))):
        raise NotPartitionable(f"decoder layer numbers are not 0..{len(indices) - 1}")
    num_layers = len(indices)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    for k, n in enumerate(nodes):
        for name in n.input:
            if name and name not in producer and name not in inits and name not in inputs:
                raise NotPartitionable(f"node {n.name} reads '{name}', which nothing produces (subgraph or unsorted graph)")
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise NotPartitionable(f"node {n.name} has a subgraph")
        for name in n.input:
            if name in producer and producer[name] > k:
                raise NotPartitionable("the graph is not topologically sorted")
    embedding = [k for k, n in enumerate(nodes) if n.op_type == "Gather" and layer_of[k] is None
                 and n.input[0] in inits and n.input[1] in inputs]
    if len(embedding) != 1:
        raise NotPartitionable(f"expected one embedding Gather reading a graph input, found {len(embedding)}")
    dependent = {nodes[embedding[0]].output[0]}  # tensors whose values depend on the stream
    downstream = set()  # tensors produced by (or after) a layer
    for k, n in enumerate(nodes):
        ins = [i for i in n.input if i]
        if n.op_type not in SHAPE_ONLY and any(i in dependent for i in ins):
            dependent.update(o for o in n.output if o)
        if layer_of[k] is not None or any(i in downstream for i in ins):
            downstream.update(o for o in n.output if o)
    prologue = [k for k in range(len(nodes)) if layer_of[k] is None and not any(o in downstream for o in nodes[k].output)]
    epilogue = [k for k in range(len(nodes)) if layer_of[k] is None and k not in set(prologue)]
    layers = [[k for k in range(len(nodes)) if layer_of[k] == i] for i in range(num_layers)]
    part_of = {k: ("p", None) for k in prologue} | {k: ("e", None) for k in epilogue}
    for i, ks in enumerate(layers):
        part_of.update({k: ("l", i) for k in ks})

    def external_reads(ks: list[int]) -> list[tuple[str, int | None]]:
        own = {o for k in ks for o in nodes[k].output}
        seen, out = set(), []
        for k in ks:
            for name in nodes[k].input:
                if name and name not in own and name not in seen and name in producer:
                    seen.add(name)
                    out.append((name, producer[name]))
        return out

    stream, support, exported = [], [], [set() for _ in range(num_layers)]
    for i, ks in enumerate(layers):
        reads = external_reads(ks)
        streams = [(name, k) for name, k in reads if name in dependent]
        if len(streams) != 1:
            raise NotPartitionable(f"layer {i} reads {len(streams)} stream tensors ({[s for s, _ in streams][:4]}), expected 1")
        name, k = streams[0]
        want = ("p", None) if i == 0 else ("l", i - 1)
        if part_of[k] != want:
            raise NotPartitionable(f"layer {i}'s stream input {name} does not come from the {'prologue' if i == 0 else 'layer before'}")
        stream.append(name)
        closure, todo = set(), [k for name, k in reads if name not in dependent and part_of[k][0] == "l"]
        for name, k in reads:
            if name not in dependent and part_of[k][0] == "l":
                exported[part_of[k][1]].add(name)
        while todo:
            k = todo.pop()
            if k in closure or part_of[k][0] == "p":
                continue
            if part_of[k] == ("l", i):
                continue
            if any(o in dependent for o in nodes[k].output):
                raise NotPartitionable(f"layer {i} reads {nodes[k].output[0]}, computed from another layer's stream")
            closure.add(k)
            todo.extend(producer[x] for x in nodes[k].input if x in producer)
        support.append(sorted(closure))
    tail = external_reads(epilogue)
    streams = [(name, k) for name, k in tail if name in dependent]
    if len(streams) != 1 or part_of[streams[0][1]] != ("l", num_layers - 1):
        raise NotPartitionable("the epilogue does not read exactly one stream tensor from the last layer")
    if any(part_of[k][0] == "l" and name not in dependent for name, k in tail):
        raise NotPartitionable("the epilogue reads non-stream tensors from a layer")
    stream.append(streams[0][0])
    readers: dict[str, list[int]] = {}
    for c, n in enumerate(nodes):
        for name in n.input:
            readers.setdefault(name, []).append(c)
    for i, ks in enumerate(layers):  # what a layer gives others: its successor's stream input and tables
        allowed = {stream[i + 1]} | exported[i]
        for k in ks:
            for o in nodes[k].output:
                if o not in allowed and any(part_of[c] != ("l", i) for c in readers.get(o, ())):
                    raise NotPartitionable(f"layer {i}'s tensor {o} is read outside the layer")
    outputs = {o.name for o in graph.output}
    if any(producer.get(o) is not None and part_of[producer[o]][0] != "e" for o in outputs):
        raise NotPartitionable("a graph output is produced outside the epilogue (KV-cache outputs: export without past)")
    prologue_set = set(prologue)
    prologue_outputs = sorted({name for k in range(len(nodes)) if k not in prologue_set for name in nodes[k].input
                               if name in producer and producer[name] in prologue_set})
    return Partition(prologue, layers, epilogue, stream, support, prologue_outputs, exported)


# -- reading one block's weights ------------------------------------------------------------------
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
    from edgeq import ir

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
    g.input.extend(graph.input)
    for out in graph.output:
        vi = g.output.add()
        vi.CopyFrom(out)
        if real_side in ("none", "embedding") and stand_ins:  # the stand-in head's width is not the vocabulary
            vi.type.tensor_type.ClearField("shape")
    return model, values


# -- assembling the compiled blocks ---------------------------------------------------------------
def ancestors(model: onnx.ModelProto, targets: Iterable[str], stop: set[str]) -> list[onnx.NodeProto]:
    """The nodes computing ``targets``, not climbing past ``stop`` tensors, in graph order."""
    return [model.graph.node[k] for k in sorted(upstream(model.graph.node, targets, stop))]


@dataclass
class Assembler:
    """The output model, grown block by block; large initializers are written to ``data_path``
    as they arrive and only their external references are kept."""

    skeleton: onnx.ModelProto
    data_path: Path
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: dict[str, TensorProto] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)
    node_names: set[str] = field(default_factory=set)
    functions: dict[tuple[str, str], onnx.FunctionProto] = field(default_factory=dict)
    opsets: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    ir_version: int = 0
    offset: int = 0

    def __post_init__(self):
        self._file = open(self.data_path, "wb")
        self.names.update(t.name for t in self.skeleton.graph.input)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def add(self, model: onnx.ModelProto, nodes: list[onnx.NodeProto], rename: dict[str, str], label: str) -> None:
        """Add ``nodes`` of ``model`` (one compiled part) with the initializers they read; inputs
        in ``rename`` are rewired; tensors and nodes whose names earlier parts used get ``label``."""
        inits = {t.name: t for t in model.graph.initializer}
        produced = {o for n in nodes for o in n.output if o}
        mapping = dict(rename)
        for name in sorted({x for n in nodes for x in n.input if x in inits}):
            t = inits[name]
            digest = _digest(t)
            if name in self.initializers:
                if self.digests[name] == digest:
                    continue  # the same constant (a shared table, a Hadamard matrix): kept once
                mapping[name] = self._fresh(f"{name}__{label}")
            elif name in self.names:
                mapping[name] = self._fresh(f"{name}__{label}")
            t = _renamed(t, mapping.get(name, name))
            self.names.add(t.name)
            self.digests[t.name] = digest
            self.initializers[t.name] = self._spill(t)
        for name in sorted(produced):
            if name in self.names:
                mapping[name] = self._fresh(f"{name}__{label}")
            self.names.add(mapping.get(name, name))
        for n in nodes:
            node = onnx.NodeProto()
            node.CopyFrom(n)
            for j, x in enumerate(node.input):
                if x in mapping:
                    node.input[j] = mapping[x]
            for j, x in enumerate(node.output):
                if x in mapping:
                    node.output[j] = mapping[x]
            if node.name in self.node_names:
                node.name = f"{node.name}__{label}"
            self.node_names.add(node.name)
            self.nodes.append(node)
        for f in model.functions:
            if (f.domain, f.name) not in self.functions:
                self.functions[(f.domain, f.name)] = _copied(f)
        for imp in model.opset_import:
            self.opsets[imp.domain] = max(self.opsets.get(imp.domain, 0), imp.version)
        self.metadata.update({p.key: p.value for p in model.metadata_props})
        self.ir_version = max(self.ir_version, model.ir_version)

    def add_missing(self, model: onnx.ModelProto, nodes: list[onnx.NodeProto], label: str) -> None:
        """Prologue tensors that ``nodes`` read and no earlier part produced (a shared constant only
        this block reads, which the first block's compile dropped as unused): computed from
        ``model``, before the nodes are added."""
        inits = {t.name for t in model.graph.initializer}
        produced = {o for n in nodes for o in n.output}
        missing = {x for n in nodes for x in n.input if x and x not in produced and x not in inits and x not in self.names}
        if missing:
            self.add(model, ancestors(model, missing, set(self.names)), {}, label)

    def _fresh(self, base: str) -> str:
        name, j = base, 0
        while name in self.names:
            j += 1
            name = f"{base}_{j}"
        return name

    def _spill(self, t: TensorProto) -> TensorProto:
        if t.data_location == TensorProto.EXTERNAL:
            raise RuntimeError(f"initializer {t.name} was not read in")
        if not t.HasField("raw_data"):
            t = onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t), t.name)
        if len(t.raw_data) < SPILL_BYTES:
            return _copied(t)  # a message of its own: a part of the block's model would keep all of it alive
        pad = -self.offset % ALIGN
        self._file.write(b"\0" * pad)
        self.offset += pad
        data = t.raw_data
        self._file.write(data)
        ref = TensorProto()
        ref.name, ref.data_type = t.name, t.data_type
        ref.dims.extend(t.dims)
        ref.data_location = TensorProto.EXTERNAL
        for key, value in (("location", DATA_LOCATION), ("offset", str(self.offset)), ("length", str(len(data)))):
            ref.external_data.add(key=key, value=value)
        self.offset += len(data)
        return ref

    def finish(self) -> onnx.ModelProto:
        """The assembled model (graph order: prologue, blocks, epilogue), nodes nothing reads dropped."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self.close()
        sk = self.skeleton
        live = upstream(self.nodes, [o.name for o in sk.graph.output])
        nodes = [n for k, n in enumerate(self.nodes) if k in live]
        read = {x for n in nodes for x in n.input}
        known = {o for n in nodes for o in n.output} | set(self.initializers) | {t.name for t in sk.graph.input}
        missing = sorted(x for x in read if x and x not in known)
        if missing:
            raise RuntimeError(f"block-wise assembly: {missing[:3]} are read but no part produces them; "
                               "compile with --blockwise off")
        model = onnx.ModelProto()
        model.ir_version = max(self.ir_version, sk.ir_version)
        model.producer_name, model.producer_version = sk.producer_name or "edgeq", sk.producer_version
        model.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in sorted(self.opsets.items()))
        for key, value in self.metadata.items():
            model.metadata_props.add(key=key, value=value)
        model.functions.extend(self.functions.values())
        g = model.graph
        g.name = sk.graph.name
        g.node.extend(nodes)
        g.initializer.extend(t for name, t in self.initializers.items() if name in read)
        g.input.extend(sk.graph.input)
        g.output.extend(sk.graph.output)
        return model


def _digest(t: TensorProto) -> str:
    h = hashlib.sha1(repr((t.data_type, list(t.dims))).encode())
    h.update(t.raw_data if t.HasField("raw_data") else t.SerializeToString())
    return h.hexdigest()


def _copied(message):
    """A copy in its own protobuf arena (holding any part of a message keeps the whole alive)."""
    out = type(message)()
    out.CopyFrom(message)
    return out


def _renamed(t: TensorProto, name: str) -> TensorProto:
    if name == t.name:
        return t
    out = TensorProto()
    out.CopyFrom(t)
    out.name = name
    return out


# -- the driver -----------------------------------------------------------------------------------
@dataclass
class BlockProgress:
    """One stderr line per block: elapsed time and an estimate of what is left."""

    total: int
    enabled: bool
    started: float = field(default_factory=time.perf_counter)

    def done(self, i: int, seconds: float, rss_mb: float) -> None:
        if not self.enabled:
            return
        import sys

        elapsed = time.perf_counter() - self.started
        eta = elapsed / (i + 1) * (self.total - i - 1)
        sys.stderr.write(f"block {i + 1}/{self.total}: {seconds:.1f} s, elapsed {_clock(elapsed)}, "
                         f"ETA {_clock(eta)}, peak RSS {rss_mb:.0f} MB\n")
        sys.stderr.flush()


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds + 0.5), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def compile_blocks(skeleton: onnx.ModelProto, part: Partition, base_dir: Path, data_path: Path,
                   run_block: Callable[[object, int], tuple[onnx.ModelProto, list[dict]]],
                   carry, progress: BlockProgress) -> tuple[onnx.ModelProto, list[list[dict]], dict]:
    """Compile every block with ``run_block(graph, i) -> (compiled model, pass records)``; returns
    the assembled model (large initializers already in ``data_path``), the records per block and
    the u8s8 worst-case bound of its linears.

    ``carry``: the calibrator's ``StreamCarry`` (None without calibration), moved on per block."""
    from edgeq.pipeline import peak_rss_mb

    last = part.num_layers - 1
    assembler = Assembler(skeleton, data_path)
    records = []
    u8s8 = U8S8Tally()
    try:
        for i in range(part.num_layers):
            start = time.perf_counter()
            if carry is not None and i > 0:
                carry.advance(cut=part.stream[0], capture=part.stream[i + 1])
            compiled, recs = run_block(block_graph(skeleton, part, i, base_dir), i)
            records.append(recs)
            _check_present(compiled, [part.stream[i + 1]] + ([part.stream[0]] if i > 0 else []), i)
            base = set(part.prologue_outputs) | {o for k in part.support[i] for o in skeleton.graph.node[k].output}
            base |= {t.name for t in skeleton.graph.input}
            if i == 0:  # (a prologue tensor the passes made unused, a tied head's Transpose, may be gone)
                assembler.add(compiled, ancestors(compiled, part.prologue_outputs, {t.name for t in skeleton.graph.input}),
                              {}, "prologue")
            targets = [part.stream[i + 1], *sorted(part.exported_support[i])]
            block = ancestors(compiled, targets, base | {part.stream[0]})
            kept = {n.name for n in block}
            if i == 0:
                kept |= {n.name for n in ancestors(compiled, part.prologue_outputs, set())}
            if i == last:
                kept |= {n.name for n in ancestors(compiled, [o.name for o in skeleton.graph.output], set())}
            u8s8.add(compiled, kept)
            assembler.add_missing(compiled, block, f"p{i}")
            assembler.add(compiled, block, {part.stream[0]: part.stream[i]} if i > 0 else {}, f"b{i}")
            if i == last:
                stop = set(part.prologue_outputs) | {part.stream[-1]} | {t.name for t in skeleton.graph.input}
                stop |= {name for s in part.exported_support for name in s}
                epilogue = ancestors(compiled, [o.name for o in skeleton.graph.output], stop)
                assembler.add_missing(compiled, epilogue, "pe")
                assembler.add(compiled, epilogue, {}, "epilogue")
            # nothing may keep a node of this block's model: any part keeps all of it alive
            del compiled, block, recs
            release_memory()
            progress.done(i, time.perf_counter() - start, peak_rss_mb())
        return assembler.finish(), records, u8s8.summary()
    finally:
        assembler.close()


@dataclass
class U8S8Tally:
    """The u8s8 worst-case bound (``edgeq.targets.u8s8_sites.static_risk``) of the linears each
    block contributes, taken while its weights are in memory: the writer then need not read the
    whole output back to report it."""

    linears: int = 0
    at_risk: dict[str, int] = field(default_factory=dict)

    def add(self, compiled: onnx.ModelProto, nodes: set[str]) -> None:
        import onnx_graphsurgeon as gs

        from edgeq.targets.u8s8_sites import find_u8s8_sites, static_risk

        sites = [s for s in find_u8s8_sites(gs.import_onnx(compiled)) if s.node.name in nodes]
        self.linears += len(sites)
        self.at_risk.update(static_risk(sites))

    def summary(self) -> dict:
        return {"linears": self.linears, "linears_at_risk": len(self.at_risk), "saturation_free": not self.at_risk,
                "at_risk": self.at_risk}


def release_memory() -> None:
    """Give freed memory back to the system between blocks: collect cycles, and ask glibc to
    return its free heap (block-sized arrays freed in the middle of the heap otherwise stay in the
    process's RSS and the next block's add up on top). A no-op where there is no glibc."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _check_present(model: onnx.ModelProto, names: list[str], i: int) -> None:
    have = {o for n in model.graph.node for o in n.output} | {t.name for t in model.graph.input}
    missing = [n for n in names if n not in have]
    if missing:
        raise RuntimeError(f"block {i}: the passes removed the tensor(s) {missing[:3]} the block-wise compile stitches "
                           "blocks at; compile with --blockwise off")


def merge_records(per_block: list[list[dict]]) -> list[dict]:
    """One record per pass for report.json: seconds summed over blocks, peak RSS the highest,
    summaries merged (numbers summed, lists joined), and how many blocks the pass changed."""
    merged = []
    for recs in zip(*per_block):
        first = dict(recs[0])
        first["seconds"] = round(sum(r["seconds"] for r in recs), 3)
        first["peak_rss_mb"] = max(r["peak_rss_mb"] for r in recs)
        first["modified"] = any(r["modified"] for r in recs)
        first["blocks_modified"] = sum(bool(r["modified"]) for r in recs)
        for key in ("ops_added", "ops_removed"):
            first[key] = _merge([r[key] for r in recs])
        first["summary"] = _merge([r["summary"] for r in recs])
        na = [r["not_applicable"] for r in recs if "not_applicable" in r]
        if na and len(na) == len(recs):
            first["not_applicable"] = na[0]
        else:
            first.pop("not_applicable", None)
        merged.append(first)
    return merged


def _merge(values: list):
    if all(isinstance(v, bool) for v in values):
        return any(values)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return round(sum(values), 6)
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _merge([v[k] for v in values if k in v]) for k in keys}
    if all(isinstance(v, list) for v in values):
        return [x for v in values for x in v]
    distinct = list(dict.fromkeys(map(str, values)))
    return values[0] if len(distinct) == 1 else distinct
