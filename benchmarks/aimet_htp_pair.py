"""The evaluation pair of ``aimet_htp.py`` (its steps 4 and 5): AIMET's QDQ prompt graph put in place of
the fp32 static pair's prefill graph (same inputs and outputs, checked), the lm_head's per-channel
DequantizeLinear -> Transpose folded exactly, and the graph's HTP context binary prepared with CPU
fallback disabled (on refusal: which nodes the HTP refuses and why)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

# files of the fp32 pair that describe its own compile, not the assembled pair
NOT_LINKED = {"prefill.onnx", "manifest.json", "report.json", "encodings.json", "aimet_encodings.json", "qnn"}


def _io(model) -> tuple[list, list]:
    def spec(vi):
        t = vi.type.tensor_type
        return (vi.name, t.elem_type, [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim])
    return [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output]


def link(src: Path, dst: Path) -> None:
    """A hard link (onnxruntime refuses external data reached through a symbolic link that leaves the
    model's folder), a copy across file systems."""
    import shutil

    if dst.is_symlink() or dst.exists():
        dst.unlink()
    try:
        os.link(src.resolve(), dst)
    except OSError:
        shutil.copy2(src.resolve(), dst)


def fold_weight_transposes(model) -> list[dict]:
    """``DequantizeLinear(integer weight, axis a) -> Transpose -> MatMul`` becomes ``DequantizeLinear(
    weight^T, axis 1 - a) -> MatMul``: the same dequantized weight, exactly (the integers are moved,
    not requantized). AIMET exports the tied lm_head of SmolLM2's graph (MatMul of Transpose(table
    copy)) this way, and the HTP takes a per-channel DequantizeLinear only inside the node unit of
    the op that reads it: behind a Transpose it is refused ("QNN EP does not support a standalone DQ
    op with per-channel quantization"). Returns what was folded (checked bit for bit)."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    folded = []
    for t in list(g.node):
        if t.op_type != "Transpose" or t.input[0] not in producer:
            continue
        dq = producer[t.input[0]]
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in inits or len(consumers[dq.output[0]]) != 1:
            continue
        if not all(c.op_type == "MatMul" and list(c.input).index(t.output[0]) == 1 for c in consumers[t.output[0]]):
            continue
        q = numpy_helper.to_array(inits[dq.input[0]])
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), list(range(q.ndim))[::-1])
        if q.ndim != 2 or perm != [1, 0]:
            continue
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        axis = axis % 2
        scale = numpy_helper.to_array(inits[dq.input[1]]) if dq.input[1] in inits else None
        zp = numpy_helper.to_array(inits[dq.input[2]]) if len(dq.input) > 2 and dq.input[2] in inits else None
        new_q = numpy_helper.from_array(np.ascontiguousarray(q.T), dq.input[0] + "_transposed")
        g.initializer.append(new_q)
        new_dq = helper.make_node("DequantizeLinear", [new_q.name, *dq.input[1:]], [t.output[0]], name=dq.name + "_transposed",
                                  axis=1 - axis)
        # the dequantized weights, both ways (a per-channel DQ: scale along `axis`)
        if scale is not None:
            shape = [1, 1]
            shape[axis] = -1
            zero = zp.astype(np.float32).reshape(shape) if zp is not None and zp.ndim else (0 if zp is None else float(zp))
            before = ((q.astype(np.float32) - zero) * scale.reshape(shape) if scale.ndim else
                      (q.astype(np.float32) - zero) * scale).T
            shape_t = shape[::-1]
            zero_t = zp.astype(np.float32).reshape(shape_t) if zp is not None and zp.ndim else zero
            after = ((q.T.astype(np.float32) - zero_t) * scale.reshape(shape_t) if scale.ndim else
                     (q.T.astype(np.float32) - zero_t) * scale)
            if not np.array_equal(before, after):
                raise SystemExit(f"folding {t.name}: dequantized weights differ")
        idx = list(g.node).index(dq)
        g.node.remove(t)
        g.node.remove(dq)
        g.node.insert(idx, new_dq)
        g.initializer.remove(inits[dq.input[0]])
        folded.append({"transpose": t.name, "dequantize": dq.name, "weight": dq.input[0], "shape": list(q.shape),
                       "axis_before": axis, "axis_after": 1 - axis, "readers": [c.name for c in consumers[t.output[0]]],
                       "dequantized_equal": scale is not None})
    return folded


def assemble(base: Path, aimet: Path, folder: Path, setting: str, fold: bool = True) -> dict:
    """``folder``: ``base``'s files (hard links) with prefill.onnx = AIMET's QDQ graph (its weights linked);
    ``fold``: lm_head's DequantizeLinear -> Transpose folded (``fold_weight_transposes``), weights rewritten."""
    import onnx

    folder.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name in NOT_LINKED:
            continue
        link(f, folder / f.name)
    fp32 = onnx.load(str(base / "prefill.onnx"), load_external_data=False)
    model = onnx.load(str(aimet / "model.onnx"), load_external_data=False)
    (in_a, out_a), (in_f, out_f) = _io(model), _io(fp32)
    if [x[0] for x in in_a] != [x[0] for x in in_f] or [x[0] for x in out_a] != [x[0] for x in out_f]:
        raise SystemExit(f"AIMET's graph has other inputs/outputs than the fp32 prefill graph: "
                         f"{[x[0] for x in in_a][:5]} / {[x[0] for x in out_a][:5]}")
    if in_a != in_f or out_a != out_f:
        diff = [(a, f) for a, f in zip(in_a + out_a, in_f + out_f) if a != f]
        raise SystemExit(f"AIMET's graph differs from the fp32 prefill graph in types or shapes: {diff[:4]}")
    meta = {p.key: p.value for p in fp32.metadata_props}
    meta["edgeq.recipe"] = f"aimet-onnx {setting}"
    meta["aimet_htp.source"] = str(aimet / "model.onnx")
    folded = []
    for stale in ("model.onnx.data", "prefill.onnx.data"):  # (onnx refuses to read a file with other hard links)
        if (folder / stale).is_symlink() or (folder / stale).exists():
            (folder / stale).unlink()
    if fold:
        model = onnx.load(str(aimet / "model.onnx"))  # with its weights: the folded ones are rewritten
        folded = fold_weight_transposes(model)
        meta["aimet_htp.folded"] = json.dumps([f["transpose"] for f in folded])
    del model.metadata_props[:]
    for k, v in meta.items():
        model.metadata_props.add(key=k, value=v)
    if fold:
        onnx.save_model(model, str(folder / "prefill.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="prefill.onnx.data", size_threshold=1024)
    else:
        link(aimet / "model.onnx.data", folder / "model.onnx.data")
        onnx.save_model(model, str(folder / "prefill.onnx"))
    return {"folder": str(folder), "inputs": len(in_a), "outputs": len(out_a), "metadata": sorted(meta),
            "folded_weight_transposes": folded}


def prepare(graph: Path, ctx: Path) -> dict:
    from edgeq.targets.qnn_vendor import ask_htp, prepare_context, vendor_version

    ctx.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = prepare_context(graph, ctx)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["vendor"] = f"onnxruntime-qnn {vendor_version()}"
    if result.get("ok"):
        files = sorted(p for p in ctx.parent.iterdir() if p.name.startswith(ctx.stem))
        result["files"] = {p.name: p.stat().st_size for p in files}
        result["bytes"] = sum(result["files"].values())
        result["whole_on_htp"] = True  # CPU fallback was disabled: every node is on QNN
    else:
        partial = [p for p in ctx.parent.iterdir() if p.name.startswith(ctx.stem)]
        if partial:  # what the failed session left: kept aside so no evaluation runs it
            aside = ctx.parent.parent / "qnn-refused"
            aside.mkdir(exist_ok=True)
            for p in partial:
                p.replace(aside / p.name)
            result["partial_files_moved_to"] = str(aside)
        verdict = ask_htp(graph)
        reasons: dict[str, int] = {}
        for r in verdict.refusals:
            key = f"{r.op}: {r.reason[:160]}"
            reasons[key] = reasons.get(key, 0) + 1
        result["whole_on_htp"] = False
        result["refusals"] = len(verdict.refusals)
        result["refusal_reasons"] = reasons
        result["refused_nodes_first"] = [r.node for r in verdict.refusals[:20]]
        result["open_error"] = verdict.error
    return result
