"""The outputs of a ``peers.py`` results file: the docs/peers.md table (``--table``) and the plot
(perplexity ratio against latency, drawn in the ``plot`` venv of pins.toml)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEERS_DIR = REPO / "benchmarks" / "peers"


def markdown_table(results: Path) -> str:
    """The docs/peers.md table of a results file (``--table``)."""
    data = json.loads(results.read_text())

    def cell(value, fmt="{}"):
        return "-" if value is None else fmt.format(value)

    lines = ["| tool | setting | W/A bits | calib | group | lm_head / emb bits | acc level | ppl (x fp32) | exact-QDQ ppl "
             "| compile s | peak RSS MiB | ORT latency ms | other runtime ms | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["rows"]:
        ratio = f" ({r['ppl_ratio']:.3f})" if r.get("ppl_ratio") else ""
        ppl = f"{r['ppl']:.3f}{ratio}" if r.get("ppl") else "-"
        setting = (r.get("setting") or "-") + (" (g32: contaminated)" if r.get("caveat") else "")
        cells = [r["tool"], setting, f"{r.get('weight_bits', '-')}/{r.get('activation_bits', '-')}",
                 cell(r.get("calib_windows")), cell(r.get("group_size")),
                 f"{cell(r.get('lm_head_bits'))} / {cell(r.get('embedding_bits'))}", cell(r.get("accuracy_level")), ppl,
                 f"{r['ppl_exact']:.3f}" if r.get("ppl_exact") else "-", str(r.get("compile_s") or "-"),
                 str(r.get("peak_rss_mb") or "-"), str(r.get("latency_ms") or "-"),
                 f"{r['runtime_latency_ms']:.0f} ({r.get('runtime', '')})" if r.get("runtime_latency_ms") else "-",
                 (r.get("error") or "")[:160].replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: Path, png: Path) -> None:
    """Perplexity ratio against latency, one marker per tool and setting (matplotlib lives in the
    ``plot`` venv of pins.toml, not in edgeq's)."""
    from venvs import ensure_venv

    python = ensure_venv("plot")
    if python is None:
        print("[peers] no plot: the plot venv could not be installed", file=sys.stderr)
        return
    subprocess.run([str(python), str(PEERS_DIR / "plot.py"), str(results), str(png)], check=False, cwd=REPO)
