"""``analyze``: one pass over a graph that finds linears, norms, blocks and residual adds.

Everything shares one ``Walker`` (one ``GraphIndex`` build), so analysing SmolLM2-135M (about
7,000 nodes) takes well under a second. The ``find_*`` functions are thin views of ``analyze``
for passes that need one kind of fact; call ``analyze`` once when you need several.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from edgeq.structure._graph import Walker
from edgeq.structure.blocks import Block, ResidualAdd, assign_roles, build_blocks, detect_drafts
from edgeq.structure.blocks import find_residual_adds as _residual_adds
from edgeq.structure.linears import Embedding, Linear, find_embeddings, raw_linears
from edgeq.structure.norms import Norm
from edgeq.structure.norms import find_norms as _norms


@dataclass(frozen=True)
class ModelStructure:
    """All recognised structure of one graph. ``linears`` includes already-quantized ones
    (``Linear.quantized``); ``blocks`` are ordered by layer, attention before MLP in a layer
    when that is the data-flow order."""

    linears: tuple[Linear, ...]
    norms: tuple[Norm, ...]
    residual_adds: tuple[ResidualAdd, ...]
    blocks: tuple[Block, ...]
    embeddings: tuple[Embedding, ...]

    @property
    def attention_blocks(self) -> tuple[Block, ...]:
        return tuple(b for b in self.blocks if b.kind == "attention")

    @property
    def mlp_blocks(self) -> tuple[Block, ...]:
        return tuple(b for b in self.blocks if b.kind == "mlp")

    @property
    def num_layers(self) -> int:
        return 1 + max((b.layer for b in self.blocks), default=-1)

    def role_counts(self) -> dict[str, int]:
        return dict(Counter(lin.role for lin in self.linears))

    def linear(self, node: str) -> Linear:
        """The linear computed by node ``node`` (KeyError if there is none)."""
        for lin in self.linears:
            if lin.node == node:
                return lin
        raise KeyError(node)


def analyze(graph: gs.Graph) -> ModelStructure:
    """Recognise the structure of ``graph`` without modifying it."""
    w = Walker(graph)
    linears = raw_linears(w)
    norms = _norms(w)
    embeddings = find_embeddings(w)
    drafts = detect_drafts(w, linears)
    blocks = build_blocks(w, drafts, linears, norms)
    linears = assign_roles(w, linears, blocks, embeddings)
    residual = _residual_adds(w, blocks, norms)
    return ModelStructure(tuple(linears), tuple(norms), tuple(residual), tuple(blocks), tuple(embeddings))


def find_linears(graph: gs.Graph, include_quantized: bool = False) -> list[Linear]:
    """Linears with constant weights, roles and blocks filled in.

    Linears whose weight already comes from DequantizeLinear are left out by default so a
    quantization pass never quantizes twice; ``include_quantized=True`` returns them too, with
    ``quantized=True``.
    """
    return [lin for lin in analyze(graph).linears if include_quantized or not lin.quantized]


def find_norms(graph: gs.Graph) -> list[Norm]:
    """RMSNorm / LayerNorm, decomposed or fused, in graph order."""
    return _norms(Walker(graph))


def find_blocks(graph: gs.Graph) -> list[Block]:
    """Attention and MLP blocks in layer order, each with its input norm."""
    return list(analyze(graph).blocks)


def find_residual_adds(graph: gs.Graph) -> list[ResidualAdd]:
    """Adds of a block output into the residual stream (and fused Skip norms doing that add)."""
    return list(analyze(graph).residual_adds)
