"""Real-shaped random decoder LLMs (Llama 3.2, Qwen2.5), for memory and time measurements only.

Scale work (how much memory a pass or a compile needs, how long it takes on a 1B or 3B model)
needs graphs with the real layer count, widths and vocabulary, not real weights; no model hub is
reachable where edgeq is built, so the weights are seeded random. Never measure accuracy on these.

Exporting such a model the usual way (torch model -> optimum -> ONNX) holds the weights at least
twice: a 3B fp32 model is 12.8 GB, so torch's copy plus the ONNX proto does not fit a 24 GB
machine. The graph is therefore built without ever holding the model:

1. optimum exports a *skeleton*: the preset's config with 2 layers, a small vocabulary and a small
   MLP width (neither appears anywhere in the graph but in the weight shapes, which is checked),
   so its nodes are exactly the ones an optimum export of the real model has;
2. the skeleton's layer 1 (nodes named ``/model/layers.1/...`` plus the anonymous ``Constant``
   nodes only it reads: torch emits those per layer) is the template of layers 1..L-1; each copy
   gets its own names (``layers.1`` -> ``layers.i``, fresh ``onnx::MatMul_N``-style names for the
   anonymous ones) and reads the previous layer's residual output; what layer 1 reads from layer 0
   (the rotary cos/sin unsqueezes) and from the model (the attention mask) stays shared, as in a
   real export;
3. every weight is drawn tensor by tensor (large ones in 32 MiB chunks) straight into one external
   data file, page-aligned, so writing needs one chunk plus the graph proto. The skeleton's own
   weights are discarded. The peak is the skeleton's export itself (measured 0.6 GB for
   qwen2.5-0.5b, 1 GB for llama-3.2-1b, 1.5 GB for llama-3.2-3b, whose fp32 weights are 2.0, 4.9
   and 12.8 GB).

``write_random_decoder`` takes any transformers config of a family with identical layers (the
tests pass tiny ones); ``export_random`` is the ``edgeq export random PRESET`` entry point.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import numpy as np
import onnx

from edgeq.errors import UserInputError
from edgeq.graph.ir import EXTERNAL_DATA_SUFFIX
from edgeq.files.output_dir import atomic_output_dir
from edgeq.models.hf_export import MODEL_FILE, export_to, require_export_deps

DATA_FILE = MODEL_FILE + EXTERNAL_DATA_SUFFIX  # model.onnx.data, like edgeq's own outputs

# The transformers configs of the released checkpoints (their config.json), minus torch_dtype
# (bfloat16 there; these exports are fp32). max_position_embeddings is kept as released, not
# reduced: the exported graph does not depend on it (transformers computes the rotary angles as
# position_ids @ inv_freq, there is no cos/sin table; an export with 4096 gives the same graph).
_LLAMA_3_2_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "use_cache": True,
    "vocab_size": 128256,
}
_QWEN2_5_COMMON = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",  # q/k/v projections with bias, o_proj without (fixed by the qwen2 family)
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
PRESETS: dict[str, dict] = {
    "llama-3.2-1b": dict(_LLAMA_3_2_COMMON, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         head_dim=64),
    "llama-3.2-3b": dict(_LLAMA_3_2_COMMON, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                         head_dim=128),
    "qwen2.5-0.5b": dict(_QWEN2_5_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, max_position_embeddings=32768, max_window_layers=24,
                         sliding_window=32768),
    "qwen2.5-1.5b": dict(_QWEN2_5_COMMON, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, max_position_embeddings=131072, max_window_layers=28,
                         sliding_window=131072),
}
RANDOM_PRESETS = tuple(PRESETS)

_SKELETON_LAYERS = 2  # layer 0 computes what every layer shares; layer 1 is the template
# Vocabulary and MLP width of the skeleton: odd primes, so never equal to a real (even) width,
# which lets the weight shapes be patched by value and the graph be checked not to use them.
_SENTINELS = (1021, 509, 1031, 521, 1033, 523)
_ALIGN = 4096  # external data offsets: page-aligned, so onnxruntime can map tensors in place
_CHUNK_ELEMENTS = 1 << 23  # floats drawn per step (32 MiB): bounds the memory of the biggest tensor
_NORM_SPREAD = 0.1  # norm scales ~ N(1, 0.1) as in models/tiny.py: a pass mishandling them shows
_BIAS_STD = 0.02


def preset_config(preset: str, layers: int | None = None):
    """The transformers config of ``preset``, with ``layers`` decoder layers (default: the preset's)."""
    if preset not in PRESETS:
        raise UserInputError(f"unknown random preset '{preset}' (choose from {', '.join(RANDOM_PRESETS)})")
    if layers is not None and layers < 1:
        raise UserInputError(f"--layers must be at least 1, got {layers}")
    require_export_deps()
    import transformers

    kwargs = dict(PRESETS[preset], dtype="float32")
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    return transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def export_random(preset: str, out_dir: str | os.PathLike, layers: int | None = None, seed: int = 0,
                  force: bool = False, with_past: bool = False) -> Path:
    """Write the random ``preset`` model (``layers`` layers, weights from ``seed``; ``with_past``:
    the KV-cache graph ``compile --static`` takes) to ``out_dir``, atomically: ``model.onnx``,
    ``model.onnx.data``, ``config.json``."""
    config = preset_config(preset, layers)
    marker = {"export": "random", "preset": preset, "layers": config.num_hidden_layers, "seed": seed}
    if with_past:
        marker["with_past"] = True
    with atomic_output_dir(out_dir, force=force, marker=marker) as tmp:
        write_random_decoder(config, tmp, seed=seed, with_past=with_past)
    return Path(out_dir).resolve()


def write_random_decoder(config, out: Path, seed: int = 0, with_past: bool = False) -> None:
    """Write the random decoder of the transformers ``config`` into the existing folder ``out``
    (not atomic): ``model.onnx`` with every weight in ``model.onnx.data``, and ``config.json``.

    The graph is the one optimum exports for ``config`` (``with_past``: its KV-cache form, each
    layer reading ``past_key_values.{i}.*`` and writing ``present.{i}.*``); the weights are drawn from
    ``np.random.default_rng(seed)``: linears and the embedding ~ N(0, initializer_range), norm
    scales ~ N(1, 0.1), biases ~ N(0, 0.02).
    """
    layer_types = set(getattr(config, "layer_types", None) or ())
    if len(layer_types) > 1:
        raise ValueError(f"layers differ ({sorted(layer_types)}): one layer cannot be the template of all")
    if not getattr(config, "architectures", None):
        raise ValueError("the config names no architecture (config.architectures)")
    vocab, ffn = [s for s in _SENTINELS if s not in _config_ints(config)][:2]
    model = _export_skeleton(config, vocab, ffn, with_past)
    _set_widths(model, {vocab: config.vocab_size, ffn: config.intermediate_size})
    weights = _weight_roles(model.graph)
    for tensor in model.graph.initializer:  # the skeleton's weights: drawn afresh, never copied per layer
        if tensor.name in weights:
            tensor.ClearField("raw_data")
    _replicate_layers(model.graph, config.num_hidden_layers)
    std = getattr(config, "initializer_range", 0.02)
    _write_random_weights(model, out, np.random.default_rng(seed), std)
    model.metadata_props.add(key="edgeq.random_weights",
                             value=f"seed {seed}; for memory and time measurements, never accuracy")
    onnx.save_model(model, str(out / MODEL_FILE))
    config.save_pretrained(out)


def _config_ints(config) -> set[int]:
    """Every integer of the config, and the attention widths derived from them."""
    ints = {v for v in config.to_dict().values() if isinstance(v, int) and not isinstance(v, bool)}
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ints | {heads * head_dim, kv * head_dim, head_dim}


def _export_skeleton(config, vocab: int, ffn: int, with_past: bool = False) -> onnx.ModelProto:
    """optimum's export of ``config`` with 2 layers, vocabulary ``vocab`` and MLP width ``ffn``
    (``with_past``: with its KV cache)."""
    from edgeq.models.kv_export import WITH_PAST_TASK

    require_export_deps()
    import torch
    import transformers

    from edgeq.models.tiny import _perturb_defaults  # the tiny models' norm/bias conventions

    fields = config.to_dict()
    fields.pop("layer_types", None)  # recomputed for 2 layers
    fields.update(num_hidden_layers=_SKELETON_LAYERS, vocab_size=vocab, intermediate_size=ffn)
    skeleton_config = type(config).from_dict(fields)
    model_class = getattr(transformers, config.architectures[0])
    torch.manual_seed(0)
    model = model_class(skeleton_config).to(torch.float32).eval()
    # Distinct values in every parameter: torch's exporter folds equal initializers (norm scales of
    # ones, zero biases) into one tensor read through Identity nodes, which a real model never has.
    _perturb_defaults(model)
    with tempfile.TemporaryDirectory(prefix="edgeq-random-skeleton-") as tmp:
        hf, onnx_dir = Path(tmp) / "hf", Path(tmp) / "onnx"
        model.save_pretrained(hf)
        del model
        onnx_dir.mkdir()
        export_to(hf, onnx_dir, WITH_PAST_TASK if with_past else "text-generation")
        return onnx.load_model(str(onnx_dir / MODEL_FILE), load_external_data=False)


def _set_widths(model: onnx.ModelProto, widths: dict[int, int]) -> None:
    """Replace the skeleton's sentinel widths by the real ones in the weight and output shapes,
    after checking that no node computes with them (else the skeleton's graph would differ)."""
    integer_types = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
    constants = [(t.name, t) for t in model.graph.initializer if t.data_type in integer_types]
    for node in model.graph.node:
        for attr in node.attribute:
            values = list(attr.ints) + ([attr.i] if attr.type == onnx.AttributeProto.INT else [])
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in integer_types:
                constants.append((node.name, attr.t))
            if set(values) & set(widths):
                raise RuntimeError(f"node {node.name} computes with a skeleton width {sorted(widths)}")
    for where, tensor in constants:
        if set(onnx.numpy_helper.to_array(tensor).ravel().tolist()) & set(widths):
            raise RuntimeError(f"{where} holds a skeleton width {sorted(widths)}: the graph depends on it")
    for tensor in model.graph.initializer:
        tensor.dims[:] = [widths.get(d, d) for d in tensor.dims]
    for value in (*model.graph.output, *model.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value in widths:
                dim.dim_value = widths[dim.dim_value]


def _in_layer(name: str, layer: int) -> bool:
    return f"/layers.{layer}/" in name


class _FreshNames:
    """Unique names for copies of torch's anonymous tensors and nodes (``Constant_812``,
    ``onnx::MatMul_901``): the name without its number, then a number no name uses yet."""

    def __init__(self, graph: onnx.GraphProto):
        self.used = {n.name for n in graph.node} | {t.name for t in graph.initializer}
        self.used |= {o for n in graph.node for o in n.output} | {v.name for v in graph.input}
        numbers = [int(m.group(1)) for name in self.used if (m := re.search(r"_(\d+)$", name))]
        self.next = max(numbers, default=0) + 1

    def __call__(self, name: str) -> str:
        base = re.sub(r"_?\d+$", "", name) or "tensor"
        while f"{base}_{self.next}" in self.used:
            self.next += 1
        fresh = f"{base}_{self.next}"
        self.used.add(fresh)
        self.next += 1
        return fresh


class _LayerTemplate:
    """Layer 1 of the skeleton: its nodes (one contiguous run), the initializers only it reads,
    the residual stream it reads from layer 0 (``stream_in``) and hands on (``stream_out``)."""

    def __init__(self, graph: onnx.GraphProto):
        nodes = list(graph.node)
        consumers: dict[str, list[int]] = {}
        for index, node in enumerate(nodes):
            for name in node.input:
                consumers.setdefault(name, []).append(index)
        members = {i for i, node in enumerate(nodes) if _in_layer(node.name, 1)}
        for index, node in enumerate(nodes):  # the anonymous Constant nodes torch emits per layer
            users = [c for out in node.output for c in consumers.get(out, [])]
            if not node.input and "/layers." not in node.name and users and all(u in members for u in users):
                members.add(index)
        self.first, self.last = min(members), max(members)
        if len(members) != self.last - self.first + 1:
            raise RuntimeError("layer 1 of the skeleton is not one contiguous run of nodes")
        self.nodes = nodes[self.first:self.last + 1]
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for node in self.nodes for a in node.attribute):
            raise RuntimeError("layer 1 of the skeleton holds subgraphs; copying them is not supported")
        self.before, self.after = nodes[:self.first], nodes[self.last + 1:]

        self.produced = {out for node in self.nodes for out in node.output}
        reads = {name for node in self.nodes for name in node.input}
        outside_reads = {name for node in (*self.before, *self.after) for name in node.input}
        # a KV-cache graph: layer 1 reads its past entries and writes its present ones (graph I/O of its own)
        self.cache_inputs = [v for v in graph.input if _cache_layer(v.name) == 1]
        self.cache_outputs = [v for v in graph.output if _cache_layer(v.name) == 1]
        own_outputs = {v.name for v in self.cache_outputs}
        handed_on = sorted(self.produced & (outside_reads | {o.name for o in graph.output}) - own_outputs)
        if len(handed_on) != 1 or not _in_layer(handed_on[0], 1):
            raise RuntimeError(f"layer 1 of the skeleton should hand one tensor on, it hands {handed_on}")
        self.stream_out = handed_on[0]
        self.stream_in = self.stream_name(0)
        if self.stream_in not in reads:
            raise RuntimeError(f"layer 1 of the skeleton does not read {self.stream_in}")
        self.initializers = [t for t in graph.initializer if t.name in reads and t.name not in outside_reads]

    def stream_name(self, layer: int) -> str:
        """The residual stream that layer ``layer`` hands on."""
        return self.stream_out.replace("/layers.1/", f"/layers.{layer}/")

    def copy(self, layer: int, fresh: _FreshNames) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
        """Layer ``layer`` (>= 1): the template's nodes and initializers renamed, reading the
        residual stream of layer ``layer - 1`` and whatever else the template reads (shared)."""
        renamed = {self.stream_in: self.stream_name(layer - 1)}
        renamed.update({v.name: _cache_name(v.name, layer) for v in (*self.cache_inputs, *self.cache_outputs)})
        for name in (*self.produced, *(t.name for t in self.initializers), *(n.name for n in self.nodes)):
            if name in renamed:
                continue
            if "/layers.1/" in name or ".layers.1." in name:
                renamed[name] = name.replace("/layers.1/", f"/layers.{layer}/").replace(".layers.1.", f".layers.{layer}.")
            elif name:
                renamed[name] = fresh(name)
        nodes = []
        for node in self.nodes:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = renamed.get(node.name, node.name)
            copy.input[:] = [renamed.get(name, name) for name in node.input]
            copy.output[:] = [renamed[name] for name in node.output]
            nodes.append(copy)
        initializers = []
        for tensor in self.initializers:
            copy = onnx.TensorProto()
            copy.CopyFrom(tensor)
            copy.name = renamed[tensor.name]
            initializers.append(copy)
        return nodes, initializers


def _cache_layer(name: str) -> int | None:
    """The layer of a KV-cache graph input or output (``past_key_values.3.key``, ``present.3.value``)."""
    m = re.fullmatch(r"(?:past_key_values|present)\.(\d+)\.(?:key|value)", name)
    return int(m.group(1)) if m else None


def _cache_name(name: str, layer: int) -> str:
    prefix, _, kind = name.split(".")
    return f"{prefix}.{layer}.{kind}"


def _cache_io(values, template: list, layers: int) -> list:
    """Graph inputs or outputs with layer 1's cache entries replaced by one set per layer 1..L-1,
    in layer order (where layer 1's stood)."""
    out, done = [], False
    for v in values:
        if _cache_layer(v.name) != 1:
            out.append(v)
        elif not done:
            done = True
            for layer in range(1, layers):
                for t in template:
                    copy = onnx.ValueInfoProto()
                    copy.CopyFrom(t)
                    copy.name = _cache_name(t.name, layer)
                    out.append(copy)
    return out


def _replicate_layers(graph: onnx.GraphProto, layers: int) -> None:
    """Turn the 2-layer skeleton ``graph`` into ``layers`` layers, in place: layer 0 stays, layer 1
    is the template of layers 1..layers-1 (so it is dropped when ``layers`` is 1)."""
    template = _LayerTemplate(graph)
    if template.cache_inputs or template.cache_outputs:
        for field, own in ((graph.input, template.cache_inputs), (graph.output, template.cache_outputs)):
            values = _cache_io(list(field), own, layers)
            copies = [onnx.ValueInfoProto.FromString(v.SerializeToString()) for v in values]
            del field[:]
            field.extend(copies)
    fresh = _FreshNames(graph)
    nodes, initializers = [], []
    for layer in range(1, layers):
        layer_nodes, layer_initializers = template.copy(layer, fresh)
        nodes += layer_nodes
        initializers += layer_initializers
    last_stream = template.stream_name(layers - 1)
    for node in template.after:
        node.input[:] = [last_stream if name == template.stream_out else name for name in node.input]
    for output in graph.output:
        if output.name == template.stream_out:
            output.name = last_stream
    dropped = {t.name for t in template.initializers}
    kept = [t for t in graph.initializer if t.name not in dropped]
    # extend copies the messages: append the new lists, then delete the old entries in front
    old_nodes, old_initializers = len(graph.node), len(graph.initializer)
    graph.node.extend([*template.before, *nodes, *template.after])
    del graph.node[:old_nodes]
    graph.initializer.extend([*kept, *initializers])
    del graph.initializer[:old_initializers]


def _weight_roles(graph: onnx.GraphProto) -> dict[str, str]:
    """Initializer name -> how to draw it: "linear", "embedding", "norm" or "bias"; initializers
    that are none of these (integer constants) keep the skeleton's values."""
    roles = {}
    floats = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    for node in graph.node:
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in floats:
            roles[node.input[1]] = "linear"
        elif node.op_type == "Gather" and node.input[0] in floats:
            roles[node.input[0]] = "embedding"
    for tensor in graph.initializer:
        if tensor.name in floats and tensor.name not in roles and len(tensor.dims) == 1:
            leaf = tensor.name.rsplit(".", 1)[-1]
            if "norm" in tensor.name:
                roles[tensor.name] = "norm"
            elif leaf == "bias":
                roles[tensor.name] = "bias"
    return roles


def _write_random_weights(model: onnx.ModelProto, out: Path, rng: np.random.Generator, std: float) -> None:
    """Draw every weight of ``model`` into ``out/model.onnx.data`` and point its initializer there.

    One chunk of at most ``_CHUNK_ELEMENTS`` floats is in memory at a time; each tensor starts at
    a multiple of 4096 bytes.
    """
    roles = _weight_roles(model.graph)
    draws = {"linear": (0.0, std), "embedding": (0.0, std), "norm": (1.0, _NORM_SPREAD), "bias": (0.0, _BIAS_STD)}
    with open(out / DATA_FILE, "wb") as data:
        for tensor in model.graph.initializer:
            role = roles.get(tensor.name)
            if role is None:
                continue
            mean, spread = draws[role]
            offset = -(-data.tell() // _ALIGN) * _ALIGN
            data.write(b"\0" * (offset - data.tell()))
            count = int(np.prod(tensor.dims, dtype=np.int64))
            for start in range(0, count, _CHUNK_ELEMENTS):
                chunk = rng.standard_normal(min(_CHUNK_ELEMENTS, count - start), dtype=np.float32)
                chunk *= np.float32(spread)
                chunk += np.float32(mean)
                # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
                data.write(memoryview(chunk.astype("<f4", copy=False)))  # type: ignore[arg-type]
            tensor.ClearField("raw_data")
            tensor.ClearField("float_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            for key, value in (("location", DATA_FILE), ("offset", offset), ("length", count * 4)):
                tensor.external_data.add(key=key, value=str(value))
