"""The machine a figure was measured on: CPU model, the ISA flags that decide onnxruntime's integer
kernels, core count and onnxruntime's version. Every benchmark result records ``machine_info()``.

Which uint8 x int8 kernel MLAS dispatches to (``onnxruntime/core/mlas/lib/platform.cpp``) decides
whether a full-range int8 weight can saturate (``edgeq.targets.saturation``): AMX and AVX-512 VNNI
/ AVX-VNNI accumulate in int32; AVX2 and AVX-512 without VNNI go through VPMADDUBSW's saturating
int16 pair sums; ARM64 kernels widen or use dot products and do not saturate.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# flags read from /proc/cpuinfo (x86 names as Linux prints them; asimddp / i8mm on ARM64)
ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8", "asimddp", "i8mm")


def _cpuinfo() -> tuple[str, set[str]]:
    flags: set[str]
    model, flags = platform.processor() or platform.machine(), set()
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        return model, flags
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and value.strip():
            model = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    return model, flags


def u8s8_kernel(flags: set[str], machine: str | None = None) -> str:
    """The uint8 x int8 GEMM kernel onnxruntime's MLAS picks on a CPU with these flags."""
    machine = (machine or platform.machine()).lower()
    if machine in ("aarch64", "arm64"):
        return "arm64 (no saturation)"
    if {"amx_tile", "amx_int8"} <= flags:
        return "amx (int32 accumulation, no saturation)"
    if "avx512_vnni" in flags and "avx512bw" in flags:
        return "avx512-vnni (int32 accumulation, no saturation)"
    if "avx_vnni" in flags:
        return "avx-vnni (int32 accumulation, no saturation)"
    if "avx512bw" in flags:
        return "avx512 vpmaddubsw (int16 pair sums saturate)"
    if "avx2" in flags:
        return "avx2 vpmaddubsw (int16 pair sums saturate)"
    return "sse (no vpmaddubsw)"


def saturating_cpu(info: dict | None = None) -> bool:
    """Whether this CPU's uint8 x int8 kernel can saturate (x86 without VNNI / AMX)."""
    info = info or machine_info()
    return "saturate" in info["u8s8_kernel"] and "no saturation" not in info["u8s8_kernel"]


def machine_info() -> dict:
    """CPU model, ISA flags, the u8s8 kernel that follows from them, cores and onnxruntime version."""
    model, flags = _cpuinfo()
    try:
        import onnxruntime as ort

        ort_version = ort.__version__
    except ImportError:  # pragma: no cover (a core dependency)
        ort_version = None
    return {
        "cpu": model,
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "isa": {flag: flag in flags for flag in ISA_FLAGS},
        "u8s8_kernel": u8s8_kernel(flags),
        "onnxruntime": ort_version,
        "python": platform.python_version(),
    }


def isa_label(info: dict | None = None) -> str:
    """A short line for tables: 'AMD EPYC, avx2, no VNNI (avx2 vpmaddubsw ...)'."""
    info = info or machine_info()
    present = [f for f, on in info["isa"].items() if on]
    return f"{info['cpu']}; {', '.join(present) or 'no listed ISA flags'}; u8s8 kernel: {info['u8s8_kernel']}"
