"""edgeq side by side with the tools users would pick instead, in one run, on SmolLM2-135M (or another model).

The same fp32 ONNX model (``artifacts/smollm2/model.onnx``), the same calibration windows of
WikiText-2 valid (the first 16 for every tool and setting; the first 64 as well for edgeq's GPTQ,
whose recipe asks for them) and the same 40 evaluation windows of test (512 tokens each, the project
protocol), for every tool in two categories: static W8A8 with per-tensor activations (the NPU
form) and 4-bit weights with float activations, and for the HTP path (Qualcomm's NPU) two more:
static W8A16 and W4A16 (16-bit per-tensor activations), where AIMET-ONNX, Qualcomm's own quantizer,
runs its LLM flows beside edgeq's ``w8a16`` and ``mquant-w4a16``. Each peer runs its own
recommended settings (cited in ``benchmarks/peers/pins.toml`` and in each adapter's ``settings``) inside its own
virtual environment (``benchmarks/peers/venvs.py``, versions pinned in ``pins.toml``), through an
adapter with one contract (``benchmarks/peers/adapters/<peer>.py``: ``settings``, ``quantize``,
and ``evaluate`` for OpenVINO outputs). onnxruntime-genai's model builder is the fourth peer
(int4 only), rebuilt in every run by ``benchmarks/peers/build_ortgenai.py``.

Equal terms: every row states ``calib_windows``, ``group_size``, ``lm_head_bits`` and
``embedding_bits`` (32 = float), ``accuracy_level`` and ``htp_ppl`` (perplexity with the graph run
on the HTP), None where they do not apply or were not measured; for ONNX outputs group size,
lm_head / embedding bits and accuracy level are read off the written graph. W4 is compared at group 128 (NNCF: 64, since
128 does not divide 576); group-32 rows carry a ``caveat``: SmolLM2's weights come from a Q4_1
GGUF, whose blocks of 32 a block-32 grid partly recovers. Where a tool allows it, lm_head is
quantized and kept float in two rows; edgeq's W4 compiles are evaluated at accuracy level 0 and 4.

Per row: the quantize or compile step in its own process, wall time and peak RSS read from outside
(GNU time, which starts the step); then, here in edgeq's venv, perplexity on the 40 windows with onnxruntime's
defaults and with exact QDQ (no integer-kernel fusion: ``session.disable_quant_qdq``), and CPU
latency of one 512-token forward pass at batch 1, as interleaved medians over all ONNX models
(every model timed once per round). The exact-QDQ perplexity is measured for the rows with static
activation quantization (W8A8, W8A16, W4A16), where onnxruntime's integer kernels replace the Q/DQ
arithmetic (4-bit weight-only rows run MatMulNBits either way).
OpenVINO outputs are evaluated by their adapter with the
OpenVINO runtime (perplexity and latency; no exact-QDQ figure exists there). A peer that cannot be
installed or fails on a setting is a row with its error, never a missing row; a machine where no
peer installs still gets the edgeq rows and exit 0.

    python benchmarks/peers.py --out benchmarks/results/peers-DATE.json     (or: make peers)
    python benchmarks/peers.py --peers aimet-onnx edgeq      (only these tools; --only TOOL/SETTING narrows further)
    python benchmarks/peers.py --model-dir artifacts/qwen25 --past-model-dir artifacts/qwen25-past
        --export-source qwen2.5-coder-0.5b --tables w8a8 htp   (the README's W8A8 and HTP-form tables on
        Qwen2.5-Coder-0.5B: make peers PEERS_MODEL=qwen25)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from edgeq.evaluate.machine import isa_label, machine_info
from measure import run_measured as _run
from peers_report import markdown_table, plot
from peers_scoring import add_perplexities, add_weight_policy, latencies

REPO = Path(__file__).resolve().parents[1]
PEERS_DIR = REPO / "benchmarks" / "peers"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(PEERS_DIR))


ADAPTER_PEERS = ("ort-quant", "quark", "nncf", "aimet-onnx")
ADAPTER_FILES = {"ort-quant": "ort_quant.py", "quark": "quark.py", "nncf": "nncf.py", "aimet-onnx": "aimet_onnx.py"}
# edgeq's closest recipes per category (mquant-w8a8 is the default recipe). The W4 recipe runs on 64
# windows (its own setting) and on 16 (the peers'), with lm_head in float (the recipe) and in 4 bits
# (the peers' default); each W4 compile is evaluated at MatMulNBits accuracy level 0 (the recipe) and
# 4 (int8 activations, what genai and onnxruntime's RTN example use). gptq-w4a16-g32 is the
# contaminated group-32 case (see G32_CAVEAT).
STATIC_SHAPES = "prefill=128,context=1024"  # the static pair of the HTP rows (docs/npu-handoff.md's figures)
EDGEQ_SETTINGS = [
    {"setting": "mquant-w8a8", "recipe": "mquant-w8a8", "category": "w8a8", "weight_bits": 8, "activation_bits": 8,
     "calib_windows": 16},
    {"setting": "w8a8", "recipe": "w8a8", "category": "w8a8", "weight_bits": 8, "activation_bits": 8, "calib_windows": 16},
    # the HTP forms, beside AIMET-ONNX's W8A16 / W4A16 rows
    {"setting": "w8a16", "recipe": "w8a16", "category": "w8a16", "weight_bits": 8, "activation_bits": 16,
     "calib_windows": 16},
    {"setting": "mquant-w4a16", "recipe": "mquant-w4a16", "category": "w4a16", "weight_bits": 4, "activation_bits": 16,
     "calib_windows": 16},
    # the same recipes in the form the HTP runs (compile --static ... --target qnn-htp: the Q/DQ of the HTP's
    # node units added, shapes fixed), compiled from the KV-cache export and scored teacher-forced through
    # the static prefill graph: the like-for-like rows beside AIMET's exports, which quantize every tensor
    *[{"setting": f"{recipe}-qnn-htp", "recipe": recipe, "category": category, "weight_bits": bits,
       "activation_bits": 16, "calib_windows": 16, "static": STATIC_SHAPES}
      for recipe, category, bits in (("w8a16", "w8a16", 8), ("mquant-w4a16", "w4a16", 4))],
    *[{"setting": f"gptq-w4a16{head}-c{n}", "recipe": "gptq-w4a16", "category": "w4", "weight_bits": 4,
       "activation_bits": 32, "calib_windows": n, "lm_head_4bit": bool(head), "accuracy_levels": (0, 4)}
      for n in (64, 16) for head in ("", "-head4")],
    {"setting": "gptq-w4a16-g32-c64", "recipe": "gptq-w4a16-g32", "category": "w4", "weight_bits": 4,
     "activation_bits": 32, "calib_windows": 64, "accuracy_levels": (0, 4)},
]
G32_CAVEAT = ("group 32: SmolLM2's weights come from a Q4_1 GGUF (asymmetric 4-bit blocks of 32 along K), so a "
              "block-32 4-bit grid partly recovers that grid; not comparable with group 128")
# the settings of each README table (``--tables``): what ``make peers PEERS_MODEL=qwen25`` runs on
# another model, the README's tables and nothing else (the weight-only table's settings are SmolLM2's)
README_TABLES = {
    "w8a8": ("edgeq/mquant-w8a8", "nncf/ptq-sq-openvino", "nncf/ptq-sq-onnx-rope-ignored", "quark/int8-transformer-sq",
             "ort-quant/static-u8s8-smoothquant-rope-excluded", "ort-quant/static-u8s8-smoothquant"),
    "htp": ("edgeq/w8a16-qnn-htp", "edgeq/mquant-w4a16-qnn-htp", "aimet-onnx/w8a16-finite-mask",
            "aimet-onnx/w4a16-lpbq-seqmse-finite-mask", "aimet-onnx/w4a16-lpbq-finite-mask",
            "aimet-onnx/w4a16-pcq-finite-mask"),
}
EXPORT_SOURCES = ("smollm2", "qwen2.5-coder-0.5b")  # `edgeq export SOURCE` for a --model-dir not made yet
CALIB_WINDOWS = (16, 64)
# what every row states so that rows compare like for like (None where it does not apply):
# calibration windows (None: data-free), W4 group size, lm_head / embedding bits (32: float),
# MatMulNBits accuracy level (0: float activations, 4: int8 activations inside the kernel)
# htp_ppl: perplexity with the graph run on the HTP (None unless the row was run there)
ROW_TERMS = ("calib_windows", "group_size", "lm_head_bits", "embedding_bits", "accuracy_level", "htp_ppl")
DATA = REPO / "data" / "wikitext-2"


def run_measured(cmd: list[str], log: Path, env: dict | None = None, timeout_s: float | None = None) -> dict:
    """Run ``cmd`` (stderr into ``log``): exit code, wall seconds, peak RSS (MiB, GNU time: see
    benchmarks/measure.py), its last stdout line, and whether it timed out."""
    run = _run(cmd, log=log, cwd=REPO, env=env, timeout_s=timeout_s)
    lines = run["stdout"].strip().splitlines()
    return {"code": run["code"], "seconds": round(run["seconds"], 1), "peak_rss_mb": run["peak_rss_mb"],
            "last_line": lines[-1] if lines else "", "timed_out": run["timed_out"]}


def _last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:400] if lines else "no output"


def data_files(work: Path, tokenizer: Path) -> tuple[dict[int, Path], Path]:
    """Calibration windows of WikiText-2 valid (the first 16 and the first 64: the 16 are the 64's
    first rows) and the 40 evaluation windows of test, 512 tokens each."""
    from edgeq.textdata import token_windows

    calib = {n: work / f"calib-{n}x512.npy" for n in CALIB_WINDOWS}
    evaluation = work / "eval-40x512.npy"
    if not all(f.is_file() for f in calib.values()):
        ids = token_windows(DATA / "valid.txt", tokenizer, 512, max(CALIB_WINDOWS))
        for n, f in calib.items():
            # what `edgeq compile --calib valid.txt --calib-windows n` tokenizes, so every tool sees these rows
            assert np.array_equal(ids[:n], token_windows(DATA / "valid.txt", tokenizer, 512, n))
            np.save(f, ids[:n])
    if not evaluation.is_file():
        np.save(evaluation, token_windows(DATA / "test.txt", tokenizer, 512, 40))
    return calib, evaluation


def peer_rows(peer: str, model: Path, calib: dict[int, Path], evaluation: Path, work: Path, timeout_s: float,
              only: set[str] | None = None, reuse: set[str] = frozenset(), slow: bool = False) -> list[dict]:
    """One row per setting of an adapter peer: quantized (timed) and, for OpenVINO outputs, evaluated.
    ``only``: the TOOL/SETTING names to run (None: all); ``reuse``: TOOL/SETTING names whose output
    and measurement an earlier run left in ``work`` (the row says so); ``slow``: also run the settings
    an adapter marks ``slow`` (otherwise each is a row saying why it was not run)."""
    from venvs import ensure_venv

    python = ensure_venv(peer)
    if python is None:
        return [{"tool": peer, "setting": None, "error": f"{peer} could not be installed (see .venvs/{peer}.install.log)"}]
    adapter = str(PEERS_DIR / "adapters" / ADAPTER_FILES[peer])
    listed = subprocess.run([str(python), adapter, "settings"], capture_output=True, text=True, cwd=REPO)
    if listed.returncode != 0:
        return [{"tool": peer, "setting": None, "error": f"settings failed: {listed.stderr.strip()[-300:]}"}]
    rows = []
    for spec in json.loads(listed.stdout):
        name = f"{peer}/{spec['setting']}"
        if only is not None and name not in only:
            continue
        row = {"tool": peer, **spec, "error": None}
        if spec.get("slow") and not slow:
            rows.append({**row, "error": f"not run (pass --slow to run it): {spec['slow']}"})
            continue
        out = work / peer / spec["setting"]
        out.parent.mkdir(parents=True, exist_ok=True)
        log = work / peer / f"{spec['setting']}.log"
        record = work / peer / f"{spec['setting']}.measured.json"  # this step's measurement, for --reuse
        if name in reuse:
            waited = time.perf_counter()
            while not record.is_file() and time.perf_counter() - waited < timeout_s:
                print(f"[peers] {name}: waiting for the separate run to write {record}", file=sys.stderr)
                time.sleep(60)
            if not record.is_file():
                rows.append({**row, "error": f"--reuse: {record} not written within --timeout-min"})
                continue
            run = json.loads(record.read_text())
            row["reused"] = (f"quantized by an earlier run ({run['when']}; {run.get('beside', 'machine state not recorded')}); "
                             "compile_s and peak_rss_mb are that step's")
            print(f"[peers] {name}: reusing the output of {run['when']} (--reuse)", file=sys.stderr)
        else:
            print(f"[peers] {name}: quantizing", file=sys.stderr)
            run = run_measured([str(python), adapter, "quantize", "--setting", spec["setting"], "--model", str(model),
                                "--calib-ids", str(calib.get(spec.get("calib_windows"), calib[16])), "--out", str(out)], log,
                               timeout_s=timeout_s)
            run["when"] = time.strftime("%Y-%m-%d %H:%M")
            if os.environ.get("PEERS_BESIDE"):  # what else ran on the machine, when a step is run apart
                run["beside"] = os.environ["PEERS_BESIDE"]
            record.write_text(json.dumps({k: v for k, v in run.items() if k != "stdout"}))
        row.update(compile_s=run["seconds"], peak_rss_mb=run["peak_rss_mb"])
        if run["timed_out"]:
            row["error"] = f"did not finish within the benchmark's limit of {timeout_s / 60:.0f} min (--timeout-min)"
        elif run["code"] != 0:
            row["error"] = _last_error(log)
            rows.append(row)
            continue
        try:
            info = json.loads(run["last_line"])
        except json.JSONDecodeError:
            info = {}
        row.update(version=info.get("version"), notes=info.get("notes"), path=str(out))
        if spec.get("format") == "openvino":
            done = subprocess.run([str(python), adapter, "evaluate", "--model", str(out), "--eval-ids", str(evaluation),
                                   "--latency-tokens", "512", "--repeats", "7"], capture_output=True, text=True, cwd=REPO)
            if done.returncode != 0:
                row["error"] = f"evaluate failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
            else:
                result = json.loads(done.stdout.strip().splitlines()[-1])
                row.update(ppl=result.get("ppl"), runtime_latency_ms=result.get("latency_ms"), runtime=result.get("runtime"),
                           runtime_defaults=result.get("runtime_defaults"))
        rows.append(row)
    return rows


# onnxruntime-genai's model builder, int4 CPU, rebuilt in every run (timed by GNU time): its
# recommended block 32 (contaminated here, see G32_CAVEAT), block 128, and block 128 with lm_head
# left in float (and the embedding not shared with it, so also float), as edgeq's W4 recipes.
GENAI_SETTINGS = [
    {"setting": "int4-rtn-b32-acc4", "group_size": 32, "caveat": G32_CAVEAT,
     "extra_options": {"accuracy_level": "4", "block_size": "32"}},
    {"setting": "int4-rtn-b128-acc4", "group_size": 128, "extra_options": {"accuracy_level": "4", "block_size": "128"}},
    {"setting": "int4-rtn-b128-acc4-head-float", "group_size": 128,
     "extra_options": {"accuracy_level": "4", "block_size": "128", "nodes_to_exclude": "/lm_head/MatMul",
                       "shared_embeddings": "false"}},
]


def genai_rows(work: Path) -> list[dict]:
    """onnxruntime-genai's model builder: int4 only (it has no static W8A8 path)."""
    from build_ortgenai import BUILD_INFO, build
    from venvs import pins

    version = next((p.split("==")[1] for p in pins("ort-genai")["packages"] if p.startswith("onnxruntime-genai==")), None)
    rows = []
    for setting in GENAI_SETTINGS:
        options = setting["extra_options"]
        row = {"tool": "ort-genai", "category": "w4", "weight_bits": 4, "activation_bits": 32, "format": "onnx",
               "calib_windows": None, **{k: v for k, v in setting.items() if k != "extra_options"},
               "description": "model builder -p int4 -e cpu, RTN (data-free), --extra_options "
               + " ".join(f"{k}={v}" for k, v in options.items()), "version": version, "error": None}
        print(f"[peers] ort-genai {setting['setting']}: building", file=sys.stderr)
        out = build(out_dir=work / "ort-genai" / setting["setting"], force=True, extra_options=options)
        if out is None:
            rows.append({**row, "error": "onnxruntime-genai could not be installed or its builder failed "
                         f"(log: {work / 'ort-genai' / setting['setting']}.build.log)"})
            continue
        info = json.loads((out / BUILD_INFO).read_text())
        rows.append({**row, "path": str(out), "compile_s": round(info["builder_wall_s"], 1),
                     "peak_rss_mb": round(info["builder_peak_rss_bytes"] / 2**20, 1),
                     "notes": "built in this run; wall time and peak RSS of the builder process by GNU time"})
    rows.append({"tool": "ort-genai", "category": "w8a8", "weight_bits": 8, "activation_bits": 8, "format": "onnx",
                 "setting": None, "error": "not offered: the model builder writes int4/fp16/fp32 decoders, no static W8A8"})
    return rows


def _recipe_file(spec: dict, work: Path) -> str:
    """The recipe to compile: the built-in name, or for ``lm_head_4bit`` a copy of it that also
    quantizes lm_head (``skip_roles = []``), written under ``work``."""
    if not spec.get("lm_head_4bit"):
        return spec["recipe"]
    from edgeq.files.tomlfile import load_named_toml

    text = load_named_toml(spec["recipe"], "edgeq", "recipes", "recipe").text
    if text.count('skip_roles = ["lm_head"]') != 1:
        raise RuntimeError(f"recipe {spec['recipe']} has no single skip_roles = [\"lm_head\"] line to drop")
    out = work / f"{spec['recipe']}-head4.toml"
    out.write_text(text.replace('skip_roles = ["lm_head"]', "skip_roles = []  # lm_head quantized too (peers benchmark)"))
    return str(out)


def with_accuracy_level(src: Path, dst: Path, level: int) -> Path:
    """A copy of the folder ``src`` whose MatMulNBits run at ``level`` (model.onnx rewritten, the
    other files copied: onnx refuses external data with several hard links): the same weights
    evaluated at another accuracy level."""
    import onnx

    dst.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(src / "model.onnx"), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    node.attribute.remove(attr)
                    break
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))
    onnx.save(model, str(dst / "model.onnx"))
    for f in src.iterdir():
        if f.name != "model.onnx" and f.is_file() and not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)
    return dst


def edgeq_rows(model: Path, past_model: Path, work: Path, only: set[str] | None = None) -> list[dict]:
    """edgeq's rows: each setting of EDGEQ_SETTINGS compiled in its own measured process (``only``:
    the ``edgeq/SETTING`` names to run, None for all). Settings with ``static`` compile the KV-cache
    export ``past_model`` into the HTP's static pair instead of the plain graph."""
    import edgeq

    rows = []
    for spec in EDGEQ_SETTINGS:
        if only is not None and f"edgeq/{spec['setting']}" not in only:
            continue
        out = work / "edgeq" / spec["setting"]
        log = work / "edgeq" / f"{spec['setting']}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[peers] edgeq {spec['setting']}: compiling", file=sys.stderr)
        static = ["--static", spec["static"], "--target", "qnn-htp"] if spec.get("static") else []
        run = run_measured([sys.executable, "-m", "edgeq", "compile", str(past_model if static else model),
                            "--recipe", _recipe_file(spec, work), "--calib", str(DATA / "valid.txt"),
                            "--calib-windows", str(spec["calib_windows"]), *static,
                            "--no-cache", "-o", str(out)], log, env={**os.environ, "EDGEQ_PROGRESS": "0"})
        base = {"tool": "edgeq", "version": edgeq.__version__,
                **{k: v for k, v in spec.items() if k not in ("accuracy_levels", "lm_head_4bit", "static")},
                "format": "onnx", "compile_s": run["seconds"], "peak_rss_mb": run["peak_rss_mb"],
                "error": None if run["code"] == 0 else _last_error(log), "path": str(out), "docs": "docs/recipes.md"}
        if spec["category"] == "w4":
            base["notes"] = (f"recipe {spec['recipe']}" + (" with lm_head quantized too (skip_roles = [])"
                             if spec.get("lm_head_4bit") else " (lm_head in float)")
                             + f", calibrated on {spec['calib_windows']} windows")
        if static:
            base["through"] = "prefill"
            base["notes"] = (f"static pair (--static {spec['static']} --target qnn-htp) compiled from the KV-cache "
                             "export; perplexity teacher-forced through its prefill graph, 128 tokens per call")
        if "g32" in spec["recipe"]:
            base["caveat"] = G32_CAVEAT
        for level in spec.get("accuracy_levels", (None,)):
            row = dict(base)
            if level is not None:
                row["setting"] = f"{spec['setting']}-acc{level}"
                if level != 0 and not row["error"]:
                    row["path"] = str(with_accuracy_level(out, work / "edgeq" / row["setting"], level))
                    row["notes"] += f"; the acc0 row's compile with MatMulNBits accuracy_level set to {level}"
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"peers-{time.strftime('%Y-%m-%d')}.json")
    ap.add_argument("--work", type=Path, default=REPO / "artifacts" / "peers")
    ap.add_argument("--model-dir", type=Path, default=REPO / "artifacts" / "smollm2")
    ap.add_argument("--peers", nargs="+", default=["edgeq", "ort-genai", "nncf", "quark", "ort-quant", "aimet-onnx"],
                    help="the tools to run, in this order (edgeq, ort-genai and the adapter peers "
                    + ", ".join(ADAPTER_PEERS) + "); e.g. --peers aimet-onnx runs that peer alone")
    ap.add_argument("--past-model-dir", type=Path, default=REPO / "artifacts" / "smollm2-past",
                    help="the model exported with a KV cache (edgeq export SOURCE --with-past; made here if missing): "
                         "what edgeq's HTP-form rows (--static) compile")
    ap.add_argument("--export-source", choices=EXPORT_SOURCES, default="smollm2",
                    help="the model of --model-dir and --past-model-dir, exported there when missing (default smollm2)")
    ap.add_argument("--tables", nargs="+", choices=sorted(README_TABLES), metavar="TABLE",
                    help="run only the settings of these README tables (" + ", ".join(sorted(README_TABLES))
                    + "): the tools of --peers that have a row in them, those rows alone")
    ap.add_argument("--windows", type=int, default=40, help="evaluation windows (of the 40 prepared)")
    ap.add_argument("--latency-repeats", type=int, default=7)
    ap.add_argument("--plot", type=Path, default=None, help="PNG (default: beside --out)")
    ap.add_argument("--resume", action="store_true", help="reuse the quantize/compile rows of peers an interrupted "
                    "run finished (artifacts/peers/rows-partial.json); the figures then come from two runs")
    ap.add_argument("--timeout-min", type=float, default=60, help="a peer setting still quantizing after this is a row "
                    "with that error (default 60; edgeq's own compiles are not limited)")
    ap.add_argument("--only", nargs="+", metavar="TOOL/SETTING", help="run only these settings of the "
                    "tools in --peers (e.g. ort-quant/nbits-gptq-b128-asym, edgeq/w8a16-qnn-htp; ort-genai's rows are "
                    "chosen with --peers alone)")
    ap.add_argument("--reuse", nargs="+", default=[], metavar="TOOL/SETTING", help="take these adapter-peer "
                    "settings' output and measurement from an earlier run in --work instead of quantizing again; "
                    "the row records when and beside what it ran")
    ap.add_argument("--slow", action="store_true", help="also run the settings an adapter marks slow (onnxruntime's "
                    "GPTQ: about 110 min); without it each is a row saying why it was not run")
    ap.add_argument("--table", type=Path, metavar="RESULTS", help="print the docs/peers.md table of a results file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown_table(args.table))
        return 0
    if args.tables:
        wanted = [name for table in args.tables for name in README_TABLES[table]]
        args.only = sorted(set(args.only or []) | set(wanted)) if args.only else wanted
        args.peers = [p for p in args.peers if any(name.startswith(f"{p}/") for name in args.only)]
    model = export_if_missing(args.model_dir, args.export_source)
    args.work.mkdir(parents=True, exist_ok=True)
    calib, evaluation = data_files(args.work, args.model_dir)
    windows = np.load(evaluation)[: args.windows]
    info = machine_info()
    fp32 = {"tool": "fp32", "setting": "fp32", "category": "fp32", "weight_bits": 32, "activation_bits": 32,
            "format": "onnx", "path": str(args.model_dir), "error": None}
    add_perplexities([fp32], windows)
    add_weight_policy([fp32])
    rows: list[dict] = [fp32]
    partial = args.work / "rows-partial.json"  # the quantize/compile rows so far: an interrupted run keeps them
    done = json.loads(partial.read_text()) if args.resume and partial.is_file() else {}
    for peer in args.peers:
        if peer in done:
            print(f"[peers] {peer}: rows from the interrupted run (--resume)", file=sys.stderr)
            rows += [{**r, "resumed": True} for r in done[peer]]
            continue
        if peer in ADAPTER_PEERS:
            got = peer_rows(peer, model, calib, evaluation, args.work, args.timeout_min * 60,
                            only=set(args.only) if args.only else None, reuse=set(args.reuse), slow=args.slow)
        elif peer == "ort-genai":
            got = genai_rows(args.work)
        elif peer == "edgeq":
            got = edgeq_rows(model, export_if_missing(args.past_model_dir, args.export_source, with_past=True), args.work,
                             only={o for o in args.only if o.startswith("edgeq/")} if args.only else None)
        else:
            ap.error(f"unknown peer {peer}")
        add_weight_policy(got)
        add_perplexities(got, windows)
        rows += got
        done[peer] = got
        partial.write_text(json.dumps(done, indent=1))
    fp32 = rows[0]
    print("[peers] latency (interleaved)", file=sys.stderr)
    latencies(rows, windows[0], args.latency_repeats)
    for row in rows:
        row.setdefault("version", None)
        for key in ("ppl", "ppl_exact", "compile_s", "peak_rss_mb", "latency_ms", *ROW_TERMS):  # htp_ppl: None here
            row.setdefault(key, None)
        row["isa"] = isa_label(info)
        if row.get("ppl") and fp32.get("ppl"):
            row["ppl_ratio"] = round(row["ppl"] / fp32["ppl"], 4)
    result = {"benchmark": "peers", "date": time.strftime("%Y-%m-%d"), "machine": info,
              "command": " ".join(["python", "benchmarks/peers.py", *(sys.argv[1:] if argv is None else argv)]),
              "protocol": {"calibration": "the first 16 or 64 windows of 512 tokens of WikiText-2 valid (row key "
                                          "calib_windows; the 16 are the 64's first rows), the same files for every tool",
                           "row_terms": list(ROW_TERMS), "evaluation": f"{args.windows} x 512 tokens, WikiText-2 test",
                           "latency": f"one 512-token forward pass, batch 1, median of {args.latency_repeats} interleaved rounds"},
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    plot(args.out, args.plot or args.out.with_suffix(".png"))
    return 0


def export_if_missing(folder: Path, source: str, with_past: bool = False) -> Path:
    """``folder/model.onnx``, exported first from ``source`` (``edgeq export SOURCE [--with-past]``)
    when the folder has none."""
    if not (folder / "model.onnx").is_file():
        past = ["--with-past"] if with_past else []
        print(f"exporting {source}{' with a KV cache' if with_past else ''} to {folder}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "edgeq", "export", source, *past, "-o", str(folder)], check=True, cwd=REPO)
    return folder / "model.onnx"


if __name__ == "__main__":
    sys.exit(main())
