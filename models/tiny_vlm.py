"""A tiny random VLM with the trained VLM's folder contract, so tests of the VLM path take seconds.

``edgeq export trained-vlm`` trains for minutes (``--quick``) to half an hour; tests of what reads
its folder (``vision.onnx``, ``vqa_eval.npz``, ``edgeq eval vqa``) need the folder's form, not its
accuracy. This writes that form with the same writers (``trained_vlm.write_samples``,
``vision_export.export_vision``, ``embeds_export.export_embeds_lm``) around a 2-layer, 64-wide
random Llama on SmolLM2's tokenizer, the real frozen CRAFT backbone at a small image size (32: 2x2
= 4 visual tokens) and a seeded random projector. Its answers are noise: never an accuracy figure.

Output folder: model.onnx (+ .data), vision.onnx, embed_tokens.npy, calib.npz / eval.npz and their
meta files, vqa_eval.npz, config.json, the tokenizer files, tiny_vlm.json and ``with-past/`` (the same
weights with a KV cache beside copies of the npz files, config, tokenizer and embedding table, as
the trained VLM's: what ``compile --static`` of a VLM reads); no metrics.json or projector.npz.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from edgeq.errors import UserInputError
from edgeq.files.vlm_folder import EMBED_TABLE_FILE
from edgeq.files.output_dir import atomic_output_dir

TINY_IMAGE_SIZE = 32
TINY_HIDDEN = 64


def export_tiny_vlm(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, seed: int = 0,
                    image_size: int = TINY_IMAGE_SIZE, calib_samples: int = 2, eval_samples: int = 8,
                    force: bool = False) -> Path:
    """Write the tiny VLM folder (see the module docstring) to ``out_dir``; atomic.

    ``tokenizer_dir``: a folder with SmolLM2's ``tokenizer.json`` (``edgeq export smollm2``'s)."""
    from edgeq.models.craft_vision import craft_weights_path, load_vgg_backbone
    from edgeq.models.easy_vqa import ChatFormat, data_dir, load_images
    from edgeq.models.embeds_export import export_embeds_lm
    from edgeq.models.hf_export import copy_sidecar_files
    from edgeq.models.trained_vlm import write_samples, write_with_past
    from edgeq.models.vision_export import export_vision
    from edgeq.models.vlm_training import image_features, projector_module

    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise UserInputError(f"{tokenizer_dir / 'tokenizer.json'} not found (SmolLM2's tokenizer: edgeq export smollm2)")
    craft = craft_weights_path()
    data_dir()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    chat = ChatFormat(tokenizer_dir / "tokenizer.json", (image_size // 16) ** 2)
    pad_id = chat.end[0]
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=chat.tokenizer.get_vocab_size(), hidden_size=TINY_HIDDEN, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, pad_token_id=pad_id,
                         eos_token_id=pad_id, bos_token_id=pad_id, tie_word_embeddings=False,
                         attn_implementation="eager")
    lm = LlamaForCausalLM(config).eval()
    projector = projector_module(TINY_HIDDEN).eval()
    backbone = load_vgg_backbone(craft)
    table = lm.get_input_embeddings().weight.detach().numpy().astype(np.float32)

    def features(split: str, ids, tag) -> np.ndarray:
        return image_features(load_images(split, ids), image_size, backbone)

    with atomic_output_dir(out_dir, force=force, marker={"export": "tiny-vlm", "seed": seed}) as tmp:
        copy_sidecar_files(tokenizer_dir, tmp)
        config.to_json_file(tmp / "config.json")
        samples = write_samples(tmp, chat, projector, table, pad_id, image_size, features, calib_samples, eval_samples)
        export_embeds_lm(lm.model, lm.lm_head, tmp, TINY_HIDDEN)
        export_vision(backbone, projector, image_size, tmp, round_to_float16=True)
        np.save(tmp / EMBED_TABLE_FILE, table)
        write_with_past(tmp, lm.model, lm.lm_head, table)
        (tmp / "tiny_vlm.json").write_text(json.dumps({
            "format": 1, "description": "random 2-layer Llama on SmolLM2's tokenizer, CRAFT VGG16-BN features, "
                                        "random projector: the trained-VLM folder form, for tests only",
            "seed": seed, "image_size": image_size, "visual_tokens": chat.visual_tokens,
            "visual_start_unpadded": chat.visual_start, "samples": samples}, indent=1))
    return Path(out_dir).resolve()
