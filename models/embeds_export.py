"""ONNX export of a decoder that takes embeddings (the composed VLM and the tiny Qwen2-VL).

Vision-language models feed their language model ``inputs_embeds`` in which a span comes from the
vision encoder; the graph passes (AIFS, MSQ) also need that span, as the ``visual_start`` and
``visual_len`` inputs. This module exports ``lm_head(decoder(inputs_embeds, attention_mask,
position_ids))`` to one ONNX graph with that interface.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Sequence

from edgeq.modality_mask import DEFAULT_SPAN_INPUTS, SPAN_METADATA_KEY

MODEL_FILE = "model.onnx"
EMBED_INPUTS = ("inputs_embeds", "attention_mask", "position_ids")
SPAN_INPUTS = DEFAULT_SPAN_INPUTS
MODEL_INPUTS = EMBED_INPUTS + SPAN_INPUTS
OPSET = 18  # what optimum uses for the text-only SmolLM2 export, so the passes see the same ops


@contextmanager
def traceable_masks() -> Iterator[None]:
    """transformers >= 4.53 builds attention masks with ``torch.vmap``, which TorchScript tracing
    cannot follow; optimum's exporter swaps in broadcast-based versions while it exports, and so
    do we, with the same functions (``Range``/``LessOrEqual`` causal part, ``Gather`` of the
    flattened ``attention_mask`` for padding)."""
    import transformers.masking_utils as masking
    from optimum.exporters.onnx import model_patcher as patcher

    registry = masking.ALL_MASK_ATTENTION_FUNCTIONS
    original = {name: registry[name] for name in ("sdpa", "eager")}
    original_packed = masking.find_packed_sequence_indices
    registry.register("sdpa", patcher.sdpa_mask_without_vmap)
    registry.register("eager", patcher.eager_mask_without_vmap)
    masking.find_packed_sequence_indices = patcher.find_packed_sequence_indices_patched
    try:
        yield
    finally:
        for name, fn in original.items():
            registry.register(name, fn)
        masking.find_packed_sequence_indices = original_packed


def _embeds_lm_module(decoder, lm_head):
    import torch

    class EmbedsToLogits(torch.nn.Module):
        """decoder(inputs_embeds, attention_mask, position_ids) -> lm_head -> logits."""

        def __init__(self):
            super().__init__()
            # Attribute names give the node names: "/model/layers.N/...", "/lm_head/MatMul", as
            # in optimum's exports of *ForCausalLM.
            self.model = decoder
            self.lm_head = lm_head

        def forward(self, inputs_embeds, attention_mask, position_ids):
            hidden = self.model(
                inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                position_ids=position_ids, use_cache=False,
            ).last_hidden_state
            return self.lm_head(hidden)

    return EmbedsToLogits().eval()


def _tensor_input(name: str, elem_type: int, dims: Sequence[Any]):
    import onnx

    return onnx.helper.make_tensor_value_info(name, elem_type, list(dims))


def export_embeds_lm(decoder, lm_head, out_dir: Path, hidden_size: int, position_rows: int | None = None) -> Path:
    """Export ``lm_head(decoder(inputs_embeds, attention_mask, position_ids))`` to ``out_dir``.

    One graph, opset 18, weights in ``model.onnx.data`` (``edgeq.graph.ir.save_model``). The
    TorchScript exporter (``dynamo=False``) is the one optimum uses, so the linears, decomposed
    RMSNorm and node names (``/model/layers.N/...``) look like the text-only SmolLM2 export's.
    Attention differs on purpose: the decoder should run eager attention (optimum exports SDPA),
    which gives one explicit float mask ``Where(bool_mask, 0, float32 min)`` shared by every
    layer's ``Add`` before ``Softmax``, the tensor an AIFS pass replaces. ``position_rows=None`` gives ``position_ids``
    [batch, seq]; ``3`` gives the M-RoPE form [3, batch, seq]. The span inputs ``visual_start``
    and ``visual_len`` (int64 [batch]) are added to ``graph.input`` afterwards: nothing reads
    them, so the exporter would drop them, but the passes that come later need them as inputs.
    ``out_dir`` must exist (callers write inside an ``atomic_output_dir``).
    """
    import onnx

    from edgeq.models.hf_export import traced_onnx
    import torch

    from edgeq.graph import ir

    module = _embeds_lm_module(decoder, lm_head)
    batch, seq = 2, 8
    embeds = torch.randn(batch, seq, hidden_size, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, seq, dtype=torch.int64)
    positions = torch.arange(seq, dtype=torch.int64).expand(batch, seq)
    pos_axes = {0: "batch_size", 1: "sequence_length"}
    if position_rows is not None:
        positions = positions.expand(position_rows, batch, seq)
        pos_axes = {1: "batch_size", 2: "sequence_length"}
    dyn = {0: "batch_size", 1: "sequence_length"}
    with traceable_masks(), warnings.catch_warnings():
        # Tracing emits dozens of expected TracerWarnings per layer, and the legacy exporter a
        # deprecation notice; neither is actionable here.
        warnings.simplefilter("ignore")
        model = traced_onnx(lambda path: torch.onnx.export(
            module,
            (embeds, mask, positions.contiguous()),
            path,
            input_names=list(EMBED_INPUTS),
            output_names=["logits"],
            dynamic_axes={"inputs_embeds": dyn, "attention_mask": dyn, "position_ids": pos_axes, "logits": dyn},
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        ))
    names = [i.name for i in model.graph.input]
    if names != list(EMBED_INPUTS):
        raise RuntimeError(f"the exporter produced inputs {names}, expected {list(EMBED_INPUTS)}")
    for name in SPAN_INPUTS:
        model.graph.input.append(_tensor_input(name, onnx.TensorProto.INT64, ["batch_size"]))
    ir.set_metadata(model, SPAN_METADATA_KEY, ",".join(SPAN_INPUTS))
    onnx.checker.check_model(model)
    return ir.save_model(model, out_dir / MODEL_FILE)


def ort_session(model_path: str | os.PathLike, threads: int | None = None):
    """An onnxruntime CPU session with graph optimizations off (the graph as written)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
