"""Splitting a decoder graph, read without its weights, into prologue, layers and epilogue (by
node names, checked by data flow): what a block-wise compile compiles one piece at a time."""

from __future__ import annotations

import re
from typing import Any
from dataclasses import dataclass, field

import onnx

from edgeq.families import LAYER_CONTAINERS

# decoder layer index in an exporter's node names (/model/layers.3/..., /transformer/h.3/...): the
# declared families' layer containers (``Family.layer_scope``), and timm-style ``/blocks.N/``
LAYER_NAME = re.compile(r"/(?:{})\.(\d+)/".format("|".join((*LAYER_CONTAINERS, "blocks"))))
# ops whose output does not depend on their input's values (shape machinery)
SHAPE_ONLY = frozenset({"Shape", "Size"})


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
    # per layer: the graph outputs it produces (a with-past graph's present.{i}.key/value), in the
    # graph's output order; empty for a graph without a KV cache
    layer_outputs: list[list[str]] = field(default_factory=list)

    def __post_init__(self):
        if not self.layer_outputs:
            self.layer_outputs = [[] for _ in self.layers]

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
    downstream: set[str] = set()  # tensors produced by (or after) a layer
    for k, n in enumerate(nodes):
        ins = [i for i in n.input if i]
        if n.op_type not in SHAPE_ONLY and any(i in dependent for i in ins):
            dependent.update(o for o in n.output if o)
        if layer_of[k] is not None or any(i in downstream for i in ins):
            downstream.update(o for o in n.output if o)
    prologue = [k for k in range(len(nodes)) if layer_of[k] is None and not any(o in downstream for o in nodes[k].output)]
    epilogue = [k for k in range(len(nodes)) if layer_of[k] is None and k not in set(prologue)]
    layers = [[k for k in range(len(nodes)) if layer_of[k] == i] for i in range(num_layers)]
    # (part, layer): "p" prologue, "e" epilogue (layer None), "l" a layer and its index
    part_of: dict[int, tuple[str, Any]] = {k: ("p", None) for k in prologue} | {k: ("e", None) for k in epilogue}
    for i, ks in enumerate(layers):
        part_of.update({k: ("l", i) for k in ks})

    def external_reads(ks: list[int]) -> list[tuple[str, int]]:
        own = {o for k in ks for o in nodes[k].output}
        seen, out = set(), []
        for k in ks:
            for name in nodes[k].input:
                if name and name not in own and name not in seen and name in producer:
                    seen.add(name)
                    out.append((name, producer[name]))
        return out

    stream: list[str] = []
    support: list[list[int]] = []
    exported: list[set[str]] = [set() for _ in range(num_layers)]
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
    # graph outputs come from the epilogue (logits) or from one layer (that layer's KV-cache entries)
    layer_outputs: list[list[str]] = [[] for _ in range(num_layers)]
    for o in (o.name for o in graph.output):
        where = part_of.get(producer.get(o, -1), ("input", None))
        if where[0] == "l":
            layer_outputs[where[1]].append(o)
        elif where[0] != "e":
            raise NotPartitionable(f"graph output {o} is produced outside the layers and the epilogue")
    prologue_set = set(prologue)
    prologue_outputs = sorted({name for k in range(len(nodes)) if k not in prologue_set for name in nodes[k].input
                               if name in producer and producer[name] in prologue_set})
    return Partition(prologue, layers, epilogue, stream, support, prologue_outputs, exported, layer_outputs)
