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
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

from aimet_bookkeeping import ADAPTER, AIMET_PY, DATA, EDGEQ, PY, REPO, Run, adopt, versions
from aimet_gemma import GEMMA_SETTINGS, run_gemma
from aimet_htp_pair import assemble, link, prepare
from aimet_htp_probe import PROBE_TENSORS, probe_compare, probe_htp, probe_model
from aimet_htp_summary import PROVIDERS, summarize

PAST_MODEL = Path("/tmp/exp/s/smollm2-past/model.onnx")
STATIC = "prefill=128,context=1024"
SETTINGS = ("w4a16-pcq-finite-mask", "w4a16-lpbq-finite-mask")
STEPS = ("pair", "feeds", "quantize", "assemble", "prepare", "eval")


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
        "versions": versions(),
    })
    run.save()
    fp32_pair, float_pair = work / "fp32-pair", work / "fp32-float-pair"
    feeds = work / "calib-feeds.npz"

    if "pair" in steps:
        for folder, target in ((fp32_pair, ["--target", "qnn-htp"]), (float_pair, [])):
            if (folder / "decode.onnx").is_file() and "pair" not in force:
                adopt(run, f"pair:{folder.name}", work / "logs" / f"{folder.name}.log")
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
                        link(f, pdir / "qnn" / f.name)

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
