"""Static VLM deployments of the trained easy-VQA VLM on CPU and on the (emulated) HTP (issue 45 item 3).

Given an ``edgeq export trained-vlm`` folder, each variant is compiled with ``edgeq compile
VLM/with-past/model.onnx --static prefill=P,context=C`` (docs/static-vlm-deployment.md) and scored
with ``edgeq eval vqa`` from pixels:

- ``fp32``: the export folder itself (the dynamic fp32 graph: the reference of every figure) and the
  fp32 static deployment (recipe ``fp32``: the static path alone; CPU only);
- ``w8a8-single``: ``mquant-w8a8-vlm`` with one static scale per activation site (``msq`` -> ``qdq``,
  no ``aifs``), the edit ``benchmarks/multimodal_msq.py`` and ``benchmarks/trained_vlm.py`` make;
- ``w8a8-msq``: ``mquant-w8a8-vlm`` without ``aifs``: a static deployment then keeps the prompt's
  order, the image at its position ``m`` and MSQ's visual scale on prefill rows ``[m, m + V)``
  (``order: original`` in ``report.json`` ``static.vlm``);
- ``w8a8-msq+aifs``: ``mquant-w8a8-vlm`` as shipped: the visual tokens at prefill rows ``[0, V)``;
- ``w4a16-msq+aifs``: ``mquant-w4a16-vlm`` (GPTQ int4 blocks of 64, head int8, 16-bit activations,
  MSQ; the 4-bit form the HTP takes); ``w4a16-single`` (its ``qdq`` form) on request.

Per variant: a CPU compile (no target) scored on ``--samples`` questions (exact match, per type),
teacher-forced logits at the answer positions (each gold answer token and the end token, the gold
tokens fed back: the positions exact match scores) for the mean KL divergence and top-1 agreement
against the fp32 export's; then a ``--target qnn-htp --context-binary`` compile scored on the
emulated HTP on ``--htp-samples`` questions and, on the same questions, that folder's graphs on
CPU: the HTP's answers against the CPU's. Every step runs as a subprocess (its command line,
wall time, peak RSS, load average and the tail of its output are recorded) and the results file is
rewritten after each one, so a run that stops resumes where it stopped (a step with rc 0 whose
output is there is not run again; ``--redo`` names steps to run again).

Usage (the real model: figures; the --quick one only proves the pipeline):
    nice -n 5 python benchmarks/vlm_static.py --model-dir /tmp/exp/vlm/trained-vlm \\
        --out benchmarks/results/vlm-static-DATE.json --work artifacts/bench-vlm-static \\
        [--samples 200] [--htp-samples 4] [--prefill 64 --context 128] [--variants ...] [--no-htp]
    python benchmarks/vlm_static.py logits FOLDER --samples N --out F.npz [--provider cpu|qnn-htp]
    python benchmarks/vlm_static.py --out F --table        # the markdown table of a results file
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from foundation import save_results

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "edgeq" / "recipes"
EDGEQ = [sys.executable, "-m", "edgeq"]
RSS_TAG = "vlm_static peak RSS kB: "

# variant -> (recipe file or built-in name, edit of its text); the order is the run order
VARIANTS = {
    "fp32": ("fp32", None),
    "w8a8-single": ("mquant-w8a8-vlm", "single"),
    "w8a8-msq": ("mquant-w8a8-vlm", "msq"),
    "w8a8-msq+aifs": ("mquant-w8a8-vlm", None),
    "w4a16-msq+aifs": ("mquant-w4a16-vlm", None),
    "w4a16-single": ("mquant-w4a16-vlm", "single"),
}
DEFAULT_VARIANTS = ("fp32", "w8a8-single", "w8a8-msq", "w8a8-msq+aifs", "w4a16-msq+aifs")
NO_HTP = ("fp32",)  # float graphs: not the HTP's


def variant_recipe(variant: str) -> str | None:
    """The recipe TOML text of ``variant`` (None: the built-in ``fp32``)."""
    name, edit = VARIANTS[variant]
    if name == "fp32":
        return None
    text = (RECIPES / f"{name}.toml").read_text()
    if edit is None:
        return text
    text = re.sub(r'\[\[pass\]\]\nname = "aifs".*?\n\n', "", text, flags=re.DOTALL)  # MSQ without AIFS
    if "aifs" in re.findall(r'name = "([^"]+)"', text):
        raise RuntimeError(f"{name}: could not remove its aifs pass")
    if edit == "msq":
        return text
    # single: one static scale per site: msq's settings on the plain qdq pass
    return re.sub(r'(lowering|min_scale_ratio) = .*\n', "", text.replace('name = "msq"', 'name = "qdq"'))


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_step(results: dict, out: Path, key: str, cmd: list[str], done: Path | None, redo: set[str],
             json_stdout: bool = False, after: tuple[str, ...] = ()) -> dict | None:
    """Run ``cmd`` as step ``key`` unless it succeeded before with the same command and ``done``
    (its output) exists; record command, seconds, peak RSS, load and output tail (and its JSON
    stdout), save the file. A step that runs drops the records of the steps ``after`` it (they
    read its output: they run again)."""
    steps = results.setdefault("steps", {})
    old = steps.get(key)
    if (old and old.get("rc") == 0 and old.get("command") == shlex.join(cmd) and (done is None or done.exists())
            and key not in redo):
        print(f"[{key}] done before ({old['seconds']} s)", flush=True)
        return old
    for later in after:
        steps.pop(later, None)
    print(f"[{key}] {shlex.join(cmd)}", flush=True)
    env = {**os.environ, "EDGEQ_PROGRESS": "0", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "benchmarks"), os.environ.get("PYTHONPATH")]))}
    load = _loadavg()
    timer = ["/usr/bin/time", "-f", f"{RSS_TAG}%M"] if Path("/usr/bin/time").is_file() else []
    start = time.perf_counter()
    proc = subprocess.run([*timer, *cmd], capture_output=True, text=True, env=env, check=False)
    seconds = round(time.perf_counter() - start, 1)
    stdout, stderr, peak = proc.stdout, proc.stderr, None
    if timer and RSS_TAG in stderr:  # GNU time's line: the child's own peak RSS
        stderr, _, tail = stderr.rpartition(RSS_TAG)
        peak = round(int(tail.split()[0]) / 1024, 1) if tail.split() and tail.split()[0].isdigit() else None
    record = {"command": shlex.join(cmd), "rc": proc.returncode, "seconds": seconds,
              "started": datetime.datetime.now().isoformat(timespec="seconds"), "loadavg_at_start": load,
              "loadavg_at_end": _loadavg(), "peak_rss_mb": peak,
              "output_tail": (stdout if not json_stdout else "")[-1500:] + stderr[-1500:]}
    if json_stdout and proc.returncode == 0:
        record["result"] = json.loads(stdout)
    steps[key] = record
    save(out, results)
    print(f"[{key}] rc {proc.returncode} in {seconds} s", flush=True)
    if proc.returncode != 0:
        print(record["output_tail"], flush=True)
        return None
    return record


def save(out: Path, results: dict) -> None:
    """The results file rewritten whole with its summary, stamped by ``foundation.save_results`` (the
    run's command, commit, versions, machine and date; a later run that adds to it under ``resumed``)."""
    results["summary"] = summary(results)
    with contextlib.redirect_stdout(io.StringIO()):  # (save_results prints the file: not after every step)
        save_results(out, results)


def fidelity(ref_npz: Path, test_npz: Path) -> dict:
    """Mean KL(fp32 || test) and top-1 agreement at the answer positions of two ``logits`` files."""
    from edgeq.evaluate.fidelity import Fidelity

    ref, test = np.load(ref_npz), np.load(test_npz)
    if ref["question_rows"].tolist() != test["question_rows"].tolist():
        raise RuntimeError(f"{ref_npz} and {test_npz} hold other questions")
    fid = Fidelity()
    a, b = ref["logits"], test["logits"]
    for i in range(0, len(a), 256):
        fid.update(a[None, i:i + 256], b[None, i:i + 256], np.ones((1, len(a[i:i + 256])), bool))
    out = {"mean_kl": round(fid.mean_kl, 6), "top1_agreement": round(fid.top1, 4), "positions": fid.positions,
           "teacher_forced_accuracy_positions": round(float((b.argmax(-1) == test["gold"]).mean()), 4)}
    return out


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> list[float]:
    """The 95% Wilson score interval of an accuracy of ``correct`` out of ``n`` questions."""
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(centre - half, 3), round(centre + half, 3)]


def paired_against(ref: dict, cpu: dict) -> dict | None:
    """The questions a variant answers differently from the reference on the same questions: how many
    it gets right that the reference got wrong (``gained``) and the reverse (``lost``), and the exact
    two-sided McNemar (sign test) p-value of that split; None when the questions differ."""
    if ref.get("question_rows") != cpu.get("question_rows") or "correct" not in ref or "correct" not in cpu:
        return None
    gained = sum(bool(b) and not a for a, b in zip(ref["correct"], cpu["correct"]))
    lost = sum(bool(a) and not b for a, b in zip(ref["correct"], cpu["correct"]))
    n = gained + lost
    p = min(1.0, 2 * sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2**n) if n else 1.0
    return {"gained": gained, "lost": lost, "answers_changed": sum(a != b for a, b in zip(ref["answers"], cpu["answers"])),
            "mcnemar_exact_p": round(p, 3)}


def summary(results: dict) -> list[dict]:
    """One row per variant: CPU accuracy (with its 95% Wilson interval on the questions scored, and
    the questions it gained and lost against the fp32 export's answers), change against fp32, KL,
    top-1, HTP answers against CPU."""
    steps, rows = results.get("steps", {}), []
    ref = (steps.get("fp32/export/eval-cpu") or {}).get("result")
    for variant in sorted(results.get("variants", []), key=list(VARIANTS).index):
        row = {"variant": variant, "recipe": VARIANTS[variant][0], "edit": VARIANTS[variant][1]}
        cpu = (steps.get(f"{variant}/eval-cpu") or {}).get("result")
        if cpu:
            row.update(accuracy=cpu["accuracy"], per_type=cpu["per_type"], samples=cpu["samples"],
                       **_interval(cpu))
            if ref:
                row["accuracy_change"] = round(cpu["accuracy"] - ref["accuracy"], 4)
                paired = paired_against(ref, cpu)
                if paired is not None:
                    row["against_fp32_export"] = paired
                row["within_3_points_of_fp32"] = row["accuracy_change"] >= -0.03  # issue 45 item 3's bar (4-bit)
        if variant in results.get("fidelity", {}):
            row.update({k: results["fidelity"][variant][k] for k in ("mean_kl", "top1_agreement", "positions")})
        for key in ("compile-cpu", "compile-htp"):
            if (steps.get(f"{variant}/{key}") or {}).get("rc") == 0:
                row[f"{key}_seconds"] = steps[f"{variant}/{key}"]["seconds"]
        htp = (steps.get(f"{variant}/eval-htp") or {}).get("result")
        htp_cpu = (steps.get(f"{variant}/eval-htp-folder-cpu") or {}).get("result")
        if htp:
            row.update(htp_samples=htp["samples"], htp_accuracy=htp["accuracy"], htp_seconds=htp["seconds"],
                       htp_answers=htp["answers"])
            if htp_cpu and htp_cpu["question_rows"] == htp["question_rows"]:
                same = sum(a == b for a, b in zip(htp["answers"], htp_cpu["answers"]))
                row.update(htp_answers_as_cpu=f"{same}/{htp['samples']}", htp_folder_cpu_accuracy=htp_cpu["accuracy"])
        rows.append(row)
    if ref:
        rows.insert(0, {"variant": "fp32 export (dynamic graph)", "accuracy": ref["accuracy"], "per_type": ref["per_type"],
                        "samples": ref["samples"], **_interval(ref)})
    return rows


def _interval(result: dict) -> dict:
    """``correct`` and ``accuracy_interval_95`` of an ``eval vqa`` result (its per-question ``correct``)."""
    if "correct" not in result:
        return {}
    correct = int(sum(bool(c) for c in result["correct"]))
    return {"correct": correct, "accuracy_interval_95": wilson_interval(correct, len(result["correct"]))}


def logits_main(argv: list[str]) -> int:
    """``logits FOLDER``: teacher-forced answer-position logits of a VLM folder into an .npz."""
    p = argparse.ArgumentParser(prog="vlm_static.py logits")
    p.add_argument("folder", type=Path)
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--provider", default="cpu")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    from edgeq.evaluate.vqa import answer_logits

    res = answer_logits(a.folder, samples=a.samples, provider=a.provider)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.stem + ".tmp.npz")
    np.savez(tmp, logits=res["logits"], counts=np.asarray(res["counts"]), gold=res["gold"],
             question_rows=np.asarray(res["question_rows"]))
    tmp.replace(a.out)
    print(json.dumps({k: res[k] for k in ("model", "provider", "seconds")} | {"positions": len(res["logits"])}))
    return 0


def markdown(results: dict) -> str:
    out = ["| deployment | recipe | CPU accuracy | 95% interval | lost / gained vs fp32 | KL | top-1 | HTP answers as CPU "
           "| HTP accuracy |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary(results):
        def fmt(k: str, f: str, r: dict = r) -> str:
            return f.format(r[k]) if k in r else "-"

        out.append(f"| {r['variant']} | {r.get('recipe', '-')}{' (' + r['edit'] + ')' if r.get('edit') else ''} | "
                   f"{fmt('accuracy', '{:.3f}')} | {_fmt_interval(r)} | {_fmt_paired(r)} | {fmt('mean_kl', '{:.4f}')} | "
                   f"{fmt('top1_agreement', '{:.3f}')} | {r.get('htp_answers_as_cpu', '-')} | {fmt('htp_accuracy', '{:.3f}')} |")
    return "\n".join(out)


def _fmt_interval(row: dict) -> str:
    lo_hi = row.get("accuracy_interval_95")
    return f"{lo_hi[0]:.3f} - {lo_hi[1]:.3f}" if lo_hi else "-"


def _fmt_paired(row: dict) -> str:
    paired = row.get("against_fp32_export")
    return f"{paired['lost']} / {paired['gained']} (p {paired['mcnemar_exact_p']:.2f})" if paired else "-"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["logits"]:
        return logits_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="edgeq export trained-vlm output folder")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"vlm-static-{datetime.date.today()}.json")
    p.add_argument("--work", type=Path, default=REPO / "artifacts" / "bench-vlm-static",
                   help="compiled folders, recipes and logits (several GB on the real model)")
    p.add_argument("--samples", type=int, default=200, help="questions scored on CPU (default 200)")
    p.add_argument("--htp-samples", type=int, default=4, help="questions run on the emulated HTP (default 4)")
    p.add_argument("--prefill", type=int, default=64)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--no-htp", action="store_true", help="CPU steps only")
    p.add_argument("--htp-only", action="store_true", help="HTP steps only (after a CPU run)")
    p.add_argument("--redo", default="", help="comma-separated step keys to run again")
    p.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    p.add_argument("--rescore", action="store_true",
                   help="recompute --out's summary from the answers its steps recorded (no model run; the file is "
                        "rewritten whole, this run stamped under resumed) and print its table")
    a = p.parse_args(argv)
    if a.table:
        print(markdown(json.loads(a.out.read_text())))
        return 0
    if a.rescore:
        if not a.out.is_file():
            p.error(f"--rescore: {a.out} not found")
        results = json.loads(a.out.read_text())
        if "run" not in results:  # a file from before the run stamp: its measuring run, as the file records it
            starts = sorted(step["started"] for step in results.get("steps", {}).values() if step.get("started"))
            command = results.get("command", "")
            results["run"] = {"command": command if command.startswith(("python", "/")) else
                              f"python benchmarks/vlm_static.py {command}",
                              "date": f"{starts[0]}Z" if starts else None, "commit": None,
                              "note": "the run that measured the steps; written before results files carried the "
                                      "commit and package versions (machine: the file's machine)"}
        save(a.out, results)
        print(markdown(results))
        return 0
    if a.model_dir is None:
        p.error("--model-dir is required")
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}")
    model_dir, work = a.model_dir.resolve(), a.work.resolve()
    past = model_dir / "with-past" / "model.onnx"
    calib = model_dir / "with-past" / "calib.npz"
    results = json.loads(a.out.read_text()) if a.out.is_file() else {}
    if results and results.get("model_dir") not in (None, str(model_dir)):
        p.error(f"{a.out} holds results of {results['model_dir']}: another --out")
    marker = json.loads((model_dir / "edgeq-export.json").read_text()) if (model_dir / "edgeq-export.json").is_file() else {}
    metrics = json.loads((model_dir / "metrics.json").read_text()) if (model_dir / "metrics.json").is_file() else {}
    results.update({"model_dir": str(model_dir), "export": marker, "quick_model": bool(marker.get("quick")),
                    "model_metrics": {k: metrics.get(k) for k in ("accuracy", "prior_accuracy", "questions", "per_type")},
                    "samples": a.samples, "htp_samples": a.htp_samples, "static": {"prefill": a.prefill, "context": a.context},
                    "variants": list(dict.fromkeys(results.get("variants", []) + variants)),
                    "command": shlex.join(["python", "benchmarks/vlm_static.py", *argv]),
                    "recipes": results.get("recipes", {})})
    if results["quick_model"]:
        print("note: a --quick export: these numbers prove the pipeline, they are not figures", flush=True)
    redo = {k for k in a.redo.split(",") if k}
    static = ["--static", f"prefill={a.prefill},context={a.context}"]
    work.mkdir(parents=True, exist_ok=True)
    save(a.out, results)
    ref_logits = work / "logits-fp32-export.npz"
    if not a.htp_only:
        run_step(results, a.out, "fp32/export/eval-cpu", [*EDGEQ, "eval", "vqa", str(model_dir), "--samples", str(a.samples),
                                                            "--json"], None, redo, json_stdout=True)
        run_step(results, a.out, "fp32/export/logits-cpu", [sys.executable, __file__, "logits", str(model_dir), "--samples",
                                                              str(a.samples), "--out", str(ref_logits)], ref_logits, redo)
    for target in (("cpu",) if a.no_htp else ("htp",) if a.htp_only else ("cpu", "htp")):
        for variant in variants:
            if target == "htp" and variant in NO_HTP:
                continue
            slug = variant.replace("+", "-")
            text = variant_recipe(variant)
            if text is None:
                recipe, calib_args = "fp32", []
            else:
                recipe_path = work / f"{slug}.toml"
                if results["recipes"].get(variant, text) != text:  # the recipe changed: compile again
                    redo |= {f"{variant}/compile-cpu", f"{variant}/compile-htp"}
                recipe_path.write_text(text)
                results["recipes"][variant] = text
                recipe, calib_args = str(recipe_path), ["--calib", str(calib)]
            folder = work / f"{slug}-{target}"
            extra = ["--target", "qnn-htp", "--context-binary"] if target == "htp" else []
            later = tuple(f"{variant}/{k}" for k in (("eval-cpu", "logits-cpu") if target == "cpu" else
                                                     ("eval-htp", "eval-htp-folder-cpu")))
            ok = run_step(results, a.out, f"{variant}/compile-{target}",
                          [*EDGEQ, "compile", str(past), "--recipe", recipe, *calib_args, *static, *extra, "-o", str(folder),
                           "--force"], folder / "report.json", redo, after=later)
            if ok is None:
                continue
            if target == "cpu":
                run_step(results, a.out, f"{variant}/eval-cpu", [*EDGEQ, "eval", "vqa", str(folder), "--samples", str(a.samples),
                                                                  "--json"], None, redo, json_stdout=True)
                npz = work / f"logits-{slug}.npz"
                if run_step(results, a.out, f"{variant}/logits-cpu", [sys.executable, __file__, "logits", str(folder),
                                                                       "--samples", str(a.samples), "--out", str(npz)],
                            npz, redo) and ref_logits.is_file():
                    results.setdefault("fidelity", {})[variant] = fidelity(ref_logits, npz)
                    save(a.out, results)
            else:
                check = json.loads((folder / "report.json").read_text()).get("target", {}).get("check", {})
                results.setdefault("htp_check", {})[variant] = {g: c.get("clean") for g, c in check.items()}
                save(a.out, results)
                run_step(results, a.out, f"{variant}/eval-htp", [*EDGEQ, "eval", "vqa", str(folder), "--provider", "qnn-htp",
                                                                  "--samples", str(a.htp_samples), "--json"], None, redo,
                         json_stdout=True)
                run_step(results, a.out, f"{variant}/eval-htp-folder-cpu", [*EDGEQ, "eval", "vqa", str(folder), "--samples",
                                                                             str(a.htp_samples), "--json"], None, redo,
                         json_stdout=True)
    save(a.out, results)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
