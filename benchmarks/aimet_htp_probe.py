"""The probe of ``benchmarks/aimet_htp.py --probe SETTING``: AIMET's prefill graph with intermediate
tensors as extra outputs, run on the emulated HTP and on onnxruntime CPU, to find the layer where the
HTP departs (kept apart from the measurement pipeline it diagnoses)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# probe: where the HTP departs from CPU inside AIMET's prefill graph (--probe SETTING)
# ------------------------------------------------------------------------------------------------

PROBE_TENSORS = (
    "/model/embed_tokens/Gather_output_0_qdq", "/model/rotary_emb/Cos_output_0_updated",
    "/model/rotary_emb/Sin_output_0_updated",
    *(f"/model/layers.0/{t}_output_0_updated" for t in (
        "input_layernorm/Mul_1", "self_attn/q_proj/MatMul", "self_attn/Softmax", "self_attn/o_proj/MatMul", "Add",
        "post_attention_layernorm/Mul_1", "mlp/down_proj/MatMul", "Add_1")),
    *(f"/model/layers.{i}/Add_1_output_0_updated" for i in (1, 5, 15, 29)),
    "/model/norm/Mul_1_output_0_updated", "logits",
)


def probe_model(pair: Path, out: Path, feeds_path: Path, feed_ids: list[int], tensors=PROBE_TENSORS) -> dict:
    """``out/probe.onnx``: the pair's prefill graph with PROBE_TENSORS (those present) as extra
    outputs, their shapes from a CPU run; ``out/feeds.npz``: the calibration feeds it runs on;
    ``out/cpu.npz``: those tensors on onnxruntime CPU with exact QDQ (the Q/DQ arithmetic as written)."""
    import onnx
    import onnxruntime as ort

    sys.path.insert(0, str(REPO / "benchmarks" / "peers" / "adapters"))
    from _peer_contract import RecordedFeeds

    out.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(pair / "prefill.onnx"))
    produced = {o for n in model.graph.node for o in n.output}
    names = [t for t in tensors if t in produced]
    existing = {o.name for o in model.graph.output}
    shapes = {vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim) for vi in model.graph.input}
    recorded = list(RecordedFeeds(feeds_path, shapes))
    feeds = [recorded[i] for i in feed_ids]
    np.savez(out / "feeds.npz", **{f"{j}/{k}": v for j, f in enumerate(feeds) for k, v in f.items()})
    for t in names:
        if t not in existing:
            model.graph.output.append(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None))
    tmp = out / "probe-untyped.onnx"
    onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True, location="probe.onnx.data",
                    size_threshold=1024)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_quant_qdq", "1")
    sess = ort.InferenceSession(str(tmp), so, providers=["CPUExecutionProvider"])
    cpu = [dict(zip(names, sess.run(names, f))) for f in feeds]
    del sess
    for vi in model.graph.output:  # static shapes for the HTP
        if vi.name in names and not vi.type.tensor_type.shape.dim:
            for d in cpu[0][vi.name].shape:
                vi.type.tensor_type.shape.dim.add().dim_value = d
    model = onnx.load(str(tmp), load_external_data=False)
    for vi in model.graph.output:
        if vi.name in names and not vi.type.tensor_type.shape.dim:
            for d in cpu[0][vi.name].shape:
                vi.type.tensor_type.shape.dim.add().dim_value = d
    onnx.save_model(model, str(out / "probe.onnx"))
    tmp.unlink()
    np.savez(out / "cpu.npz", **{f"{j}/{k}": v for j, r in enumerate(cpu) for k, v in r.items()})
    return {"tensors": names, "feeds": feed_ids}


def probe_htp(out: Path) -> None:
    """Child: the probe graph on the HTP (prepared in this process), its tensors to ``out/htp.npz``."""
    from edgeq.targets.qnn_vendor import open_htp_session

    npz = np.load(out / "feeds.npz")
    feeds: dict[int, dict] = {}
    for key in npz.files:
        j, name = key.split("/", 1)
        feeds.setdefault(int(j), {})[name] = npz[key]
    started = time.perf_counter()
    sess = open_htp_session(out / "probe.onnx")
    opened = time.perf_counter() - started
    names = [o.name for o in sess.get_outputs()]
    res, secs = {}, []
    for j in sorted(feeds):
        t = time.perf_counter()
        for k, v in zip(names, sess.run(names, feeds[j])):
            res[f"{j}/{k}"] = v
        secs.append(round(time.perf_counter() - t, 1))
    np.savez(out / "htp.npz", **res)
    print(json.dumps({"open_s": round(opened, 1), "run_s": secs}))


def probe_compare(out: Path, names: list[str], n_feeds: int) -> dict:
    cpu, htp = np.load(out / "cpu.npz"), np.load(out / "htp.npz")
    rows = {}
    for j in range(n_feeds):
        for t in names:
            a, b = cpu[f"{j}/{t}"].astype(np.float64), htp[f"{j}/{t}"].astype(np.float64)
            rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))
            row = {"rel_l2": round(rel, 5), "max_abs": round(float(np.max(np.abs(a - b))), 4),
                   "cpu_absmax": round(float(np.max(np.abs(a))), 4), "htp_absmax": round(float(np.max(np.abs(b))), 4)}
            if t == "logits":
                row["top1_agreement"] = round(float(np.mean(a[0].argmax(-1) == b[0].argmax(-1))), 4)
            rows.setdefault(t, {})[j] = row
    return rows


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
