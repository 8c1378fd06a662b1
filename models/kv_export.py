"""Decoder graphs *with* a KV cache (``edgeq export ... --with-past``), for KV-cache quantization.

edgeq's passes rewrite the no-cache graph (``edgeq.models.hf_export``); CalibQuant quantizes the
KV cache between prefill and decode, so it needs the cached form. This module exports it for the
three sources that have a causal decoder, without touching their no-cache builders (whose source
hashes key the test-model cache):

- ``export_smollm2_with_past`` and ``export_tiny_with_past`` (``TINY_WITH_PAST``): optimum's
  ``text-generation-with-past`` task, unchanged. One graph serves prefill (past length 0) and
  decode. Inputs ``input_ids`` [batch, seq], ``attention_mask`` [batch, past + seq],
  ``position_ids`` [batch, seq], ``past_key_values.{i}.key`` / ``.value`` [batch, kv_heads,
  past, head_dim]; outputs ``logits`` [batch, seq, vocab], ``present.{i}.key`` / ``.value``
  [batch, kv_heads, past + seq, head_dim] (the past followed by this call's keys/values, keys
  after RoPE). optimum names the dims ``batch_size``, ``sequence_length``,
  ``past_sequence_length`` and ``past_sequence_length + sequence_length``.
- ``export_composed_vlm_with_past``: the composed vision-language model on ``inputs_embeds``
  through a torch wrapper (``export_embeds_lm_with_past``), with the same cache names and dims and
  the inputs ``inputs_embeds``, ``attention_mask``, ``position_ids``, ``visual_start``,
  ``visual_len`` (the span inputs are not read by the fp32 graph; the multimodal and KV passes
  need them), then the past key/values. Eager attention, opset 18, weights in
  ``model.onnx.data``, like the no-cache composed graph. The folder also holds
  ``embed_tokens.npy`` (SmolLM2's input embedding table, float32 [vocab, hidden]): decoding feeds
  ``embed_tokens[token]`` as the next ``inputs_embeds``.

Prefill: past tensors with past length 0 (``np.zeros((batch, kv_heads, 0, head_dim))``),
``attention_mask`` over the prompt. Decode: the presents as the next pasts, ``attention_mask``
grown by one column, ``position_ids`` the next position (``edgeq.evaluate.generate``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np

from edgeq.errors import UserInputError
from edgeq.files.vlm_folder import EMBED_TABLE_FILE
from edgeq.families import TINY_WITH_PAST
from edgeq.files.output_dir import atomic_output_dir

MODEL_FILE = "model.onnx"
WITH_PAST_TASK = "text-generation-with-past"
# TINY_WITH_PAST (edgeq.families): the tiny architectures with a cached form (``Family.tiny_with_past``);
# the others and qwen2vl have none.
PAST_AXES = ("batch_size", "past_sequence_length")
TOTAL_AXIS = "past_sequence_length + sequence_length"


def past_names(layers: int) -> list[str]:
    """``past_key_values.{i}.key`` / ``.value`` for every layer, in graph-input order."""
    return [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def present_names(layers: int) -> list[str]:
    """``present.{i}.key`` / ``.value`` for every layer, in graph-output order."""
    return [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def present_for(past_name: str) -> str:
    """The output that feeds ``past_name`` at the next step (``past_key_values.3.key`` -> ``present.3.key``)."""
    return "present." + past_name[len("past_key_values."):]


# ---------------------------------------------------------------------------------------------
# Token-id graphs through optimum
# ---------------------------------------------------------------------------------------------


def export_smollm2_with_past(out_dir: str | os.PathLike, force: bool = False) -> Path:
    """``edgeq export smollm2 --with-past``: SmolLM2-135M-Instruct with a KV cache; atomic."""
    from edgeq.models.hf_export import export_to, require_export_deps
    from edgeq.models.gguf_folder import record_add_bos
    from edgeq.models.smollm2 import gguf_path, save_hf_folder

    gguf_path()  # fail on a missing package before the slower dependency checks
    require_export_deps("gguf")
    with atomic_output_dir(out_dir, force=force, marker={"export": "smollm2", "with_past": True}) as tmp, \
            tempfile.TemporaryDirectory(prefix="edgeq-smollm2-") as hf:
        save_hf_folder(Path(hf))
        export_to(Path(hf), tmp, task=WITH_PAST_TASK)
        record_add_bos(gguf_path(), tmp)
    return Path(out_dir).resolve()


def check_tiny_with_past(arch: str) -> None:
    """One line naming the architectures that have a cached form, for any other ``arch``."""
    if arch not in TINY_WITH_PAST:
        raise UserInputError(
            f"--with-past needs a causal decoder; tiny {arch} has none (choose from {', '.join(TINY_WITH_PAST)})"
        )


def export_tiny_with_past(arch: str, out_dir: str | os.PathLike, seed: int = 0, force: bool = False) -> Path:
    """``edgeq export tiny ARCH --with-past``: the same seeded weights as ``export_tiny``, cached graph."""
    check_tiny_with_past(arch)
    from edgeq.models.hf_export import export_to
    from edgeq.models.tiny import build_tiny

    model = build_tiny(arch, seed)
    marker = {"export": "tiny", "arch": arch, "seed": seed, "with_past": True}
    with atomic_output_dir(out_dir, force=force, marker=marker) as tmp, \
            tempfile.TemporaryDirectory(prefix="edgeq-tiny-") as hf:
        model.save_pretrained(hf)
        export_to(Path(hf), tmp, WITH_PAST_TASK)
    return Path(out_dir).resolve()


# ---------------------------------------------------------------------------------------------
# Embeddings graph through a torch wrapper
# ---------------------------------------------------------------------------------------------


def _cache_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers decoder config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def _embeds_past_module(decoder, lm_head, layers: int):
    import torch
    from transformers.cache_utils import DynamicCache

    class EmbedsWithPast(torch.nn.Module):
        """(inputs_embeds, attention_mask, position_ids, *past) -> (logits, *presents)."""

        def __init__(self):
            super().__init__()
            self.model = decoder  # node names "/model/layers.N/...", as in the no-cache export
            self.lm_head = lm_head

        def forward(self, inputs_embeds, attention_mask, position_ids, *past):
            cache = DynamicCache.from_legacy_cache(tuple((past[2 * i], past[2 * i + 1]) for i in range(layers)))
            out = self.model(
                inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=cache, use_cache=True,
            )
            presents = []
            for layer in out.past_key_values.layers:
                presents += [layer.keys, layer.values]
            return (self.lm_head(out.last_hidden_state), *presents)

    return EmbedsWithPast().eval()


def export_embeds_lm_with_past(decoder, lm_head, out_dir: Path) -> Path:
    """Export ``lm_head(decoder(inputs_embeds, attention_mask, position_ids, past))`` with its
    presents to ``out_dir/model.onnx`` (``out_dir`` must exist).

    The cached counterpart of ``embeds_export.export_embeds_lm`` (same exporter, opset and
    attention implementation as the decoder was loaded with): inputs ``inputs_embeds``,
    ``attention_mask``, ``position_ids``, ``visual_start``, ``visual_len`` (int64 [batch], not read
    by the graph, added after the export so the passes find them), ``past_key_values.{i}.key`` /
    ``.value``; outputs ``logits`` and ``present.{i}.key`` / ``.value``. Traced with a non-empty
    past, so the same graph runs with past length 0 (prefill) and > 0 (decode). Position ids
    [batch, seq] only (no M-RoPE).
    """
    import onnx

    from edgeq.models.hf_export import traced_onnx
    import torch
    from optimum.exporters.onnx import model_patcher as patcher
    from transformers.cache_utils import DynamicLayer

    from edgeq.graph import ir
    from edgeq.modality_mask import SPAN_METADATA_KEY
    from edgeq.models.embeds_export import EMBED_INPUTS, OPSET, SPAN_INPUTS, _tensor_input, traceable_masks

    layers, kv_heads, head_dim = _cache_shape(decoder.config)
    hidden = decoder.config.hidden_size
    module = _embeds_past_module(decoder, lm_head, layers)
    batch, seq, past_len = 2, 3, 5
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(batch, seq, hidden, generator=gen)
    mask = torch.ones(batch, past_len + seq, dtype=torch.int64)
    positions = torch.arange(past_len, past_len + seq, dtype=torch.int64).expand(batch, seq).contiguous()
    past = [torch.randn(batch, kv_heads, past_len, head_dim, generator=gen) for _ in range(2 * layers)]
    pasts, presents = past_names(layers), present_names(layers)
    dyn = {0: "batch_size", 1: "sequence_length"}
    axes = {"inputs_embeds": dyn, "position_ids": dyn, "logits": dyn,
            "attention_mask": {0: "batch_size", 1: TOTAL_AXIS}}
    axes.update({name: {0: PAST_AXES[0], 2: PAST_AXES[1]} for name in pasts})
    axes.update({name: {0: "batch_size", 2: TOTAL_AXIS} for name in presents})
    original_update = DynamicLayer.update
    # what optimum's ModelPatcher does (a monkeypatch of transformers' class)
    DynamicLayer.update = patcher.patched_dynamic_layer_update  # type: ignore[method-assign]
    try:
        with traceable_masks(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = traced_onnx(lambda path: torch.onnx.export(
                module, (embeds, mask, positions, *past), path,
                input_names=[*EMBED_INPUTS, *pasts], output_names=["logits", *presents],
                dynamic_axes=axes, opset_version=OPSET, do_constant_folding=True, dynamo=False,
            ))
    finally:
        DynamicLayer.update = original_update  # type: ignore[method-assign]  # (undoing the patch)
    names = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    if names != [*EMBED_INPUTS, *pasts] or outputs != ["logits", *presents]:
        raise RuntimeError(f"the exporter produced inputs {names} and outputs {outputs}")
    kept = list(model.graph.input)
    del model.graph.input[:]
    model.graph.input.extend(kept[:len(EMBED_INPUTS)])
    model.graph.input.extend(_tensor_input(n, onnx.TensorProto.INT64, ["batch_size"]) for n in SPAN_INPUTS)
    model.graph.input.extend(kept[len(EMBED_INPUTS):])
    ir.set_metadata(model, SPAN_METADATA_KEY, ",".join(SPAN_INPUTS))
    onnx.checker.check_model(model)
    return ir.save_model(model, out_dir / MODEL_FILE)


def export_composed_vlm_with_past(out_dir: str | os.PathLike, force: bool = False, **kwargs) -> Path:
    """``edgeq export composed-vlm --with-past``: the composed VLM folder with the cached graph.

    Builds the ordinary folder (``export_composed_vlm`` with ``kwargs``: samples, npz files,
    manifest) in a temporary subfolder, then replaces its ``model.onnx`` by the with-past graph of
    the same language model, writes ``embed_tokens.npy`` and records in ``composed.json``
    (``onnx`` and ``with_past``) the graph's interface and how far its prefill logits are from the
    no-cache graph's on the first two eval samples. ``calib.npz`` / ``eval.npz`` stay the prefill
    inputs (no past tensors: ``edgeq.evaluate.generate.greedy_decode`` adds the empty ones).
    """
    from edgeq.models.composed_vlm import export_composed_vlm, load_language_model, load_split
    from edgeq.models.embeds_export import MODEL_INPUTS, ort_session

    text_dir = kwargs.get("text_dir")
    with atomic_output_dir(out_dir, force=force, inputs=(text_dir,) if text_dir else (),
                           marker={"export": "composed-vlm", "with_past": True}) as tmp:
        base = export_composed_vlm(tmp / "no-cache", **kwargs)
        for item in base.iterdir():
            item.rename(tmp / item.name)
        base.rmdir()
        inputs, _ = load_split(tmp, "eval")
        feeds = {k: v[:2] for k, v in inputs.items()}
        (reference,) = ort_session(tmp / MODEL_FILE).run(["logits"], feeds)
        (tmp / MODEL_FILE).unlink()
        (tmp / (MODEL_FILE + ".data")).unlink()

        model = load_language_model()
        layers, kv_heads, head_dim = _cache_shape(model.config)
        np.save(tmp / EMBED_TABLE_FILE, model.get_input_embeddings().weight.detach().numpy().astype(np.float32))
        export_embeds_lm_with_past(model.model, model.lm_head, tmp)
        del model

        session = ort_session(tmp / MODEL_FILE)
        batch = feeds["inputs_embeds"].shape[0]
        empty = np.zeros((batch, kv_heads, 0, head_dim), np.float32)
        (logits,) = session.run(["logits"], {**feeds, **{n: empty for n in past_names(layers)}})
        manifest_path = tmp / "composed.json"
        manifest = json.loads(manifest_path.read_text())
        manifest["onnx"].update({
            "inputs": [*MODEL_INPUTS, *past_names(layers)],
            "outputs": ["logits", *present_names(layers)],
            "cache": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                      "past_dims": ["batch_size", kv_heads, "past_sequence_length", head_dim],
                      "present_dims": ["batch_size", kv_heads, TOTAL_AXIS, head_dim]},
        })
        manifest["with_past"] = {
            "embed_table": EMBED_TABLE_FILE,
            "prefill_vs_no_cache_max_abs_logit_diff": float(np.abs(logits - reference).max()),
            "prefill_vs_no_cache_top1_agreement": float((logits.argmax(-1) == reference.argmax(-1)).mean()),
            "samples": int(batch),
            "note": "the sanity figures were measured on the no-cache graph of the same weights",
        }
        manifest_path.write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(tmp / "no-cache", ignore_errors=True)
    return Path(out_dir).resolve()
