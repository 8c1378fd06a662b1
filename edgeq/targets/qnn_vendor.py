"""Ask Qualcomm's own compiler whether it takes a model: QNN HTP through onnxruntime-qnn.

edgeq's ``qnn-htp`` profile is an approximation of what the HTP accepts; the vendor's answer is
the one that counts. onnxruntime-qnn (the ``[qnn]`` extra) ships Qualcomm's QAIRT HTP backend;
on x86-64 it emulates the HTP and prepares context binaries as Qualcomm's offline flow does. A
session opened on it with CPU fallback disabled only opens when the HTP takes every node, and
the EP logs, at verbose level, each node unit it refused with its reason.

Everything that touches the vendor library runs in a child process (``python -m
edgeq.targets.qnn_vendor``): the EP's log goes to that process's stderr, which is the only place
it can be read from, and a crash of the vendor library cannot take edgeq down with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgeq.errors import EdgeqError

EP_NAME = "QNNExecutionProvider"
RESULT_MARK = "edgeq-vendor-result: "  # the prefix of the child process's answer line
# Snapdragon 8 Elite (HTP v79) is the current flagship generation the prepared binaries target by default
DEFAULT_HTP_ARCH = 79
# HTP generation -> the QNN SoC id of its Snapdragon (the backend needs one for fp16 float ops):
# v73 Snapdragon 8 Gen 2 (SM8550), v75 8 Gen 3 (SM8650), v79 8 Elite (SM8750; the backend's own default SoC for v79)
HTP_SOCS = {73: 43, 75: 57, 79: 69}

_FAILED_UNIT = re.compile(r"Validation FAILED for \d+ nodes in OrtNodeUnit \((?P<unit>[^)]*)\)")
_UNIT_NODE = re.compile(r"^\s*Operator type: (?P<op>\S+) Node name: (?P<name>.*?) Node index: (?P<index>\d+)\s*$")
_REASON = re.compile(r"^\s*REASON\s*:\s*(?P<reason>.*\S)\s*$")
_PREPARE_ERROR = re.compile(r'<E> "(?P<name>[^"]*)" generated: (?P<reason>.*\S)')
_UNSUPPORTED = re.compile(r"Unsupported nodes in QNN EP: \{ name: (?P<name>.*?), type: (?P<op>\S+) \}")


class VendorRefused(EdgeqError):
    """The vendor's compiler refused or failed to prepare a graph (exit 3: outside the target)."""

    exit_code = 3


def vendor_version() -> str | None:
    """onnxruntime-qnn's version when it is installed and importable here, else None."""
    try:
        import onnxruntime_qnn
    except Exception:  # noqa: BLE001 (absent, or a wheel for another platform: no vendor)
        return None
    return getattr(onnxruntime_qnn, "__version__", "unknown")


@dataclass(frozen=True)
class Refusal:
    node: str  # the ONNX node name ("" when the node has none), or "<graph>" for a graph-level failure
    op: str
    reason: str  # the EP's own words


@dataclass
class VendorVerdict:
    """What the HTP made of a graph: opened whole, or the node units it refused and why."""

    model: str
    accepted: bool
    refusals: list[Refusal] = field(default_factory=list)
    error: str = ""  # the session's error when it did not open
    seconds: float = 0.0  # session creation (HTP graph preparation included)
    vendor: str = ""  # onnxruntime-qnn version
    htp_arch: int = DEFAULT_HTP_ARCH

    def to_dict(self) -> dict:
        return asdict(self)

    def headline(self) -> str:
        if self.accepted:
            return f"QNN HTP (v{self.htp_arch}, onnxruntime-qnn {self.vendor}) takes every node ({self.seconds:.1f} s)"
        if self.refusals:
            return f"QNN HTP (v{self.htp_arch}, onnxruntime-qnn {self.vendor}) refuses {len(self.refusals)} node(s)"
        return f"QNN HTP (v{self.htp_arch}, onnxruntime-qnn {self.vendor}) could not open the model: {self.error}"


def htp_provider_options(htp_arch: int = DEFAULT_HTP_ARCH) -> dict[str, str]:
    # float ops run in fp16 on the HTP (it has no fp32 units): without this the backend refuses them at prepare
    return {"backend_type": "htp", "htp_arch": str(htp_arch), "soc_model": str(HTP_SOCS[htp_arch]),
            "enable_htp_fp16_precision": "1"}


def htp_session_options(htp_arch: int = DEFAULT_HTP_ARCH, config: dict[str, str] | None = None,
                        log_severity: int = 3):
    """onnxruntime SessionOptions that put the whole graph on the (emulated) HTP or fail: the
    QNN plugin EP registered, CPU fallback disabled. Imports onnxruntime-qnn: call it only where
    a missing vendor is already a clear error."""
    import onnxruntime as ort
    import onnxruntime_qnn

    if EP_NAME not in {d.ep_name for d in ort.get_ep_devices()}:
        ort.register_execution_provider_library(EP_NAME, onnxruntime_qnn.get_library_path())
    devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
    so = ort.SessionOptions()
    so.log_severity_level = log_severity
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    so.add_provider_for_devices(devices, htp_provider_options(htp_arch))
    return so


@contextlib.contextmanager
def vendor_stdout_to_stderr():
    """QNN's backend prints a banner on the process's own stdout when it loads (" # LIBNATIVE: No
    alternate configuration present ..."), which would corrupt ``--json`` output: while the block
    runs, file descriptor 1 points at stderr (C-level buffers flushed before it is put back)."""
    import ctypes

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        try:
            ctypes.CDLL(None).fflush(None)
        except (OSError, AttributeError):  # no libc to flush: nothing was buffered there either
            pass
        os.dup2(saved, 1)
        os.close(saved)


def open_htp_session(model: str | os.PathLike, htp_arch: int = DEFAULT_HTP_ARCH):
    """An onnxruntime session of ``model`` wholly on the (emulated) HTP, for running it: one line
    and exit 3 when the HTP refuses any of it (``edgeq check --target qnn-htp`` lists what), exit 2
    when the vendor is not installed."""
    from edgeq.errors import UserInputError

    if vendor_version() is None:
        raise UserInputError("--provider qnn-htp needs Qualcomm's runtime: pip install 'edgeq[qnn]' (onnxruntime-qnn)")
    if htp_arch not in HTP_SOCS:
        raise UserInputError(f"--htp-arch {htp_arch}: known HTP generations are {', '.join(map(str, HTP_SOCS))}")
    import onnxruntime as ort

    ort.set_default_logger_severity(4)  # the EP's own warnings and errors: the one line below says it
    try:
        with vendor_stdout_to_stderr():
            return ort.InferenceSession(str(model), htp_session_options(htp_arch, log_severity=4))
    except Exception as exc:  # noqa: BLE001 (onnxruntime's pybind errors)
        first = " ".join(str(exc).split())[:300]
        raise VendorRefused(f"QNN HTP v{htp_arch} does not run {model} whole: {first} "
                            f"(`edgeq check {model} --target qnn-htp` lists the nodes it refuses)") from None


def parse_ep_log(lines) -> list[Refusal]:
    """The node units the QNN EP's verbose log says it refused, each node once (the EP asks twice:
    before and after its layout transform). Units it refused without a validation entry (no op
    builder at all) come from its "Unsupported nodes" line; nodes that passed validation and then
    failed when the HTP prepared the graph from the backend's own error lines."""
    refusals: dict[tuple[str, str], Refusal] = {}
    pending: list[tuple[str, str]] = []
    in_unit = False
    unsupported: list[tuple[str, str]] = []
    for line in lines:
        if _FAILED_UNIT.search(line):
            in_unit, pending = True, []
            continue
        if in_unit:
            node = _UNIT_NODE.match(line)
            if node:
                pending.append((node["name"], node["op"]))
                continue
            reason = _REASON.match(line)
            if reason:
                for name, op in pending:
                    refusals.setdefault((name, op), Refusal(name, op, reason["reason"]))
            in_unit = False
        found = _UNSUPPORTED.search(line)
        if found:
            unsupported.append((found["name"], found["op"]))
        found = _PREPARE_ERROR.search(line)
        if found:  # taken at validation, failed when the HTP prepared the graph (the op from the model)
            refusals.setdefault((found["name"], ""), Refusal(found["name"], "", f"HTP graph prepare: {found['reason']}"))
    for name, op in unsupported:
        refusals.setdefault((name, op), Refusal(name, op, "no QNN op builder takes it"))
    return list(refusals.values())


def ask_htp(model: str | os.PathLike, htp_arch: int = DEFAULT_HTP_ARCH, timeout: float = 1800) -> VendorVerdict:
    """Open ``model`` on the emulated HTP with CPU fallback disabled, in a child process; the
    verdict lists every node unit the EP refused, with its reason."""
    model = Path(model)
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as log:
        started = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "edgeq.targets.qnn_vendor", str(model), str(htp_arch)],
                                  stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout,
                                  preexec_fn=_cap_memory)
        except subprocess.TimeoutExpired:
            return VendorVerdict(str(model), False, error=f"the HTP did not finish within {timeout:.0f} s",
                                 seconds=time.perf_counter() - started, vendor=vendor_version() or "", htp_arch=htp_arch)
        log.seek(0)
        refusals = parse_ep_log(log)
    answer = _child_answer(done.stdout) or {
        "opened": False, "error": f"the vendor library ended the process (exit {done.returncode})",
        "seconds": time.perf_counter() - started}
    refusals = _with_ops(model, refusals)
    accepted = bool(answer["opened"]) and not refusals
    if not accepted and not refusals:
        refusals = [Refusal("<graph>", "", answer.get("error", "") or "refused without a reason")]
    return VendorVerdict(str(model), accepted, refusals, answer.get("error", ""), float(answer["seconds"]),
                         vendor_version() or "", htp_arch)


def memory_cap_bytes() -> int:
    """The address space the vendor's child may take: 60% of this machine's memory (the emulated
    HTP's graph preparation has been seen to take all of it, and the kernel's OOM killer then
    picks any process); ``EDGEQ_QNN_MEMORY_GB`` overrides it."""
    override = os.environ.get("EDGEQ_QNN_MEMORY_GB")
    if override:
        return int(float(override) * 2**30)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.6)


def _cap_memory() -> None:  # runs in the child, before the vendor library is loaded
    import resource

    cap = memory_cap_bytes()
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _with_ops(model: Path, refusals: list[Refusal]) -> list[Refusal]:
    """Fill in the op of refusals the backend named by node only (read from the graph, no weights)."""
    if all(r.op for r in refusals):
        return refusals
    import onnx

    ops = {n.name: n.op_type for n in onnx.load(str(model), load_external_data=False).graph.node}
    return [r if r.op else Refusal(r.node, ops.get(r.node, "?"), r.reason) for r in refusals]


def _open_on_htp(model: str, htp_arch: int) -> dict:
    """The child's side: open the session at verbose level (the EP writes its reasons to stderr)."""
    import onnxruntime as ort

    ort.set_default_logger_severity(0)
    so = htp_session_options(htp_arch, log_severity=0)
    started = time.perf_counter()
    try:
        ort.InferenceSession(model, so)
    except Exception as exc:  # noqa: BLE001 (the verdict carries the EP's error)
        return {"opened": False, "error": " ".join(str(exc).split())[:500], "seconds": time.perf_counter() - started}
    return {"opened": True, "error": "", "seconds": time.perf_counter() - started}


def _prepare_context(model: str, ctx_model: str, htp_arch: int) -> dict:
    """The child's side of ``prepare_context``: one session that writes the EPContext model and
    its context binary beside it (``embed_mode`` 0), then a second session that loads it back."""
    import onnxruntime as ort

    config = {"ep.context_enable": "1", "ep.context_file_path": ctx_model, "ep.context_embed_mode": "0"}
    started = time.perf_counter()
    try:
        ort.InferenceSession(model, htp_session_options(htp_arch, config))
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": " ".join(str(exc).split())[:500]}
    prepare = time.perf_counter() - started
    started = time.perf_counter()
    try:
        ort.InferenceSession(ctx_model, htp_session_options(htp_arch))
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": "the prepared context binary does not load back: " + " ".join(str(exc).split())[:400]}
    return {"ok": True, "error": "", "prepare_seconds": prepare, "load_seconds": time.perf_counter() - started}


def prepare_context(model: str | os.PathLike, ctx_model: str | os.PathLike, htp_arch: int = DEFAULT_HTP_ARCH,
                    timeout: float = 3600) -> dict:
    """Prepare ``model`` for the HTP generation ``htp_arch`` as Qualcomm's offline flow does: an
    EPContext model at ``ctx_model`` with its context binary beside it, proven to load back with
    CPU fallback disabled. Runs in a child process (memory-capped); returns its record
    (``ok``, ``error``, ``prepare_seconds``, ``load_seconds``)."""
    return _child(["--context", str(model), str(ctx_model), str(htp_arch)], timeout)


def _prepare_shared(models: list[str], ctx_models: list[str], htp_arch: int) -> dict:
    """The child's side of ``prepare_shared_context``: every graph prepared in this one process
    with ``ep.share_ep_contexts`` (the last with ``ep.stop_share_ep_contexts``), so QNN writes one
    binary holding the weights once. Not loaded back: no x86-64 release loads it (module docstring
    of ``edgeq.targets.qnn_context``)."""
    import onnxruntime as ort

    started = time.perf_counter()
    folder = Path(ctx_models[0]).parent
    before = {p.name for p in folder.glob("*.bin")}
    sessions = []
    for i, (model, ctx_model) in enumerate(zip(models, ctx_models)):
        config = {"ep.context_enable": "1", "ep.context_file_path": ctx_model, "ep.context_embed_mode": "0",
                  "ep.share_ep_contexts": "1"}
        if i == len(models) - 1:
            config["ep.stop_share_ep_contexts"] = "1"
        try:
            sessions.append(ort.InferenceSession(model, htp_session_options(htp_arch, config)))
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "error": f"{Path(model).name}: " + " ".join(str(exc).split())[:400]}
    binaries = sorted({p.name for p in folder.glob("*.bin")} - before)
    if len(binaries) != 1:
        return {"ok": False, "error": f"expected one shared binary, QNN wrote {binaries or 'none'}"}
    return {"ok": True, "error": "", "prepare_seconds": time.perf_counter() - started, "binary": binaries[0]}


def prepare_shared_context(models: list, ctx_models: list, htp_arch: int = DEFAULT_HTP_ARCH,
                           timeout: float = 3600) -> dict:
    """Prepare ``models`` into one QNN context binary that holds their weights once (QNN weight
    sharing), an EPContext model per graph at ``ctx_models``; in a memory-capped child process.
    Returns ``ok``, ``error``, ``prepare_seconds`` and the ``binary`` file name."""
    return _child(["--shared", json.dumps([str(m) for m in models]), json.dumps([str(c) for c in ctx_models]),
                   str(htp_arch)], timeout)


def _child(args: list[str], timeout: float) -> dict:
    try:
        done = subprocess.run([sys.executable, "-m", "edgeq.targets.qnn_vendor", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, timeout=timeout, preexec_fn=_cap_memory)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the HTP did not finish within {timeout:.0f} s"}
    return _child_answer(done.stdout) or {"ok": False,
                                          "error": f"the vendor library ended the process (exit {done.returncode})"}


def _child_answer(stdout: str) -> dict | None:
    """The child process's answer: its line marked ``RESULT_MARK`` (the vendor library writes its own
    lines to the same stdout from C, a "# LIBNATIVE: ..." banner among them, before or after that
    line depending on how Python buffers it), or None when it gave none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            try:
                return json.loads(line[len(RESULT_MARK):])
            except json.JSONDecodeError:
                return None
    return None


if __name__ == "__main__":
    if sys.argv[1] == "--context":
        answer = _prepare_context(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "--shared":
        answer = _prepare_shared(json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]))
    else:
        answer = _open_on_htp(sys.argv[1], int(sys.argv[2]))
    print(RESULT_MARK + json.dumps(answer), flush=True)
