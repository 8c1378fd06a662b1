"""The facts passes hand to each other, one typed accessor each.

A fact is a key in the model's metadata with a fixed text encoding: it travels with the graph
through the pipeline (``ir.to_graph`` keeps the metadata), is saved with the model, and is what a
later pass, a later compile or a tool reads. Passes never touch these keys directly: they read
and write through the objects below, and a pass's marker (``Pass.establishes``) is one of them,
which is how the pipeline knows a pass was already applied.

Encodings are kept exactly as earlier versions wrote them (compiled models must not change):
``KeyValueFact`` writes ``k=v;k=v`` in the order given, ``JsonFact`` JSON (keys sorted where it
says so), ``NameSetFact`` a sorted JSON list of node names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from edgeq.graph import ir


@dataclass(frozen=True)
class Fact:
    """A metadata key and what it means."""

    key: str
    meaning: str

    def text(self, graph: gs.Graph) -> str | None:
        return ir.graph_metadata(graph).get(self.key)

    def present(self, graph: gs.Graph) -> bool:
        return self.key in ir.graph_metadata(graph)

    def write(self, graph: gs.Graph, text: str) -> None:
        ir.set_graph_metadata(graph, self.key, text)

    def not_applied(self, graph: gs.Graph) -> str | None:
        """Why the pass that leaves this marker did not apply, where the marker records it (a pass
        that ``marks_when_not_applicable``); None for a marker that says the pass applied."""
        return None


@dataclass(frozen=True)
class KeyValueFact(Fact):
    """``k=v;k=v`` fields (what a rewrite was run with)."""

    def get(self, graph: gs.Graph) -> dict[str, str] | None:
        raw = self.text(graph)
        if raw is None:
            return None
        return dict(part.split("=", 1) for part in raw.split(";") if "=" in part)

    def set(self, graph: gs.Graph, **fields) -> None:
        self.write(graph, ";".join(f"{k}={v}" for k, v in fields.items()))


@dataclass(frozen=True)
class JsonFact(Fact):
    """A JSON value (a layout, calibrated parameters). With a ``reason_key``, the marker of a pass
    that ``marks_when_not_applicable``: where the pass did not apply, an object with the reason
    under that key (``set_not_applied``; the pipeline writes it)."""

    sort_keys: bool = False
    reason_key: str | None = None

    def get(self, graph: gs.Graph):
        raw = self.text(graph)
        return None if raw is None else json.loads(raw)

    def set(self, graph: gs.Graph, value) -> None:
        self.write(graph, self.encode(value))

    def encode(self, value) -> str:
        """The metadata text of ``value`` (for a model built as a proto, not a graph)."""
        return json.dumps(value, sort_keys=self.sort_keys)

    def set_not_applied(self, graph: gs.Graph, detail: str, **fields) -> None:
        self.set(graph, {**fields, self.reason_key: detail})

    def not_applied(self, graph: gs.Graph) -> str | None:
        value = self.get(graph) if self.reason_key else None
        return value.get(self.reason_key) if isinstance(value, dict) else None


@dataclass(frozen=True)
class NameSetFact(Fact):
    """A set of node names (sorted JSON list)."""

    def names(self, graph: gs.Graph) -> set[str]:
        return set(json.loads(self.text(graph) or "[]"))

    def add(self, graph: gs.Graph, names) -> None:
        self.write(graph, json.dumps(sorted(self.names(graph) | set(names))))


# ------------------------------------------------------------------ markers of the rewrites
ROTATED = KeyValueFact("edgeq.rotate", "the residual stream is rotated (seed, kind of rotation)")
RMS = KeyValueFact("edgeq.rms", "MQuant RMS side branches are in (mode, branch precision)")
MASSIVE_SPLIT = KeyValueFact("edgeq.massive_split", "massive-activation channels are split off (ratio, branch)")
MUXQ = KeyValueFact("edgeq.muxq", "MUXQ Body/Aux split is in (method, rule, form)")
AIFS = KeyValueFact("edgeq.aifs", "tokens are reordered visual-first (span inputs, visual count tensor, ...)")
MSQ = KeyValueFact("edgeq.msq", "per-modality static scales are in (layout, lowering, the original-order visual mask tensor)")
RESQ = JsonFact("edgeq.resq", "ResQ projections are folded in: the subspace layout, or why they could not be",
                sort_keys=True, reason_key="not_applicable")
RESQ_QDQ = JsonFact("edgeq.resq_qdq", "ResQ mixed-precision quantization is in (activation mode)")
STATIC = JsonFact("edgeq.static", "a static prefill or decode graph: its role and fixed cache layout "
                  "(prefill, context, layers, kv_heads, head_dim, cache_dtype)", sort_keys=True)
KVQUANT = JsonFact("edgeq.kvquant", "the visual KV cache is quantized: the calibrated cache layout", sort_keys=True)

# ------------------------------------------------------------------ facts for later passes
KEEP_FLOAT = NameSetFact("edgeq.keep_float", "linears a method keeps in float: the qdq pass leaves them alone")
WEIGHTS_QUANTIZED_FIRST = NameSetFact(
    "edgeq.weights_quantized_first",
    "linears whose weights a weight pass (gptq) quantized and whose activations qdq should still quantize")
STAND_INS = JsonFact("edgeq.blockwise.stand_ins",
                     "a block-wise compile's block model: small tables standing in for the vocabulary tables "
                     "this block does not use -> the real table's shape (never in a compiled model)", sort_keys=True)
VISUAL_SPAN_INPUTS = Fact("edgeq.visual_span_inputs",
                          "names of the inputs giving each row's visual span (written by the VLM exports)")


def merge_part_metadata(into: dict[str, str], part: dict[str, str], discarded: set[str]) -> None:
    """The metadata of a model assembled from compiled parts (``edgeq.blockwise``), one part at a
    time: a name set is joined over the parts, less the names of the nodes a part's result was not
    taken for (``discarded``: a middle block's stand-in head, and nodes named after one); the
    stand-in record is dropped; every other fact is the same in every part."""
    sets = {fact.key for fact in (KEEP_FLOAT, WEIGHTS_QUANTIZED_FIRST)}
    for key, value in part.items():
        if key == STAND_INS.key:
            continue
        if key not in sets:
            into[key] = value
            continue
        taken = {name for name in json.loads(value) if not any(name.startswith(d) for d in discarded)}
        into[key] = json.dumps(sorted(set(json.loads(into.get(key, "[]"))) | taken))
