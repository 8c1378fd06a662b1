"""Visual KV-cache fidelity on the composed vision-language model (CalibQuant issue), through the
``kvquant`` decode graphs: for every variant and bit width, the pass compiles the decode graph
(calibrating on calib.npz: clip factors and (tau1, tau2) where the variant searches them), the
float graph runs the prefill, ``edgeq.kv_cache.visual_cache_feeds`` packs its visual rows, and the
decode graph (``edgeq::VisualKVAttention`` / ``VisualKVAttentionKIVI`` run by onnxruntime through
their function bodies) generates the rest.

Variants (all: K channel-wise):
- ``calibquant``: V channel-wise, searched clip factors, searched (tau1, tau2) (the method);
- ``no-calibration``: V channel-wise, no clipping, no logit calibration;
- ``clip-only``: V channel-wise, searched clip factors, no logit calibration;
- ``tau-only``: V channel-wise, no clipping, searched (tau1, tau2) (the paper's calibration alone);
- ``global-v``: V one range per head, searched clip factors and taus ("without channel-wise V");
- ``kivi``: V per token, no clipping or calibration (the KIVI-style comparator).

Per sample of eval.npz (prompt: 16 text, 196 visual, 48 text tokens): the fp32 graph generates 32
tokens greedily; each variant is run (a) teacher-forced along the fp32 tokens, for the mean KL
divergence of the next-token distributions and top-1 agreement over the 31 decode steps (the
prefill is float in every variant, so step 0 is identical), and (b) free-running, for the
exact-match rate of all 32 generated tokens. Also the visual cache bytes per token against fp16 and
fp32, and the values each variant's calibration chose.

Usage: python benchmarks/kv_fidelity.py --model-dir DIR --out F   (DIR: edgeq export composed-vlm --with-past)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from foundation import save_results

REPO = Path(__file__).resolve().parents[1]

BITS = (8, 4, 2, 1)
SEARCH = {"clip_search": True, "tau_search": True, "calibrate": True}
VARIANTS = {
    "calibquant": {"scheme": "calibquant", **SEARCH},
    "no-calibration": {"scheme": "calibquant", "clip_search": False, "calibrate": False},
    "clip-only": {"scheme": "calibquant", "clip_search": True, "calibrate": False},
    "tau-only": {"scheme": "calibquant", "clip_search": False, "tau_search": True, "calibrate": True},
    "global-v": {"scheme": "global-v", **SEARCH},
    "kivi": {"scheme": "kivi", "clip_search": False, "calibrate": False},
}


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    def log_softmax(x):
        x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def _reference(session, data, n, steps, embed):
    """Per sample: the prompt feeds, the fp32 greedy result and the prefill's presents."""
    from edgeq.evaluate.generate import greedy_decode
    from edgeq.textdata import empty_cache_feeds

    names = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    caches = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    refs = []
    for i in range(n):
        feeds = {k: data[k][i:i + 1] for k in data.files if k in names}
        ref = greedy_decode(session, feeds, steps, embed)
        result = dict(zip(outputs, session.run(outputs, {**feeds, **empty_cache_feeds(caches, 1)})))
        presents = {k: v for k, v in result.items() if k.startswith("present.")}
        refs.append((feeds, ref, presents))
    return refs


def _compile(model_dir: Path, bits: int, options: dict):
    from edgeq.graph import ir
    from edgeq.calib.dataset import build_calibration_set
    from edgeq.calib.session import Calibrator
    from edgeq.passmanager.passbase import PassContext
    from edgeq.passmanager.pipeline import Pipeline
    from edgeq.passmanager.registry import get_pass

    model = ir.load_model(model_dir / "model.onnx")
    specs = ir.input_specs(model)
    data = build_calibration_set(model_dir / "calib.npz", specs, None, windows=16, seq_len=0)
    kvquant = get_pass("kvquant")
    qmodel, records = Pipeline([kvquant(kvquant.Config(bits=bits, **options))]).run(model, PassContext(Calibrator(data, use_cache=False)))
    return qmodel, records[-1].to_json()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="edgeq export composed-vlm --with-past folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants to run")
    p.add_argument("--bits", default=",".join(map(str, BITS)), help="comma-separated bit widths")
    a = p.parse_args(argv)

    from edgeq.graph import ir
    from edgeq.evaluate.generate import greedy_decode
    from edgeq.kv_cache import VisualCacheSpec, cache_bytes_per_token, visual_cache_feeds
    from edgeq.models.embeds_export import ort_session

    session = ort_session(a.model_dir / "model.onnx")
    embed = np.load(a.model_dir / "embed_tokens.npy")
    data = np.load(a.model_dir / "eval.npz")
    n = min(a.samples, len(data["inputs_embeds"]))
    variants = [x for x in a.variants.split(",") if x]
    bit_list = [int(x) for x in a.bits.split(",") if x]
    start = time.perf_counter()
    refs = _reference(session, data, n, a.steps, embed)
    del session
    print(f"fp32 references: {time.perf_counter() - start:.0f} s", flush=True)
    table, chosen = {}, {}
    for variant in variants:
        for bits in bit_list:
            qmodel, record = _compile(a.model_dir, bits, VARIANTS[variant])
            spec = VisualCacheSpec.from_model(qmodel)
            qs = ir.make_session(qmodel)
            del qmodel
            kl, top1, exact = [], [], []
            for feeds, ref, presents in refs:
                vs, vl = feeds["visual_start"], feeds["visual_len"]
                seq = feeds["inputs_embeds"].shape[1]
                step = {"position_ids": feeds["position_ids"][:, -1:] + 1, "visual_start": vs, "visual_len": vl,
                        "attention_mask": np.ones((1, seq - int(vl[0]) + 1), np.int64),
                        **visual_cache_feeds(presents, vs, vl, spec)}
                forced = greedy_decode(qs, {**step, "inputs_embeds": embed[ref.tokens[0]][None, None].astype(np.float32)},
                                       a.steps - 1, embed, force_tokens=ref.tokens[1:])
                free = greedy_decode(qs, {**step, "inputs_embeds": embed[ref.tokens[0]][None, None].astype(np.float32)},
                                     a.steps - 1, embed)
                kl.append(float(_kl(ref.logits[1:], forced.logits).mean()))
                top1.append(float((forced.logits.argmax(-1) == ref.logits[1:].argmax(-1)).mean()))
                exact.append(float(np.array_equal(free.tokens, ref.tokens[1:])))
            key = f"{variant}@{bits}"
            table[key] = {"kl": round(float(np.mean(kl)), 5), "top1": round(float(np.mean(top1)), 4),
                          "exact": round(float(np.mean(exact)), 4)}
            summary = record["summary"]
            chosen[key] = {k: summary[k] for k in ("k_clip", "v_clip", "tau1", "tau2", "calibrate")}
            chosen[key]["calibration"] = {k: {m: v for m, v in summary["calibration"][k].items() if m != "errors"}
                                          for k in ("clip", "tau") if k in summary["calibration"]}
            print(f"{key}: {table[key]} {chosen[key]} ({time.perf_counter() - start:.0f} s)", flush=True)
    cfg = json.loads((a.model_dir / "config.json").read_text())
    kvh, d, layers = cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"], cfg["num_hidden_layers"]
    nv = int(data["visual_len"][0])
    values = 2 * layers * kvh * d
    cache = {"fp32": values * 4, "fp16": values * 2}
    for bits in BITS:
        for scheme in ("calibquant", "global-v", "kivi"):
            cache[f"{scheme}@{bits}"] = round(cache_bytes_per_token(layers, kvh, d, nv, bits, scheme), 1)
    results = {
        "samples": n, "steps": a.steps, "method": "kvquant decode graphs in onnxruntime after a float prefill (function bodies)",
        "table": table, "chosen": chosen, "cache_bytes_per_visual_token": cache,
        "seconds": round(time.perf_counter() - start, 1),
    }
    save_results(a.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
