"""Structure recognition shared by every quantization pass.

Finds, from data flow rather than tensor names: linears (MatMul/Gemm with constant weights) with
their roles (q/k/v/o, gate/up/down, fc1/fc2, qkv, lm_head, classifier), norms (RMSNorm and
LayerNorm, decomposed or fused), attention and MLP blocks with their input norms, residual adds
and tied embeddings. Node names are only a fallback hint for linears no pattern explains
(``Linear.role_source == 'name'``). What they find on each model family's export (norm kind,
sandwich norms, parallel blocks, fused projections, per-head norms) is declared in
``edgeq.families`` and checked against them by ``tests/test_families.py``; the matchers never
branch on a family's name.

Typical use::

    s = analyze(graph)            # one walk; everything below comes from it
    print(format_structure(s))
    for lin in s.linears: ...
"""

from edgeq.structure._graph import BreadthFirst
from edgeq.structure.blocks import Block, ResidualAdd
from edgeq.structure.core import (
    ModelStructure,
    analyze,
    find_blocks,
    find_linears,
    find_norms,
    find_residual_adds,
)
from edgeq.structure.linears import Embedding, Linear
from edgeq.structure.norms import Norm
from edgeq.structure.report import format_structure

__all__ = [
    "Block",
    "BreadthFirst",
    "Embedding",
    "Linear",
    "ModelStructure",
    "Norm",
    "ResidualAdd",
    "analyze",
    "find_blocks",
    "find_linears",
    "find_norms",
    "find_residual_adds",
    "format_structure",
]
