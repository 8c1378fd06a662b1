"""``format_structure``: the human-readable summary printed by ``edgeq inspect``."""

from __future__ import annotations

from collections import Counter

from edgeq.structure.core import ModelStructure
from edgeq.structure.norms import Norm


def _counts(counter: Counter) -> str:
    return ", ".join(f"{key} {count}" for key, count in sorted(counter.items())) or "none"


def _norm_label(norm: Norm | None) -> str:
    if norm is None:
        return "norm=-"
    return f"norm={norm.kind}{'' if not norm.fused else '(' + norm.op + ')'}"


def _header(s: ModelStructure) -> list[str]:
    quantized = sum(lin.quantized for lin in s.linears)
    norms = Counter(f"{n.kind}{'/fused' if n.fused else ''}" for n in s.norms)
    lines = [
        f"linears: {len(s.linears)}" + (f" ({quantized} already quantized)" if quantized else ""),
        f"  roles: {_counts(Counter(lin.role for lin in s.linears))}",
        f"norms: {len(s.norms)} ({_counts(norms)})",
        f"residual adds: {len(s.residual_adds)}",
        f"blocks: {len(s.attention_blocks)} attention, {len(s.mlp_blocks)} mlp in {s.num_layers} layers",
    ]
    for emb in s.embeddings:
        lines.append(f"embedding: {emb.node} {emb.rows}x{emb.dim}")
    return lines


def _block_line(s: ModelStructure, block) -> str:
    by_node = {lin.node: lin for lin in s.linears}
    kind = block.kind if block.kind == "attention" else f"mlp({block.activation}{', gated' if block.gated else ''})"
    parts = [f"{block.name:<10} {kind:<20} {_norm_label(block.norm):<10}"]
    for name, role in zip(block.linears, block.roles):
        lin = by_node[name]
        parts.append(f"{role} {lin.k}x{lin.n}" + (" q" if lin.quantized else ""))
    return "  ".join(parts)


def format_structure(structure: ModelStructure) -> str:
    """Counts first, then one line per block (norm kind, linears with role and K x N), then the
    linears outside every block (heads, tied embeddings, unexplained ones)."""
    lines = _header(structure)
    lines += [_block_line(structure, b) for b in structure.blocks]
    for lin in structure.linears:
        if lin.block is None:
            tied = f" tied to {lin.tied_embedding}{' (copy)' if lin.tied_copy else ''}" if lin.tied_embedding else ""
            source = "" if lin.role_source == "structure" else f" [{lin.role_source}]"
            lines.append(f"{'-':<10} {lin.role:<20} {lin.node} {lin.k}x{lin.n}{tied}{source}")
    return "\n".join(lines)
