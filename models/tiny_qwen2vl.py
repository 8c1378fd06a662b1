"""A tiny random Qwen2-VL language model on embeddings, for structure tests of multimodal passes.

The composed SmolLM2 VLM (``edgeq.models.composed_vlm``) is the fidelity testbed but uses plain
1-D RoPE. Qwen2-VL's language model uses M-RoPE: ``position_ids`` has three rows (temporal,
height, width), visual tokens get their grid coordinates there and text tokens the same index in
all three rows, and the head dimension's rotary frequencies are split between the rows by
``mrope_section``. An AIFS pass must permute all three rows alike, so the pass writers need a
graph with that input; this module gives one that exports in about a second.

Only the language part is exported (vision tower and merger are not: visual tokens arrive as
embeddings), with the same interface as the composed model except ``position_ids``:

    inputs_embeds  float32 [batch, seq, 64]
    attention_mask int64   [batch, seq]        0 on left padding
    position_ids   int64   [3, batch, seq]     M-RoPE rows t/h/w
    visual_start   int64   [batch]             unused by the fp32 graph (for later passes)
    visual_len     int64   [batch]             unused by the fp32 graph
    logits         float32 [batch, seq, 256]

It is deliberately not one of ``edgeq.models.tiny.TINY_ARCHS``: the generic pass harness feeds
those models ``random_feeds``, whose position ids are 2-D aranges, and checks them against
token-input assumptions this graph does not meet. Weights are random (norm scales and biases
redrawn like the other tiny models): never use it for accuracy.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from edgeq.errors import UserInputError
from edgeq.files.output_dir import atomic_output_dir

TINY_QWEN2VL = "qwen2vl"  # the name ``edgeq export tiny`` accepts for it
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 16
MROPE_SECTION = (2, 3, 3)  # sums to HEAD_DIM / 2, in Qwen2-VL's 1 : 1.5 : 1.5 proportion
VOCAB = 256
LAYERS = 2
FFN = 128
MAX_POS = 256
# Far below Qwen2-VL's 1e6: with 8 rotary frequencies per head and sequences of a few dozen
# tokens, a large theta leaves the width row (the lowest frequencies) rotating by ~1e-5 rad, so
# a pass that scrambled it would go unnoticed. At 10 every row turns by a measurable angle.
ROPE_THETA = 10.0
QK_GAIN = 6.0


def tiny_qwen2vl_config():
    """The ``Qwen2VLConfig``: a 2-layer, 64-wide text model with GQA and M-RoPE, eager attention,
    and a one-block vision tower that only exists so the config is a complete Qwen2-VL one."""
    from transformers import Qwen2VLConfig

    text = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
        rope_scaling={"type": "mrope", "mrope_section": list(MROPE_SECTION)}, rope_theta=ROPE_THETA,
        tie_word_embeddings=False,
    )
    vision = dict(depth=1, embed_dim=32, hidden_size=HIDDEN, num_heads=2, mlp_ratio=2, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=2)
    return Qwen2VLConfig(text_config=text, vision_config=vision, attn_implementation="eager",
                         tie_word_embeddings=False)


def build_tiny_qwen2vl(seed: int = 0):
    """The seeded random ``Qwen2VLForConditionalGeneration``, float32, eval mode."""
    from edgeq.models.hf_export import require_export_deps

    require_export_deps()
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from edgeq.models.tiny import _perturb_defaults

    torch.manual_seed(seed)
    # transformers' @wraps(Module.to) on PreTrainedModel.to makes mypy take the dtype for self
    model = Qwen2VLForConditionalGeneration(
        tiny_qwen2vl_config()).to(torch.float32).eval()  # type: ignore[arg-type]
    _perturb_defaults(model)
    # At the default init (std 0.02) attention scores are ~0.03 and softmax is nearly uniform,
    # so positions barely matter; sharper q/k make a wrong mask or position row show in logits.
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_GAIN)
            layer.self_attn.k_proj.weight.mul_(QK_GAIN)
    return model


def text_decoder(model):
    """``(decoder, lm_head)`` of a Qwen2-VL model: what the export runs, also for references."""
    return model.model.language_model, model.lm_head


def mrope_position_ids(prefix: int, grid: tuple[int, int], suffix: int, start: int = 0) -> np.ndarray:
    """M-RoPE ids [3, seq] of "text, image, text" as Qwen2-VL's ``get_rope_index`` builds them.

    Text tokens carry the same index in all three rows; the ``grid`` = (h, w) visual tokens
    (row-major) carry ``(base, base + row, base + col)`` with ``base`` the index after the
    prefix; the suffix continues from one past the largest index used by the image.
    """
    h, w = grid
    if prefix < 0 or suffix < 0 or h < 1 or w < 1:
        raise UserInputError(f"bad M-RoPE layout: prefix {prefix}, grid {grid}, suffix {suffix}")
    pre = np.arange(prefix) + start
    base = start + prefix
    rows, cols = np.divmod(np.arange(h * w), w)
    visual = np.stack([np.full(h * w, base), base + rows, base + cols])
    after = base + max(h, w)
    post = np.arange(suffix) + after
    return np.concatenate([np.stack([pre] * 3), visual, np.stack([post] * 3)], axis=1).astype(np.int64)


def export_tiny_qwen2vl(out_dir: str | os.PathLike, seed: int = 0, force: bool = False) -> Path:
    """Build the tiny Qwen2-VL with ``seed`` and export its language part to ``out_dir``
    (``model.onnx`` + ``model.onnx.data``, ``config.json``); atomic."""
    from edgeq.models.embeds_export import export_embeds_lm

    model = build_tiny_qwen2vl(seed)
    decoder, head = text_decoder(model)
    with atomic_output_dir(out_dir, force=force, marker={"export": "tiny", "arch": TINY_QWEN2VL, "seed": seed}) as tmp:
        export_embeds_lm(decoder, head, tmp, HIDDEN, position_rows=3)
        model.config.save_pretrained(tmp)
    return Path(out_dir).resolve()
