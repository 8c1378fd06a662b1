"""Qualcomm's compiler in the loop (issue 31; Qwen2.5 in issue 52: --model-dir): a model's static pairs on the QNN HTP, through
onnxruntime-qnn (the HTP emulated on x86-64), per recipe:

- nodes the HTP refuses before (the qnn-htp lowering as it was: expand-functions,
  matmulnbits-to-qdq, symmetric-weights) and after (today's lowering), with CPU fallback disabled;
- ``--context-binary``: prepare time and size of each graph's context binary, load-back time;
- on the first ``--windows`` test windows, teacher-forced through the prefill graph (128-token
  chunks): logits agreement of the HTP (the context binaries) with onnxruntime CPU on the same
  graphs, and the perplexity of each (the HTP emulator's speed, about 1-2 minutes per 128-token
  chunk on 2 cores for SmolLM2, about 10 for Qwen2.5-0.5B, decides how many windows; each window
  is written as it is measured, and a rerun resumes after the last).

Usage: python benchmarks/qnn_htp.py --model-dir artifacts/smollm2-past --out F [--recipes a,b]
       [--windows N] [--before]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from foundation import save_results

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"

RECIPES = ("mquant-w8a8", "w8a16", "mquant-w4a16")
STATIC = "prefill=128,context=1024"
OLD_LOWERING = ["expand-functions", "matmulnbits-to-qdq", "symmetric-weights"]


def _edgeq(*args: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "edgeq", *args], check=True)
    return time.perf_counter() - started


def _old_profile(folder: Path) -> Path:
    """The qnn-htp profile with the lowering it had before the vendor was asked (no node-unit rule)."""
    text = (REPO / "edgeq" / "targets" / "profiles" / "qnn-htp.toml").read_text()
    lines = [ln for ln in text.splitlines() if not ln.startswith(("lowering =", "node_units", "vendor =", "int8_weight_range"))]
    path = folder / "qnn-htp-before.toml"
    path.write_text(f"lowering = {json.dumps(OLD_LOWERING)}\n" + "\n".join(lines) + "\n")
    return path


def _verdicts(pair: Path) -> dict:
    from edgeq.targets.qnn_vendor import ask_htp

    out = {}
    for graph in ("prefill.onnx", "decode.onnx"):
        v = ask_htp(pair / graph)
        reasons: dict[str, int] = {}
        for r in v.refusals:
            key = f"{r.op}: {r.reason}"
            reasons[key] = reasons.get(key, 0) + 1
        out[graph] = {"accepted": v.accepted, "refused_nodes": len(v.refusals), "reasons": reasons,
                      "session_seconds": round(v.seconds, 1)}
    return out


def _windows(tokenizer: Path, n: int, seq_len: int) -> np.ndarray:
    from edgeq.textdata import token_windows

    return token_windows(DATA / "test.txt", tokenizer, seq_len=seq_len, windows=n)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _on_both(pair: Path, ids: np.ndarray, done: list[dict], save) -> dict:
    """Each window teacher-forced through the prefill graph on onnxruntime CPU and on the HTP (its
    context binaries), one window at a time: logits agreement and both perplexities. ``done``: the
    windows measured by an earlier run (kept and skipped: an HTP window of a 0.5B model takes most of
    an hour on 2 cores); each new window is appended and ``save()`` called, so a run resumes."""
    from edgeq.generation.decoders import open_decoder
    from edgeq.generation.teacher_forced import window_logits
    from edgeq.runtime.nll import window_nll

    decoders = None
    for row in ids[len(done):]:
        if decoders is None:
            decoders = {"cpu": open_decoder(pair), "qnn-htp": open_decoder(pair, provider="qnn-htp")}
        logits, seconds = {}, {}
        for name, decoder in decoders.items():
            started = time.perf_counter()
            logits[name] = window_logits(decoder, row, "prefill").astype(np.float64)
            seconds[name] = round(time.perf_counter() - started, 1)
        a, b = logits["cpu"], logits["qnn-htp"]
        la, lb = _log_softmax(a), _log_softmax(b)
        done.append({"tokens": int(len(row) - 1),
                     "nll": {name: float(window_nll(v.astype(np.float32), np.asarray(row, np.int64)))
                             for name, v in logits.items()},
                     "max_abs_logit_diff": float(np.abs(a - b).max()), "max_abs_logit": float(np.abs(a).max()),
                     "top1": float((a.argmax(-1) == b.argmax(-1)).mean()),
                     "kl_cpu_to_htp": float((np.exp(la) * (la - lb)).sum(-1).mean()), "seconds": seconds})
        save()
    return _pooled(done)


def _graph_digests(pair: Path) -> dict[str, str]:
    """SHA-256 of the pair's two QDQ graphs and their weights (what both providers run)."""
    import hashlib

    digests = {}
    for path in sorted([*pair.glob("*.onnx"), *pair.glob("*.data")]):
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        digests[path.name] = h.hexdigest()
    return digests


def _check_same_pair(rec: dict, pair: Path) -> None:
    """A recompiled pair must be the one the earlier windows were measured on: its digests are kept
    on first compile and compared on every later one (edgeq's compile is deterministic)."""
    digests = _graph_digests(pair)
    kept = rec.setdefault("graph_sha256", {})
    if any(kept[name] != digest for name, digest in digests.items() if name in kept):
        sys.exit(f"qnn_htp.py: the recompiled {pair} differs from the pair measured before; "
                 "move the results file aside to measure the new one")
    kept.update(digests)


def _pooled(windows: list[dict]) -> dict:
    """The figures over the measured windows: pooled perplexities and their ratio, per-window ratios."""
    tokens = sum(w["tokens"] for w in windows)
    nll = {name: sum(w["nll"][name] for w in windows) for name in ("cpu", "qnn-htp")}
    return {"windows": len(windows), "tokens": tokens,
            "ppl": {name: float(np.exp(v / tokens)) for name, v in nll.items()},
            "htp_over_cpu": float(np.exp((nll["qnn-htp"] - nll["cpu"]) / tokens)),
            "htp_over_cpu_per_window": [float(np.exp((w["nll"]["qnn-htp"] - w["nll"]["cpu"]) / w["tokens"]))
                                        for w in windows],
            "top1_per_window": [w["top1"] for w in windows],
            "seconds": {name: round(sum(w["seconds"][name] for w in windows), 1) for name in ("cpu", "qnn-htp")},
            "seconds_per_128_token_call": {name: round(sum(w["seconds"][name] for w in windows)
                                                       / sum(-(-(w["tokens"] + 1) // 128) for w in windows), 1)
                                           for name in ("cpu", "qnn-htp")},
            "max_abs_logit_diff": max(w["max_abs_logit_diff"] for w in windows),
            "max_abs_logit": max(w["max_abs_logit"] for w in windows),
            "top1_agreement": float(np.mean([w["top1"] for w in windows])),
            "kl_cpu_to_htp": float(np.mean([w["kl_cpu_to_htp"] for w in windows]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=REPO / "artifacts" / "smollm2-past")
    ap.add_argument("--work", type=Path, default=REPO / "artifacts" / "qnn-bench")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--windows", type=int, default=2, help="test windows (HTP and CPU alike)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--before", action="store_true", help="also compile with the old lowering and ask the HTP")
    args = ap.parse_args()
    from edgeq.targets.qnn_vendor import vendor_version

    model = args.model_dir / "model.onnx"
    calib = DATA / "valid.txt"
    results = {"command": " ".join(["python", str(Path(sys.argv[0]).resolve().relative_to(REPO)), *sys.argv[1:]]), "vendor": f"onnxruntime-qnn {vendor_version()}", "static": STATIC,
               "ppl_protocol": f"WikiText-2 test, first {args.windows} windows of {args.seq_len} tokens, teacher-forced "
                               "through the prefill graph (batch 1), the same graphs on both providers",
               "recipes": {}}
    if args.out.exists():  # resumed: the earlier rows stay, the stamp names the latest command
        results = {**json.loads(args.out.read_text()), "command": results["command"]}
        results.pop("run", None)
    for recipe in args.recipes.split(","):
        rec = results["recipes"].setdefault(recipe, {})
        pair = args.work / recipe
        if not (pair / "report.json").exists():  # a resumed run on a fresh machine compiles the pair again
            seconds = round(_edgeq("compile", str(model), "--recipe", recipe, "--calib", str(calib),
                                   "--static", STATIC, "--target", "qnn-htp", "--context-binary",
                                   "-o", str(pair), "--force"), 1)
            rec.setdefault("compile_seconds", seconds)
            _check_same_pair(rec, pair)
            save_results(args.out, results)
        if "after" not in rec:
            report = json.loads((pair / "report.json").read_text())
            rec["compile_report_seconds"] = report["seconds_total"]
            rec["context_binaries"] = report["qnn_context"]
            rec["lowering"] = {r["name"]: r["summary"] for r in report["target"]["lowering"] if r["modified"]}
            rec["after"] = _verdicts(pair)
            save_results(args.out, results)
        if args.before and "before" not in rec:
            with tempfile.TemporaryDirectory() as tmp:
                old = _edgeq("compile", str(model), "--recipe", recipe, "--calib", str(calib), "--static", STATIC,
                             "--target", str(_old_profile(Path(tmp))), "-o", str(Path(tmp) / "pair"))
                rec["before"] = {"compile_seconds": round(old, 1), **_verdicts(Path(tmp) / "pair")}
            save_results(args.out, results)
        if rec.get("htp_vs_cpu", {}).get("windows", 0) < args.windows:
            done = rec.setdefault("htp_vs_cpu_windows", [])
            rec["htp_vs_cpu"] = _on_both(pair, _windows(args.model_dir, args.windows, args.seq_len), done,
                                         lambda: save_results(args.out, results))
            save_results(args.out, results)
    if "fp32" not in results:  # the exported with-past graph, same windows, same route
        from edgeq.generation.teacher_forced import perplexity_through

        r = perplexity_through(model, DATA / "test.txt", args.model_dir, windows=args.windows, seq_len=args.seq_len,
                               through="prefill")
        results["fp32"] = {"ppl": r["ppl"], "windows": r["windows"]}
    save_results(args.out, results)

if __name__ == "__main__":
    main()
