"""MSQ, AIFS and the CalibQuant visual KV cache on the trained VLM, with its task metric (one run).

The model is ``edgeq export trained-vlm`` (a LLaVA-style VLM trained here on easy-VQA). Parts:

- ``ranges``: per linear-input site, the visual and text |x| max on eval samples (padding
  excluded), on the fp32 graph and after rotation (fuse-norms, ln-to-rms, rotate): does MQuant's
  premise (visual tokens much wider than text) hold on this model?
- ``accuracy``: single-scale static, MSQ (interleaved, no AIFS), MSQ+AIFS (the mquant-*-vlm
  recipe) and per-token dynamic activations, each at W8A8 and W4A8 (recipes edited as in
  ``multimodal_msq.py``, calibration on the folder's calib.npz), on ``--samples`` eval questions:
  exact-match VQA accuracy (all and per question type), and against fp32 the mean KL divergence
  and top-1 agreement of the next-token distributions at the scored (answer) positions. Sessions
  use onnxruntime's default options; W8A8 rows also give the exact-QDQ accuracy (no integer-kernel
  fusion), since the CPU's integer kernel can differ from the Q/DQ arithmetic (docs/cpu-int8-kernels.md, "Integer
  kernels and your CPU").
- ``latency``: one eval sample, batch 1, interleaved medians: fp32, single, MSQ (integer
  lowering), MSQ with the select lowering, MSQ+AIFS, at W8A8: AIFS's overhead.
- ``kv``: the CalibQuant 1/2-bit visual KV cache (``kvquant`` decode graphs on ``with-past/``,
  plus the global-V ablation): the float graph prefills the user prefix and the image only; the
  decode graph, reading the quantized visual cache, then takes the question and the answer one
  token at a time (teacher-forced), so every question token attends to the quantized image
  (prefilling the question too would leave one-token answers untouched by the cache). Accuracy is
  exact match over the answer positions, as above; the float with-past graph on the same path is
  the reference.

Usage: python benchmarks/trained_vlm.py --model-dir artifacts/trained-vlm --out benchmarks/results/trained-vlm-DATE.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from foundation import interleaved_latency_ms, save_results
from multimodal_msq import compile_variant, range_table, recipe_text

REPO = Path(__file__).resolve().parents[1]

VARIANTS = ("single", "msq", "msq+aifs", "token")
LATENCY_VARIANTS = ("single", "msq", "msq-select", "msq+aifs")
BITS = ("w8a8", "w4a8")
KV_VARIANTS = {"calibquant": "calibquant", "global-v": "global-v"}
KV_BITS = (2, 1)
PARTS = ("ranges", "accuracy", "latency", "kv")


def _session(path: Path, exact: bool = False):
    import onnxruntime as ort

    from edgeq.runtime.ort_session import session_options

    return ort.InferenceSession(str(path), session_options(exact_qdq=exact), providers=["CPUExecutionProvider"])


def _kl_top1(ref: np.ndarray, test: np.ndarray) -> dict:
    from kv_fidelity import _kl

    return {"mean_kl": round(float(_kl(ref, test).mean()), 5),
            "top1_agreement": round(float((ref.argmax(-1) == test.argmax(-1)).mean()), 4)}


def _subset(inputs: dict, meta: dict, samples: int) -> tuple[dict, dict]:
    from edgeq.evaluate.vqa import spread_rows

    rows = spread_rows(len(meta["labels"]), samples)
    return ({k: v[rows] for k, v in inputs.items()},
            {k: (v if k == "pad_embedding" else v[rows]) for k, v in meta.items()})


def accuracy_part(model_dir: Path, work: Path, inputs: dict, meta: dict, skip_compile: bool,
                  bits_list: tuple[str, ...] = BITS) -> tuple[dict, dict]:
    from edgeq.models.trained_vlm import vqa_accuracy

    fp32 = model_dir / "model.onnx"
    start = time.perf_counter()
    ref = vqa_accuracy(_session(fp32), inputs, meta)
    rows = {"fp32": {k: ref[k] for k in ("accuracy", "per_type")}}
    print(f"fp32: accuracy {ref['accuracy']:.4f} {ref['per_type']} ({time.perf_counter() - start:.0f} s)", flush=True)
    graphs = {}
    for bits in bits_list:
        for variant in VARIANTS:
            out = work / f"{bits}-{variant.replace('+', '-')}"
            if not skip_compile:
                compile_variant(fp32, model_dir / "calib.npz", out, recipe_text(bits, variant))
            graphs[f"{bits}/{variant}"] = out
            res = vqa_accuracy(_session(out / "model.onnx"), inputs, meta)
            row = {"accuracy": res["accuracy"], "per_type": res["per_type"], **_kl_top1(ref["logits"], res["logits"]),
                   "accuracy_change": round(res["accuracy"] - ref["accuracy"], 4)}
            if bits == "w8a8":
                row["accuracy_exact_qdq"] = vqa_accuracy(_session(out / "model.onnx", exact=True), inputs, meta)["accuracy"]
            rows[f"{bits}/{variant}"] = row
            print(f"{bits}/{variant}: {row} ({time.perf_counter() - start:.0f} s)", flush=True)
    return rows, graphs


def latency_part(model_dir: Path, work: Path, inputs: dict, repeats: int) -> dict:
    fp32 = model_dir / "model.onnx"
    models = {"fp32": fp32}
    for variant in LATENCY_VARIANTS:
        out = work / f"w8a8-{variant.replace('+', '-')}"
        if not (out / "model.onnx").is_file():  # msq-select is compiled here only
            compile_variant(fp32, model_dir / "calib.npz", out, recipe_text("w8a8", variant))
        models[variant] = out / "model.onnx"
    feeds = {k: v[:1] for k, v in inputs.items()}
    lat = interleaved_latency_ms(models, repeats=repeats, feeds=feeds)
    return {"tokens": int(feeds["inputs_embeds"].shape[1]), "visual_tokens": int(feeds["visual_len"][0]),
            "latency_ms": {k: round(v, 2) for k, v in lat.items()},
            "ratios": {"msq+aifs_over_single": round(lat["msq+aifs"] / lat["single"], 3),
                       "msq+aifs_over_msq": round(lat["msq+aifs"] / lat["msq"], 3),
                       "msq+aifs_over_msq_select": round(lat["msq+aifs"] / lat["msq-select"], 3),
                       "single_over_fp32": round(lat["single"] / lat["fp32"], 3)}}


def ranges_part(model_dir: Path, inputs: dict, meta: dict, samples: int) -> dict:
    from multimodal_ranges import role_summary, rotated_copy, site_ranges

    n = min(samples, len(meta["labels"]))
    feeds = [{k: v[i:i + 1] for k, v in inputs.items()} for i in range(n)]
    vis = [meta["is_visual"][i:i + 1].astype(bool) for i in range(n)]
    pad = [meta["is_pad"][i:i + 1].astype(bool) for i in range(n)]
    out = {"samples": n, "graphs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        rotated = rotated_copy(model_dir, Path(tmp))
        for label, path in (("fp32", model_dir / "model.onnx"), ("rotated", rotated)):
            out["graphs"][label] = role_summary(site_ranges(path, feeds, vis, pad))
    return out


def _kv_path(session, sample: dict, meta_row: dict, embed: np.ndarray, spec=None) -> bool:
    """Exact match of one sample through prefill(prefix + image) -> decode(question, answer)."""
    from edgeq.evaluate.generate import greedy_decode
    from edgeq.kv_cache import visual_cache_feeds
    from edgeq.models.easy_vqa import IGNORE
    from edgeq.textdata import empty_cache_feeds

    pad = int(meta_row["pad_len"])
    s, v = int(sample["visual_start"][0]) - pad, int(sample["visual_len"][0])
    embeds = sample["inputs_embeds"][:, pad:]
    ids, labels = meta_row["text_ids"][pad:], meta_row["labels"][pad:]
    cut = s + v  # prefill: the user prefix and the image
    float_session, decode_session = session if isinstance(session, tuple) else (session, session)
    caches = [i for i in float_session.get_inputs() if i.name.startswith("past_key_values.")]
    outputs = [o.name for o in float_session.get_outputs()]
    prefill = {"inputs_embeds": embeds[:, :cut], "attention_mask": np.ones((1, cut), np.int64),
               "position_ids": np.arange(cut, dtype=np.int64)[None], "visual_start": np.array([s]),
               "visual_len": np.array([v]), **empty_cache_feeds(caches, 1)}
    result = dict(zip(outputs, float_session.run(outputs, prefill)))
    presents = {k: val for k, val in result.items() if k.startswith("present.")}
    rest = ids[cut:]
    if spec is None:  # the float graph: the whole cache as it is
        cache = {"past_key_values." + k[len("present."):]: val for k, val in presents.items()}
        mask_len = cut + 1
    else:
        cache = visual_cache_feeds(presents, np.array([s]), np.array([v]), spec)
        mask_len = cut - v + 1
    step = {"inputs_embeds": embed[rest[0]][None, None].astype(np.float32), "attention_mask": np.ones((1, mask_len), np.int64),
            "position_ids": np.array([[cut]], np.int64), "visual_start": np.array([s]), "visual_len": np.array([v]), **cache}
    decoded = greedy_decode(decode_session, step, len(rest) - 1, embed, force_tokens=rest[1:])
    target = labels[cut + 1:]
    scored = target != IGNORE
    return bool((decoded.tokens[scored] == target[scored]).all())


def kv_part(model_dir: Path, samples: int) -> dict:
    from edgeq.evaluate.vqa import accuracy_by_type
    from edgeq.graph import ir
    from edgeq.kv_cache import VisualCacheSpec, cache_bytes_per_token
    from edgeq.models.easy_vqa import QUESTION_TYPES
    from edgeq.models.trained_vlm import WITH_PAST_DIR, load_eval
    from kv_fidelity import VARIANTS as KV_OPTIONS
    from kv_fidelity import _compile

    past_dir = model_dir / WITH_PAST_DIR
    inputs, meta = _subset(*load_eval(past_dir), samples)
    embed = np.load(past_dir / "embed_tokens.npy")
    n = len(meta["labels"])
    float_session = _session(past_dir / "model.onnx")
    start = time.perf_counter()

    def score(session, spec=None) -> dict:
        correct = [_kv_path(session, {k: v[i:i + 1] for k, v in inputs.items()},
                            {k: meta[k][i] for k in ("pad_len", "text_ids", "labels")}, embed, spec) for i in range(n)]
        summary = accuracy_by_type(correct, [QUESTION_TYPES[int(t)] for t in meta["qtype"]], order=QUESTION_TYPES)
        return {k: summary[k] for k in ("accuracy", "per_type")}

    from edgeq.models.trained_vlm import vqa_accuracy

    no_cache = vqa_accuracy(_session(model_dir / "model.onnx"), inputs, meta)
    table = {"no-cache graph (one pass)": {k: no_cache[k] for k in ("accuracy", "per_type")},
             "float cache": score(float_session)}
    print(f"kv float cache: {table['float cache']} ({time.perf_counter() - start:.0f} s)", flush=True)
    cfg = json.loads((past_dir / "config.json").read_text())
    kvh, d, layers = cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"], cfg["num_hidden_layers"]
    nv = int(inputs["visual_len"][0])
    for variant, scheme in KV_VARIANTS.items():
        for bits in KV_BITS:
            qmodel, record = _compile(past_dir, bits, KV_OPTIONS[variant])
            spec = VisualCacheSpec.from_model(qmodel)
            decode = ir.make_session(qmodel)
            row = score((float_session, decode), spec)
            row["bytes_per_visual_token"] = round(cache_bytes_per_token(layers, kvh, d, nv, bits, scheme), 1)
            row["chosen"] = {k: record["summary"][k] for k in ("k_clip", "v_clip", "tau1", "tau2", "calibrate")}
            table[f"{variant}@{bits}"] = row
            print(f"kv {variant}@{bits}: {row} ({time.perf_counter() - start:.0f} s)", flush=True)
    return {"samples": n, "fp16_bytes_per_visual_token": 2 * layers * kvh * d * 2, "table": table,
            "path": "float prefill of the user prefix and the image; question and answer through the decode graph"}


def markdown(results: dict) -> str:
    """The docs/figures-trained-vlm.md tables of a results file."""
    out = []
    m = results["metrics"]
    out.append("| question type | questions | accuracy | answer prior |\n| --- | --- | --- | --- |")
    for t, row in m["per_type"].items():
        out.append(f"| {t} | {row['questions']} | {row['accuracy']:.3f} | {row['prior_accuracy']:.3f} |")
    out.append(f"| all | {m['questions']} | **{m['accuracy']:.3f}** | {m['prior_accuracy']:.3f} |\n")
    if "ranges" in results:
        out.append("| site role | graph | visual absmax | text absmax | visual/text | text absmax without the first token | "
                   "visual/text |\n| --- | --- | --- | --- | --- | --- | --- |")
        graphs = results["ranges"]["graphs"]
        for role in sorted(set(graphs["fp32"]) | set(graphs["rotated"])):
            for label in ("fp32", "rotated"):
                r = graphs[label].get(role)
                if r:
                    out.append(f"| {role} | {label} | {r['visual_absmax_median']:.2f} | {r['text_absmax_median']:.2f} | "
                               f"{r['visual_over_text_median']:.2f} | {r['text_after_first_median']:.2f} | "
                               f"{r['visual_over_text_after_first_median']:.2f} |")
        out.append("")
    if "accuracy" in results:
        acc = results["accuracy"]
        bits = [b for b in BITS if f"{b}/single" in acc]
        head = " | ".join(f"{b.upper()} accuracy | KL | top-1" for b in bits)
        out.append(f"| activations | {head} |\n| --- |" + " --- | --- | --- |" * len(bits))
        names = {"single": "single static scale per site", "msq": "MSQ without AIFS (interleaved)",
                 "msq+aifs": "MSQ + AIFS (mquant-*-vlm recipe)", "token": "per-token dynamic (reference)"}
        out.append("| fp32 | " + " | ".join(f"{acc['fp32']['accuracy']:.3f} | - | -" for _ in bits) + " |")
        for v in VARIANTS:
            cells = []
            for b in bits:
                r = acc[f"{b}/{v}"]
                exact = f" (exact QDQ {r['accuracy_exact_qdq']:.3f})" if "accuracy_exact_qdq" in r else ""
                cells.append(f"{r['accuracy']:.3f}{exact} | {r['mean_kl']:.4f} | {r['top1_agreement']:.3f}")
            out.append(f"| {names[v]} | " + " | ".join(cells) + " |")
        out.append("")
    if "latency" in results:
        lat = results["latency"]
        out.append("latency (ms, " + f"{lat['tokens']} tokens): " + ", ".join(f"{k} {v}" for k, v in lat["latency_ms"].items())
                   + "; " + ", ".join(f"{k} {v}" for k, v in lat["ratios"].items()) + "\n")
    if "kv" in results:
        kv = results["kv"]
        out.append("| visual KV cache | accuracy | yes/no | shape | color | bytes per visual token |\n| --- | --- | --- | --- | --- | --- |")
        for name, r in kv["table"].items():
            pt = r["per_type"]
            size = r.get("bytes_per_visual_token", kv["fp16_bytes_per_visual_token"] if name == "float cache" else "-")
            out.append(f"| {name} | {r['accuracy']:.3f} | {pt.get('yes/no', 0):.3f} | {pt.get('shape', 0):.3f} | "
                       f"{pt.get('color', 0):.3f} | {size} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="edgeq export trained-vlm output folder")
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    p.add_argument("--work", type=Path, default=REPO / "artifacts" / "bench-trained-vlm")
    p.add_argument("--samples", type=int, default=500, help="eval questions for the accuracy table (default 500)")
    p.add_argument("--kv-samples", type=int, default=200, help="eval questions for the KV-cache table (default 200)")
    p.add_argument("--range-samples", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--bits", default=",".join(BITS), help=f"comma-separated subset of {','.join(BITS)}")
    p.add_argument("--skip-compile", action="store_true", help="reuse the graphs already in --work")
    p.add_argument("--table", action="store_true", help="print the docs/figures-trained-vlm.md tables of --out and exit")
    a = p.parse_args(argv)
    if a.table:
        print(markdown(json.loads(a.out.read_text())))
        return 0

    from edgeq.models.trained_vlm import load_eval

    parts = [x for x in a.parts.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}")
    inputs, meta = load_eval(a.model_dir)
    results = json.loads(a.out.read_text()) if a.out.is_file() else {}
    results.update({"model": str(a.model_dir), "metrics": json.loads((a.model_dir / "metrics.json").read_text())})
    results["metrics"].pop("machine", None)
    if "ranges" in parts:
        results["ranges"] = ranges_part(a.model_dir, inputs, meta, a.range_samples)
    if "accuracy" in parts:
        sub_inputs, sub_meta = _subset(inputs, meta, a.samples)
        results["accuracy"], graphs = accuracy_part(a.model_dir, a.work, sub_inputs, sub_meta, a.skip_compile,
                                                    tuple(b for b in a.bits.split(",") if b))
        results["accuracy_samples"] = len(sub_meta["labels"])
        if "w8a8/msq+aifs" in graphs:
            report = json.loads((graphs["w8a8/msq+aifs"] / "report.json").read_text())
            results["msq_calibration_ranges_w8a8"] = range_table(report)
    if "latency" in parts:
        results["latency"] = latency_part(a.model_dir, a.work, inputs, a.repeats)
    if "kv" in parts:
        results["kv"] = kv_part(a.model_dir, a.kv_samples)
    save_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
