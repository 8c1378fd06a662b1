"""MQuant Eq. 9: which weights get a channel-mean outlier from an online Hadamard.

For a normalized Hadamard H whose first row is all 1/sqrt(n), row 0 of ``H^T W`` (W: [n, m], the
MatMul layout, n = input features) is ``sqrt(n) * mean(W[:, j])`` (Eq. 8). Column j gets a new
outlier when that exceeds the column's largest entry (Eq. 9). We compare magnitudes,
``|sqrt(n) mean(W[:, j])| > max_i |W[i, j]|``: the paper's argument is about the incoherence
max|HW| / max|W| (Eq. 7), which a large negative mean raises just as well.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs


def eq9_columns(w_kn: np.ndarray) -> np.ndarray:
    """Boolean per output column: does it meet Eq. 9 for a Hadamard over the K axis?"""
    w = np.asarray(w_kn, np.float64)
    n = w.shape[0]
    first_row = np.abs(np.sqrt(n) * w.mean(axis=0))
    return first_row > np.abs(w).max(axis=0)


def eq9_table(graph: gs.Graph) -> dict:
    """MQuant Table 2 for one model: the MLP output linears (where the online Hadamard goes) and
    how many meet Eq. 9, plus the same count over all linears."""
    from edgeq.structure import analyze
    from edgeq.passes.methods.weights import LinearEditor

    s = analyze(graph)
    editor = LinearEditor(graph)
    by_node = {lin.node: lin for lin in s.linears if not lin.quantized}
    rows: list[dict] = []
    for block in s.mlp_blocks:
        lin = by_node.get(block.linears[-1]) if block.linears else None
        if lin is None:
            continue
        cols = eq9_columns(editor.weight(lin))
        rows.append({"layer": block.layer, "linear": lin.node, "role": lin.role, "k": lin.k, "n": lin.n,
                     "columns_meeting": int(cols.sum())})
    all_meeting = sum(int(eq9_columns(editor.weight(lin)).any()) for lin in by_node.values())
    return {
        "mlp_output_blocks": len(rows),
        "mlp_output_blocks_meeting": sum(r["columns_meeting"] > 0 for r in rows),
        "all_linears": len(by_node),
        "all_linears_meeting": all_meeting,
        "rows": rows,
    }


def format_eq9_table(table: dict, part: str = "LLM") -> str:
    n, m = table["mlp_output_blocks"], table["mlp_output_blocks_meeting"]
    ratio = f"{100.0 * m / n:.1f}%" if n else "-"
    lines = ["Eq. 9 (MQuant Table 2): MLP output linears (down_proj/fc2) whose online Hadamard creates a channel-mean outlier",
             f"{'part':<8} {'blocks':>7} {'meet Eq. 9':>11} {'ratio':>7}",
             f"{part:<8} {n:>7} {m:>11} {ratio:>7}",
             f"all linears: {table['all_linears_meeting']} of {table['all_linears']} meet Eq. 9"]
    meeting = [f"{r['layer']}({r['columns_meeting']})" for r in table["rows"] if r["columns_meeting"]]
    if meeting:
        lines.append("layers meeting (columns): " + " ".join(meeting))
    return "\n".join(lines)
