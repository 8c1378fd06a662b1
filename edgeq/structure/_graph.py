"""Graph walking shared by the structure matchers.

Every matcher works on one ``Walker`` (a ``GraphIndex`` plus constant resolution and graph-output
lookup), so ``analyze`` builds the use-def index once and every pattern walk is O(pattern size).
Walks are bounded (a visit cap) because a wrongly classified node must cost a few steps, not a
scan of the whole graph.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any, cast
from collections.abc import Callable, Hashable, Iterable, Iterator

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph.ir import GraphIndex

# Ops that move one data tensor (input 0) without mixing it with another activation: a value
# that reaches a node only through these is still "the same" tensor for pattern purposes.
PASS_THROUGH = frozenset({
    "Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Dropout",
    "QuantizeLinear", "DequantizeLinear",
    "OnlineHadamard",  # edgeq's per-position rotation (inserted by ``rotate`` before down_proj)
})

# Ops whose only data operand is input 0 (the others are shapes, indices, scales or axes).
FIRST_INPUT_ONLY = PASS_THROUGH | frozenset({
    "Transpose", "Expand", "Slice", "Tile", "Split", "Pad", "Gather",
})

MAX_VISITS = 256
# the suffix ``WeightStore.set_weight`` gives a rewritten weight (``ir.unique_name`` may add ``_N``)
REWRITTEN = re.compile(r"_rewritten(?:_\d+)?$")


def _tensor_name(tensor) -> str:
    return tensor.name


class BreadthFirst:
    """One bounded breadth-first walk: iterate it for the items in visiting order, ``push`` the
    items a visited one leads to.

    Every graph search here (and aifs's mask cone) is this loop; only what a visited item yields
    and where the walk goes on from it differ, so those stay in the caller's loop body, and a
    search that stops at its first hit returns from the loop. Items are tensors (deduplicated by
    name) unless ``key`` says otherwise; the walk ends when the queue is empty or ``limit``
    distinct items were visited (a wrongly classified start costs a few steps, not the graph).
    """

    def __init__(self, start: Any, limit: int = MAX_VISITS, key: Callable[[Any], Hashable] = _tensor_name):
        self._queue = deque([start])
        self._seen: set[Hashable] = set()
        self._limit = limit
        self._key = key

    def __iter__(self) -> Iterator[Any]:
        while self._queue and len(self._seen) < self._limit:
            item = self._queue.popleft()
            key = self._key(item)
            if key in self._seen:
                continue
            self._seen.add(key)
            yield item

    def push(self, items: Iterable[Any]) -> None:
        self._queue.extend(items)


class Walker:
    """A ``GraphIndex`` with the lookups the matchers share (constants, graph outputs, order)."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self.index = GraphIndex(graph)
        self.graph_outputs = frozenset(t.name for t in graph.outputs)
        self._stand_ins: dict | None = None
        self._position: dict[int, int] | None = None

    def producer(self, name: str) -> gs.Node | None:
        return self.index.producer(name)

    def consumers(self, name: str) -> list[gs.Node]:
        return self.index.consumers(name)

    def sole_consumer(self, tensor: gs.Tensor) -> gs.Node | None:
        """The one node reading ``tensor``; None if it has several readers or is a graph output.

        Pattern tails use this so a match never claims a tensor that something else also reads.
        """
        users = self.consumers(tensor.name)
        if len(users) != 1 or tensor.name in self.graph_outputs:
            return None
        return users[0]

    def const_source(self, tensor: gs.Tensor) -> gs.Tensor | None:
        """The tensor holding ``tensor``'s constant value (an initializer or a Constant node's
        output), following Identity chains; None if it is not constant."""
        for _ in range(16):
            if isinstance(tensor, gs.Constant):
                return tensor
            node = self.producer(tensor.name)
            if node is None:
                return None
            if node.op == "Constant":
                return tensor if "value" in node.attrs else None
            if node.op != "Identity":
                return None
            tensor = node.inputs[0]
        return None

    def stand_ins(self) -> dict:
        """Stand-in name -> the real shape of the vocabulary table it replaces (``facts.STAND_INS``;
        empty outside a block-wise compile's block models)."""
        if self._stand_ins is None:
            from edgeq.graph import facts

            self._stand_ins = facts.STAND_INS.get(self.graph) or {}
        return self._stand_ins

    def stand_in_shape(self, name: str) -> tuple[int, ...] | None:
        """The real shape of a vocabulary table a block-wise compile replaced with a small stand-in
        (``facts.STAND_INS``); None for any other tensor."""
        stand_ins = self.stand_ins()
        shape = stand_ins.get(name)
        while shape is None and REWRITTEN.search(name):  # a pass's rewrite of a stand-in (rotation, norm folding)
            name = REWRITTEN.sub("", name)
            shape = stand_ins.get(name)
        return None if shape is None else tuple(int(d) for d in shape)

    def is_const(self, tensor: gs.Tensor) -> bool:
        return self.const_source(tensor) is not None

    def value(self, tensor: gs.Tensor) -> np.ndarray | None:
        src = self.const_source(tensor)
        return None if src is None else self.index.constant_value(src)

    def const_shape(self, tensor: gs.Tensor) -> tuple[int, ...] | None:
        """Shape of a constant without materialising a copy when graphsurgeon knows it."""
        src = self.const_source(tensor)
        if src is None:
            return None
        if isinstance(src, gs.Constant):
            return tuple(int(d) for d in src.shape)
        return tuple(cast(np.ndarray, self.index.constant_value(src)).shape)  # src is constant

    def const_dtype(self, tensor: gs.Tensor) -> np.dtype | None:
        src = self.const_source(tensor)
        if src is None:
            return None
        if isinstance(src, gs.Constant):
            return np.dtype(src.dtype) if src.dtype is not None else None
        return cast(np.ndarray, self.index.constant_value(src)).dtype  # src is constant

    def scalar(self, tensor: gs.Tensor) -> float | None:
        """The value of a one-element constant (eps, an exponent), else None."""
        if not self.is_const(tensor):
            return None
        shape = self.const_shape(tensor)
        if shape is None or int(np.prod(shape)) != 1:
            return None
        return float(np.asarray(self.value(tensor)).reshape(-1)[0])

    def position(self, node: gs.Node) -> int:
        """Topological position of ``node`` (computed once), so blocks order by data flow even
        after a pass appended nodes out of order."""
        if self._position is None:
            self._position = topological_positions(self.graph.nodes, self.index)
        return self._position.get(id(node), len(self._position))


def topological_positions(nodes: Iterable[gs.Node], index: GraphIndex) -> dict[int, int]:
    """Kahn's algorithm over the index: ``id(node) -> position``. Nodes on a cycle (invalid
    graphs) keep their list order after the rest."""
    nodes = list(nodes)
    pending = {id(n): sum(1 for t in n.inputs if index.producer(t.name) is not None) for n in nodes}
    ready = deque(n for n in nodes if pending[id(n)] == 0)
    order: dict[int, int] = {}
    while ready:
        node = ready.popleft()
        order[id(node)] = len(order)
        for out in node.outputs:
            for user in index.consumers(out.name):
                pending[id(user)] -= 1
                if pending[id(user)] == 0:
                    ready.append(user)
    for node in nodes:
        order.setdefault(id(node), len(order))
    return order


def data_inputs(walker: Walker, node: gs.Node) -> list[gs.Tensor]:
    """The inputs of ``node`` that carry activations (not shapes, axes, indices or constants).

    Elementwise ops (and anything not listed) count every non-constant input; the caller's op
    whitelist decides which nodes a walk may cross at all.
    """
    if node.op in FIRST_INPUT_ONLY:
        candidates = node.inputs[:1]
    elif node.op == "Where":
        candidates = node.inputs[1:3]
    else:
        candidates = node.inputs
    return [t for t in candidates if t.name and not walker.is_const(t)]


def trace_back(walker: Walker, tensor: gs.Tensor, ops: frozenset[str] = PASS_THROUGH) -> gs.Tensor:
    """Follow ``tensor`` upstream through single-input ``ops`` to where the value was made."""
    for _ in range(MAX_VISITS):
        node = walker.producer(tensor.name)
        if node is None or node.op not in ops or not node.inputs:
            return tensor
        tensor = node.inputs[0]
    return tensor


def reaches_graph_output(walker: Walker, tensor: gs.Tensor) -> bool:
    """Whether ``tensor`` is a graph output or becomes one through pass-through ops only, or
    through logit soft-capping (``tanh(x / c) * c``: Tanh and Mul/Div by a scalar constant, as
    Gemma 2 caps its logits)."""
    walk = BreadthFirst(tensor)
    for t in walk:
        if t.name in walker.graph_outputs:
            return True
        for user in walker.consumers(t.name):
            if user.op in PASS_THROUGH and user.inputs and user.inputs[0].name == t.name:
                walk.push(user.outputs[:1])
            elif _softcap_step(walker, user, t):
                walk.push(user.outputs[:1])
    return False


def _softcap_step(walker: Walker, node: gs.Node, tensor: gs.Tensor) -> bool:
    """Tanh of ``tensor``, or ``tensor`` times / divided by a scalar constant."""
    if node.op == "Tanh":
        return True
    if node.op not in ("Mul", "Div") or len(node.inputs) != 2 or node.inputs[0].name != tensor.name:
        return node.op == "Mul" and len(node.inputs) == 2 and node.inputs[1].name == tensor.name \
            and walker.scalar(node.inputs[0]) is not None
    return walker.scalar(node.inputs[1]) is not None
