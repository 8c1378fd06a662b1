"""``--target ort-genai``: edgeq's quantized decoder in onnxruntime-genai's graph form.

onnxruntime-genai is what CPU users generate text with; its speed comes from its graph form
(GroupQueryAttention over a shared KV buffer, SkipSimplifiedLayerNormalization, MatMulNBits at
accuracy level 4), not an NPU form, so this is a target of its own: the recipe runs on the
with-past graph as usual, then ``edgeq.genai.layers`` reads the result back layer by layer and
``edgeq.genai.emit`` writes the folder genai opens (``model.onnx`` + data, ``genai_config.json``,
the tokenizer files).

Which recipes map: those whose passes leave a Llama-form decoder with weight-only quantization
(``MAPPED_PASSES``: norm fusion, LayerNorm->RMSNorm, rotation with its online Hadamards, GPTQ
weights). Static activation quantization, split branches, custom attention or KV-cache ops have
no place in genai's form; such recipes are refused before any work (``check_recipe``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from edgeq.errors import UserInputError
from edgeq.families import FAMILIES

# recipe passes whose result genai's form can carry (weights and online rotations, nothing else)
MAPPED_PASSES = frozenset({"expand-functions", "fuse-norms", "ln-to-rms", "rotate", "gptq", "matmulnbits-to-qdq"})
# the model types whose attention genai's Llama form computes (config.json ``model_type``):
# the families declared ``genai`` in edgeq.families
MAPPED_FAMILIES = frozenset(f.model_type for f in FAMILIES if f.genai)


def check_recipe(recipe) -> None:
    """Refuse, in one line, a recipe whose result genai's graph form cannot carry."""
    other = [spec.name for spec in recipe.passes if spec.name not in MAPPED_PASSES]
    if other:
        raise UserInputError(f"--target ort-genai: recipe '{recipe.name}' runs {', '.join(other)}, which "
                             f"onnxruntime-genai's graph form cannot carry (it maps weight-only recipes: "
                             f"gptq-w4a16, gptq-w4a16-g32, quarot-gptq-w4a16, fp32)")
    if recipe.kv_cache.dtype != "float32":
        raise UserInputError(f"--target ort-genai: recipe '{recipe.name}' quantizes the KV cache, which "
                             f"genai's CPU cache does not take")


def read_config(model_path: Path) -> tuple[dict, dict]:
    """(config.json, generation_config.json) beside the with-past model; the family must map."""
    folder = Path(model_path).parent
    path = folder / "config.json"
    if not path.is_file():
        raise UserInputError(f"--target ort-genai needs config.json beside {model_path} "
                             f"(an `edgeq export ... --with-past` folder has it)")
    config = json.loads(path.read_text(encoding="utf-8"))
    family = config.get("model_type")
    if family not in MAPPED_FAMILIES:
        raise UserInputError(f"--target ort-genai: model_type '{family}' is not mapped (mapped: "
                             f"{', '.join(sorted(MAPPED_FAMILIES))})")
    if config.get("rope_scaling"):
        raise UserInputError("--target ort-genai: rope_scaling is not mapped (plain rotary embedding is)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise UserInputError("--target ort-genai: biased attention/MLP linears are not mapped")
    gen_path = folder / "generation_config.json"
    generation = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}
    for key in ("bos_token_id", "eos_token_id"):  # genai's config parser takes numbers only, no null
        if generation.get(key, config.get(key)) is None:
            raise UserInputError(f"--target ort-genai: {key} is not in {path} or generation_config.json "
                                 f"(onnxruntime-genai's genai_config.json needs it)")
    return config, generation


def genai_tokenizer(text: str) -> str:
    """``tokenizer.json`` as onnxruntime-extensions (genai's tokenizer) reads it.

    transformers' GGUF conversion writes a byte-level BPE (ByteLevel pre-tokenizer and vocabulary)
    with ``byte_fallback: true`` and a SentencePiece-style decoder; onnxruntime-extensions then
    treats it as SentencePiece: every space becomes U+2581, falls back to 3 bytes not in the
    vocabulary and is encoded as -1 ids. A byte-level vocabulary covers all 256 bytes, so byte
    fallback never fires: switching it off and decoding byte-level changes no Hugging Face id
    (checked on 200k characters of WikiText-2 test). Other tokenizers are returned unchanged."""
    tok = json.loads(text)
    if (tok.get("pre_tokenizer") or {}).get("type") != "ByteLevel" or not (tok.get("model") or {}).get("byte_fallback"):
        return text
    tok["model"]["byte_fallback"] = False
    tok["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    return json.dumps(tok, ensure_ascii=False)


def is_genai_folder(path: str | os.PathLike) -> bool:
    """A folder onnxruntime-genai opens (``genai_config.json`` in it)."""
    path = Path(path)
    return path.is_dir() and (path / "genai_config.json").is_file()
