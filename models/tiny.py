"""Tiny random transformers exported to ONNX, for structure and exactness tests only.

Each architecture keeps the graph shapes edgeq's passes must recognise (linears with constant
weights, decomposed RMSNorm in llama/qwen2, LayerNorm in gpt2/bert/vit, GQA with fewer KV heads)
at a size that exports in about a second. The weights are random: never use these for accuracy.

Norm scales and all biases are re-drawn away from transformers' defaults (ones and zeros), so a
pass that mishandles a norm weight or a bias changes the output instead of multiplying by 1 or
adding 0 and hiding the bug.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from edgeq.errors import UserInputError
from edgeq.ir import atomic_output_dir
from edgeq.models.hf_export import export_to, require_export_deps

TINY_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2", "opt", "phi", "bert", "vit")

# arch -> (config class, model class, optimum task)
_SPECS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "text-generation"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "text-generation"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "text-generation"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "text-generation"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "text-generation"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "text-generation"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "text-generation"),
    "opt": ("OPTConfig", "OPTForCausalLM", "text-generation"),
    "phi": ("PhiConfig", "PhiForCausalLM", "text-generation"),  # Phi-2: parallel attention + MLP block
    "bert": ("BertConfig", "BertForMaskedLM", "fill-mask"),
    "vit": ("ViTConfig", "ViTForImageClassification", "image-classification"),
}

_VOCAB = 256
_HIDDEN = 64
_HEADS = 4
_KV_HEADS = 2
_LAYERS = 2
_FFN = 128
_MAX_POS = 128


def _config_kwargs(arch: str) -> dict:
    """Small but non-degenerate sizes: several heads, GQA, an FFN wider than the hidden size."""
    decoder = dict(vocab_size=_VOCAB, hidden_size=_HIDDEN, intermediate_size=_FFN, num_hidden_layers=_LAYERS,
                   num_attention_heads=_HEADS, num_key_value_heads=_KV_HEADS, max_position_embeddings=_MAX_POS,
                   tie_word_embeddings=False)
    if arch in ("llama", "qwen2"):
        return decoder
    if arch == "phi3":  # fused qkv_proj and gate_up_proj
        return dict(decoder, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "qwen3":  # q/k RMSNorm per head
        return dict(decoder, head_dim=_HIDDEN // _HEADS)
    if arch in ("gemma2", "gemma3"):
        # sandwich norms, (1 + w) RMSNorm, sqrt(hidden)-scaled embedding, GeGLU (tanh GELU), tied
        # head as the family ships it; gemma2: logit and attention soft-capping; gemma3: QK-norm;
        # both alternate sliding-window and global layers
        extra = dict(head_dim=_HIDDEN // _HEADS, sliding_window=8, query_pre_attn_scalar=_HIDDEN // _HEADS,
                     tie_word_embeddings=True)
        if arch == "gemma3":
            extra["sliding_window_pattern"] = 2
        return dict(decoder, **extra)
    if arch == "opt":  # LayerNorm with bias, learned positions, ReLU MLP
        return dict(vocab_size=_VOCAB, hidden_size=_HIDDEN, ffn_dim=_FFN, num_hidden_layers=_LAYERS,
                    num_attention_heads=_HEADS, max_position_embeddings=_MAX_POS, word_embed_proj_dim=_HIDDEN,
                    tie_word_embeddings=False)
    if arch == "phi":  # one LayerNorm feeding attention and MLP in parallel, partial rotary, biases
        return dict(vocab_size=_VOCAB, hidden_size=_HIDDEN, intermediate_size=_FFN, num_hidden_layers=_LAYERS,
                    num_attention_heads=_HEADS, num_key_value_heads=_HEADS, max_position_embeddings=_MAX_POS,
                    partial_rotary_factor=0.5, tie_word_embeddings=False)
    if arch == "gpt2":
        return dict(vocab_size=_VOCAB, n_embd=_HIDDEN, n_layer=_LAYERS, n_head=_HEADS,
                    n_inner=_FFN, n_positions=_MAX_POS)
    if arch == "bert":
        return dict(vocab_size=_VOCAB, hidden_size=_HIDDEN, num_hidden_layers=_LAYERS,
                    num_attention_heads=_HEADS, intermediate_size=_FFN,
                    max_position_embeddings=_MAX_POS)
    if arch == "vit":
        return dict(image_size=32, patch_size=8, num_channels=3, hidden_size=_HIDDEN,
                    num_hidden_layers=_LAYERS, num_attention_heads=_HEADS,
                    intermediate_size=_FFN, num_labels=10)
    raise AssertionError(arch)


def _perturb_defaults(model) -> None:
    """Draw norm scales around 1 and every bias around 0 instead of exactly 1 and 0. Gemma's
    RMSNorm scales by ``1 + w`` (its weights start at 0), so there ``w`` is drawn around 0."""
    import torch

    offset = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                param.normal_(0.0, 0.02)
            elif "norm" in name.lower() or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                param.normal_(offset, 0.1)


def build_tiny(arch: str, seed: int = 0, tie_word_embeddings: bool | None = None):
    """The seeded random transformers model for ``arch``, in eval mode; ``tie_word_embeddings``
    overrides whether the head shares the embedding table (default: as the family ships it)."""
    if arch not in _SPECS:
        raise UserInputError(f"unknown tiny architecture '{arch}' (choose from {', '.join(TINY_ARCHS)})")
    require_export_deps()
    import torch
    import transformers

    config_cls, model_cls, _ = _SPECS[arch]
    kwargs = _config_kwargs(arch)
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    _perturb_defaults(model)
    return model


def export_tiny(arch: str, out_dir: str | os.PathLike, seed: int = 0, force: bool = False) -> Path:
    """Build the tiny ``arch`` model with ``seed`` and export it to ``out_dir`` (atomically)."""
    model = build_tiny(arch, seed)
    task = _SPECS[arch][2]
    with atomic_output_dir(out_dir, force=force, marker={"export": "tiny", "arch": arch, "seed": seed}) as tmp, \
            tempfile.TemporaryDirectory(prefix="edgeq-tiny-") as hf:
        model.save_pretrained(hf)
        export_to(Path(hf), tmp, task)
    return Path(out_dir).resolve()
