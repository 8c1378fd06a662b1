"""Private virtual environments for peer tools, built from ``pins.toml``.

``ensure_venv("ort-genai")`` returns the python of ``.venvs/ort-genai/`` at the repository root,
creating it first if it is missing or was built from other pins (a SHA-256 of the peer's table
is kept in the venv as a marker, and written only after a successful install). If the
installation fails it prints why and returns None, so a benchmark can skip that peer cleanly.
Peer tools never go into edgeq's own .venv.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINS = Path(__file__).resolve().with_name("pins.toml")
VENVS = ROOT / ".venvs"
MARKER = ".edgeq-pins-sha256"


def pins(peer: str) -> dict:
    """The peer's table from pins.toml (``packages`` and friends); KeyError if absent."""
    with open(PINS, "rb") as f:
        table = tomllib.load(f)
    if peer not in table:
        raise KeyError(f"no [{peer}] table in {PINS}")
    return table[peer]


def pins_hash(peer: str) -> str:
    """SHA-256 of the peer's table, canonical JSON; changes whenever a pin does."""
    blob = json.dumps(pins(peer), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def venv_python(peer: str) -> Path:
    return VENVS / peer / "bin" / "python"


def is_current(peer: str) -> bool:
    """True when the peer's venv exists and was built from the current pins."""
    marker = VENVS / peer / MARKER
    return venv_python(peer).exists() and marker.exists() and marker.read_text().strip() == pins_hash(peer)


def ensure_venv(peer: str) -> Path | None:
    """Return the python of ``.venvs/<peer>/``, building it from pins.toml if needed; None on failure."""
    try:
        packages = list(pins(peer)["packages"])
        want = pins_hash(peer)
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        print(f"[peers] {peer}: cannot read pins: {exc}", file=sys.stderr)
        return None
    VENVS.mkdir(exist_ok=True)
    venv = VENVS / peer
    log = VENVS / f"{peer}.install.log"
    with open(VENVS / f".{peer}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two benchmarks must not build the same venv at once
        if is_current(peer):
            return venv_python(peer)
        if venv.exists():
            print(f"[peers] {peer}: pins changed, rebuilding {venv}", file=sys.stderr)
            shutil.rmtree(venv)
        print(f"[peers] {peer}: creating {venv} ({len(packages)} pinned packages; log: {log})", file=sys.stderr)
        with open(log, "w") as out:
            steps = [
                [sys.executable, "-m", "venv", str(venv)],
                [str(venv_python(peer)), "-m", "pip", "install", "--no-input", *packages],
            ]
            for cmd in steps:
                out.write("$ " + " ".join(cmd) + "\n")
                out.flush()
                rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
                if rc != 0:
                    tail = log.read_text().splitlines()[-15:]
                    print(f"[peers] {peer}: installation failed (exit {rc}): {' '.join(cmd[:4])} ...\n"
                          + "\n".join("    " + line for line in tail), file=sys.stderr)
                    shutil.rmtree(venv, ignore_errors=True)
                    return None
        (venv / MARKER).write_text(want + "\n")
        return venv_python(peer)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["ort-genai"]:
        py = ensure_venv(name)
        print(f"{name}: {py if py else 'UNAVAILABLE'}")
        if py is None:
            sys.exit(1)
