"""The rotation chain is exact on a real model (issue 52: Qwen2's q/k/v biases through rotation).

Compiles the float rotation chain (fuse-norms, ln-to-rms, rotate, rms with every layer split into a
float branch; no quantization) with ``edgeq compile`` (block-wise where the model is large, as a
user's compile would run), then runs the original and the rotated graph on the same WikiText-2 test
windows (onnxruntime CPU, graph optimizations off) and records, per window, the largest logit
difference over the largest logit magnitude (the fp32 tolerance the passes' exactness tests hold:
``FLOAT_EQUIV_RTOL``) and the top-1 agreement; pooled perplexity of both.

Usage: python benchmarks/rotation_exactness.py --model-dir artifacts/qwen25 --out F [--windows 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from foundation import save_results
from measure import run_measured

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"


ROTATION_FLOAT = """description = "the float rotation chain: fuse-norms, ln-to-rms, rotate, rms (every layer, float branch)"

[[pass]]
name = "fuse-norms"
sandwich = "keep"

[[pass]]
name = "ln-to-rms"

[[pass]]
name = "rotate"
essential = true
seed = 0

[[pass]]
name = "rms"
mode = "all"
branch = "float"
"""


def _nll(logits: np.ndarray, ids: np.ndarray) -> float:
    """Summed next-token negative log-likelihood of one window."""
    x = logits[0, :-1].astype(np.float64)
    x -= x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=REPO / "artifacts" / "rotation-exactness")
    ap.add_argument("--windows", type=int, default=2)
    args = ap.parse_args()

    from edgeq.graph.ir import session_options
    from edgeq.passmanager.passbase import FLOAT_EQUIV_RTOL
    from edgeq.textdata import feeds_for_windows, token_windows
    import onnxruntime as ort

    results = {"model": args.model_dir.name, "protocol": f"WikiText-2 test, first {args.windows} windows of 512 "
               "tokens; onnxruntime CPU, graph optimizations off; rel = max |rotated - fp32| / max |fp32| per window",
               "tolerance": FLOAT_EQUIV_RTOL}
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "rotation-float.toml"
        recipe.write_text(ROTATION_FLOAT)
        step = run_measured([sys.executable, "-m", "edgeq", "compile", str(args.model_dir / "model.onnx"), "--recipe",
                             str(recipe), "-o", str(args.work), "--force"])
    if step["code"] != 0:
        raise SystemExit(step["stderr"])
    report = json.loads((args.work / "report.json").read_text())
    results["compile"] = {"seconds": step["seconds"], "peak_rss_mb": step["peak_rss_mb"],
                          "blockwise": report.get("compile_path", {}).get("blockwise"),
                          "passes": {p["name"]: p.get("status") for p in report.get("passes", [])}}
    ids = token_windows(DATA / "test.txt", args.model_dir, 512, args.windows)
    so = session_options(optimize=False)
    rows, nll = [], {"fp32": 0.0, "rotated": 0.0}
    sessions = {}
    for name, path in (("fp32", args.model_dir / "model.onnx"), ("rotated", args.work / "model.onnx")):
        sessions[name] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for w in range(args.windows):
        out = {}
        for name, session in sessions.items():
            feeds = feeds_for_windows(session.get_inputs(), ids[w:w + 1])
            out[name] = session.run(["logits"], feeds)[0]
            nll[name] += _nll(out[name], ids[w])
        a, b = out["fp32"], out["rotated"]
        rows.append({"window": w, "rel_max_diff": float(np.abs(b - a).max() / np.abs(a).max()),
                     "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).mean())})
    tokens = args.windows * 511
    results["windows"] = rows
    results["ppl"] = {k: float(np.exp(v / tokens)) for k, v in nll.items()}
    results["within_tolerance"] = all(r["rel_max_diff"] <= FLOAT_EQUIV_RTOL for r in rows)
    save_results(args.out, results)


if __name__ == "__main__":
    main()
