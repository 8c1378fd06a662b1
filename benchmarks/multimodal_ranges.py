"""Visual vs text activation ranges of the composed vision-language model, per layer and site:
the table that motivates MQuant's per-modality static scales (MSQ).

For every linear input (the tensors a static per-tensor QDQ would quantize), the absolute maximum
over visual tokens and over text tokens (all, and all but the first token, which is the attention
sink with massive activations) of the evaluation samples, on the fp32 graph and on the
rotated one (fuse-norms, ln-to-rms, rotate: what the mquant recipes quantize). The ratio shows how
much of one shared 8-bit scale a modality would waste or clip.

Usage: python benchmarks/multimodal_ranges.py --model-dir DIR --out artifacts/multimodal-ranges.json
(DIR: an ``edgeq export composed-vlm`` or ``trained-vlm`` folder)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np


def site_ranges(model_path: Path, feeds: list[dict], visual_masks: list[np.ndarray],
                pad_masks: list[np.ndarray] | None = None) -> dict[str, dict]:
    """{linear input tensor: {"role", "layer", "visual", "text", "text_after_first"}} absolute
    maxima over the samples ``feeds`` (batch 1 each). ``pad_masks``: positions that are padding
    (left padding of the trained VLM's eval samples), counted in neither modality; "first" is the
    first real token (the attention sink that carries massive activations)."""
    import onnx

    from edgeq.graph import ir
    from edgeq.structure import find_linears

    model = onnx.load(str(model_path))
    graph = ir.to_graph(model)
    sites = {}
    for lin in find_linears(graph):
        sites.setdefault(lin.input, (lin.role, lin.layer))
    names = sorted(sites)
    for name in names:
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = ir.make_session(model, optimize=True)
    out = {n: {"role": sites[n][0], "layer": sites[n][1], "visual": 0.0, "text": 0.0, "text_after_first": 0.0} for n in names}
    pads = pad_masks if pad_masks is not None else [np.zeros_like(m, bool) for m in visual_masks]
    for f, vis, pad in zip(feeds, visual_masks, pads):
        values = session.run(names, f)
        mask, real = vis.reshape(-1), ~pad.reshape(-1)
        text = real & ~mask
        later = text.copy()
        later[int(np.argmax(real))] = False  # the first real token
        for name, v in zip(names, values):
            a = np.abs(v).max(-1).reshape(-1)  # per token
            out[name]["visual"] = max(out[name]["visual"], float(a[mask].max()))
            out[name]["text"] = max(out[name]["text"], float(a[text].max()))
            out[name]["text_after_first"] = max(out[name]["text_after_first"], float(a[later].max()))
    return out


def rotated_copy(model_dir: Path, tmp: Path) -> Path:
    """The fp32 graph after fuse-norms, ln-to-rms and rotate (what the mquant recipes quantize)."""
    from edgeq.compiler import compile_model
    from edgeq.plan import CompileRequest

    recipe = tmp / "rotate.toml"
    recipe.write_text('[[pass]]\nname = "fuse-norms"\n\n[[pass]]\nname = "ln-to-rms"\n\n[[pass]]\nname = "rotate"\n')
    compile_model(CompileRequest(model_dir / "model.onnx", tmp / "rotated", recipe=str(recipe)))
    return tmp / "rotated" / "model.onnx"


def role_summary(ranges: dict[str, dict]) -> dict[str, dict]:
    """Per role (q/k/v, o, gate/up, down, lm_head...): medians over layers of the visual and text
    absmax and of their ratio, plus the per-layer triples."""
    by_role: dict[str, list] = {}
    for r in ranges.values():
        by_role.setdefault(r["role"], []).append(r)
    return {
        role: {"layers": len(rows),
               "visual_absmax_median": round(float(np.median([x["visual"] for x in rows])), 3),
               "text_absmax_median": round(float(np.median([x["text"] for x in rows])), 3),
               "visual_over_text_median": round(float(np.median([x["visual"] / max(x["text"], 1e-9) for x in rows])), 3),
               "text_after_first_median": round(float(np.median([x["text_after_first"] for x in rows])), 3),
               "visual_over_text_after_first_median": round(float(np.median(
                   [x["visual"] / max(x["text_after_first"], 1e-9) for x in rows])), 3),
               "per_layer": [(x["layer"], round(x["visual"], 3), round(x["text"], 3), round(x["text_after_first"], 3))
                             for x in sorted(rows, key=lambda x: (x["layer"] is None, x["layer"] or 0))]}
        for role, rows in sorted(by_role.items())}


def print_summary(graphs: dict) -> None:
    for label, roles in graphs.items():
        for role, r in roles.items():
            print(f"{label:8s} {role:10s} visual {r['visual_absmax_median']:9.3f} text {r['text_absmax_median']:9.3f} "
                  f"ratio {r['visual_over_text_median']:6.2f}  text after the first token {r['text_after_first_median']:9.3f} "
                  f"ratio {r['visual_over_text_after_first_median']:6.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--samples", type=int, default=8)
    a = p.parse_args(argv)

    from edgeq.models.composed_vlm import load_split

    inputs, meta = load_split(a.model_dir, "eval")
    feeds = [{k: v[i:i + 1] for k, v in inputs.items()} for i in range(min(a.samples, len(meta["is_visual"])))]
    masks = [meta["is_visual"][i:i + 1].astype(bool) for i in range(len(feeds))]
    pads = [meta["is_pad"][i:i + 1].astype(bool) for i in range(len(feeds))] if "is_pad" in meta else None
    results = {"samples": len(feeds), "graphs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        rotated = rotated_copy(a.model_dir, Path(tmp))
        for label, path in (("fp32", a.model_dir / "model.onnx"), ("rotated", rotated)):
            results["graphs"][label] = role_summary(site_ranges(path, feeds, masks, pads))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    from edgeq.evaluate.machine import machine_info

    a.out.write_text(json.dumps({**results, "machine": machine_info()}, indent=1))
    print_summary(results["graphs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
