"""MSQ and AIFS on the composed vision-language model (issue: multimodal MSQ/AIFS), one run.

Every variant sits on the same rotation chain as the mquant-*-vlm recipes (fuse-norms, ln-to-rms,
rotate, massive-split, rms) and differs only in how activations are quantized:

- ``single``: one static per-tensor scale per site (qdq);
- ``msq``: MSQ without AIFS: a visual and a text scale per site, tokens left interleaved (the
  per-token modality mask; ``integer`` lowering);
- ``msq+aifs``: the mquant-*-vlm recipe (AIFS reorders visual-first, MSQ on the two slices);
- ``token``: per-token dynamic activations (the reference MSQ tries to match statically);

each at W8A8 (int8 per-channel weights) and W4A8 (int4 per-channel). Calibration: the export's
calib.npz (16 samples); evaluation: eval.npz (32 samples, disjoint images and text windows).
Fidelity against the fp32 graph at the text positions after the image: mean KL divergence of the
next-token distributions and top-1 agreement. Also: visual vs text absmax per layer as calibrated
by MSQ (the range table), and onnxruntime CPU latency of one forward pass (196 visual + 64 text
tokens, batch 1, median of 30, runs interleaved across the graphs) for fp32, single, msq+aifs, msq
and msq with the ``select`` lowering (two QDQs and a per-token select, what interleaved MSQ costs a
backend with only per-tensor Q/DQ).

Usage: python benchmarks/multimodal_msq.py --model-dir DIR --out artifacts/bench-msq.json
(DIR: an ``edgeq export composed-vlm`` folder)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from foundation import fused_ops, interleaved_latency_ms, save_results

REPO = Path(__file__).resolve().parents[1]

VARIANTS = ("single", "msq", "msq+aifs", "msq+aifs-all", "token")
LATENCY_ONLY = ("msq-select",)
BITS = {"w8a8": "w8a8", "w4a8": "w4a8", "w4a8-g128": "w4a8"}  # setting -> recipe it edits


def recipe_text(bits: str, variant: str) -> str:
    """The mquant-<bits>-vlm recipe, edited into ``variant``."""
    text = (REPO / "edgeq" / "recipes" / f"mquant-{BITS[bits]}-vlm.toml").read_text()
    if bits.endswith("-g128"):
        text = text.replace('weight_granularity = "channel"', 'weight_granularity = "group"\ngroup_size = 128')
    if variant == "msq+aifs":
        return text
    if variant == "msq+aifs-all":  # two scales at every site (the paper), however close they are
        return re.sub(r"min_scale_ratio = .*\n", "min_scale_ratio = 1.0\n", text)
    text = re.sub(r'\[\[pass\]\]\nname = "aifs".*?\n\n', "", text, flags=re.S)
    if variant == "msq":
        return text
    if variant == "msq-select":
        return re.sub(r'lowering = "integer".*\n', 'lowering = "select"\n', text)
    text = re.sub(r'(lowering|min_scale_ratio) = .*\n', "", text.replace('name = "msq"', 'name = "qdq"'))
    if variant == "token":
        text += 'activation_granularity = "token"\n'
    return text


def compile_variant(model: Path, calib: Path, out: Path, recipe: str) -> dict:
    recipe_path = out.parent / f"{out.name}.toml"
    out.parent.mkdir(parents=True, exist_ok=True)
    recipe_path.write_text(recipe)
    cmd = [sys.executable, "-m", "edgeq", "compile", str(model), "--recipe", str(recipe_path), "--calib", str(calib), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return json.loads((out / "report.json").read_text())


def fidelity(models: dict[str, Path], ref: Path, inputs: dict, meta: dict, batch: int = 4) -> dict[str, dict]:
    """KL / top-1 of each model against ``ref`` at text positions after the image."""
    from edgeq.evaluate.fidelity import Fidelity
    from edgeq.models.composed_vlm import ort_session

    n = inputs["inputs_embeds"].shape[0]
    seq = np.arange(inputs["attention_mask"].shape[1])[None]
    after = (seq >= (inputs["visual_start"] + inputs["visual_len"])[:, None]) & (inputs["attention_mask"] == 1)
    ref_sess = ort_session(ref)
    ref_logits = []
    for i in range(0, n, batch):
        feeds = {k: v[i:i + batch] for k, v in inputs.items()}
        ref_logits.append(ref_sess.run(None, feeds)[0][after[i:i + batch]])
    del ref_sess
    out = {}
    for name, path in models.items():
        sess, fid = ort_session(path), Fidelity()
        for j, i in enumerate(range(0, n, batch)):
            feeds = {k: v[i:i + batch] for k, v in inputs.items()}
            logits = sess.run(None, feeds)[0][after[i:i + batch]]
            fid.update(ref_logits[j][None], logits[None], np.ones((1, logits.shape[0]), bool))
        out[name] = fid.as_dict()
        print(f"{name}: KL {fid.mean_kl:.5f} top-1 {fid.top1:.4f} ({fid.positions} positions)", flush=True)
    return out


def range_table(report: dict) -> list[dict]:
    """Per layer: the widest visual and text |x| max over its activation sites (calibration data,
    rotated graph, as msq saw them), and the smallest / largest per-site visual/text ratio."""
    (msq,) = [p for p in report["passes"] if p["name"] == "msq"]
    layers: dict[str, dict] = {}
    for site, r in msq["summary"]["modality_ranges"].items():
        m = re.search(r"layers\.(\d+)/", site)
        key = m.group(1) if m else "head"
        row = layers.setdefault(key, {"layer": key, "sites": 0, "visual_absmax": 0.0, "text_absmax": 0.0, "ratios": []})
        v, t = r["absmax"]  # unclipped |x| max per modality
        row["sites"] += 1
        row["visual_absmax"] = max(row["visual_absmax"], v)
        row["text_absmax"] = max(row["text_absmax"], t)
        row["ratios"].append(v / max(t, 1e-12))
    table = []
    for key in sorted(layers, key=lambda k: (k == "head", int(k) if k.isdigit() else 0)):
        row = layers[key]
        ratios = row.pop("ratios")
        table.append({**row, "visual_absmax": round(row["visual_absmax"], 3), "text_absmax": round(row["text_absmax"], 3),
                      "site_ratio_min": round(min(ratios), 3), "site_ratio_max": round(max(ratios), 3)})
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="edgeq export composed-vlm output folder")
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    p.add_argument("--work", type=Path, default=REPO / "artifacts" / "bench-msq")
    p.add_argument("--bits", default="w8a8,w4a8,w4a8-g128")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--skip-compile", action="store_true", help="reuse the graphs already in --work")
    p.add_argument("--latency-only", action="store_true",
                   help="reuse the graphs in --work and the fidelity in --out; measure latency again")
    a = p.parse_args(argv)

    from edgeq.models.composed_vlm import load_split

    fp32 = a.model_dir / "model.onnx"
    inputs, meta = load_split(a.model_dir, "eval")
    results: dict = {"model": str(fp32), "eval_samples": int(inputs["inputs_embeds"].shape[0]), "fidelity": {}}
    graphs: dict[str, Path] = {}
    if a.latency_only:
        results = json.loads(a.out.read_text())
        a.skip_compile = True
    for bits in a.bits.split(","):
        for variant in VARIANTS + (LATENCY_ONLY if bits == "w8a8" else ()):
            out = a.work / f"{bits}-{variant.replace('+', '-')}"
            if not a.skip_compile:
                compile_variant(fp32, a.model_dir / "calib.npz", out, recipe_text(bits, variant))
            graphs[f"{bits}/{variant}"] = out / "model.onnx"
        if a.latency_only:
            continue
        results["fidelity"][bits] = fidelity({v: graphs[f"{bits}/{v}"] for v in VARIANTS}, fp32, inputs, meta)
        f = results["fidelity"][bits]
        results["fidelity"][bits]["targets"] = {
            "msq+aifs_kl_over_single_kl": round(f["msq+aifs"]["mean_kl"] / f["single"]["mean_kl"], 3),
            "msq+aifs_kl_over_token_kl": round(f["msq+aifs"]["mean_kl"] / f["token"]["mean_kl"], 3),
            "msq+aifs-all_kl_over_single_kl": round(f["msq+aifs-all"]["mean_kl"] / f["single"]["mean_kl"], 3),
            "msq+aifs-all_kl_over_token_kl": round(f["msq+aifs-all"]["mean_kl"] / f["token"]["mean_kl"], 3),
        }
    if "w8a8/msq+aifs" in graphs:
        report = json.loads((graphs["w8a8/msq+aifs"].parent / "report.json").read_text())
        results["range_table_w8a8"] = range_table(report)
        feeds = {k: v[:1] for k, v in inputs.items()}
        lat_models = {"fp32": fp32, **{v: graphs[f"w8a8/{v}"] for v in ("single", "msq+aifs", "msq+aifs-all", "msq", "msq-select")}}
        lat = interleaved_latency_ms(lat_models, repeats=a.repeats, feeds=feeds)
        results["latency_ms_w8a8"] = {k: round(v, 1) for k, v in lat.items()}
        results["latency_ratios"] = {
            "msq+aifs_over_single": round(lat["msq+aifs"] / lat["single"], 3),
            "msq+aifs-all_over_single": round(lat["msq+aifs-all"] / lat["single"], 3),
            "msq+aifs_over_msq": round(lat["msq+aifs"] / lat["msq"], 3),
            "msq+aifs_over_msq_select": round(lat["msq+aifs"] / lat["msq-select"], 3),
        }
        results["fused_ops_w8a8"] = {k: fused_ops(v) for k, v in lat_models.items()}
    save_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
