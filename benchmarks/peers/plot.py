"""Perplexity ratio to fp32 against CPU latency, one marker per tool and setting (peers.py's PNG).

Runs in the ``plot`` venv of ``pins.toml`` (matplotlib is not an edgeq dependency):
    .venvs/plot/bin/python benchmarks/peers/plot.py RESULTS.json OUT.png
Rows without a perplexity or a latency (errors, OpenVINO-only rows use their runtime latency) are
left out of the plot and listed under it.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MARKERS = {"w8a8": "o", "w4": "s", "w8a16": "D", "w4a16": "v", "fp32": "*"}


def main(results: str, png: str) -> int:
    data = json.load(open(results))
    fig, ax = plt.subplots(figsize=(9, 6))
    left_out = []
    tools = sorted({r["tool"] for r in data["rows"]})
    colors = {t: plt.cm.tab10(i % 10) for i, t in enumerate(tools)}
    for r in data["rows"]:
        latency = r.get("latency_ms") or r.get("runtime_latency_ms")
        if r.get("error") or not r.get("ppl_ratio") or not latency:
            left_out.append(f"{r['tool']} {r.get('setting')}: {r.get('error') or 'no ppl or latency'}"[:110])
            continue
        hollow = r.get("latency_ms") is None  # OpenVINO runtime latency, not onnxruntime's
        ax.scatter(latency, r["ppl_ratio"], marker=MARKERS.get(r["category"], "^"), s=80,
                   facecolors="none" if hollow else colors[r["tool"]], edgecolors=colors[r["tool"]],
                   label=f"{r['tool']} {r['setting']}")
        ax.annotate(f"{r['tool']}:{r['setting']}", (latency, r["ppl_ratio"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("latency of one 512-token forward pass, batch 1 (ms; hollow = OpenVINO runtime)")
    ax.set_ylabel("perplexity / fp32 perplexity (WikiText-2 test, 40 x 512)")
    machine = data["machine"]
    ax.set_title(f"SmolLM2-135M, {machine['cpu']} ({data['rows'][0].get('isa', '')}), {machine['cores']} cores\n"
                 "o = static W8A8, s = 4-bit weights, * = fp32", fontsize=9)
    ax.grid(alpha=0.3)
    if left_out:
        fig.text(0.01, 0.005, "not plotted: " + "; ".join(left_out)[:600], fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
