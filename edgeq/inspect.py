"""``edgeq inspect``: the recognised structure and, with calibration data, activation ranges.

With ``--calib`` every linear's input is observed (per-channel absolute maximum) and the report
lists its range and its outlier channels (|x| above the threshold, the LLM.int8()/MUXQ rule), the
numbers that decide whether static per-tensor activation quantization can work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import numpy as np

from edgeq.graph import ir
from edgeq.calib.dataset import InputLimits, build_calibration_set
from edgeq.calib.observers import PerChannelAbsMaxObserver
from edgeq.calib.session import Calibrator
from edgeq.passes.methods.eq9 import eq9_table, format_eq9_table
from edgeq.structure import analyze, format_structure


def inspect_model(model_path: Path, calib: Path | None, tokenizer: Path | None, windows: int, seq_len: int,
                  threshold: float, as_json: bool = False) -> str:
    from edgeq.textdata import default_tokenizer_dir

    model = ir.load_model(model_path)
    graph = ir.to_graph(model)
    structure = analyze(graph)
    rows: list[dict[str, Any]] = []
    if calib is not None:
        specs = ir.input_specs(model)
        data = build_calibration_set(calib, specs, tokenizer or default_tokenizer_dir(model_path), windows, seq_len,
                                     limits=InputLimits.of(model, model_path))
        names = sorted({lin.input for lin in structure.linears})
        observers = Calibrator(data).observe(graph, {n: PerChannelAbsMaxObserver for n in names}, "inspect:absmax")
        for lin in structure.linears:
            absmax = cast(np.ndarray, cast(PerChannelAbsMaxObserver, observers[lin.input]).absmax)  # (observed)
            outliers = np.flatnonzero(absmax > threshold)
            rows.append({"linear": lin.node, "role": lin.role, "k": lin.k, "n": lin.n,
                         "absmax": float(absmax.max()), "median_channel_absmax": float(np.median(absmax)),
                         "outlier_channels": outliers.tolist()})
    eq9 = eq9_table(graph)
    if as_json:
        return json.dumps({"structure": format_structure(structure), "eq9": eq9, "activations": rows}, indent=1)
    lines = [format_structure(structure), "", format_eq9_table(eq9)]
    if rows:
        lines.append(f"\nactivation ranges at linear inputs ({data.description}; outlier: |x| > {threshold:g})")
        lines.append(f"{'linear':<48} {'role':<10} {'absmax':>9} {'median':>8} outliers")
        for r in rows:
            shown = ",".join(map(str, r["outlier_channels"][:8])) + ("..." if len(r["outlier_channels"]) > 8 else "")
            lines.append(f"{r['linear'][:48]:<48} {r['role']:<10} {r['absmax']:9.2f} {r['median_channel_absmax']:8.3f} "
                         f"{len(r['outlier_channels'])} [{shown}]")
    return "\n".join(lines)
