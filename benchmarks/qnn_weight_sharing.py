"""Issue 44 item 1: can the prefill and decode context binaries share one copy of the weights?

For every onnxruntime-qnn release on the package index (each installed with ``pip install --no-deps
--target .venvs/onnxruntime-qnn-X``, beside the main venv's onnxruntime, or an older onnxruntime where
the plugin needs one), prepare a pair of graphs two ways and load each back on the emulated HTP with
CPU fallback disabled, in a child process (a crash of the vendor library is a result, not the end):

- ``separate``: each graph its own context binary (what ``--context-binary`` writes);
- ``shared``: QNN weight sharing as onnxruntime's EP-context design documents it: generated with
  ``ep.share_ep_contexts=1`` on every session and ``ep.stop_share_ep_contexts=1`` on the last (one
  binary for both graphs); loaded with ``ep.share_ep_contexts=1`` on every session, run once, the
  sessions destroyed in reverse order.

Pairs: ``minimal`` (two graphs, [1, 8, 256] and [1, 1, 256], over the same four uint8 per-channel
QDQ linears with uint16 activations: what every release takes, so only the sharing is probed) and,
with ``--pair DIR``, an edgeq static pair (``prefill.onnx`` + ``decode.onnx``).

Each row: what happened (``loads``, ``crash`` with the signal, ``error`` with QNN's own ``<E>`` lines),
the bytes on disk, the child's peak RSS measured from outside (``wait4``) and, when it loads, the
relative L2 of the HTP's first output against onnxruntime CPU on the same graph.

    python benchmarks/qnn_weight_sharing.py [--pair DIR] [--versions 2.3.0,2.7.0] --out F
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("2.3.0", "2.4.0", "2.5.0", "2.6.0", "2.7.0")
# onnxruntime-qnn 2.3.0's plugin declares no ORT API version; onnxruntime 1.32 refuses it
# ("OrtEp has invalid ort_version_supported=0"): it is run beside the oldest onnxruntime it names
OLDER_ORT = {"2.3.0": "1.24.2"}
GRAPHS = ("prefill", "decode")
_QNN_ERROR = re.compile(r"<E> (?P<msg>.*\S)")


# -- the minimal pair ------------------------------------------------------------------------------

def write_minimal_pair(folder: Path, hidden: int = 256, layers: int = 4) -> None:
    """prefill.onnx ([1, 8, hidden]) and decode.onnx ([1, 1, hidden]) over the same weights: uint8
    per-channel QDQ weights, uint16 QDQ activations (the HTP's W8A16 node units)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits, weights = [], []
    for i in range(layers):
        w = rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.05
        scale = np.abs(w).max(axis=0) / 127.0
        q = np.clip(np.round(w / scale) + 128, 0, 255).astype(np.uint8)
        inits += [numpy_helper.from_array(q, f"w{i}_q"), numpy_helper.from_array(scale.astype(np.float32), f"w{i}_s"),
                  numpy_helper.from_array(np.full(hidden, 128, np.uint8), f"w{i}_z")]
        weights.append(i)
    inits += [numpy_helper.from_array(np.array(2.0 ** -10, np.float32), "a_s"),
              numpy_helper.from_array(np.array(32768, np.uint16), "a_z")]
    for role, seq in zip(GRAPHS, (8, 1)):
        nodes, x = [], "x"
        for i in weights:
            nodes += [helper.make_node("QuantizeLinear", [x, "a_s", "a_z"], [f"q{i}"]),
                      helper.make_node("DequantizeLinear", [f"q{i}", "a_s", "a_z"], [f"dq{i}"]),
                      helper.make_node("DequantizeLinear", [f"w{i}_q", f"w{i}_s", f"w{i}_z"], [f"w{i}"], axis=1),
                      helper.make_node("MatMul", [f"dq{i}", f"w{i}"], [f"h{i}"])]
            x = f"h{i}"
        nodes += [helper.make_node("QuantizeLinear", [x, "a_s", "a_z"], ["qy"]),
                  helper.make_node("DequantizeLinear", ["qy", "a_s", "a_z"], ["y"])]
        graph = helper.make_graph(nodes, role, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, hidden])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, hidden])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        model.ir_version = 10
        onnx.save_model(model, str(folder / f"{role}.onnx"))


# -- the child: one vendor release, one step -----------------------------------------------------

def _feeds(session, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        if "int" in i.type:
            feeds[i.name] = np.ones(shape, np.int64 if "int64" in i.type else np.int32)
        else:
            feeds[i.name] = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    return feeds


def child(step: str, pair: Path, ctx: Path, share: bool) -> dict:
    """``gen``: prepare both graphs into ``ctx``; ``load``: open ``ctx``'s EPContext models, run each
    against CPU on the same graph, destroy the sessions in reverse order."""
    import onnxruntime as ort

    from edgeq.targets.qnn_vendor import htp_session_options

    ort.set_default_logger_severity(0)  # QNN's own error lines go to stderr, where the parent reads them
    sessions = []
    started = time.perf_counter()
    if step == "gen":
        ctx.mkdir(parents=True, exist_ok=True)
        for i, role in enumerate(GRAPHS):
            config = {"ep.context_enable": "1", "ep.context_file_path": str(ctx / f"{role}_ctx.onnx"),
                      "ep.context_embed_mode": "0"}
            if share:
                config["ep.share_ep_contexts"] = "1"
                if i == len(GRAPHS) - 1:
                    config["ep.stop_share_ep_contexts"] = "1"
            sessions.append(ort.InferenceSession(str(pair / f"{role}.onnx"), htp_session_options(79, config, 0)))
        return {"seconds": time.perf_counter() - started}
    config = {"ep.share_ep_contexts": "1"} if share else {}
    for role in GRAPHS:
        sessions.append(ort.InferenceSession(str(ctx / f"{role}_ctx.onnx"), htp_session_options(79, config, 0)))
    load_seconds = time.perf_counter() - started
    departures = {}
    for role, session in zip(GRAPHS, sessions):
        cpu = ort.InferenceSession(str(pair / f"{role}.onnx"), providers=["CPUExecutionProvider"])
        feeds = _feeds(cpu)
        first = session.get_outputs()[0].name
        htp = session.run([first], {i.name: feeds[i.name] for i in session.get_inputs()})[0]
        want = cpu.run([first], feeds)[0]
        departures[role] = float(np.linalg.norm(htp - want) / max(np.linalg.norm(want), 1e-12))
        del cpu
    while sessions:  # reverse order of creation, as upstream's shared-context test does
        del sessions[-1]
        gc.collect()
    return {"seconds": load_seconds, "relative_l2": departures}


# -- the parent ------------------------------------------------------------------------------------

def vendor_path(version: str) -> Path | None:
    """The target folder holding onnxruntime-qnn ``version`` (None: the main venv's own release)."""
    import onnxruntime_qnn

    if onnxruntime_qnn.__version__ == version:
        return None
    folder = ROOT / ".venvs" / f"onnxruntime-qnn-{version}"
    if not (folder / "onnxruntime_qnn").is_dir():
        packages = [f"onnxruntime-qnn=={version}"] + ([f"onnxruntime=={OLDER_ORT[version]}"] if version in OLDER_ORT else [])
        print(f"installing {' '.join(packages)} into {folder}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), *packages],
                       check=True)
    return folder


def run_child(version: str, step: str, pair: Path, ctx: Path, share: bool) -> dict:
    env = dict(os.environ)
    path = vendor_path(version)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryFile("w+", errors="replace") as log, tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--child", step, str(pair), str(ctx), str(int(share))],
                                stdout=out, stderr=log, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()
        out.seek(0)
        lines = out.read().strip().splitlines()
    errors = list(dict.fromkeys(m["msg"] for m in _QNN_ERROR.finditer(text)))[:6]
    record = {"exit": proc.returncode, "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "qnn_errors": errors}
    if proc.returncode == 0 and lines:
        record.update(json.loads(lines[-1]))
        record["outcome"] = "ok"
    elif proc.returncode < 0:
        record["outcome"] = f"crash (signal {-proc.returncode})"
    else:
        tail = [ln for ln in text.splitlines() if "Error" in ln or "FAIL" in ln or "what()" in ln]
        record["outcome"] = "error"
        record["error"] = " ".join(tail[-1].split())[:400] if tail else text.strip().splitlines()[-1][:400]
    return record


def probe(version: str, name: str, pair: Path, work: Path) -> list[dict]:
    rows = []
    for share in (False, True):
        ctx = work / f"{version}-{name}-{'shared' if share else 'separate'}"
        gen = run_child(version, "gen", pair, ctx, share)
        files = {p.name: p.stat().st_size for p in sorted(ctx.glob("*"))} if ctx.is_dir() else {}
        binaries = {k: v for k, v in files.items() if k.endswith(".bin")}
        row = {"onnxruntime_qnn": version, "pair": name, "form": "shared" if share else "separate",
               "generate": gen, "files": files, "binary_bytes": sum(binaries.values())}
        complete = gen["outcome"] == "ok" and all((ctx / f"{r}_ctx.onnx").is_file() for r in GRAPHS)
        row["load"] = run_child(version, "load", pair, ctx, share) if complete else {"outcome": "not generated"}
        rows.append(row)
        print(f"  {version} {name:8s} {row['form']:8s} generate: {gen['outcome']:18s} load: {row['load']['outcome']:18s} "
              f"binaries {row['binary_bytes'] / 2**20:.2f} MB, load peak RSS {row['load'].get('peak_rss_mb', '-')} MB",
              flush=True)
    return rows


def machine() -> dict:
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.*)", text)[1]
        flags = re.search(r"flags\s*:\s*(.*)", text)[1].split()
    except (OSError, TypeError):
        model = platform.processor()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return {"cpu": model, "cores": os.cpu_count(), "isa": isa, "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, help="an edgeq static pair folder (prefill.onnx + decode.onnx)")
    parser.add_argument("--versions", default=",".join(VERSIONS), help="onnxruntime-qnn releases (comma-separated)")
    parser.add_argument("--out", type=Path, help="results JSON (written after every release; required)")
    parser.add_argument("--child", nargs=4, metavar=("STEP", "PAIR", "CTX", "SHARE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        step, pair, ctx, share = args.child
        print(json.dumps(child(step, Path(pair), Path(ctx), share == "1")), flush=True)
        return
    if args.out is None:
        parser.error("--out is required")
    import onnxruntime

    result = {"command": "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:]), "machine": machine(),
              "onnxruntime": onnxruntime.__version__, "older_onnxruntime_for": OLDER_ORT, "rows": []}
    with tempfile.TemporaryDirectory(prefix="qnn-sharing-") as tmp:
        work = Path(tmp)
        pairs = {"minimal": work / "minimal"}
        pairs["minimal"].mkdir()
        write_minimal_pair(pairs["minimal"])
        if args.pair:
            pairs[args.pair.name] = args.pair.resolve()
        for version in args.versions.split(","):
            for name, pair in pairs.items():
                result["rows"] += probe(version, name, pair, work)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
