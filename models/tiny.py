"""Tiny random transformers exported to ONNX, for structure and exactness tests only.

Which architectures there are, their transformers classes, export task and config (2 layers,
hidden 64, several heads, GQA with fewer KV heads, an FFN wider than the hidden size) are declared
in ``edgeq.families``; this module builds and exports them. Each keeps the graph shapes edgeq's
passes must recognise (linears with constant weights, decomposed RMSNorm, LayerNorm, the traits
the table states) at a size that exports in about a second. The weights are random: never use
these for accuracy.

Norm scales and all biases are re-drawn away from transformers' defaults (ones and zeros), so a
pass that mishandles a norm weight or a bias changes the output instead of multiplying by 1 or
adding 0 and hiding the bug.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from edgeq.errors import UserInputError
from edgeq.families import BY_NAME, TINY_ARCHS, by_model_type
from edgeq.files.output_dir import atomic_output_dir
from edgeq.models.hf_export import export_to, require_export_deps

__all__ = ["TINY_ARCHS", "build_tiny", "export_tiny"]


def _perturb_defaults(model) -> None:
    """Draw norm scales around 1 and every bias around 0 instead of exactly 1 and 0. A family whose
    norms scale by ``offset + w`` (Gemma's ``1 + w``, ``Family.norm_scale_offset``) draws ``w``
    around ``1 - offset``; a model of no declared family, around 1."""
    import torch

    family = by_model_type(model.config.model_type)
    mean = 1.0 - (family.norm_scale_offset if family is not None else 0.0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                param.normal_(0.0, 0.02)
            elif "norm" in name.lower() or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                param.normal_(mean, 0.1)


def build_tiny(arch: str, seed: int = 0, tie_word_embeddings: bool | None = None):
    """The seeded random transformers model for ``arch``, in eval mode; ``tie_word_embeddings``
    overrides whether the head shares the embedding table (default: as the family ships it)."""
    family = BY_NAME.get(arch)
    if family is None:
        raise UserInputError(f"unknown tiny architecture '{arch}' (choose from {', '.join(TINY_ARCHS)})")
    require_export_deps()
    import torch
    import transformers

    kwargs = dict(family.tiny)
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    config = getattr(transformers, family.config_class)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(config).to(torch.float32).eval()
    _perturb_defaults(model)
    return model


def export_tiny(arch: str, out_dir: str | os.PathLike, seed: int = 0, force: bool = False) -> Path:
    """Build the tiny ``arch`` model with ``seed`` and export it to ``out_dir`` (atomically)."""
    model = build_tiny(arch, seed)
    task = BY_NAME[arch].task
    with atomic_output_dir(out_dir, force=force, marker={"export": "tiny", "arch": arch, "seed": seed}) as tmp, \
            tempfile.TemporaryDirectory(prefix="edgeq-tiny-") as hf:
        model.save_pretrained(hf)
        export_to(Path(hf), tmp, task)
    return Path(out_dir).resolve()
