"""A GGUF file (weights shipped as pip packages) as an fp32 Hugging Face folder, for the exporters.

transformers dequantizes GGUF to fp32 (the 4-bit rounding of the file is baked into the weights:
what every accuracy figure of these models is measured against) and builds the tokenizer from the
GGUF's vocabulary. Two slips of that conversion (transformers 4.57) are mended from the GGUF's own
metadata, so the folder says what the model's authors said:

- ``eos_token`` / ``pad_token``: set from the config ids it builds (it names a wrong token for SmolLM2);
- ``add_bos_token`` in the exported ``tokenizer_config.json`` (``record_add_bos``): the GGUF's
  ``tokenizer.ggml.add_bos_token`` (transformers writes ``true`` whatever the file says). ``edgeq.textdata`` reads it to decide whether
  every window starts with BOS; the tokenizer's post-processor itself is left as transformers builds
  it (SmolLM2's reference figures were measured with its one BOS at the start of the file).
"""

from __future__ import annotations

import json
from pathlib import Path


def gguf_add_bos(gguf: Path) -> bool | None:
    """``tokenizer.ggml.add_bos_token`` of the file, None when it does not say."""
    import gguf as gguf_lib

    field = gguf_lib.GGUFReader(str(gguf)).fields.get("tokenizer.ggml.add_bos_token")
    return None if field is None else bool(field.contents())


def save_hf_folder(gguf: Path, hf_dir: Path) -> None:
    """Dequantize ``gguf`` into an fp32 Hugging Face folder (model, config, tokenizer) in ``hf_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config
    if config.eos_token_id is not None:
        eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos))
    if config.pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(config.pad_token_id))
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)


def record_add_bos(gguf: Path, out_dir: Path) -> None:
    """Write the GGUF's ``add_bos_token`` into the EXPORTED ``tokenizer_config.json`` (after optimum
    re-saved the tokenizer: written earlier, transformers would rebuild ``tokenizer.json``'s
    post-processor from it, and SmolLM2's file-start BOS, part of its reference figures, would go)."""
    add_bos = gguf_add_bos(gguf)
    settings = Path(out_dir) / "tokenizer_config.json"
    if add_bos is None or not settings.is_file():
        return
    data = json.loads(settings.read_text())
    data["add_bos_token"] = add_bos
    settings.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def export_gguf(gguf: Path, out_dir, name: str, force: bool = False, task: str = "text-generation") -> Path:
    """Export ``gguf`` (dequantized to fp32) to ``out_dir`` as ``edgeq export NAME`` does: the
    folder written atomically and marked as edgeq's (``with_past`` for a ``*-with-past`` task), the
    GGUF's ``add_bos_token`` recorded. Shared by the real models' exporters (Gemma 3, Qwen2.5)."""
    import tempfile

    from edgeq.files.output_dir import atomic_output_dir
    from edgeq.models.hf_export import export_to, require_export_deps

    require_export_deps("gguf")
    marker = {"export": name, **({"with_past": True} if task.endswith("-with-past") else {})}
    with atomic_output_dir(out_dir, force=force, marker=marker) as tmp, \
            tempfile.TemporaryDirectory(prefix=f"edgeq-{name}-") as hf:
        save_hf_folder(gguf, Path(hf))
        export_to(Path(hf), tmp, task=task)
        record_add_bos(gguf, tmp)
    return Path(out_dir).resolve()
