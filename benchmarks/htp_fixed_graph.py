"""A model with no static pair, taken whole by the HTP at a fixed shape (issue 43 item 1's "every graph
accepted whole by the HTP" for a model ``--static`` cannot take yet: Gemma 3, whose KV-cache export has no
position_ids input).

Steps: compile the model's graph (no KV cache) with the recipe and the qnn-htp lowering, through a copy of
the qnn-htp profile that allows dynamic shapes (``static_shapes = false``, the shape ops allowed, no vendor
check: the graph is made static below); fix its inputs to [1, TOKENS], fold the shape machinery and drop the
exporter's ``Where(IsNaN(softmax))`` guard as ``--static`` does; prepare the HTP context binary with CPU
fallback disabled and load it back (``edgeq.targets.qnn_vendor.prepare_context``); then run the first
TOKENS of WikiText-2 test (BOS-led) through it on the emulated HTP and on onnxruntime CPU: relative L2 of
the logits, top-1 agreement; and the residual stream's largest values on CPU for the same tokens (the HTP
runs float ops in fp16, largest finite value 65504).

Usage: python benchmarks/htp_fixed_graph.py --model-dir GEMMA_DIR --recipe mquant-w4a16 --calib-windows 16
           --work DIR --out benchmarks/results/htp-fixed-graph-DATE.json [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from measure import run_measured

REPO = Path(__file__).resolve().parents[1]


def dynamic_profile(path: Path) -> None:
    """The qnn-htp profile with dynamic shapes allowed (the shape ops in its op set, no vendor check)."""
    text = (REPO / "edgeq" / "targets" / "profiles" / "qnn-htp.toml").read_text()
    for old, new in (("static_shapes = true", "static_shapes = false"),
                     ('vendor = "qnn-htp"', "# no vendor check: the graph is made static afterwards"),
                     ('    "Where",\n]', '    "Where", "Shape", "ConstantOfShape", "Range", "IsNaN",\n]'),
                     ('description = "', 'description = "qnn-htp with dynamic shapes (benchmarks/htp_fixed_graph.py): ')):
        if old not in text:
            raise SystemExit(f"the qnn-htp profile changed: '{old}' not found")
        text = text.replace(old, new)
    path.write_text(text)


def fixed_graph(compiled: Path, out: Path, tokens: int) -> dict:
    """``compiled``'s graph with every input [1, tokens], folded to static shapes, saved in ``out``."""
    import onnx

    from edgeq.static.specialize import fold_static

    model = onnx.load(str(compiled / "model.onnx"))
    for vi in model.graph.input:
        for dim, value in zip(vi.type.tensor_type.shape.dim, [1, tokens]):
            dim.Clear()
            dim.dim_value = value
    model = fold_static(model, drop_nan_guards=True)
    out.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(out / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data")
    return {"inputs": {vi.name: [1, tokens] for vi in model.graph.input},
            "ops": sorted({n.op_type for n in model.graph.node}), "nodes": len(model.graph.node)}


def htp_against_cpu(fixed: Path, tokenizer_dir: Path, tokens: int) -> tuple[dict, dict]:
    import onnxruntime as ort
    from tokenizers import Tokenizer

    from edgeq.targets.qnn_vendor import open_htp_session

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = tok.encode((REPO / "data" / "wikitext-2" / "test.txt").read_text()[:20000]).ids
    bos = json.loads((tokenizer_dir / "config.json").read_text()).get("bos_token_id")
    if bos is not None and ids[0] != bos:
        ids = [bos] + ids
    ids = np.array([ids[:tokens]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    cpu = ort.InferenceSession(str(fixed / "model.onnx"), providers=["CPUExecutionProvider"])
    started = time.perf_counter()
    c = cpu.run(["logits"], feeds)[0]
    cpu_s = time.perf_counter() - started
    htp = open_htp_session(fixed / "model_ctx.onnx")
    started = time.perf_counter()
    h = htp.run(["logits"], feeds)[0]
    htp_s = time.perf_counter() - started
    return feeds, {"tokens": tokens, "relative_l2": float(np.linalg.norm(h - c) / np.linalg.norm(c)),
            "top1_agreement": float(np.mean(h.argmax(-1) == c.argmax(-1))),
            "max_abs_diff": float(np.abs(h - c).max()), "max_abs_logit_cpu": float(np.abs(c).max()),
            "cpu_seconds": round(cpu_s, 2), "htp_seconds": round(htp_s, 2)}


def residual_peaks(fixed: Path, feeds: dict) -> dict:
    """The largest |value| of each decoder block's residual adds (``/model/layers.N/Add``, ``Add_1``) on
    onnxruntime CPU for ``feeds``, over all positions and without position 0: float ops on the HTP
    run in fp16, whose largest finite value is 65504."""
    import re

    import onnx
    import onnxruntime as ort

    model = onnx.load(str(fixed / "model.onnx"))
    names = [n.output[0] for n in model.graph.node if n.op_type == "Add" and re.fullmatch(r"/model/layers\.\d+/Add(_1)?", n.name)]
    for name in names:
        model.graph.output.add(name=name)
    probe = fixed.parent / "residual-probe"
    probe.mkdir(exist_ok=True)
    onnx.save_model(model, str(probe / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data")
    values = ort.InferenceSession(str(probe / "model.onnx"), providers=["CPUExecutionProvider"]).run(names, feeds)
    peaks = {n: {"all": float(np.abs(v).max()), "after_position_0": float(np.abs(v[0, 1:]).max())} for n, v in zip(names, values)}
    return {"per_add": peaks, "max_all": max(p["all"] for p in peaks.values()),
            "max_after_position_0": max(p["after_position_0"] for p in peaks.values()),
            "over_fp16_max": [n for n, p in peaks.items() if p["all"] > 65504.0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--recipe", default="mquant-w4a16")
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from edgeq.evaluate.machine import machine_info
    from edgeq.targets.qnn_vendor import prepare_context, vendor_version

    args.work.mkdir(parents=True, exist_ok=True)
    profile = args.work / "qnn-htp-dynamic.toml"
    dynamic_profile(profile)
    compiled = args.work / "compiled"
    compile_cmd = [sys.executable, "-m", "edgeq", "compile", str(args.model_dir / "model.onnx"), "--recipe", args.recipe,
                   "--calib", str(REPO / "data" / "wikitext-2" / "valid.txt"), "--calib-windows", str(args.calib_windows),
                   "--target", str(profile), "-o", str(compiled), "--force"]
    step = run_measured(compile_cmd)
    result = {"what": __doc__.split("\n\n")[0], "command": " ".join(["python", "benchmarks/htp_fixed_graph.py", *sys.argv[1:]]),
              "machine": machine_info(), "vendor": f"onnxruntime-qnn {vendor_version()}", "model": args.model_dir.name,
              "recipe": args.recipe, "calib_windows": args.calib_windows,
              "compile": {"command": " ".join(compile_cmd[1:]), "code": step["code"], "seconds": step["seconds"],
                          "peak_rss_mb": step["peak_rss_mb"], "stderr_tail": step["stderr"].strip().splitlines()[-2:]}}
    if step["code"] == 0:
        fixed = args.work / "fixed"
        result["fixed"] = fixed_graph(compiled, fixed, args.tokens)
        result["htp_prepare"] = prepare_context(fixed / "model.onnx", fixed / "model_ctx.onnx")
        result["htp_prepare"]["context_binary_bytes"] = sum(p.stat().st_size for p in fixed.glob("*_qnn.bin"))
        if result["htp_prepare"].get("ok"):
            feeds, result["htp_vs_cpu"] = htp_against_cpu(fixed, args.model_dir, args.tokens)
            result["residual_stream_cpu"] = residual_peaks(fixed, feeds)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result.get(k) for k in ("htp_prepare", "htp_vs_cpu")}))
    if "residual_stream_cpu" in result:
        print(json.dumps({k: v for k, v in result["residual_stream_cpu"].items() if k != "per_add"}))


if __name__ == "__main__":
    main()
