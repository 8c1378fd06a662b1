"""Visual KV-cache quantization fidelity on the composed vision-language model (CalibQuant issue),
by fake quantization of the cache: after a float prefill, the visual tokens' rows of every layer's
present keys and values are quantized and dequantized, then greedy decoding continues on them.

What this measures and what it does not: post-scaling is an exact rewrite of attention over the
dequantized cache, so fake quantization gives the same numbers as ``edgeq::VisualKVAttention``
without logit calibration. It therefore covers "CalibQuant without calibration" (K and V
channel-wise), "without channel-wise V" (V with one range per layer and KV head) and the
KIVI-style comparator (K per channel, V per token); CalibQuant WITH calibration changes the
attention itself and needs the ``kvquant`` pass's graph (not written yet).

Per sample of eval.npz (prompt: 16 text, 196 visual, 48 text tokens): the fp32 graph generates 32
tokens greedily; each variant is run (a) teacher-forced along the fp32 tokens, for the mean KL
divergence of the next-token distributions and top-1 agreement over the 31 decode steps (the
prefill logits are float in every variant), and (b) free-running, for the exact-match rate of
all 32 generated tokens. Also the visual cache bytes per token against fp16 and fp32.

Usage: python benchmarks/kv_fidelity.py --model-dir DIR --out F   (DIR: edgeq export composed-vlm --with-past)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from foundation import save_results  # noqa: E402

BITS = (8, 4, 2, 1)
SCHEMES = {
    "calibquant-no-calibration": ("channel", "channel"),
    "global-v": ("channel", "global"),
    "kivi": ("channel", "token"),
    # the released CalibQuant code's 1-bit range clipping (K 0.5, V 0.3), not searched here
    "channel-clip-k0.5-v0.3": ("channel", "channel"),
}
CLIP = {"channel-clip-k0.5-v0.3": (0.5, 0.3)}


def fake_quant(x: np.ndarray, bits: int, axis: str, clip: float = 1.0) -> np.ndarray:
    """Min/max asymmetric quantize-dequantize of x [KVH, N, D] (one sequence's visual rows):
    ``channel`` one range per (head, channel) over the tokens, ``token`` per (head, token) over the
    channels, ``global`` one per head; ``clip`` < 1 shrinks each range about its midpoint."""
    reduce = {"channel": (1,), "token": (2,), "global": (1, 2)}[axis]
    lo, hi = x.min(axis=reduce, keepdims=True), x.max(axis=reduce, keepdims=True)
    mid, half = (lo + hi) / 2, (hi - lo) / 2 * clip
    lo = mid - half
    scale = 2 * half / (2 ** bits - 1)
    safe = np.where(scale > 0, scale, 1.0)
    codes = np.clip(np.round((x - lo) / safe), 0, 2 ** bits - 1)
    return (codes * scale + lo).astype(x.dtype)


def cache_bytes_per_token(layers: int, kv_heads: int, head_dim: int, visual_tokens: int) -> dict:
    """Bytes of K+V per visual token: fp32, fp16, and b-bit codes plus the channel-wise fp32
    alpha/scale of K and V amortized over the image's visual tokens."""
    values = 2 * layers * kv_heads * head_dim
    params = 2 * 2 * layers * kv_heads * head_dim * 4 / visual_tokens
    out = {"fp32": values * 4, "fp16": values * 2}
    for b in BITS:
        out[f"{b}-bit"] = round(values * b / 8 + params, 1)
    return out


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    def log_softmax(x):
        x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="edgeq export composed-vlm --with-past folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated schemes to run")
    p.add_argument("--bits", default=",".join(map(str, BITS)), help="comma-separated bit widths")
    a = p.parse_args(argv)

    from edgeq.evaluate.generate import PAST_PREFIX, PRESENT_PREFIX, greedy_decode
    from edgeq.models.embeds_export import ort_session

    session = ort_session(a.model_dir / "model.onnx")
    embed = np.load(a.model_dir / "embed_tokens.npy")
    data = np.load(a.model_dir / "eval.npz")
    names = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    pasts = [n for n in names if n.startswith(PAST_PREFIX)]
    n = min(a.samples, len(data["inputs_embeds"]))
    schemes = [x for x in a.schemes.split(",") if x]
    bit_list = [int(x) for x in a.bits.split(",") if x]
    rows = {f"{s}@{b}": {"kl": [], "top1": [], "exact": []} for s in schemes for b in bit_list}
    start = time.perf_counter()
    for i in range(n):
        feeds = {k: data[k][i:i + 1] for k in data.files if k in names}
        ref = greedy_decode(session, feeds, a.steps, embed)
        prefill = {**feeds, **{k: np.zeros((1, session.get_inputs()[names.index(k)].shape[1], 0,
                                            session.get_inputs()[names.index(k)].shape[3]), np.float32) for k in pasts}}
        result = dict(zip(outputs, session.run(outputs, prefill)))
        vs, vl = int(data["visual_start"][i]), int(data["visual_len"][i])
        seq = feeds["inputs_embeds"].shape[1]
        for scheme in schemes:
            k_axis, v_axis = SCHEMES[scheme]
            for bits in bit_list:
                cache = {}
                for past in pasts:
                    present = result[PRESENT_PREFIX + past[len(PAST_PREFIX):]].copy()
                    is_key = past.endswith(".key")
                    clip = CLIP.get(scheme, (1.0, 1.0))[0 if is_key else 1]
                    present[0, :, vs:vs + vl] = fake_quant(present[0, :, vs:vs + vl], bits, k_axis if is_key else v_axis, clip)
                    cache[past] = present
                first = int(result["logits"][0, -1].argmax())
                step_feeds = {"inputs_embeds": embed[first][None, None].astype(np.float32),
                              "attention_mask": np.ones((1, seq + 1), np.int64),
                              "position_ids": feeds["position_ids"][:, -1:] + 1, **cache,
                              **{k: feeds[k] for k in ("visual_start", "visual_len") if k in names}}
                forced = greedy_decode(session, {**step_feeds, "inputs_embeds": embed[ref.tokens[0]][None, None].astype(np.float32)},
                                       a.steps - 1, embed, force_tokens=ref.tokens[1:])
                free = greedy_decode(session, step_feeds, a.steps - 1, embed)
                row = rows[f"{scheme}@{bits}"]
                row["kl"].append(float(_kl(ref.logits[1:], forced.logits).mean()))
                row["top1"].append(float((forced.logits.argmax(-1) == ref.logits[1:].argmax(-1)).mean()))
                row["exact"].append(float(first == ref.tokens[0] and np.array_equal(free.tokens, ref.tokens[1:])))
        print(f"sample {i + 1}/{n} ({time.perf_counter() - start:.0f} s)", flush=True)
    cfg = json.loads((a.model_dir / "config.json").read_text())
    kvh, d = cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    results = {
        "samples": n, "steps": a.steps, "method": "fake-quantized visual cache after a float prefill (no logit calibration)",
        "table": {k: {m: round(float(np.mean(v[m])), 5) for m in ("kl", "top1", "exact")} for k, v in rows.items()},
        "cache_bytes_per_visual_token": cache_bytes_per_token(cfg["num_hidden_layers"], kvh, d, int(data["visual_len"][0])),
        "seconds": round(time.perf_counter() - start, 1),
    }
    save_results(a.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
