"""What the calibration cache's key costs: SmolLM2 mquant-w8a8 compiled cold (empty cache) and
warm (same model, recipe and data again), with this checkout and, side by side in the same run,
with an older checkout (``--baseline-src``: a git worktree of another commit, e.g. ab70bbc, the
last one that keyed each calibration by exporting the graph and hashing the exported model).

Each compile runs in its own process (``python -m edgeq compile``, own cache folder); the table
has wall seconds, calibration onnxruntime runs / cache hits, seconds spent keying (when the code
records it) and the output's hash (the two checkouts must write the same model).

Usage: python benchmarks/calibration_cache.py --model-dir artifacts/smollm2 --baseline-src /tmp/old \
           --out benchmarks/results/calibration-cache-DATE.json

The baseline worktree needs ``edgeq/passes`` -> ``../passes`` (and runtime_ops, kernels, models)
symlinks so that ``PYTHONPATH`` imports it instead of the installed checkout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from foundation import DATA, save_results

REPO = Path(__file__).resolve().parents[1]


def _compile(src: Path, model: Path, out: Path, cache: Path, recipe: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "EDGEQ_CACHE_DIR": str(cache), "EDGEQ_PROGRESS": "0"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "edgeq", "compile", str(model), "--recipe", recipe, "--calib",
                    str(DATA / "valid.txt"), "-o", str(out)], check=True, env=env, cwd=tempfile.gettempdir(),
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    report = json.loads((out / "report.json").read_text())
    cal = report["calibration"]
    digest = hashlib.sha256()
    for f in sorted(out.iterdir()):
        if f.name == "model.onnx" or f.name.endswith(".data"):
            digest.update(f.read_bytes())
    return {"wall_s": round(wall, 1), "seconds_total": report["seconds_total"], "onnxruntime_runs": cal["onnxruntime_runs"],
            "cache_hits": cal["cache_hits"], "calibration_s": cal["seconds"], "keying_s": cal.get("fingerprint_seconds"),
            "model_sha256_16": digest.hexdigest()[:16]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--baseline-src", type=Path, help="a worktree of the commit to compare with")
    p.add_argument("--recipe", default="mquant-w8a8")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    a.model_dir = a.model_dir.resolve()  # the compiles run from a temporary folder
    sources = {"this": REPO, **({"baseline": a.baseline_src.resolve()} if a.baseline_src else {})}
    rows: dict = {}
    with tempfile.TemporaryDirectory(prefix="edgeq-calibcache-") as tmp:
        for phase in ("cold", "warm"):  # interleaved: this, baseline, this, baseline
            for name, src in sources.items():
                rows[f"{name}/{phase}"] = _compile(src, a.model_dir / "model.onnx", Path(tmp) / f"{name}-{phase}",
                                                   Path(tmp) / f"cache-{name}", a.recipe)
                print(name, phase, rows[f"{name}/{phase}"], flush=True)
    save_results(a.out, {"recipe": a.recipe, "model": str(a.model_dir), "sources": {k: str(v) for k, v in sources.items()},
                         "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
