"""NPU hand-off figures (issue 9) on SmolLM2: for every shipped text recipe, is the compiled graph
inside the `generic-qdq` profile after lowering, does lowering leave perplexity unchanged, what
does the strict power-of-two profile cost, and how fast are `ort-cpu` graphs (edgeq ops kept,
onnxruntime inlines their function bodies) against their `generic-qdq` lowering.

Per recipe: ``edgeq compile`` (the recipe's own calibration settings) gives the ``ort-cpu`` graph
(the ort-cpu profile keeps edgeq ops and lowers nothing); each other profile's lowering passes are
then run on that graph, exactly the passes ``edgeq compile --target NAME`` appends to the recipe's,
and the result is checked against the profile (``edgeq check``). Perplexity: WikiText-2 test, the
first ``--eval-windows`` windows of 512 tokens (the protocol of data/wikitext-2/README.md). Latency: 512 tokens, batch 1,
median of 10 runs interleaved between the two graphs, for recipes whose graph has edgeq ops. A graph
whose lowering turned MatMulNBits back into DQ + MatMul is also evaluated with
``session.qdq_matmulnbits_accuracy_level = 0``: onnxruntime re-fuses it into MatMulNBits, by default
at accuracy level 4 (int8 activations), where the recipe's own graph pins level 0.

Usage: python benchmarks/npu_handoff.py --model-dir artifacts/smollm2 --out F [--recipes a,b] [--resume]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from foundation import interleaved_latency_ms, save_results

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"

RECIPES = ("w8a8", "w8a8-mse", "w8a16", "muxq-w8a8", "quarot-w8a8", "mquant-w8a8", "mquant-w8a8-a16down",
           "mquant-w4a8", "gptq-w4a16", "dpq-w4a8", "resq-w4a8", "resq-w4a4")
TARGETS = ("generic-qdq", "pow2-int")
# a graph lowered from MatMulNBits is also evaluated with onnxruntime's re-fusion pinned to fp32
ACCURACY_LEVEL_0 = {"session.qdq_matmulnbits_accuracy_level": "0"}


def _lower(base: Path, target: str, out: Path) -> dict:
    """Run the profile's lowering passes on a compiled graph, check it, save it under ``out``."""
    from edgeq.graph import ir
    from edgeq.passmanager.passbase import PassContext
    from edgeq.passmanager.pipeline import Pipeline
    from edgeq.passmanager.registry import get_pass
    from edgeq.targets import check_model, load_target

    profile = load_target(target)
    model = ir.load_model(base)
    lowered, records = Pipeline([get_pass(n)() for n in profile.lowering]).run(model, PassContext(), consume=True)
    result = check_model(lowered, profile).to_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    ir.save_model(lowered, out)
    rules: dict[str, int] = {}
    for v in result.get("violations", []):
        rules[v["rule"]] = rules.get(v["rule"], 0) + 1
    return {"clean": result["clean"], "violations": len(result.get("violations", [])), "rules": rules,
            "lowering": {r.name: r.summary for r in records if r.modified}}


def _has_edgeq_ops(path: Path) -> bool:
    import onnx

    return any(n.domain == "edgeq" for n in onnx.load(str(path), load_external_data=False).graph.node)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("artifacts/bench-handoff"))
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--eval-windows", type=int, default=40)
    p.add_argument("--resume", action="store_true", help="keep the rows of an earlier --out")
    p.add_argument("--redo-target", default=None, help="with --resume: redo this target's column (lowering, check, "
                   "perplexity) for --recipes from the compiled graphs of the earlier run")
    a = p.parse_args(argv)

    from edgeq.evaluate.ppl import perplexity

    fp32 = a.model_dir / "model.onnx"
    env = {**os.environ, "EDGEQ_PROGRESS": "0"}
    results = json.loads(a.out.read_text()) if a.resume and a.out.is_file() else {"eval_windows": a.eval_windows}

    def ppl(path: Path, config: dict | None = None) -> float:
        return round(perplexity(path, DATA / "test.txt", a.model_dir, windows=a.eval_windows, session_config=config)["ppl"], 3)

    def lowered_column(recipe: str, target: str) -> dict:
        lowered = a.work / f"{recipe}@{target}" / "model.onnx"
        col = _lower(a.work / recipe / "model.onnx", target, lowered)
        col["ppl"] = ppl(lowered)
        if "matmulnbits-to-qdq" in col["lowering"]:  # onnxruntime re-fuses DQ + MatMul at accuracy level 4
            col["ppl_accuracy_level_0"] = ppl(lowered, ACCURACY_LEVEL_0)
        return col

    if "fp32" not in results:
        results["fp32"] = ppl(fp32)
    for recipe in [r for r in a.recipes.split(",") if r]:
        if recipe in results and a.redo_target and a.redo_target in results[recipe]:
            row, target = results[recipe], a.redo_target
            row[target] = lowered_column(recipe, target)
            row[target]["ppl_change"] = round(row[target]["ppl"] / row["ort-cpu"]["ppl"] - 1, 5)
            print(recipe, target, json.dumps(row[target]), flush=True)
            save_results(a.out, results)
            continue
        if recipe in results:
            continue
        base = a.work / recipe / "model.onnx"
        start = time.perf_counter()
        if not base.is_file():
            subprocess.run([sys.executable, "-m", "edgeq", "compile", str(fp32), "--recipe", recipe,
                            "--calib", str(DATA / "valid.txt"), "-o", str(base.parent)],
                           check=True, env=env, stdout=subprocess.DEVNULL)
        row = {"ort-cpu": {"ppl": ppl(base), "edgeq_ops": _has_edgeq_ops(base)}}
        paths = {"ort-cpu": base}
        for target in TARGETS:
            row[target] = lowered_column(recipe, target)
            row[target]["ppl_change"] = round(row[target]["ppl"] / row["ort-cpu"]["ppl"] - 1, 5)
            paths[target] = a.work / f"{recipe}@{target}" / "model.onnx"
        if row["ort-cpu"]["edgeq_ops"]:
            ms = interleaved_latency_ms({"ort-cpu": paths["ort-cpu"], "generic-qdq": paths["generic-qdq"]})
            row["latency_ms_512"] = {k: round(v, 1) for k, v in ms.items()}
            row["latency_generic_over_ort_cpu"] = round(ms["generic-qdq"] / ms["ort-cpu"], 3)
        row["seconds"] = round(time.perf_counter() - start, 1)
        results[recipe] = row
        print(recipe, json.dumps(row), flush=True)
        save_results(a.out, results)
    save_results(a.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
