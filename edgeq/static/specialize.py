"""A decoder with a KV cache, specialized into the static prefill and decode graphs NPUs run.

The with-past export (``edgeq export ... --with-past``) is one dynamic graph: its cache grows by
concatenation and its masks, positions and reshapes are computed at run time from ``Shape`` nodes.
NPU compilers (QNN, OpenVINO NPU, vendor SDKs) take only fixed shapes, so ``specialize`` fixes
every input dimension and folds the shape machinery away at compile time:

- batch 1, ``W`` new tokens per run (``W = prefill`` for the prompt processor, 1 for the token
  generator) and a cache of ``context`` slots per layer: ``past_key_values.{i}.key`` /
  ``.value`` [1, H, C, D] fixed-size, ``attention_mask`` [1, C + W], ``position_ids`` [1, W];
- onnx shape inference (with data propagation) gives every tensor its static shape, and
  onnx-graphsurgeon's constant folding turns ``Shape`` / ``Range`` / ``ConstantOfShape`` /
  ``Gather`` chains into constants; it repeats until nothing changes. Quantize/Dequantize nodes,
  non-standard domains and nodes reading a large constant are never folded, so the weights stay
  as the recipe wrote them (and stay byte-identical between the two graphs);
- the ``Where(IsNaN(softmax), 0, softmax)`` guard the exporter puts after every attention softmax
  (for rows with every key masked) is removed: under the contract below every query attends at
  least to itself, so no row is fully masked and the guard never fires. ``IsNaN`` is outside
  NPU op sets;
- each ``present.{i}.*`` output becomes the new entries only ([1, H, W, D], the last input of the
  cache ``Concat``) instead of the whole concatenated cache;
- grouped-query attention reads the cache once per KV head instead of repeating it for every
  query head (``edgeq.static.grouped_attention``, exact).

Why the host writes the new entries (instead of an in-graph ScatterND at the position): a graph
that updates the cache must take the whole cache in and return the whole cache out every step
(C slots per layer copied twice per token), while a graph that returns only the new rows moves W
rows out and the host writes them into the buffer it owns anyway, in place. Qualcomm's and
Intel's LLM pipelines do the same (the runtime owns the KV buffers).

The cache layout (the contract ``edgeq generate`` and an app code against): slots 0..pos-1 hold
the keys/values of the tokens so far (keys after rotary embedding, as the model computes them);
``attention_mask[:, :C]`` is 1 on those slots and 0 on the rest, ``attention_mask[:, C:]`` is 1 on
the real tokens of this run and 0 on padding; ``position_ids`` = pos + arange(W). The exporter's
causal mask compares key index with query index in the concatenated [cache; new] sequence, so
every cache slot precedes every new token and new tokens see each other causally: the result is
the dynamic graph's, up to the order of float sums over the masked slots.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import shape_inference

from edgeq.graph import ir
from edgeq.errors import UserInputError
from edgeq.graph.facts import STATIC
from edgeq.passmanager.stages import StageOptions, StageRecord, check_stage_output
from edgeq.static.grouped_attention import group_queries
from edgeq.kv_cache import PAST_PREFIX, PRESENT_PREFIX

ROLES = ("prefill", "decode")
FORBIDDEN_OPS = ("Shape", "Range", "ConstantOfShape", "NonZero", "If", "Loop", "IsNaN")
_NEVER_FOLD = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")
_LARGE_CONSTANT = 1 << 16  # elements: a node reading a weight this large is never folded (no weight copies)
_FOLD_ROUNDS = 6
_PAST_RE = re.compile(rf"^{re.escape(PAST_PREFIX)}(\d+)\.(key|value)$")


@dataclass(frozen=True)
class StaticShape:
    """What ``--static prefill=S,context=C`` asks for, and the cache it implies."""

    prefill: int
    context: int
    layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    cache_dtype: str = "float32"

    def width(self, role: str) -> int:
        return self.prefill if role == "prefill" else 1

    def metadata(self, role: str) -> str:
        return STATIC.encode({"role": role, **asdict(self)})


def parse_static(text: str) -> tuple[int, int]:
    """``prefill=128,context=1024`` -> (128, 1024); anything else is a one-line error."""
    fields = {}
    for part in (text or "").split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("prefill", "context") or key.strip() in fields:
            raise UserInputError(f"--static expects prefill=N,context=M (e.g. prefill=128,context=1024), got '{text}'")
        try:
            fields[key.strip()] = int(value)
        except ValueError:
            raise UserInputError(f"--static: {key.strip()} must be an integer, got '{value}'") from None
    if set(fields) != {"prefill", "context"}:
        raise UserInputError(f"--static needs both prefill=N and context=M, got '{text}'")
    prefill, context = fields["prefill"], fields["context"]
    if prefill < 1 or context < 2 or prefill >= context:
        raise UserInputError(f"--static needs 1 <= prefill < context, got prefill={prefill}, context={context}")
    return prefill, context


def cache_layout(model: onnx.ModelProto, prefill: int, context: int) -> StaticShape:
    """The cache a with-past decoder needs, read from its inputs; a graph that is not one is a
    one-line error naming what to export instead."""
    names = {vi.name: vi for vi in model.graph.input}
    token = "inputs_embeds" if "inputs_embeds" in names else "input_ids"  # (a VLM's language graph: edgeq.static.vlm)
    missing = [n for n in (token, "attention_mask", "position_ids") if n not in names]
    pasts = {}
    for name, vi in names.items():
        match = _PAST_RE.match(name)
        if match:
            dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
            if len(dims) != 4 or dims[1] is None or dims[3] is None:
                raise UserInputError(f"--static: cache input {name} has shape {dims}, expected [batch, kv_heads, past, head_dim]")
            pasts[(int(match.group(1)), match.group(2))] = (dims[1], dims[3])
    if pasts and missing == ["position_ids"]:
        raise UserInputError("--static needs the token positions as an input (position_ids), and this KV-cache graph "
                             "derives them inside from the cache length, which a fixed-size cache makes wrong (optimum "
                             "exports Gemma this way): not supported yet; --static takes exports with position_ids "
                             "(edgeq export smollm2 --with-past, tiny llama/qwen2/gpt2 --with-past)")
    if not pasts or missing:
        what = f"inputs {', '.join(missing)} missing" if missing else "no past_key_values.{i}.key/.value inputs"
        raise UserInputError(f"--static needs a decoder exported with a KV cache ({what}): "
                             "export it with `edgeq export ... --with-past`")
    layers = sorted({i for i, _ in pasts})
    if layers != list(range(len(layers))) or len(pasts) != 2 * len(layers) or len(set(pasts.values())) != 1:
        raise UserInputError("--static: the cache inputs are not one key and one value of the same shape per layer")
    outputs = {o.name for o in model.graph.output}
    lacking = [f"{PRESENT_PREFIX}{i}.{kv}" for i in layers for kv in ("key", "value")
               if f"{PRESENT_PREFIX}{i}.{kv}" not in outputs]
    if "logits" not in outputs or lacking:
        raise UserInputError(f"--static: the graph lacks outputs {', '.join((['logits'] if 'logits' not in outputs else []) + lacking[:2])}")
    heads, dim = next(iter(pasts.values()))
    return StaticShape(prefill, context, len(layers), heads, dim)


class _Stages:
    """Runs the named stages of one graph's specialization and records each (``StageRecord``)."""

    def __init__(self, role: str, options: StageOptions | None, records: list[StageRecord] | None):
        self.role, self.options, self.records = role, options or StageOptions(), records

    def run(self, name: str, graph: gs.Graph, step) -> None:
        before = collections.Counter(n.op for n in graph.nodes)
        started = time.perf_counter()
        step(graph)
        record = StageRecord.between(name, started, before, collections.Counter(n.op for n in graph.nodes))
        if self.options.active:
            record.verified = self._check(name, graph)
        if self.records is not None:
            self.records.append(record)

    def _check(self, name: str, graph: gs.Graph) -> bool | None:
        # (a copy, cleaned and its shapes inferred as the last step does: a stage may leave nodes it
        # disconnected, and the cache entries it makes outputs have their shapes only then)
        model = _with_static_shapes(ir.to_model(graph.copy().cleanup(remove_unused_graph_inputs=False).toposort()))
        return check_stage_output(model, name, f"static-{self.role}", self.options, 1 + len(self.records or []))


def specialize(model: onnx.ModelProto, shape: StaticShape, role: str,
               kv_scales: dict[str, float] | None = None, records: list[StageRecord] | None = None,
               options: StageOptions | None = None) -> onnx.ModelProto:
    """The static ``role`` graph (prefill or decode) of a with-past decoder; ``model`` is not
    changed (the result holds its own copy of the weights). ``kv_scales`` (``{i}.key`` -> scale):
    an int8 cache (``edgeq.static.kv_cache_int8``). Each step after the shapes are fixed and
    folded is a named stage, recorded into ``records`` (``StageRecord``)."""
    width = shape.width(role)
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    _fix_io_shapes(fixed.graph, width, shape.context)
    stages = _Stages(role, options, records)
    started = time.perf_counter()
    graph = _fold(fixed)  # (the fold imports the graph: the ops before it are the input model's)
    del fixed
    if records is not None:
        records.append(StageRecord.between("fix-shapes-and-fold", started,
                                           collections.Counter(n.op_type for n in model.graph.node),
                                           collections.Counter(n.op for n in graph.nodes)))
    stages.run("drop-nan-guards", graph, _drop_nan_guards)
    stages.run("new-entries-as-outputs", graph, _new_entries_as_outputs)
    stages.run("group-queries", graph, group_queries)
    if kv_scales:
        from edgeq.static.kv_cache_int8 import quantize_cache

        stages.run("quantize-cache", graph, lambda g: quantize_cache(g, kv_scales))
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    out = _with_static_shapes(ir.to_model(graph))
    ir.set_metadata(out, STATIC.key, shape.metadata(role))
    return out


def _set_dims(vi: onnx.ValueInfoProto, dims: list[int | None]) -> None:
    for d, value in zip(vi.type.tensor_type.shape.dim, dims):
        if value is not None:
            d.Clear()
            d.dim_value = value


def _fix_io_shapes(graph: onnx.GraphProto, width: int, context: int) -> None:
    for vi in graph.input:
        if vi.name in ("input_ids", "position_ids"):
            _set_dims(vi, [1, width])
        elif vi.name == "inputs_embeds":
            _set_dims(vi, [1, width, None])
        elif vi.name == "attention_mask":
            _set_dims(vi, [1, context + width])
        elif _PAST_RE.match(vi.name):
            _set_dims(vi, [1, None, context, None])
    for vi in graph.output:  # re-inferred after folding
        vi.type.tensor_type.ClearField("shape")
    del graph.value_info[:]


@contextlib.contextmanager
def _quiet_onnxruntime():
    """graphsurgeon folds through onnxruntime sessions, whose optimizer warns about every
    Unsqueeze it cannot remove; those lines are not the user's concern."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    try:
        yield
    finally:
        ort.set_default_logger_severity(2)


def _never_fold(node: gs.Node) -> bool:
    if node.op in _NEVER_FOLD or node.domain not in (None, "", "ai.onnx"):
        return True
    return any(isinstance(t, gs.Constant) and int(np.prod(t.shape or [1])) > _LARGE_CONSTANT for t in node.inputs)


def _fold(model: onnx.ModelProto) -> gs.Graph:
    """Shape inference and constant folding until the node count stops falling."""
    graph = ir.to_graph(infer_shapes(model))
    before = None
    with _quiet_onnxruntime():
        for _ in range(_FOLD_ROUNDS):
            graph.fold_constants(fold_shapes=True, size_threshold=_LARGE_CONSTANT * 4,
                                 should_exclude_node=_never_fold)
            _fold_ranges(graph)
            _fold_constant_shapes(graph)
            graph.cleanup(remove_unused_graph_inputs=False)
            if len(graph.nodes) == before:
                break
            before = len(graph.nodes)
            graph = ir.to_graph(infer_shapes(ir.to_model(graph)))
    return graph


def _fold_constant_shapes(graph: gs.Graph) -> None:
    """``Shape`` of a constant -> its shape. A constant too large to fold through (a dense 8192 x 8192
    online Hadamard, 256 MB, on Llama-3.2-1B's MLP) keeps its ``Shape`` reader out of the folding,
    which would otherwise copy it through onnxruntime (and, block-wise, read it from its file)."""
    for node in graph.nodes:
        if node.op != "Shape" or not node.outputs or not isinstance(node.inputs[0], gs.Constant):
            continue
        dims = np.array(node.inputs[0].shape, dtype=np.int64)
        rank = len(dims)
        start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
        out = node.outputs[0]
        _bypass(graph, out, gs.Constant(f"{out.name}/folded", dims[start:end]))


def _fold_ranges(graph: gs.Graph) -> None:
    """``Range`` on constant inputs -> its constant, whatever its length. graphsurgeon folds only
    outputs under ``size_threshold`` bytes, and the positions Range of a cache of C slots holds
    C + W int64 values: past C + W = 32768 it would stay in the graph (an op NPUs lack), while as a
    constant it is one row of C + W values, small beside the weights."""
    for node in graph.nodes:
        if node.op != "Range" or not node.outputs or not all(isinstance(t, gs.Constant) for t in node.inputs):
            continue  # (a node without outputs was folded already)
        start, limit, delta = (np.asarray(t.values).reshape(()) for t in node.inputs)
        out = node.outputs[0]
        values = np.arange(start, limit, delta).astype(start.dtype)  # type: ignore[call-overload]  # (0-d arrays)
        _bypass(graph, out, gs.Constant(f"{out.name}/folded", values))


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx shape inference with data propagation, and onnxruntime's symbolic inference when an
    op of another domain has no onnx shape function (com.microsoft's MatMulNBits after
    gptq-w4a16): without it nothing after that op gets a shape, and no Shape node there folds."""
    inferred = shape_inference.infer_shapes(model, data_prop=True)
    g = inferred.graph
    shaped = {vi.name for vi in (*g.value_info, *g.output) if vi.type.tensor_type.HasField("shape")}
    if any(o and o not in shaped for n in g.node if n.domain not in ("", "ai.onnx") for o in n.output):
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        # on failure it saves the model into the working directory: give it a scratch one
        cwd = os.getcwd()
        with tempfile.TemporaryDirectory(prefix="edgeq-shapes-") as scratch:
            os.chdir(scratch)
            try:
                inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=False)
            except Exception:  # noqa: BLE001 (it refuses graphs it cannot finish; onnx's result stands)
                pass
            finally:
                os.chdir(cwd)
    return inferred


def _drop_nan_guards(graph: gs.Graph) -> None:
    """``Where(IsNaN(x), 0, x)`` -> ``x`` (see the module docstring for why this is exact here)."""
    for node in [n for n in graph.nodes if n.op == "Where"]:
        cond, fill, value = node.inputs
        guard = cond.inputs[0] if cond.inputs else None
        if guard is None or guard.op != "IsNaN" or guard.inputs[0] is not value:
            continue
        if not isinstance(fill, gs.Constant) or np.any(fill.values != 0):
            continue
        _bypass(graph, node.outputs[0], value)


def _bypass(graph: gs.Graph, old: gs.Variable, new: gs.Tensor) -> None:
    """Every reader of ``old`` reads ``new`` instead (``old`` must not be a graph output)."""
    for consumer in list(old.outputs):
        consumer.inputs = [new if t is old else t for t in consumer.inputs]
    old.inputs.clear()


def _new_entries_as_outputs(graph: gs.Graph) -> None:
    """``present.{i}.*`` = the new rows: the last input of the cache Concat, through an Identity
    (the Concat's own result stays inside, feeding attention)."""
    outputs = []
    for out in graph.outputs:
        if not out.name.startswith(PRESENT_PREFIX):
            outputs.append(out)
            continue
        concat = out.inputs[0] if out.inputs else None
        if concat is None or concat.op != "Concat" or len(concat.inputs) != 2 or not _PAST_RE.match(_source_name(concat.inputs[0])):
            raise UserInputError(f"--static: {out.name} is not a concatenation of the past cache and new entries; "
                                 "this decoder's cache layout is not supported")
        out.name = f"{out.name}.full"
        new_rows = gs.Variable(out.name[: -len(".full")], dtype=out.dtype)
        graph.nodes.append(gs.Node("Identity", name=f"{new_rows.name}/new_rows", inputs=[concat.inputs[1]], outputs=[new_rows]))
        outputs.append(new_rows)
    graph.outputs = outputs


def _source_name(tensor: gs.Tensor) -> str:
    """The graph input a tensor comes from through single-input nodes (a Dequantize of the cache)."""
    while tensor.inputs and tensor.inputs[0].inputs:
        tensor = tensor.inputs[0].inputs[0]
    return tensor.name


def _with_static_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shapes inferred onto every value (onnxruntime's symbolic inference where onnx lacks an
    op's shape function, e.g. MatMulNBits); a dimension left symbolic or unknown is a bug here."""
    inferred = infer_shapes(model)
    left = unknown_shapes(inferred)
    forbidden = sorted({n.op_type for n in inferred.graph.node if n.op_type in FORBIDDEN_OPS})
    if left or forbidden:
        raise RuntimeError(f"static specialization left {len(left)} values without a static shape "
                           f"({', '.join(left[:3])}) and ops {forbidden}")
    return inferred


def build_pair(model: onnx.ModelProto, shape: StaticShape, kv_scales: dict[str, float] | None = None,
               weights_dir: Path | None = None, prepare=None, records: dict[str, list[StageRecord]] | None = None,
               options: StageOptions | None = None) -> dict[str, onnx.ModelProto]:
    """``{"prefill.onnx": ..., "decode.onnx": ...}`` from one compiled with-past graph.
    ``weights_dir``: where its initializers stored as external data are (a block-wise compile's
    weights file); the weights stay there, referenced by both graphs, and only the constants
    small enough to fold are read in (the folding runs them through onnxruntime from memory).
    ``prepare(model, role)``: the graph each role is specialized from, where it differs per role
    (a VLM's fixed visual slice: ``edgeq.static.vlm``). ``records``: each graph's stages
    (``StageRecord``), by graph file name."""
    from edgeq.runtime.progress import progress

    if weights_dir is not None:
        _read_in_foldable(model, weights_dir)

    pair = {}
    for role in progress(ROLES, desc="static graphs"):
        stages = records.setdefault(f"{role}.onnx", []) if records is not None else None
        pair[f"{role}.onnx"] = specialize(prepare(model, role) if prepare else model, shape, role, kv_scales,
                                          stages, options)
    return pair


def fold_static(model: onnx.ModelProto, drop_nan_guards: bool = False) -> onnx.ModelProto:
    """``model`` (its inputs' shapes fixed by the caller) with its shape machinery folded and every
    value's shape static, as ``specialize`` leaves a decoder: for graphs beside the pair (a VLM's
    vision graph at batch 1), or a decoder without a cache at a fixed shape. ``drop_nan_guards``:
    also drop the exporter's ``Where(IsNaN(softmax))`` guards, as ``specialize`` does (exact when no
    attention row is fully masked). ``model`` is changed."""
    for vi in model.graph.output:
        vi.type.tensor_type.ClearField("shape")
    del model.graph.value_info[:]
    graph = _fold(model)
    if drop_nan_guards:
        _drop_nan_guards(graph)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return _with_static_shapes(ir.to_model(graph))


def _read_in_foldable(model: onnx.ModelProto, weights_dir: Path) -> None:
    """External initializers under ``_LARGE_CONSTANT`` elements read into the graph: the only ones
    the folding may evaluate (a node reading a larger one is never folded)."""
    from edgeq.graph.ir import external_bytes

    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL and int(np.prod(tensor.dims, dtype=np.int64)) < _LARGE_CONSTANT:
            tensor.raw_data = external_bytes(tensor, weights_dir)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT


def unknown_shapes(model: onnx.ModelProto) -> list[str]:
    """Names of the values (inputs, outputs, intermediates) whose shape is not fully static."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    known = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        known[vi.name] = tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim)
    names = [o for n in g.node for o in n.output if o] + [vi.name for vi in g.input if vi.name not in inits]
    return [n for n in names if not known.get(n, False)]


def check_static(model: onnx.ModelProto) -> list[str]:
    """One line per way ``model`` is not static: a value without a static shape (after shape
    inference), or a forbidden op. Empty for a graph an NPU compiler takes."""
    inferred = infer_shapes(model)
    lines = [f"{name}: shape not static" for name in unknown_shapes(inferred)]
    lines += [f"{n.name or n.op_type}: {n.op_type} is not allowed in a static graph" for n in model.graph.node
              if n.op_type in FORBIDDEN_OPS]
    return lines


def describe(model: onnx.ModelProto) -> dict:
    """The ``edgeq.static`` metadata of a specialized graph (or {})."""
    for prop in model.metadata_props:
        if prop.key == STATIC.key:
            return json.loads(prop.value)
    return {}
