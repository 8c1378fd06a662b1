"""The summary table of ``aimet_htp.py``'s results file: per pair and test window the perplexity on
onnxruntime CPU, with exact QDQ and on the HTP, pooled over windows, HTP over CPU on the windows both
ran, and edgeq's own mquant-w4a16 HTP pair on the same windows (read from its evaluation files)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from aimet_bookkeeping import Run

PROVIDERS = ("cpu", "exact", "htp")


def _pooled(rows: list[dict]) -> float | None:
    if not rows:
        return None
    return math.exp(sum(r["nll"] for r in rows) / sum(r["tokens"] for r in rows))



def _last_json(path: Path) -> dict | None:
    """The JSON record on the last line of an ``edgeq eval ppl --json`` output file; None while the
    run has written nothing (or was stopped mid-line)."""
    if not (path.is_file() and path.stat().st_size):
        return None
    try:
        return json.loads(path.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None

def summarize(run: Run, settings: list[str], windows: list[int], edgeq_evals: Path) -> None:
    ev = run.work / "evals"
    table = {}
    # "@as-exported": AIMET's graph as written (--no-fold; the first run of 2026-11-28, CPU only: the HTP refused it)
    names = ["fp32-float", "fp32-htp-form", "edgeq-mquant-w4a16", *settings, *(f"{s}@as-exported" for s in settings)]
    for name in names:
        per = {}
        for k in windows:
            row = {}
            for prov in PROVIDERS:
                got = _last_json(ev / f"{name}-{prov}-{k}.json")
                if got is not None:
                    row[prov] = got
            if row:
                per[k] = row
        if not per:
            continue
        out = {"per_window": {}}
        for k, row in per.items():
            out["per_window"][k] = {p: round(r["ppl"], 4) for p, r in row.items()}
            if "htp" in row:
                out["per_window"][k]["htp_seconds"] = round(row["htp"]["seconds"], 1)
            if "htp" in row and "cpu" in row:
                out["per_window"][k]["htp_over_cpu"] = round(row["htp"]["ppl"] / row["cpu"]["ppl"], 4)
        both = [k for k, row in per.items() if "htp" in row and "cpu" in row]
        for prov in PROVIDERS:
            rows = [per[k][prov] for k in per if prov in per[k]]
            out[f"{prov}_pooled"] = round(_pooled(rows), 4) if rows else None
            out[f"{prov}_windows"] = sorted(k for k in per if prov in per[k])
        if both:
            c, h = _pooled([per[k]["cpu"] for k in both]), _pooled([per[k]["htp"] for k in both])
            out["htp_vs_cpu_same_windows"] = {"windows": both, "cpu": round(c, 4), "htp": round(h, 4),
                                              "htp_over_cpu": round(h / c, 4)}
        table[name] = out
    # edgeq's own mquant-w4a16 HTP pair on the same windows (same commands, read-only)
    ref = {}
    for k in windows:
        row = {}
        for prov in ("cpu", "htp"):
            got = _last_json(edgeq_evals / f"w4a16h8-{prov}-{k}.json")
            if got is not None:
                row[prov] = got
        if row:
            ref[k] = row
    if ref:
        both = [k for k, r in ref.items() if "cpu" in r and "htp" in r]
        table["edgeq mquant-w4a16 (/tmp/exp/s/w4a16h8-whole)"] = {
            "per_window": {k: {p: round(r["ppl"], 4) for p, r in row.items()} for k, row in ref.items()},
            "cpu_pooled": round(_pooled([ref[k]["cpu"] for k in ref if "cpu" in ref[k]]), 4),
            "htp_vs_cpu_same_windows": ({"windows": both, "cpu": round(_pooled([ref[k]["cpu"] for k in both]), 4),
                                         "htp": round(_pooled([ref[k]["htp"] for k in both]), 4)} if both else None),
            "source": str(edgeq_evals / "w4a16h8-{cpu,htp}-K.json"),
        }
    run.res["summary"] = table
    run.save()
