"""AIMET-ONNX's W4A16 on the (emulated) Qualcomm HTP, through the same evaluation as edgeq's HTP figures.

edgeq's HTP figures come from a static pair (``edgeq compile PAST_MODEL --static prefill=128,context=1024
--target qnn-htp --context-binary``) scored with ``edgeq eval ppl PAIR --windows 1 --offset K --through
prefill [--provider qnn-htp]`` one 512-token window at a time. A Qualcomm user (AI Hub's LLM export)
quantizes a static-shaped prompt graph with AIMET and prepares it for the HTP. This script does that
for SmolLM2-135M and puts AIMET's prompt graph through edgeq's evaluation, step by step (each step
skipped when its output exists; ``--force STEP`` redoes one):

1. ``pair``: the fp32 static pairs. ``fp32-pair``: ``edgeq compile PAST --recipe fp32 --static
   prefill=128,context=1024 --target qnn-htp`` (the folder the evaluation pair is built from: its
   decode graph, tokenizer files); ``fp32-float-pair``: the same without ``--target``, the plain float
   static graph a user hands AIMET (``--target qnn-htp`` would add edgeq's own lowering to it: a
   16-bit embedding-table QDQ and rescaled RMSNorm inputs).
2. ``feeds``: calibration feeds for the prefill graph: the 16 calibration windows (WikiText-2 valid,
   ``edgeq.textdata.token_windows``, 512 tokens, what ``compile --calib-windows 16`` uses) fed through
   the fp32 float pair on onnxruntime CPU by edgeq's own static-pair decoder
   (``StaticPairDecoder.prefill_all``: 4 chunks of 128 tokens per window, the KV cache filled as the
   deployment fills it), each prefill call's input dict recorded (64 feeds; cache inputs stored up to
   their filled slots, ``_peer_contract.RecordedFeeds`` zero-pads them back).
3. ``quantize``: ``benchmarks/peers/adapters/aimet_onnx.py quantize --setting S --model
   fp32-float-pair/prefill.onnx --calib-feeds feeds.npz`` in AIMET's venv.
4. ``assemble``: ``pair-S/``: the fp32 qnn-htp pair's files with ``prefill.onnx`` replaced by AIMET's QDQ
   graph (same input and output names and shapes, checked; the pair's ``edgeq.static`` metadata added),
   its lm_head ``DequantizeLinear -> Transpose`` folded into the integer weight (``fold_weight_transposes``:
   exact; the HTP refuses the per-channel DequantizeLinear behind a Transpose; ``--no-fold`` keeps the
   graph as exported). The decode graph is fp32's: ``--through prefill`` never runs it.
5. ``prepare``: the HTP context binary of AIMET's prefill graph (``edgeq.targets.qnn_vendor
   .prepare_context``, CPU fallback disabled, loaded back) into ``pair-S/qnn/``; the fp32 decode graph's
   binary once (so the pair opens on the HTP); on refusal, the refused nodes (``ask_htp``).
6. ``eval``: per window K, ``edgeq eval ppl pair-S --through prefill`` on CPU (default session),
   with ``--exact-qdq``, and with ``--provider qnn-htp``; CPU first for every window, then the HTP.

Results (every command, wall seconds, peak RSS of each step's process tree from GNU time) go to
``--out`` after every step. edgeq's own mquant-w4a16 pair on the same windows is read from
``--edgeq-evals`` (``/tmp/exp/h8/w4a16h8-{cpu,htp}-K.json``, produced by the same ``edgeq eval ppl``
commands on ``/tmp/exp/s/w4a16h8-whole``) when present.

``--probe SETTING [--probe-feeds 0] [--probe-tensors a,b] [--probe-tag T]`` (after the steps): the pair's
prefill graph with intermediate tensors as extra outputs, run on the HTP and on onnxruntime CPU with
exact QDQ on recorded calibration feeds; relative L2 error per tensor (where the HTP departs).

Usage: nice -n 5 .venv/bin/python benchmarks/aimet_htp.py [--work DIR] [--settings a,b] [--windows 0,1]
       [--steps pair,feeds,quantize,assemble,prepare,eval] [--providers cpu,exact,htp] [--out F]

``--gemma GEMMA_DIR`` runs the other measurement instead: AIMET-ONNX on Gemma 3 270M on CPU
(``--gemma-settings``, default w8a16-finite-mask, w4a16-pcq-finite-mask, w4a16-lpbq-finite-mask), with
the 16 BOS-led calibration windows edgeq's ``compile --calib-windows 16`` tokenizes for Gemma
(``token_windows``: BOS + 511 text tokens each), AIMET's topology with ``model_type gemma3_text``, and
``edgeq eval ppl model.onnx --windows 40 --json`` (default session and ``--exact-qdq``); rows as in
``benchmarks/results/aimet-onnx-2026-11-28.json``, written to ``--gemma-out``. Each quantize runs
under a memory watchdog: when the machine's MemAvailable falls below ``--min-available-gb`` (other
jobs share it), the quantize process group is stopped and the row records the peak reached.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"
EDGEQ = REPO / ".venv" / "bin" / "edgeq"
PY = REPO / ".venv" / "bin" / "python"
AIMET_PY = REPO / ".venvs" / "aimet-onnx" / "bin" / "python"
ADAPTER = REPO / "benchmarks" / "peers" / "adapters" / "aimet_onnx.py"
PAST_MODEL = Path("/tmp/exp/s/smollm2-past/model.onnx")
STATIC = "prefill=128,context=1024"
SETTINGS = ("w4a16-pcq-finite-mask", "w4a16-lpbq-finite-mask")
STEPS = ("pair", "feeds", "quantize", "assemble", "prepare", "eval")
PROVIDERS = ("cpu", "exact", "htp")
# files of the fp32 pair that describe its own compile, not the assembled pair
NOT_LINKED = {"prefill.onnx", "manifest.json", "report.json", "encodings.json", "aimet_encodings.json", "qnn"}


# ------------------------------------------------------------------------------------------------
# bookkeeping
# ------------------------------------------------------------------------------------------------

class Run:
    def __init__(self, out: Path, work: Path) -> None:
        self.out, self.work = out, work
        self.res = json.loads(out.read_text()) if out.is_file() else {}
        self.res.setdefault("steps", [])

    def save(self) -> None:
        from edgeq.evaluate.machine import machine_info

        self.res.setdefault("machine", machine_info())
        self.res["machine"]["isa_flags_cpuinfo"] = _isa_flags()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.res, indent=1) + "\n")

    def timed(self, step: str, cmd: list[str], log: Path, **extra) -> dict:
        """Run ``cmd`` under GNU time (``nice -n 5`` is inherited from the caller), its output to
        ``log``; record the command, wall seconds, peak RSS and exit status."""
        log.parent.mkdir(parents=True, exist_ok=True)
        tfile = log.with_suffix(log.suffix + ".time")
        print(f"[aimet-htp] {step}: {' '.join(cmd)}", flush=True)
        started = time.perf_counter()
        with open(log, "w") as fh:
            rc = subprocess.run(["/usr/bin/time", "-v", "-o", str(tfile), *cmd], stdout=fh, stderr=subprocess.STDOUT,
                                check=False).returncode
        wall = time.perf_counter() - started
        rss = None
        if tfile.is_file():
            m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", tfile.read_text())
            rss = round(int(m.group(1)) / 1024, 1) if m else None
        rec = {"step": step, "command": " ".join(cmd), "wall_s": round(wall, 1), "peak_rss_mib": rss, "rc": rc,
               "log": str(log), **extra}
        self.res["steps"] = [s for s in self.res["steps"] if s["step"] != step] + [rec]
        self.save()
        print(f"[aimet-htp] {step}: rc {rc}, {wall:.1f} s, peak RSS {rss} MiB", flush=True)
        return rec


def _adopt(run: Run, step: str, log: Path) -> None:
    """Record a step that was run by hand before this script (same command, GNU time -v in its log)."""
    if any(r["step"] == step for r in run.res["steps"]) or not log.is_file():
        return
    text = log.read_text()
    cmd = re.search(r'Command being timed: "(.*)"', text)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    code = re.search(r"Exit status: (\d+)", text)
    secs = None
    if wall:
        secs = 0.0
        for part in wall.group(1).split(":"):
            secs = secs * 60 + float(part)
    run.res["steps"].append({"step": step, "command": cmd.group(1) if cmd else None, "wall_s": secs,
                             "peak_rss_mib": round(int(rss.group(1)) / 1024, 1) if rss else None,
                             "rc": int(code.group(1)) if code else None, "log": str(log), "adopted": True})
    run.save()


def _isa_flags() -> list[str]:
    keep = ("avx", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16", "fma",
            "f16c", "sse4_2", "avx512_bf16", "avx512vbmi")
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return sorted(f for f in flags if f in keep)


def _versions() -> dict:
    import onnxruntime

    out = {"onnxruntime": onnxruntime.__version__}
    try:
        import onnxruntime_qnn
        out["onnxruntime-qnn"] = onnxruntime_qnn.__version__
    except Exception:  # noqa: BLE001
        out["onnxruntime-qnn"] = None
    try:
        probe = "import aimet_onnx, onnxruntime; print(aimet_onnx.__version__, onnxruntime.__version__)"
        out["aimet-onnx"] = subprocess.run([str(AIMET_PY), "-c", probe], capture_output=True, text=True,
                                           check=False).stdout.split()
    except OSError:
        out["aimet-onnx"] = None
    return out


# ------------------------------------------------------------------------------------------------
# step 2: calibration feeds (in the edgeq venv)
# ------------------------------------------------------------------------------------------------

def record_feeds(pair: Path, tokenizer: Path, text: Path, windows: int, seq_len: int, out: Path) -> dict:
    """Feed each calibration window through ``pair``'s prefill graph with edgeq's static-pair decoder
    on onnxruntime CPU and write every prefill call's inputs to ``out`` (``RecordedFeeds`` format:
    ``<feed>/<input>``; cache inputs truncated to their filled slots, the rest checked to be zero)."""
    from edgeq.generation.decoders import open_decoder
    from edgeq.textdata import token_windows

    ids = token_windows(text, tokenizer, seq_len=seq_len, windows=windows)
    decoder = open_decoder(pair)
    inner = decoder.sessions["prefill"]
    context = decoder.context
    tmp = out.with_suffix(".tmp.npz")
    count, stored = 0, 0

    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        class Recorder:
            def run(self, outputs, feeds):
                nonlocal count, stored
                filled = int(feeds["attention_mask"][0, :context].sum())
                for name, value in feeds.items():
                    arr = np.asarray(value)
                    if name.startswith("past_key_values."):
                        if np.any(arr[:, :, filled:]):
                            raise RuntimeError(f"{name}: cache slots past {filled} are not zero")
                        arr = arr[:, :, :filled]
                    with zf.open(f"{count:03d}/{name}.npy", "w", force_zip64=True) as fh:
                        np.lib.format.write_array(fh, np.ascontiguousarray(arr))
                    stored += arr.nbytes
                count += 1
                return inner.run(outputs, feeds)

            def __getattr__(self, name):
                return getattr(inner, name)

        decoder.sessions["prefill"] = Recorder()
        for row in ids:
            decoder.reset()
            decoder.prefill_all(row)
    tmp.replace(out)
    return {"feeds": count, "windows": int(ids.shape[0]), "tokens_per_window": int(ids.shape[1]),
            "calls_per_window": count // int(ids.shape[0]), "bytes_stored": stored,
            "ids_sha256_16": __import__("hashlib").sha256(np.ascontiguousarray(ids).tobytes()).hexdigest()[:16]}


# ------------------------------------------------------------------------------------------------
# step 4: the evaluation pair
# ------------------------------------------------------------------------------------------------

def _io(model) -> tuple[list, list]:
    def spec(vi):
        t = vi.type.tensor_type
        return (vi.name, t.elem_type, [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim])
    return [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output]


def _link(src: Path, dst: Path) -> None:
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
        _link(f, folder / f.name)
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
        _link(aimet / "model.onnx.data", folder / "model.onnx.data")
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

from aimet_htp_probe import PROBE_TENSORS, probe_compare, probe_htp, probe_model  # noqa: E402


def _pooled(rows: list[dict]) -> float | None:
    if not rows:
        return None
    return math.exp(sum(r["nll"] for r in rows) / sum(r["tokens"] for r in rows))



def _last_json(path: Path) -> dict | None:
    """The JSON record on the last line of an ``edgeq eval ppl --json`` output file; None while the
    run has written nothing (or was stopped mid-line)."""
    if not (path.is_file() and path.stat().st_size):
        return None
    try:
        return json.loads(path.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None

def summarize(run: Run, settings: list[str], windows: list[int], edgeq_evals: Path) -> None:
    ev = run.work / "evals"
    table = {}
    # "@as-exported": AIMET's graph as written (--no-fold; the first run of 2026-11-28, CPU only: the HTP refused it)
    names = ["fp32-float", "fp32-htp-form", "edgeq-mquant-w4a16", *settings, *(f"{s}@as-exported" for s in settings)]
    for name in names:
        per = {}
        for k in windows:
            row = {}
            for prov in PROVIDERS:
                got = _last_json(ev / f"{name}-{prov}-{k}.json")
                if got is not None:
                    row[prov] = got
            if row:
                per[k] = row
        if not per:
            continue
        out = {"per_window": {}}
        for k, row in per.items():
            out["per_window"][k] = {p: round(r["ppl"], 4) for p, r in row.items()}
            if "htp" in row:
                out["per_window"][k]["htp_seconds"] = round(row["htp"]["seconds"], 1)
            if "htp" in row and "cpu" in row:
                out["per_window"][k]["htp_over_cpu"] = round(row["htp"]["ppl"] / row["cpu"]["ppl"], 4)
        both = [k for k, row in per.items() if "htp" in row and "cpu" in row]
        for prov in PROVIDERS:
            rows = [per[k][prov] for k in per if prov in per[k]]
            out[f"{prov}_pooled"] = round(_pooled(rows), 4) if rows else None
            out[f"{prov}_windows"] = sorted(k for k in per if prov in per[k])
        if both:
            c, h = _pooled([per[k]["cpu"] for k in both]), _pooled([per[k]["htp"] for k in both])
            out["htp_vs_cpu_same_windows"] = {"windows": both, "cpu": round(c, 4), "htp": round(h, 4),
                                              "htp_over_cpu": round(h / c, 4)}
        table[name] = out
    # edgeq's own mquant-w4a16 HTP pair on the same windows (same commands, read-only)
    ref = {}
    for k in windows:
        row = {}
        for prov in ("cpu", "htp"):
            got = _last_json(edgeq_evals / f"w4a16h8-{prov}-{k}.json")
            if got is not None:
                row[prov] = got
        if row:
            ref[k] = row
    if ref:
        both = [k for k, r in ref.items() if "cpu" in r and "htp" in r]
        table["edgeq mquant-w4a16 (/tmp/exp/s/w4a16h8-whole)"] = {
            "per_window": {k: {p: round(r["ppl"], 4) for p, r in row.items()} for k, row in ref.items()},
            "cpu_pooled": round(_pooled([ref[k]["cpu"] for k in ref if "cpu" in ref[k]]), 4),
            "htp_vs_cpu_same_windows": ({"windows": both, "cpu": round(_pooled([ref[k]["cpu"] for k in both]), 4),
                                         "htp": round(_pooled([ref[k]["htp"] for k in both]), 4)} if both else None),
            "source": str(edgeq_evals / "w4a16h8-{cpu,htp}-K.json"),
        }
    run.res["summary"] = table
    run.save()


# ------------------------------------------------------------------------------------------------
# Gemma 3 on CPU (--gemma)
# ------------------------------------------------------------------------------------------------

GEMMA_SETTINGS = ("w8a16-finite-mask", "w4a16-pcq-finite-mask", "w4a16-lpbq-finite-mask")


def _tree_rss_kib(pgid: int) -> int:
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getpgid(int(d.name)) != pgid:
                continue
            for line in (d / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ProcessLookupError, ValueError):
            continue
    return total


def _mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def watched(cmd: list[str], log: Path, min_available_gb: float) -> dict:
    """Run ``cmd`` (its own process group, under GNU time) and stop that group if the machine's
    MemAvailable falls below ``min_available_gb``; returns wall, GNU time's peak RSS, the sampled
    peak of the group's RSS, the lowest MemAvailable seen and whether the watchdog stopped it."""
    import signal

    log.parent.mkdir(parents=True, exist_ok=True)
    tfile = log.with_suffix(log.suffix + ".time")
    print(f"[aimet-gemma] {' '.join(cmd)}", flush=True)
    started = time.perf_counter()
    peak, low, stopped = 0, _mem_available_kib(), False
    with open(log, "w") as fh:
        proc = subprocess.Popen(["/usr/bin/time", "-v", "-o", str(tfile), *cmd], stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        while proc.poll() is None:
            time.sleep(0.5)
            peak = max(peak, _tree_rss_kib(proc.pid))
            avail = _mem_available_kib()
            low = min(low, avail)
            if avail < min_available_gb * 1024 * 1024 and not stopped:
                stopped = True
                os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    rss = None
    if tfile.is_file():
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", tfile.read_text())
        rss = round(int(m.group(1)) / 1024, 1) if m else None
    return {"command": " ".join(cmd), "wall_s": round(time.perf_counter() - started, 1), "peak_rss_mib": rss,
            "sampled_group_peak_rss_mib": round(peak / 1024, 1), "min_mem_available_mib": round(low / 1024, 1),
            "exit_status": rc, "stopped_by_watchdog": stopped, "log": str(log)}


def run_gemma(args) -> int:
    from edgeq.textdata import bos_token_id, token_windows, window_convention

    gemma: Path = args.gemma
    work: Path = args.work / "gemma"
    work.mkdir(parents=True, exist_ok=True)
    out: Path = args.gemma_out
    res = json.loads(out.read_text()) if out.is_file() else {}
    model = gemma / "model.onnx"
    calib = work / "calib-16x512.npy"
    bos = bos_token_id(gemma)
    if not calib.is_file():
        ids = token_windows(DATA / "valid.txt", gemma, seq_len=512, windows=args.calib_windows)
        np.save(calib, ids)
    ids = np.load(calib)
    fp32 = json.loads((REPO / "benchmarks" / "results" / "gemma3-w4a16-head8-2026-11-28.json").read_text())["fp32"]
    res.update({
        "benchmark": "peers/aimet-onnx on Gemma 3 270M", "date": "2026-11-28", "model": str(model),
        "script": "benchmarks/aimet_htp.py --gemma " + str(gemma),
        "protocol": {
            "calibration": f"the first {ids.shape[0]} windows of 512 tokens of WikiText-2 valid, each BOS-led "
                           f"(edgeq.textdata.token_windows: BOS id {bos} + 511 text tokens, the ids edgeq compile "
                           f"--calib-windows 16 feeds Gemma; {calib}; every window starts with BOS: "
                           f"{bool(np.all(ids[:, 0] == bos))})",
            "evaluation": "edgeq eval ppl MODEL --text data/wikitext-2/test.txt --tokenizer GEMMA_DIR --windows 40 --json "
                          "(onnxruntime CPU default session) and with --exact-qdq; window convention "
                          f"{window_convention(gemma)}",
            "topology": "analyze_llm_topology(model, gemma3_text) (AIMET finds Gemma 3's blocks by its active norms)",
        },
        "fp32": {"ppl": fp32["ppl"], "windows": fp32["windows"], "window_convention": fp32["window_convention"],
                 "source": "benchmarks/results/gemma3-w4a16-head8-2026-11-28.json (same model, test windows and "
                           "evaluation)"},
        "versions": _versions(),
    })
    res.setdefault("rows", [])
    from edgeq.evaluate.machine import machine_info
    res["machine"] = {**machine_info(), "isa_flags_cpuinfo": _isa_flags()}

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1) + "\n")

    save()
    specs = {r["setting"]: r for r in json.loads(subprocess.run([str(AIMET_PY), str(ADAPTER), "settings"],
                                                                capture_output=True, text=True, check=True).stdout)}
    for setting in [s for s in args.gemma_settings.split(",") if s]:
        row = next((r for r in res["rows"] if r["setting"] == setting), None)
        if row is None:
            row = {"tool": "aimet-onnx", **specs[setting], "model": "gemma3-270m"}
            res["rows"].append(row)
        qdir = work / f"aimet-{setting}"
        if not (qdir / "model.onnx").is_file() and row.get("error") and not args.gemma_retry:
            continue  # an earlier attempt failed (recorded); --gemma-retry tries again
        if not (qdir / "model.onnx").is_file():
            if row.get("error"):
                row.setdefault("earlier_attempts", []).append({"quantize": row.get("quantize"), "error": row["error"],
                                                               "quantize_command": row.get("quantize_command")})
            free = _mem_available_kib() / 1024 / 1024
            print(f"[aimet-gemma] {setting}: MemAvailable {free:.1f} GB before quantize", flush=True)
            cmd = [str(AIMET_PY), str(ADAPTER), "quantize", "--setting", setting, "--model", str(model),
                   "--calib-ids", str(calib), "--out", str(qdir), "--model-type", "gemma3_text",
                   *(["--release-session"] if args.release_session else [])]
            rec = watched(cmd, work / f"quantize-{setting}.log", args.min_available_gb)
            rec["mem_available_gb_before"] = round(free, 1)
            row["path"] = str(qdir)
            row["quantize_command"] = "nice -n 5 /usr/bin/time -v " + rec["command"]
            row["quantize"] = {k: rec[k] for k in ("wall_s", "peak_rss_mib", "exit_status", "sampled_group_peak_rss_mib",
                                                   "min_mem_available_mib", "stopped_by_watchdog",
                                                   "mem_available_gb_before")}
            lines = (work / f"quantize-{setting}.log").read_text().strip().splitlines()
            if rec["exit_status"] == 0 and lines:
                info = json.loads(lines[-1])
                row.update({"version": info["version"], "notes": info["notes"], "timings": info["timings"]})
                row.pop("error", None)
            else:
                row["error"] = (f"stopped by the memory watchdog (MemAvailable under {args.min_available_gb} GB; "
                                f"quantize group RSS {rec['sampled_group_peak_rss_mib']} MiB)" if rec["stopped_by_watchdog"]
                                else (lines[-1] if lines else f"exit {rec['exit_status']}"))
            save()
        if not (qdir / "model.onnx").is_file():
            continue
        for key, extra in (("default", []), ("exact", ["--exact-qdq"])):
            if key not in args.gemma_evals.split(",") or (row.get(key) or {}).get("ppl"):
                continue
            cmd = [str(EDGEQ), "eval", "ppl", str(qdir / "model.onnx"), "--text", str(DATA / "test.txt"), "--tokenizer",
                   str(gemma), "--windows", str(args.gemma_windows), "--json", *extra]
            rec = watched(cmd, work / f"eval-{setting}-{key}.log", args.min_available_gb)
            lines = (work / f"eval-{setting}-{key}.log").read_text().strip().splitlines()
            js = [ln for ln in lines if ln.startswith("{")]
            entry = {"command": "nice -n 5 " + rec["command"], "eval_wall_s": rec["wall_s"],
                     "eval_peak_rss_mib": rec["peak_rss_mib"], "eval_exit_status": rec["exit_status"]}
            if rec["exit_status"] == 0 and js:
                r = json.loads(js[-1])
                entry.update({"ppl": round(r["ppl"], 3), "qdq": r.get("qdq"), "windows": r.get("windows"),
                              "window_convention": r.get("window_convention"),
                              "eval_seconds_reported": round(r["seconds"], 1),
                              "x_fp32": round(r["ppl"] / fp32["ppl"], 4)})
            else:
                entry["error"] = lines[-1] if lines else f"exit {rec['exit_status']}"
            row[key] = entry
            save()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/exp/aimet-htp"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "aimet-htp-2026-11-28.json")
    ap.add_argument("--past-model", type=Path, default=PAST_MODEL, help="SmolLM2 with KV cache (optimum export)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="default: the past model's folder")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--windows", default="0,1", help="test windows K to score (comma list)")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--force", default="", help="comma list of steps to redo")
    ap.add_argument("--edgeq-evals", type=Path, default=Path("/tmp/exp/h8"))
    ap.add_argument("--edgeq-pair", type=Path, default=Path("/tmp/exp/s/w4a16h8-whole"),
                    help="edgeq's mquant-w4a16 HTP pair (16 calibration windows), scored on CPU here as a reference")
    ap.add_argument("--no-fold", action="store_true", help="assemble AIMET's prefill graph exactly as exported (its "
                    "lm_head DequantizeLinear -> Transpose, which the HTP refuses) instead of folding the Transpose")
    ap.add_argument("--probe", metavar="SETTING", help="compare intermediate tensors of pair-SETTING's prefill graph "
                    "on the HTP and on CPU (exact QDQ) on --probe-feeds recorded calibration feeds")
    ap.add_argument("--probe-feeds", default="0")
    ap.add_argument("--probe-tensors", default=None, help="comma list of tensor names (default: PROBE_TENSORS)")
    ap.add_argument("--probe-tag", default=None, help="name of this probe (several per setting)")
    ap.add_argument("--probe-htp-child", help=argparse.SUPPRESS)
    ap.add_argument("--record-feeds", nargs=2, metavar=("PAIR", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--prepare-one", nargs=3, metavar=("GRAPH", "CTX", "JSON"), help=argparse.SUPPRESS)
    ap.add_argument("--gemma", type=Path, default=None, metavar="GEMMA_DIR",
                    help="run AIMET on Gemma 3 270M on CPU instead (the folder with model.onnx and the tokenizer)")
    ap.add_argument("--gemma-settings", default=",".join(GEMMA_SETTINGS))
    ap.add_argument("--gemma-evals", default="default,exact")
    ap.add_argument("--gemma-windows", type=int, default=40)
    ap.add_argument("--gemma-out", type=Path, default=REPO / "benchmarks" / "results" / "aimet-onnx-gemma3-2026-11-28.json")
    ap.add_argument("--gemma-retry", action="store_true", help="--gemma: quantize again where an earlier attempt failed")
    ap.add_argument("--release-session", action="store_true",
                    help="--gemma: the adapter's --release-session (the sim's session dropped before the export)")
    ap.add_argument("--min-available-gb", type=float, default=1.5,
                    help="--gemma: stop a step when the machine's MemAvailable falls below this")
    args = ap.parse_args(argv)
    if args.gemma:
        return run_gemma(args)
    tokenizer = args.tokenizer or args.past_model.parent
    if args.record_feeds:  # child of the feeds step
        info = record_feeds(Path(args.record_feeds[0]), tokenizer, DATA / "valid.txt", args.calib_windows, 512,
                            Path(args.record_feeds[1]))
        print(json.dumps(info))
        return 0
    if args.probe_htp_child:
        probe_htp(Path(args.probe_htp_child))
        return 0
    if args.probe:
        work = args.work
        tag = args.probe + (f"@{args.probe_tag}" if args.probe_tag else "")
        pair, out = work / f"pair-{args.probe}", work / f"probe-{tag}"
        run = Run(args.out, work)
        feed_ids = [int(x) for x in args.probe_feeds.split(",")]
        t = time.perf_counter()
        tensors = args.probe_tensors.split(",") if args.probe_tensors else PROBE_TENSORS
        info = probe_model(pair, out, work / "calib-feeds.npz", feed_ids, tensors)
        info["cpu_build_s"] = round(time.perf_counter() - t, 1)
        rec = run.timed(f"probe:{tag}", [str(PY), str(Path(__file__).resolve()), "--probe-htp-child", str(out)],
                        work / "logs" / f"probe-{tag}.log")
        info["htp_rc"] = rec["rc"]
        lines = (work / "logs" / f"probe-{tag}.log").read_text().strip().splitlines()
        js = [ln for ln in lines if ln.startswith("{")]
        if js:
            info["htp"] = json.loads(js[-1])
        if rec["rc"] == 0 and (out / "htp.npz").is_file():
            info["compare"] = probe_compare(out, info["tensors"], len(feed_ids))
        else:
            info["error"] = lines[-1] if lines else f"exit {rec['rc']}"
        info["what"] = ("the pair's prefill graph with intermediate tensors as extra outputs, on the HTP (open_htp_session, "
                        "CPU fallback disabled) and on onnxruntime CPU with exact QDQ, on recorded calibration feeds "
                        f"{feed_ids} (feed 4k = window k's first 128-token chunk, empty cache; 4k+1 its second)")
        run.res.setdefault("probe", {})[tag] = info
        run.save()
        print(json.dumps(info.get("compare", info.get("error")), indent=1))
        return 0
    if args.prepare_one:  # child of the prepare step (GNU time measures it)
        result = prepare(Path(args.prepare_one[0]), Path(args.prepare_one[1]))
        Path(args.prepare_one[2]).write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
        return 0

    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    settings = [s for s in args.settings.split(",") if s]
    windows = [int(k) for k in args.windows.split(",") if k != ""]
    steps = set(args.steps.split(","))
    force = set(args.force.split(",")) - {""}
    providers = [p for p in args.providers.split(",") if p]
    run = Run(args.out, work)
    run.res.update({
        "what": "AIMET-ONNX W4A16 (its LLM flow for the HTP) on SmolLM2-135M's static prompt graph, scored through edgeq's "
                "static-pair evaluation (WikiText-2 test, one 512-token window at a time, teacher-forced through the "
                "prefill graph in 128-token calls) on onnxruntime CPU and on the emulated HTP (onnxruntime-qnn)",
        "script": "benchmarks/aimet_htp.py", "work": str(work), "past_model": str(args.past_model),
        "static": STATIC, "calib": f"{DATA / 'valid.txt'}, first {args.calib_windows} windows of 512 tokens",
        "versions": _versions(),
    })
    run.save()
    fp32_pair, float_pair = work / "fp32-pair", work / "fp32-float-pair"
    feeds = work / "calib-feeds.npz"

    if "pair" in steps:
        for folder, target in ((fp32_pair, ["--target", "qnn-htp"]), (float_pair, [])):
            if (folder / "decode.onnx").is_file() and "pair" not in force:
                _adopt(run, f"pair:{folder.name}", work / "logs" / f"{folder.name}.log")
                continue
            run.timed(f"pair:{folder.name}", [str(EDGEQ), "compile", str(args.past_model), "--recipe", "fp32", "--calib",
                                              str(DATA / "valid.txt"), "--calib-windows", str(args.calib_windows),
                                              "--static", STATIC, *target, "-o", str(folder), "--force"],
                      work / "logs" / f"{folder.name}.log")

    if "feeds" in steps and (not feeds.is_file() or "feeds" in force):
        rec = run.timed("feeds", [str(PY), str(Path(__file__).resolve()), "--record-feeds", str(float_pair), str(feeds),
                                  "--calib-windows", str(args.calib_windows), "--past-model", str(args.past_model)],
                        work / "logs" / "feeds.log")
        if rec["rc"] == 0:
            run.res["feeds"] = json.loads((work / "logs" / "feeds.log").read_text().strip().splitlines()[-1])
            run.save()

    run.res.setdefault("quantize", {})
    run.res.setdefault("htp_prepare", {})
    run.res.setdefault("assemble", {})
    for s in settings:
        qdir = work / f"aimet-{s}"
        if "quantize" in steps and (not (qdir / "model.onnx").is_file() or "quantize" in force):
            rec = run.timed(f"quantize:{s}", [str(AIMET_PY), str(ADAPTER), "quantize", "--setting", s, "--model",
                                              str(float_pair / "prefill.onnx"), "--calib-feeds", str(feeds), "--out", str(qdir)],
                            work / "logs" / f"quantize-{s}.log")
            lines = (work / "logs" / f"quantize-{s}.log").read_text().strip().splitlines()
            try:
                run.res["quantize"][s] = json.loads(lines[-1])
            except (ValueError, IndexError):
                run.res["quantize"][s] = {"error": lines[-1] if lines else f"exit {rec['rc']}"}
            run.save()
        pdir = work / f"pair-{s}"
        if "assemble" in steps and (qdir / "model.onnx").is_file() and (not (pdir / "prefill.onnx").is_file()
                                                                          or "assemble" in force):
            run.res["assemble"][s] = assemble(fp32_pair, qdir, pdir, s, fold=not args.no_fold)
            run.save()
        if "prepare" in steps and (pdir / "prefill.onnx").is_file():
            ctx = pdir / "qnn" / "prefill_ctx.onnx"
            if not ctx.is_file() or "prepare" in force:
                if (pdir / "qnn").is_dir():  # a failed or forced earlier attempt
                    for f in (pdir / "qnn").iterdir():
                        if f.name.startswith("prefill_ctx"):
                            f.unlink()
                out_json = work / "logs" / f"prepare-{s}.json"
                rec = run.timed(f"prepare:{s}", [str(PY), str(Path(__file__).resolve()), "--prepare-one",
                                                 str(pdir / "prefill.onnx"), str(ctx), str(out_json)],
                                work / "logs" / f"prepare-{s}.log")
                if out_json.is_file():
                    run.res["htp_prepare"][s] = json.loads(out_json.read_text())
                    run.save()
            # the fp32 decode graph's binary, once, linked into every pair (never run through prefill)
            dctx = fp32_pair / "qnn" / "decode_ctx.onnx"
            if ctx.is_file() and not dctx.is_file():
                out_json = work / "logs" / "prepare-fp32-decode.json"
                run.timed("prepare:fp32-decode", [str(PY), str(Path(__file__).resolve()), "--prepare-one",
                                                  str(fp32_pair / "decode.onnx"), str(dctx), str(out_json)],
                          work / "logs" / "prepare-fp32-decode.log")
                if out_json.is_file():
                    run.res["htp_prepare"]["fp32-decode"] = json.loads(out_json.read_text())
                    run.save()
            if ctx.is_file() and dctx.is_file():
                for f in dctx.parent.iterdir():
                    if f.name.startswith("decode_ctx") and not (pdir / "qnn" / f.name).exists():
                        _link(f, pdir / "qnn" / f.name)

    if "eval" in steps:
        ev = work / "evals"
        ev.mkdir(exist_ok=True)
        base = [str(EDGEQ), "eval", "ppl"]
        common = ["--text", str(DATA / "test.txt"), "--tokenizer", str(tokenizer), "--windows", "1", "--through",
                  "prefill", "--json"]
        flags = {"cpu": [], "exact": ["--exact-qdq"], "htp": ["--provider", "qnn-htp"]}
        pairs = {s: work / f"pair-{s}" for s in settings}
        refs = {"fp32-float": float_pair, "fp32-htp-form": fp32_pair}
        if args.edgeq_pair and (args.edgeq_pair / "prefill.onnx").is_file():
            refs["edgeq-mquant-w4a16"] = args.edgeq_pair  # read only: CPU and exact QDQ here, its HTP runs in --edgeq-evals
        order = [(p, k, name, folder) for p in ("cpu", "exact") if p in providers for k in windows
                 for name, folder in {**refs, **pairs}.items() if p == "cpu" or name in pairs
                 or name == "edgeq-mquant-w4a16"]
        order += [(p, k, name, folder) for p in ("htp",) if p in providers for k in windows
                  for name, folder in pairs.items()]
        for prov, k, name, folder in order:
            f = ev / f"{name}-{prov}-{k}.json"
            if f.is_file() and f.stat().st_size and "eval" not in force:
                continue
            if not (folder / "prefill.onnx").is_file():
                continue
            if prov == "htp" and not (folder / "qnn" / "prefill_ctx.onnx").is_file():
                print(f"[aimet-htp] {name}: no HTP context binary, HTP eval skipped", flush=True)
                continue
            rec = run.timed(f"eval:{name}:{prov}:{k}", [*base, str(folder), *common, "--offset", str(k), *flags[prov]],
                            ev / f"{name}-{prov}-{k}.log")
            lines = (ev / f"{name}-{prov}-{k}.log").read_text().strip().splitlines()
            js = [ln for ln in lines if ln.startswith("{")]
            if rec["rc"] == 0 and js:
                f.write_text(js[-1] + "\n")
            else:
                run.res.setdefault("eval_errors", {})[f"{name}:{prov}:{k}"] = lines[-1] if lines else f"exit {rec['rc']}"
            summarize(run, settings, windows, args.edgeq_evals)
    summarize(run, settings, windows, args.edgeq_evals)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
