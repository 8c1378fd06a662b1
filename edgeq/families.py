"""The model families edgeq knows, declared in one place.

A family is one transformers architecture. Its ``Family`` entry says how to build its tiny random
model (the transformers classes, the optimum task and the config of ``edgeq export tiny NAME``,
built by ``edgeq.models.tiny``), which exports it has, and the structural traits the engine relies
on, stated as data: norm kind, Gemma's ``(1 + w)`` norm scale, sandwich norms, a parallel
attention + MLP block, fused projections, per-head q/k norms, a scaled embedding, whether it
splits into decoder blocks and whether ``--target ort-genai`` maps it.

The matchers that find this structure (``edgeq.structure``, ``edgeq.passes.methods.stream``,
``edgeq.blockwise.partition``) recognise patterns, never family names; the traits here are what
they find on each family's tiny export, and ``tests/test_families.py`` checks every declaration
against that analysis. What reads the table: ``edgeq.models.tiny`` (classes, task, config, norm
scale offset), ``edgeq.models.kv_export`` and the ``export`` CLI (``TINY_WITH_PAST``),
``edgeq.genai`` (``MAPPED_FAMILIES``), ``edgeq.blockwise.partition`` (``LAYER_CONTAINERS``).
Adding a family: one entry in ``FAMILIES`` plus what that test asks (ARCHITECTURE.md, "Adding a
model family").

Data only: importing this module imports neither torch, transformers nor onnx.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast
from types import MappingProxyType
from collections.abc import Mapping

# Sizes of the tiny models: small but non-degenerate (several heads, GQA, an FFN wider than the
# hidden size), exported in about a second.
TINY_VOCAB = 256
TINY_HIDDEN = 64
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_LAYERS = 2
TINY_FFN = 128
TINY_MAX_POS = 128

_DECODER = dict(vocab_size=TINY_VOCAB, hidden_size=TINY_HIDDEN, intermediate_size=TINY_FFN,
                num_hidden_layers=TINY_LAYERS, num_attention_heads=TINY_HEADS, num_key_value_heads=TINY_KV_HEADS,
                max_position_embeddings=TINY_MAX_POS, tie_word_embeddings=False)
# Gemma 2/3: per-head width, a short sliding window (both alternate sliding-window and global
# layers) and the head tied to the embedding, as the family ships it
_GEMMA = dict(head_dim=TINY_HIDDEN // TINY_HEADS, sliding_window=8, query_pre_attn_scalar=TINY_HIDDEN // TINY_HEADS,
              tie_word_embeddings=True)

NORM_KINDS = ("rms", "layer")  # edgeq.structure.Norm.kind


@dataclass(frozen=True)
class Family:
    """One model family. The first fields build and export its tiny model; the traits after
    ``layer_scope`` are what ``edgeq.structure.analyze`` and ``analyze_stream`` find on that
    export (``tests/test_families.py`` checks each)."""

    name: str  # ``edgeq export tiny NAME``; the key of the tests' ``tiny_models`` fixture
    model_type: str  # ``model_type`` of its config.json (what the engine reads off a model folder)
    config_class: str  # transformers class names
    model_class: str
    task: str  # optimum export task: text-generation (a causal LM), fill-mask, image-classification
    tiny: Mapping[str, object]  # keyword arguments of ``config_class`` for the tiny model
    layer_scope: str  # node-name scope of its layers: ``{layer_scope}.{i}/`` (optimum's export)
    norm: str  # 'rms' | 'layer': every norm of the export is of this kind
    activation: str  # the MLP's activation, as ``Block.activation`` names it
    gated_mlp: bool = False  # activated gate times an up projection (gate_proj / up_proj)
    norm_scale_offset: float = 0.0  # norms compute ``x_hat * (offset + w)``: 1.0 for Gemma's ``(1 + w)``
    pre_norm: bool = True  # norms read the residual stream (False: post-LN, BERT: the stream is not rotatable)
    sandwich_norms: bool = False  # a norm on each block's write path, before the residual add (Gemma 2/3)
    parallel_block: bool = False  # attention and MLP read one norm, their outputs summed into one add (Phi-2)
    fused_qkv: bool = False  # one linear projects q, k and v (role ``qkv``)
    fused_gate_up: bool = False  # one linear projects gate and up (role ``gate_up_proj``)
    head_norms: bool = False  # per-head q/k norms inside attention (Qwen3, Gemma 3): not stream norms
    embedding_scale: bool = False  # the token embedding times sqrt(hidden) before the first layer (Gemma)
    blockwise: bool = True  # splits into prologue, layers and epilogue (``edgeq.blockwise``)
    tiny_with_past: bool = False  # ``edgeq export tiny NAME --with-past`` gives its KV-cache form
    genai: bool = False  # ``--target ort-genai`` maps it (genai's Llama form computes its attention)
    real: tuple[str, ...] = ()  # released models of the family edgeq exports (``edgeq export`` sources, random presets)

    def __post_init__(self):
        if self.norm not in NORM_KINDS:
            raise ValueError(f"family {self.name}: norm must be one of {NORM_KINDS}, got {self.norm!r}")
        object.__setattr__(self, "tiny", MappingProxyType(dict(self.tiny)))

    @property
    def causal(self) -> bool:
        """A causal language model (the decoder families)."""
        return self.task == "text-generation"

    @property
    def tiny_layers(self) -> int:
        """How many layers its tiny model has."""
        return int(cast(int, self.tiny.get("num_hidden_layers", self.tiny.get("n_layer", 0))))


FAMILIES: tuple[Family, ...] = (
    Family("llama", "llama", "LlamaConfig", "LlamaForCausalLM", "text-generation", _DECODER,
           layer_scope="/model/layers", norm="rms", activation="silu", gated_mlp=True, tiny_with_past=True,
           genai=True, real=("smollm2", "random llama-3.2-1b", "random llama-3.2-3b")),
    Family("qwen2", "qwen2", "Qwen2Config", "Qwen2ForCausalLM", "text-generation", _DECODER,
           layer_scope="/model/layers", norm="rms", activation="silu", gated_mlp=True, tiny_with_past=True,
           genai=True, real=("qwen2.5-coder-0.5b", "random qwen2.5-0.5b", "random qwen2.5-1.5b")),
    Family("qwen3", "qwen3", "Qwen3Config", "Qwen3ForCausalLM", "text-generation",
           dict(_DECODER, head_dim=TINY_HIDDEN // TINY_HEADS),
           layer_scope="/model/layers", norm="rms", activation="silu", gated_mlp=True, head_norms=True),
    # gemma2: logit and attention soft-capping
    Family("gemma2", "gemma2", "Gemma2Config", "Gemma2ForCausalLM", "text-generation", dict(_DECODER, **_GEMMA),
           layer_scope="/model/layers", norm="rms", activation="gelu_tanh", gated_mlp=True, norm_scale_offset=1.0,
           sandwich_norms=True, embedding_scale=True),
    Family("gemma3", "gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", "text-generation",
           dict(_DECODER, **_GEMMA, sliding_window_pattern=2),
           layer_scope="/model/layers", norm="rms", activation="gelu_tanh", gated_mlp=True, norm_scale_offset=1.0,
           sandwich_norms=True, head_norms=True, embedding_scale=True, real=("gemma3",)),
    Family("phi3", "phi3", "Phi3Config", "Phi3ForCausalLM", "text-generation",
           dict(_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2),
           layer_scope="/model/layers", norm="rms", activation="silu", gated_mlp=True, fused_qkv=True,
           fused_gate_up=True),
    # Conv1D linears (Gemm after a flatten)
    Family("gpt2", "gpt2", "GPT2Config", "GPT2LMHeadModel", "text-generation",
           dict(vocab_size=TINY_VOCAB, n_embd=TINY_HIDDEN, n_layer=TINY_LAYERS, n_head=TINY_HEADS, n_inner=TINY_FFN,
                n_positions=TINY_MAX_POS),
           layer_scope="/transformer/h", norm="layer", activation="gelu_tanh", fused_qkv=True, tiny_with_past=True),
    # LayerNorm with bias, learned positions, the stream flattened to [b * s, h] around the MLP
    Family("opt", "opt", "OPTConfig", "OPTForCausalLM", "text-generation",
           dict(vocab_size=TINY_VOCAB, hidden_size=TINY_HIDDEN, ffn_dim=TINY_FFN, num_hidden_layers=TINY_LAYERS,
                num_attention_heads=TINY_HEADS, max_position_embeddings=TINY_MAX_POS, word_embed_proj_dim=TINY_HIDDEN,
                tie_word_embeddings=False),
           layer_scope="/decoder/layers", norm="layer", activation="relu", blockwise=False),
    # Phi-2: partial rotary, biases
    Family("phi", "phi", "PhiConfig", "PhiForCausalLM", "text-generation",
           dict(vocab_size=TINY_VOCAB, hidden_size=TINY_HIDDEN, intermediate_size=TINY_FFN,
                num_hidden_layers=TINY_LAYERS, num_attention_heads=TINY_HEADS, num_key_value_heads=TINY_HEADS,
                max_position_embeddings=TINY_MAX_POS, partial_rotary_factor=0.5, tie_word_embeddings=False),
           layer_scope="/model/layers", norm="layer", activation="gelu_tanh", parallel_block=True),
    Family("bert", "bert", "BertConfig", "BertForMaskedLM", "fill-mask",
           dict(vocab_size=TINY_VOCAB, hidden_size=TINY_HIDDEN, num_hidden_layers=TINY_LAYERS,
                num_attention_heads=TINY_HEADS, intermediate_size=TINY_FFN, max_position_embeddings=TINY_MAX_POS),
           layer_scope="/bert/encoder/layer", norm="layer", activation="gelu", pre_norm=False, blockwise=False),
    Family("vit", "vit", "ViTConfig", "ViTForImageClassification", "image-classification",
           dict(image_size=32, patch_size=8, num_channels=3, hidden_size=TINY_HIDDEN, num_hidden_layers=TINY_LAYERS,
                num_attention_heads=TINY_HEADS, intermediate_size=TINY_FFN, num_labels=10),
           layer_scope="/vit/encoder/layer", norm="layer", activation="gelu", blockwise=False),
)

BY_NAME: Mapping[str, Family] = MappingProxyType({f.name: f for f in FAMILIES})
TINY_ARCHS: tuple[str, ...] = tuple(BY_NAME)
TINY_WITH_PAST: tuple[str, ...] = tuple(f.name for f in FAMILIES if f.tiny_with_past)
# the containers of layers in exported node names (``/model/layers.3/``, ``/transformer/h.3/``, ...)
LAYER_CONTAINERS: tuple[str, ...] = tuple(dict.fromkeys(f.layer_scope.rsplit("/", 1)[-1] for f in FAMILIES))


def by_model_type(model_type: str | None) -> Family | None:
    """The family of a config.json ``model_type`` (None for one not declared here)."""
    return next((f for f in FAMILIES if f.model_type == model_type), None)
