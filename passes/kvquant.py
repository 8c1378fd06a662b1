"""``kvquant``: CalibQuant's 1/2-bit visual KV cache (paper 001, sections 4.1-4.2) in a decoder graph.

The input is a decoder with a KV cache (``edgeq export composed-vlm --with-past``). The output is
its decode graph over a mixed cache: the visual tokens' keys and values, quantized after prefill
(``edgeq.kv_cache``: channel-wise min/max per layer, KV head and channel, packed MSB first into
uint8 along head_dim), come in as new inputs ``visual_key_values.{i}.*``; the text tokens stay in
``past_key_values.{i}.*`` in float, and ``present.{i}.*`` carry the text cache plus the new
token. Each layer's ``Softmax(q k^T * scale + mask) v`` becomes ``edgeq::VisualKVAttention``
(post-scaling for K and V, so the dequantized cache never exists; logit calibration g with tau1,
tau2) over [visual codes, text cache]; the mask gets zero columns in front for the visual tokens
(the visual prefix is fully visible to every decode position). Attention is invariant to the order
of its keys, so splitting the visual rows out of the cache changes nothing but their precision.
Prefill runs the input graph; ``edgeq.kv_cache.visual_cache_feeds`` turns its presents into the
decode feeds.

Calibration (on ``--calib`` samples, prefill only): for each sample and layer, the post-RoPE
queries of the last ``query_tokens`` prompt positions (text after the image, the positions that
read the visual cache the way decode steps do), the visual and text keys and values, and the
causal mask among the text; then ``edgeq.passes.methods.kv_calibration``: range-clipping factors for K and V
(grid 1.0 ... 0.2, coordinate descent, no logit calibration) and (tau1, tau2) on {0,1,2,3}^2, both
minimizing the mean relative attention-output error. The chosen values and the errors go to the
pass summary (report.json) and to the model metadata ``edgeq.kvquant`` (which the host-side
packing reads: the clip factors are part of the quantizer).

``scheme``: ``calibquant`` (K, V channel-wise), ``global-v`` (V one range per head: the
"without channel-wise V" ablation), ``kivi`` (V per token: ``edgeq::VisualKVAttentionKIVI``, the
KIVI-style comparator). ``bits``: 1 or 2 (the method), 4 and 8 for the fidelity curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import facts
from edgeq.errors import UserInputError
from edgeq.passes.methods.kv_attention_sites import KVSite, find_kv_sites
from edgeq.kv_cache import FIELDS, VISUAL_PREFIX, VisualCacheSpec
from edgeq.passmanager.passbase import Exactness, Pass, PassConfig, PassContext, PassResult
from edgeq.runtime_ops.domain import DOMAIN



@dataclass(frozen=True)
class KvQuantConfig(PassConfig):
    bits: int = 2
    scheme: str = "calibquant"  # calibquant | global-v | kivi
    calibrate: bool = True  # logit calibration g (tau1, tau2)
    tau_search: bool = True  # search (tau1, tau2) on calibration data; else use tau1 / tau2
    tau1: float = 0.0
    tau2: float = 0.0
    clip_search: bool = True  # search the K / V range-clipping factors; else use k_clip / v_clip
    k_clip: float = 1.0
    v_clip: float = 1.0
    query_tokens: int = 16  # last prompt positions used as decode-time queries in calibration
    max_samples: int = 16
    visual_start: int = -1  # the visual span when the graph has no visual_start / visual_len inputs
    visual_len: int = 0

    def __post_init__(self):
        if self.query_tokens < 1 or self.max_samples < 1:
            raise UserInputError("kvquant: query_tokens and max_samples must be >= 1")
        VisualCacheSpec(self.bits, self.scheme, self.k_clip, self.v_clip)  # validates bits, scheme and clip factors

    @property
    def needs_data(self) -> bool:
        return self.clip_search or (self.calibrate and self.tau_search)


class KvQuantPass(Pass, name="kvquant", exactness=Exactness.LOSSY, config=KvQuantConfig, establishes=facts.KVQUANT,
                  calibrates=True, needs=("kv-cache",),
                  summary="CalibQuant visual KV cache: packed 1/2-bit channel-wise codes, post-scaled attention, logit calibration"):
    config: KvQuantConfig

    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        cfg: KvQuantConfig = self.config
        sites = find_kv_sites(graph)
        spec = VisualCacheSpec(cfg.bits, cfg.scheme, cfg.k_clip, cfg.v_clip)
        tau = (cfg.tau1, cfg.tau2)
        calibration: dict = {}
        if cfg.needs_data:
            from edgeq.passes.methods.kv_calibration import search_clip, search_tau

            samples = collect_attention_samples(graph, sites, ctx.require_calibrator(self.name), cfg)
            calibration["samples"] = len(samples)
            if cfg.clip_search:
                clip = search_clip(samples, spec)
                spec = VisualCacheSpec(cfg.bits, cfg.scheme, clip.k_clip, clip.v_clip)
                calibration["clip"] = {"error": clip.error, "unclipped_error": clip.unclipped_error, "errors": clip.errors}
            if cfg.calibrate and cfg.tau_search:
                choice = search_tau(samples, cfg.bits, spec=spec)
                tau = (choice.tau1, choice.tau2)
                calibration["tau"] = {"error": choice.error, "uncalibrated_error": choice.uncalibrated_error,
                                      "errors": {f"{a:g},{b:g}": e for (a, b), e in choice.errors.items()}}
        for site in sites:
            _rewrite(graph, site, spec, tau, cfg.calibrate)
        graph.cleanup().toposort()
        chosen = {"bits": spec.bits, "scheme": spec.scheme, "k_clip": spec.k_clip, "v_clip": spec.v_clip,
                  "tau1": tau[0], "tau2": tau[1], "calibrate": bool(cfg.calibrate)}
        facts.KVQUANT.set(graph, chosen)
        return PassResult(True, {"layers": len(sites), **chosen, "calibration": calibration,
                                 "visual_inputs": [f"{VISUAL_PREFIX}{{i}}.{f}" for f in FIELDS]})


def _visual_inputs(site: KVSite, spec: VisualCacheSpec) -> dict[str, gs.Variable]:
    kvh, d, b = site.kv_heads, site.head_dim, spec.bits
    if d % (8 // b):
        raise UserInputError(f"kvquant: head_dim {d} is not a multiple of {8 // b} (8 / bits)")
    v_shapes: dict[str, list[int | str]] = {"channel": [1, d], "global": [1, 1], "token": ["visual_length", 1]}
    v_shape = v_shapes[spec.axes[1]]
    shapes: dict[str, list[int | str]] = {
        "key_codes": ["visual_length", d * b // 8], "key_alpha": [1, d], "key_scale": [1, d],
        "value_codes": ["visual_length", d * b // 8], "value_alpha": v_shape, "value_scale": v_shape}
    return {f: gs.Variable(f"{VISUAL_PREFIX}{site.layer}.{f}", np.uint8 if f.endswith("codes") else np.float32,
                           ["batch_size", kvh, *shapes[f]]) for f in FIELDS}


def _rewrite(graph: gs.Graph, site: KVSite, spec: VisualCacheSpec, tau: tuple[float, float], calibrate: bool) -> None:
    prefix = f"/kvquant/layers.{site.layer}"
    visual = _visual_inputs(site, spec)
    graph.inputs.extend(visual.values())
    q = site.q
    factor = site.logit_scale * math.sqrt(site.head_dim)
    if abs(factor - 1.0) > 1e-6:
        q = _op(graph, "Mul", f"{prefix}/q_scale", [q, gs.Constant(f"{prefix}/q_scale_value", np.array(factor, np.float32))])
    if site.mask is None:
        mask = gs.Constant(f"{prefix}/no_mask", np.array(0.0, np.float32))
    else:  # zero columns for the visual tokens in front of the text mask [.., S, T]
        lead = _op(graph, "Slice", f"{prefix}/mask_lead", [
            _op(graph, "Shape", f"{prefix}/mask_shape", [site.mask]),
            gs.Constant(f"{prefix}/zero", np.array([0], np.int64)), gs.Constant(f"{prefix}/three", np.array([3], np.int64))])
        nv = _op(graph, "Slice", f"{prefix}/nv", [
            _op(graph, "Shape", f"{prefix}/codes_shape", [visual["key_codes"]]),
            gs.Constant(f"{prefix}/two", np.array([2], np.int64)), gs.Constant(f"{prefix}/three_b", np.array([3], np.int64))])
        shape = _op(graph, "Concat", f"{prefix}/visual_mask_shape", [lead, nv], attrs={"axis": 0})
        zeros = _op(graph, "ConstantOfShape", f"{prefix}/visual_mask", [shape],
                    attrs={"value": gs.Constant(f"{prefix}/zero_f", np.array([0.0], np.float32))})
        mask = _op(graph, "Concat", f"{prefix}/mask", [zeros, site.mask], attrs={"axis": -1})
    tensors = graph.tensors()
    inputs = [q, visual["key_codes"], visual["key_alpha"], visual["key_scale"], visual["value_codes"],
              visual["value_alpha"], visual["value_scale"], tensors[site.key], tensors[site.value], mask]
    op = "VisualKVAttentionKIVI" if spec.scheme == "kivi" else "VisualKVAttention"
    attrs = {"bits": int(spec.bits), "tau1": float(tau[0]), "tau2": float(tau[1]), "calibrate": int(bool(calibrate))}
    out = site.out
    site.pv.outputs = []
    graph.nodes.append(gs.Node(op, f"{prefix}/{op}", attrs, inputs, [out], domain=DOMAIN))


def _op(graph: gs.Graph, op: str, name: str, inputs, attrs=None) -> gs.Variable:
    out = gs.Variable(f"{name}_output_0")
    graph.nodes.append(gs.Node(op, name, attrs or {}, list(inputs), [out]))
    return out


def collect_attention_samples(graph: gs.Graph, sites: list[KVSite], calibrator, cfg: KvQuantConfig) -> list:
    """Decode-like attention samples of every layer from prefill runs on the calibration data
    (see the module docstring)."""
    from edgeq.kv_cache import split_visual_rows
    from edgeq.passes.methods.kv_calibration import AttentionSample

    names = {t.name for t in graph.inputs}
    has_span = {"visual_start", "visual_len"} <= names
    if not has_span and cfg.visual_start < 0:
        raise UserInputError("kvquant calibration needs the visual span: a graph with visual_start / visual_len "
                             "inputs, or the pass options visual_start and visual_len")
    fetch = [s.q.name for s in sites] + [n for s in sites for n in (s.key, s.value)]
    samples = []
    for feeds, values in calibrator.fetch(graph, fetch, cfg.max_samples):
        batch = values[sites[0].key].shape[0]
        starts = feeds["visual_start"] if has_span else np.full(batch, cfg.visual_start)
        lens = feeds["visual_len"] if has_span else np.full(batch, cfg.visual_len)
        pad = feeds.get("attention_mask")
        for b in range(batch):
            vs, vl = int(np.ravel(starts)[b]), int(np.ravel(lens)[b])
            t = values[sites[0].key].shape[2]
            queries = np.arange(max(vs + vl, t - cfg.query_tokens), t)
            if queries.size == 0:
                continue
            text_pos = np.concatenate([np.arange(vs), np.arange(vs + vl, t)])
            masked = text_pos[None, :] > queries[:, None]
            if pad is not None:
                masked |= pad[b][text_pos][None, :] == 0
            mask = np.concatenate([np.zeros((queries.size, vl)), np.where(masked, -1e9, 0.0)], axis=1)[None, None]
            for site in sites:
                factor = site.logit_scale * math.sqrt(site.head_dim)
                q = (values[site.q.name][b:b + 1][:, :, queries] * factor).astype(np.float32)
                k_vis, k_txt = split_visual_rows(values[site.key][b:b + 1], [vs], [vl])
                v_vis, v_txt = split_visual_rows(values[site.value][b:b + 1], [vs], [vl])
                samples.append(AttentionSample(q, k_vis, v_vis, k_txt, v_txt, mask.astype(np.float32)))
    if not samples:
        raise UserInputError("kvquant calibration found no prompt positions after the visual span")
    return samples
