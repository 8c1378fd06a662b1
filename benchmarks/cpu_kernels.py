"""Integer kernels and your CPU: every 8-bit-activation recipe on SmolLM2, onnxruntime's default
session (integer kernels) beside exact QDQ, and the int8 weight forms tried against saturation.

One run, on this machine, recorded with its CPU model and ISA flags:
1. forms (``--forms-recipe``, default mquant-w8a8): the weight grid of its uint8 x int8 linears:
   ``full`` (full int8 grid, ``--target ort-cpu-vnni``: saturates on AVX2), ``pair`` (edgeq's
   default pair-bounded grid), ``7bit`` (onnxruntime's reduce_range / NNCF's overflow_fix:
   ``weight_bits = 7``) and ``u8u8`` (uint8 weights: onnxruntime's exact U8U8 kernel);
2. recipes (``--recipes``): each compiled with the default (saturation-free) settings;
3. per graph: perplexity with onnxruntime defaults and with exact QDQ (the kernel gap), the
   VPMADDUBSW model's rates from ``report.json``, the static worst-case pair bound, and
   onnxruntime latency (512 tokens, batch 1, all graphs interleaved, median of ``--repeats``)
   with its ratio to fp32.

Usage: python benchmarks/cpu_kernels.py --model-dir artifacts/smollm2 --out benchmarks/results/cpu-kernels-DATE.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from foundation import DATA, bench_parser, fused_ops, interleaved_latency_ms, save_results

RECIPES_8BIT = ("w8a8,w8a8-mse,quarot-w8a8,mquant-w8a8,mquant-w4a8,muxq-w8a8,resq-w4a8,mquant-w8a8-a16down")

# form -> (extra qdq keys appended to the recipe's last pass, target)
FORMS = {
    "full": ({}, "ort-cpu-vnni"),
    "pair": ({}, None),
    "7bit": ({"weight_bits": 7}, None),
    "u8u8": ({"weight_dtype": '"uint8"'}, None),
}


def _recipe_variant(recipe: str, extra: dict, folder: Path) -> str:
    """The built-in recipe with keys added to its final ``qdq`` pass (a file in ``folder``)."""
    if not extra:
        return recipe
    from importlib import resources

    import re

    text = (resources.files("edgeq") / "recipes" / f"{recipe}.toml").read_text()
    head, last = text.rstrip().rsplit("[[pass]]", 1)
    if 'name = "qdq"' not in last:
        raise SystemExit(f"{recipe}: the forms study needs qdq as the last pass")
    for key, value in extra.items():  # replace the key where the recipe sets it, else add it
        last, found = re.subn(rf"(?m)^{key}\s*=.*$", f"{key} = {value}", last)
        if not found:
            last += f"\n{key} = {value}"
    path = folder / f"{recipe}-{'-'.join(f'{k}{v}'.replace(chr(34), '') for k, v in extra.items())}.toml"
    path.write_text(head + "[[pass]]" + last + "\n")
    return str(path)


def _compile(fp32: Path, recipe: str, out: Path, calib_windows: int, target: str | None, reuse: bool) -> dict:
    if not (reuse and (out / "report.json").is_file()):
        cmd = [sys.executable, "-m", "edgeq", "compile", str(fp32), "--recipe", recipe, "--calib", str(DATA / "valid.txt"),
               "--calib-windows", str(calib_windows), "-o", str(out)] + (["--target", target] if target else [])
        subprocess.run(cmd, check=True, env={**os.environ, "EDGEQ_PROGRESS": "0"})
    report = json.loads((out / "report.json").read_text())
    u8s8 = report.get("u8s8", {})
    return {"compile_s": report["seconds_total"], "int8_weight_range": u8s8.get("int8_weight_range"),
            "u8s8_linears": u8s8.get("linears"), "worst_pair": u8s8.get("worst_pair"),
            "linears_at_risk": u8s8.get("linears_at_risk"), "model_max_pair_rate": u8s8.get("max_pair_rate"),
            "model_max_rel_error": u8s8.get("max_rel_error")}


def main(argv=None) -> int:
    p = bench_parser(__doc__, "cpu-kernels", RECIPES_8BIT)
    p.add_argument("--forms-recipe", default="mquant-w8a8")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--repeats", type=int, default=10, help="latency runs per graph (interleaved)")
    p.add_argument("--reuse", action="store_true", help="reuse compiled graphs already in --work")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--latency-only", action="store_true",
                   help="reuse the graphs and the perplexities of an earlier --out; measure latency only (on a quiet machine)")
    a = p.parse_args(argv)
    a.reuse = a.reuse or a.latency_only

    from edgeq.evaluate.machine import isa_label
    from edgeq.evaluate.ppl import perplexity

    fp32 = a.model_dir / "model.onnx"
    graphs: dict[str, Path] = {}
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for form in a.forms.split(","):
            extra, target = FORMS[form]
            name = f"{a.forms_recipe}/{form}"
            out = a.work / f"{a.forms_recipe}-{form}"
            rows[name] = {"recipe": a.forms_recipe, "form": form, "target": target,
                          **_compile(fp32, _recipe_variant(a.forms_recipe, extra, Path(tmp)), out, a.calib_windows, target, a.reuse)}
            graphs[name] = out / "model.onnx"
        for recipe in a.recipes.split(","):
            if recipe == a.forms_recipe and "pair" in a.forms.split(","):
                continue  # the default form is the recipe's default compile
            out = a.work / recipe
            rows[recipe] = {"recipe": recipe, "form": "pair", "target": None,
                            **_compile(fp32, recipe, out, a.calib_windows, None, a.reuse)}
            graphs[recipe] = out / "model.onnx"
    results: dict = {"model": str(fp32), "calib_windows": a.calib_windows, "eval_windows": a.eval_windows,
                     "isa": isa_label(), "rows": rows}
    if a.latency_only:
        earlier = json.loads(a.out.read_text())  # its "machine" / "isa" are the perplexities' machine
        from edgeq.evaluate.machine import machine_info

        results = {**earlier, "latency_isa": isa_label(), "latency_machine": machine_info()}
        rows = results["rows"]
    else:
        results["fp32_ppl"] = round(perplexity(fp32, DATA / "test.txt", a.model_dir, windows=a.eval_windows)["ppl"], 3)
    base = results["fp32_ppl"]
    for name, path in graphs.items() if not a.latency_only else ():
        kern = perplexity(path, DATA / "test.txt", a.model_dir, windows=a.eval_windows)["ppl"]
        exact = perplexity(path, DATA / "test.txt", a.model_dir, windows=a.eval_windows, exact_qdq=True)["ppl"]
        rows[name].update({"ppl": round(kern, 3), "ppl_exact_qdq": round(exact, 3), "x_fp32": round(kern / base, 4),
                           "kernel_gap": round(kern / exact - 1, 4)})
        print(f"{name}: ppl {kern:.3f} exact {exact:.3f} ({kern / base:.3f}x fp32)", flush=True)
        save_results(a.out, results)
    if not a.skip_latency:
        lat = interleaved_latency_ms({"fp32": fp32, **graphs}, repeats=a.repeats)
        results["fp32_latency_ms_512"] = round(lat["fp32"], 1)
        for name in graphs:
            rows[name].update({"latency_ms_512": round(lat[name], 1), "speedup_vs_fp32": round(lat["fp32"] / lat[name], 3),
                               "fused_ops": fused_ops(graphs[name])})
    save_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
