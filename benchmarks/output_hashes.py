"""Hash what `edgeq compile` writes on the recipes x tiny families matrix and on the block-wise,
static and genai routes, so that a refactor can show its outputs are byte-identical.

Why: a change to the compiler's shape (routes, the report record, module layout) must not change
a single byte of a graph, encodings file or report. Run it with the edgeq of the commit before and
after (each checkout's own venv) over the same folder and compare:

    python benchmarks/output_hashes.py --edgeq /path/to/old/.venv/bin/edgeq --work /tmp/oh --out old.json
    python benchmarks/output_hashes.py --edgeq .venv/bin/edgeq --work /tmp/oh --out new.json
    python benchmarks/output_hashes.py --compare old.json new.json

Volatile fields are dropped before hashing (timestamps, durations, peak RSS, the manifest's hash
of report.json, which holds them); everything else, graphs and weights included, is hashed as
written. The same --work folder keeps the input paths the reports record equal between runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--calib-windows", "2", "--seq-len", "16", "--no-cache"]
VOLATILE = ("second", "time", "created", "rss", "peak", "elapsed", "duration", "started")


def _clean(obj):
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if not any(w in k.lower() for w in VOLATILE)}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def _digest(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".json":
        try:
            body = _clean(json.loads(data))
        except ValueError:
            return hashlib.sha256(data).hexdigest()
        if path.name == "manifest.json" and isinstance(body, dict):
            files = body.get("files") or {}
            body["files"] = {k: v for k, v in files.items() if not k.endswith("report.json")}
        data = json.dumps(body, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


def folder_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): _digest(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _run(edgeq: str, argv: list[str]) -> tuple[int, str]:
    done = subprocess.run([edgeq, *argv], capture_output=True, text=True, env={"EDGEQ_PROGRESS": "0",
                          "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    return done.returncode, done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""


def cases(edgeq: str, work: Path) -> list[tuple[str, list[str]]]:
    """(name, compile argv) for every case; exports the tiny models it needs first."""
    recipes = [line.split()[0] for line in subprocess.run([edgeq, "recipes"], capture_output=True, text=True,
                                                          check=True).stdout.splitlines() if line.strip()]
    archs = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2"]
    sys.path.insert(0, str(ROOT / "tests"))
    from toy import write_text, write_tokenizer  # a word-level tokenizer whose ids fit every tiny vocabulary

    (work / "tok").mkdir(parents=True, exist_ok=True)
    write_tokenizer(work / "tok")
    calib = write_text(work / "calib.txt", 4000)
    data = ["--calib", str(calib), "--tokenizer", str(work / "tok"), *FAST]
    out = []
    for arch in archs:
        model = work / "models" / arch
        if not (model / "model.onnx").is_file():
            subprocess.run([edgeq, "export", "tiny", arch, "-o", str(model)], check=True, capture_output=True)
        for recipe in recipes:
            out.append((f"{arch}/{recipe}", ["compile", str(model / "model.onnx"), "--recipe", recipe, *data]))
    past = work / "models" / "llama-past"
    if not (past / "model.onnx").is_file():
        subprocess.run([edgeq, "export", "tiny", "llama", "--with-past", "-o", str(past)], check=True,
                       capture_output=True)
    llama = work / "models" / "llama" / "model.onnx"
    common = data
    out += [
        ("route/blockwise-mquant-w8a8", ["compile", str(llama), "--recipe", "mquant-w8a8", "--blockwise", "on", *common]),
        ("route/blockwise-w8a8", ["compile", str(llama), "--recipe", "w8a8", "--blockwise", "on", *common]),
        ("route/static-mquant-w8a8", ["compile", str(past / "model.onnx"), "--recipe", "mquant-w8a8", "--static",
                                      "prefill=16,context=32", *common]),
        ("route/static-w8a16-qnn", ["compile", str(past / "model.onnx"), "--recipe", "w8a16", "--static",
                                    "prefill=16,context=32", "--target", "qnn-htp", *common]),
        ("route/genai", ["compile", str(past / "model.onnx"), "--recipe", "quarot-gptq-w4a16", "--target", "ort-genai",
                         *common]),
        ("route/target-qnn-htp", ["compile", str(llama), "--recipe", "mquant-w8a8", "--target", "qnn-htp", *common]),
        # the target's output stages (Qualcomm's compiler: pip install 'edgeq[qnn]'): binaries and genai's
        # pipeline, then the parts prepared instead of the whole graphs
        ("route/static-context-binary", ["compile", str(past / "model.onnx"), "--recipe", "mquant-w8a8", "--static",
                                         "prefill=8,context=48", "--target", "qnn-htp", "--context-binary", *common]),
        ("route/static-context-binary-parts", ["compile", str(past / "model.onnx"), "--recipe", "mquant-w8a8",
                                               "--static", "prefill=8,context=48", "--target", "qnn-htp",
                                               "--context-binary", "--max-context-mb", "0.15", *common]),
    ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edgeq", default=str(ROOT / ".venv" / "bin" / "edgeq"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/edgeq-output-hashes"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    ap.add_argument("--only", metavar="PREFIX", help="run only the cases whose name starts with PREFIX (e.g. route/)")
    args = ap.parse_args()
    if args.compare:
        old, new = (json.loads(p.read_text()) for p in args.compare)
        differ = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        for key in differ:
            o, n = old.get(key, {}), new.get(key, {})
            files = sorted(f for f in set(o.get("files", {})) | set(n.get("files", {}))
                           if o.get("files", {}).get(f) != n.get("files", {}).get(f))
            print(f"DIFFERS {key}: exit {o.get('exit')} -> {n.get('exit')}; files {files[:6]}")
        print(f"{len(old)} cases, {len(differ)} differ")
        return 1 if differ else 0
    results = {}
    work = args.work.resolve()
    todo = [case for case in cases(args.edgeq, work) if args.only is None or case[0].startswith(args.only)]
    for i, (name, argv) in enumerate(todo, 1):
        out = work / "out" / name
        code, last = _run(args.edgeq, [*argv, "-o", str(out), "--force"])
        results[name] = {"exit": code, "files": folder_hashes(out) if code == 0 else {},
                         "error": last if code else ""}
        print(f"[{i}/{len(todo)}] {name}: exit {code} {last[:100] if code else ''}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
