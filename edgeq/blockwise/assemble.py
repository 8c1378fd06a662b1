"""The output model grown block by block: each block's nodes taken out of its compiled model,
renamed where they would clash, large initializers streamed to the output's data file."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable

import onnx
from onnx import TensorProto

from edgeq.graph import facts
from edgeq.graph.protowalk import upstream

# initializers at least this large go to the external data file as soon as their block is done
# (the encodings and target checks read them back from it; shape tensors stay inline, as
# onnxruntime's shape inference needs them in the graph)
SPILL_BYTES = 1 << 16
ALIGN = 4096
DATA_LOCATION = "model.onnx.data"


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
            if node.name and node.name in self.node_names:  # (unnamed nodes stay unnamed)
                node.name = f"{node.name}__{label}"
            self.node_names.add(node.name)
            self.nodes.append(node)
        for f in model.functions:
            if (f.domain, f.name) not in self.functions:
                self.functions[(f.domain, f.name)] = _copied(f)
        for imp in model.opset_import:
            self.opsets[imp.domain] = max(self.opsets.get(imp.domain, 0), imp.version)
        self.ir_version = max(self.ir_version, model.ir_version)

    def add_metadata(self, model: onnx.ModelProto, discarded: set[str]) -> None:
        """A block's facts (``facts.merge_part_metadata``); ``discarded``: the names of the input
        graph's nodes whose compiled form is not taken from this block."""
        facts.merge_part_metadata(self.metadata, {p.key: p.value for p in model.metadata_props}, discarded)

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
