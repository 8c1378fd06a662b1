"""``vision.onnx``: a VLM's vision side (CRAFT backbone + projector) as one graph, pixels in.

The language graphs of the VLM exports (``composed_vlm``, ``trained_vlm``, ``tiny_vlm``) take
``inputs_embeds`` with the visual tokens already in place: fine for the CPU passes, but a device
deployment and an evaluation that starts from pixels (``edgeq eval vqa``) need the vision side as
a graph too. This module exports exactly what the torch model computes before the language model:

    pixels [batch, S, S, 3] float32, RGB in [0, 1], S = the model's image size (static)
      -> (x - ImageNet mean) / std -> CRAFT VGG16-BN up to conv5_2 + BatchNorm (stride 16)
      -> [batch, (S/16)^2, 512] row-major over the grid
      -> (optional) rounded to float16 and back: the trained VLM's projector learnt on features
         cached in float16, so its visual tokens are those of the rounded features
      -> projector -> visual_tokens [batch, (S/16)^2, hidden] float32

The file and tensor names are the evaluation's (``edgeq.files.vqa_questions``), which reads
them. The image size is fixed in the graph (a device compiles one shape; another size is refused by the
caller with one line, not silently resized). Opset and exporter are those of the language graphs.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import cast

from edgeq.files.vlm_folder import PIXELS_INPUT, VISION_FILE, VISUAL_OUTPUT
from edgeq.models.craft_vision import FEATURE_CHANNELS, FEATURE_STRIDE, IMAGENET_MEAN, IMAGENET_STD
from edgeq.models.embeds_export import OPSET


def _vision_module(layers: list, projector, round_to_float16: bool):
    """A torch module pixels -> visual tokens from the backbone ``layers`` (``load_vgg_backbone``)."""
    import torch

    blocks: list[torch.nn.Module] = []
    for layer in layers:
        if layer[0] == "pool":
            blocks.append(torch.nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        _, w, b, g, beta, rmean, rvar, relu = layer
        conv = torch.nn.Conv2d(w.shape[1], w.shape[0], kernel_size=w.shape[2:], padding=1)
        bn = torch.nn.BatchNorm2d(w.shape[0], eps=1e-5)
        with torch.no_grad():
            conv.weight.copy_(w)
            cast(torch.Tensor, conv.bias).copy_(b)  # (bias, running stats: set at construction)
            bn.weight.copy_(g)
            bn.bias.copy_(beta)
            cast(torch.Tensor, bn.running_mean).copy_(rmean)
            cast(torch.Tensor, bn.running_var).copy_(rvar)
        blocks += [conv, bn] + ([torch.nn.ReLU()] if relu else [])

    class PixelsToVisualTokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Sequential(*blocks)
            self.projector = projector
            self.register_buffer("mean", torch.tensor(IMAGENET_MEAN, dtype=torch.float32))
            self.register_buffer("std", torch.tensor(IMAGENET_STD, dtype=torch.float32))

        def forward(self, pixels):
            x = ((pixels - self.mean) / self.std).permute(0, 3, 1, 2)
            feats = self.backbone(x).permute(0, 2, 3, 1)
            feats = feats.reshape(feats.shape[0], -1, FEATURE_CHANNELS)
            if round_to_float16:
                feats = feats.half().float()
            return self.projector(feats)

    return PixelsToVisualTokens().eval()


def export_vision(layers: list, projector, image_size: int, out_dir: str | os.PathLike,
                  round_to_float16: bool = False) -> Path:
    """Write ``out_dir/vision.onnx`` (see the module docstring); returns its path.

    ``layers``: ``edgeq.models.craft_vision.load_vgg_backbone()``; ``projector``: a torch module
    [.., 512] -> [.., hidden] (the trained MLP, or a bias-free Linear holding the composed VLM's
    fixed matrix); ``image_size``: S, a multiple of 16. The batch axis is dynamic."""
    import onnx

    from edgeq.models.hf_export import traced_onnx
    import torch

    from edgeq.graph import ir

    if image_size % FEATURE_STRIDE:
        raise ValueError(f"image size {image_size} is not a multiple of {FEATURE_STRIDE}")
    module = _vision_module(layers, projector.eval(), round_to_float16)
    out_dir = Path(out_dir)
    example = torch.rand(1, image_size, image_size, 3, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
        model = traced_onnx(lambda path: torch.onnx.export(
            module, (example,), path, input_names=[PIXELS_INPUT], output_names=[VISUAL_OUTPUT],
            dynamic_axes={PIXELS_INPUT: {0: "batch_size"}, VISUAL_OUTPUT: {0: "batch_size"}},
            opset_version=OPSET, do_constant_folding=True, dynamo=False))
    onnx.checker.check_model(model)
    return ir.save_model(model, out_dir / VISION_FILE)
