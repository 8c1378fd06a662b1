"""Bookkeeping of the AIMET-ONNX measurements (``aimet_htp.py``, ``aimet_gemma.py``): the paths of the
two venvs and the adapter, each step run as a subprocess under GNU time with its command, wall seconds,
peak RSS and exit status recorded in the results file after every step (so a stopped run resumes), a
memory watchdog for steps that share the machine, and the versions and ISA flags every figure carries."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "wikitext-2"
EDGEQ = REPO / ".venv" / "bin" / "edgeq"
PY = REPO / ".venv" / "bin" / "python"
AIMET_PY = REPO / ".venvs" / "aimet-onnx" / "bin" / "python"
ADAPTER = REPO / "benchmarks" / "peers" / "adapters" / "aimet_onnx.py"


class Run:
    def __init__(self, out: Path, work: Path) -> None:
        self.out, self.work = out, work
        self.res = json.loads(out.read_text()) if out.is_file() else {}
        self.res.setdefault("steps", [])

    def save(self) -> None:
        from edgeq.evaluate.machine import machine_info

        self.res.setdefault("machine", machine_info())
        self.res["machine"]["isa_flags_cpuinfo"] = isa_flags()
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


def adopt(run: Run, step: str, log: Path) -> None:
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


def isa_flags() -> list[str]:
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


def versions() -> dict:
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


def tree_rss_kib(pgid: int) -> int:
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


def mem_available_kib() -> int:
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
    peak, low, stopped = 0, mem_available_kib(), False
    with open(log, "w") as fh:
        proc = subprocess.Popen(["/usr/bin/time", "-v", "-o", str(tfile), *cmd], stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        while proc.poll() is None:
            time.sleep(0.5)
            peak = max(peak, tree_rss_kib(proc.pid))
            avail = mem_available_kib()
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
