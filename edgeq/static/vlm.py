"""``compile --static`` of a vision-language model: the visual span at a fixed slice of the prefill.

A VLM's language graph (``edgeq export trained-vlm``'s ``with-past/model.onnx``) takes
``inputs_embeds`` with the visual tokens somewhere inside and says where through ``visual_start`` /
``visual_len``; MSQ finds its visual rows from those inputs in the graph, AIFS reorders the rows
visual-first in the graph. An NPU compiles one shape, and MQuant's point is that per-modality
scales are then a *static* slice. So the static deployment fixes the layout instead of computing it:

- ``prefill.onnx`` takes ``inputs_embeds`` [1, P, hidden] in AIFS order: rows ``[0, V)`` are the
  visual tokens (``vision.onnx``'s output, V of them), rows ``[V, V + n)`` the prompt's text tokens
  in their order, padding after them. ``position_ids`` carry each row's *original* position (the
  visual rows ``m .. m + V - 1`` where the image sits at ``m`` in the prompt, the text rows theirs),
  so RoPE sees the original sequence (MQuant appendix A.2);
- the causal mask compares those positions instead of the row indices (Eq. 5 of MQuant in its
  general form: row i attends row j iff ``position_j <= position_i``): the exporter's comparison
  of two ``Range`` index tensors is rewired once, on the compiled graph, to read ``position_ids``
  for the new rows (cache slots keep their slot index, below every new position under the static
  cache contract). For text-only runs (positions ``pos + arange(W)``) it is the exporter's mask;
- MSQ's is-visual tensor (``visual_mask`` of its marker: which rows get the visual scale) becomes
  a constant: rows ``[0, V)`` in the prefill graph, none in ``decode.onnx`` (text tokens, text
  scales). The per-row gains then fold into constants: no span input, no run-time slicing;
- the recipe's ``aifs`` pass is not run: the fixed layout *is* its reorder (the dynamic graph's
  in-graph permutation reads the padding of an ``attention_mask`` that under the cache contract
  marks cache slots). MSQ then calibrates on the export's calibration samples in their original
  order, which gives each site the same visual and text statistics (every per-token op is row-wise);
- a recipe with ``msq`` but no ``aifs`` (MSQ without AIFS) keeps the prompt's order instead
  (``order: original``): the image at its prompt position ``m`` (the one position every question
  of the export's ``vqa_eval.npz`` puts it at; refused otherwise), MSQ's visual scale on prefill
  rows ``[m, m + V)``, ``position_ids`` 0, 1, ...: the same scales on the same tokens, but one
  compiled graph serves that image position only (AIFS's layout serves any);
- ``vision.onnx`` from the export folder, at batch 1 with its shapes folded (static), goes beside the
  pair over the same weights file, with the embedding table (``embed_tokens.npy``: the host embeds
  text tokens) and the evaluation questions (``vqa_eval.npz``).

Prompts whose text runs past the prefill window continue through ``decode.onnx`` one token at a
time (``edgeq.generation.vlm_pair``); a prompt needs ``P >= V +`` its text tokens before the image.
What the compile refuses (one line, exit 2, before any work): a graph without visual span inputs or
without ``vision.onnx`` beside it, a prefill with no room for a text token after the visual span,
calibration samples whose visual span is not the vision graph's token count, an MSQ lowering that
needs the in-graph AIFS (``custom``), a pass this layout cannot fix (``kvquant``), and block-wise,
split or shared-weights forms (not built for VLMs).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from edgeq.errors import UserInputError
from edgeq.files.npzfile import NumpyFileError, read_npz
from edgeq.files.vlm_folder import EMBED_TABLE_FILE, QUESTIONS_FILE, VISION_FILE
from edgeq.graph import facts, ir
from edgeq.modality_mask import span_input_names

VLM_KEY = "edgeq.static_vlm"  # metadata of the three graphs: the fixed layout (json)
DROPPED_PASSES = ("aifs",)  # realized by the fixed layout
REFUSED_PASSES = {"kvquant": "its packed visual cache is a dynamic-graph form"}
_CAUSAL = ("LessOrEqual", "GreaterOrEqual")


@dataclass(frozen=True)
class StaticVlm:
    """The fixed layout of a static VLM deployment and where its vision side comes from."""

    vision: Path  # the export's vision.onnx
    image_size: int
    visual_tokens: int  # V: prefill rows [0, V) are visual
    hidden: int
    prefill: int
    side_files: tuple[Path, ...]  # embed_tokens.npy, vqa_eval.npz (when the export has it)
    dropped: tuple[str, ...]  # recipe passes the layout realizes
    order: str = "aifs"  # "aifs": visual rows [0, V); "original": the prompt's order, the image at visual_start
    visual_start: int = 0  # m: the prefill's visual rows are [m, m + V)

    @property
    def visual_rows(self) -> list[int]:
        return [self.visual_start, self.visual_start + self.visual_tokens]

    def metadata(self) -> str:
        return json.dumps({"visual_rows": self.visual_rows, "visual_tokens": self.visual_tokens,
                           "image_size": self.image_size, "hidden": self.hidden, "vision": VISION_FILE,
                           "embed_table": EMBED_TABLE_FILE, "order": self.order}, sort_keys=True)

    def report(self) -> dict:
        """report.json's ``static.vlm``: where the span is and what realizes AIFS."""
        layout = ("prefill inputs_embeds rows [0, V) visual, then the prompt's text in order, padding last; "
                  "position_ids = original positions; causal mask on positions (AIFS, Eq. 5)") if self.order == "aifs" else \
            (f"prefill inputs_embeds in the prompt's order (no aifs in the recipe): the image at its prompt position, "
             f"rows [{self.visual_start}, {self.visual_start + self.visual_tokens}), text around it, padding last; "
             "position_ids = 0, 1, ...; every prompt must put its image there")
        return {"visual_rows": self.visual_rows, "visual_tokens": self.visual_tokens, "order": self.order,
                "image_size": self.image_size, "hidden": self.hidden, "vision": VISION_FILE,
                "source_vision": str(self.vision), "layout": layout,
                "passes_realized_by_layout": list(self.dropped),
                "msq_visual_rows": {"prefill.onnx": self.visual_rows, "decode.onnx": []}}


def is_vlm_graph(model: onnx.ModelProto) -> bool:
    """A language graph on embeddings with visual span inputs (the VLM exports' form)."""
    names = {i.name for i in model.graph.input}
    span = span_input_names({p.key: p.value for p in model.metadata_props})
    return "inputs_embeds" in names and all(n in names for n in span)


def plan_static_vlm(model_path: Path, model: onnx.ModelProto, recipe, prefill: int, calib: Path | None,
                    split: bool = False, shared: bool = False) -> tuple[StaticVlm, object]:
    """(the layout, the recipe as run: without the passes the layout realizes); every refusal
    of the module docstring, one line each (``UserInputError``)."""
    if split or shared:
        raise UserInputError("--max-context-mb and --share-weights are not built for a static VLM deployment")
    for spec in recipe.passes:
        if spec.name in REFUSED_PASSES:
            raise UserInputError(f"recipe '{recipe.name}': pass {spec.name} does not compile into a static VLM "
                                 f"deployment ({REFUSED_PASSES[spec.name]})")
        if spec.name == "msq" and getattr(spec.config, "lowering", "") == "custom":
            raise UserInputError(f"recipe '{recipe.name}': msq lowering 'custom' needs the in-graph AIFS order; the "
                                 "static VLM deployment fixes the visual slice: use lowering 'integer' or 'select'")
    folder = ir.model_folder(model_path)
    vision = next((f / VISION_FILE for f in (folder, folder.parent) if (f / VISION_FILE).is_file()), None)
    if vision is None:
        raise UserInputError(f"--static of a VLM needs its vision graph: no {VISION_FILE} in {folder} or "
                             f"{folder.parent} (export it again: edgeq export trained-vlm)")
    embed = next((f / EMBED_TABLE_FILE for f in (folder, folder.parent) if (f / EMBED_TABLE_FILE).is_file()), None)
    if embed is None:
        raise UserInputError(f"--static of a VLM needs the embedding table {EMBED_TABLE_FILE} beside {model_path}")
    size, tokens, hidden = _vision_shape(vision)
    embeds = next(i for i in model.graph.input if i.name == "inputs_embeds").type.tensor_type.shape.dim
    if embeds[2].dim_value and embeds[2].dim_value != hidden:
        raise UserInputError(f"{vision} gives visual tokens of width {hidden}, {model_path} takes inputs_embeds of "
                             f"width {embeds[2].dim_value}")
    if prefill < tokens + 1:
        raise UserInputError(f"--static prefill={prefill} is shorter than the visual span ({tokens} tokens of a "
                             f"{size}x{size} image) and one text token: use prefill >= {tokens + 1}")
    _check_calibration(calib, tokens, size)
    questions = next((f / QUESTIONS_FILE for f in (folder, folder.parent) if (f / QUESTIONS_FILE).is_file()), None)
    names = {s.name for s in recipe.passes}
    order, start = "aifs", 0
    if "msq" in names and "aifs" not in names:  # MSQ without AIFS: the visual scale at the image's own rows
        order, start = "original", _image_position(questions, recipe.name)
        if prefill < start + tokens + 1:
            raise UserInputError(f"--static prefill={prefill}: recipe '{recipe.name}' (msq without aifs) keeps the image "
                                 f"at prompt rows [{start}, {start + tokens}); use prefill >= {start + tokens + 1}")
    dropped = tuple(s.name for s in recipe.passes if s.name in DROPPED_PASSES)
    run = dataclasses.replace(recipe, passes=tuple(s for s in recipe.passes if s.name not in DROPPED_PASSES))
    layout = StaticVlm(vision, size, tokens, hidden, prefill, tuple(p for p in (embed, questions) if p), dropped,
                       order, start)
    return layout, run


def _image_position(questions: Path | None, recipe: str) -> int:
    """The one prompt position of the image in the export's questions (``vqa_eval.npz``): where a
    recipe with msq but without aifs fixes its visual rows (one compiled shape, one slice)."""
    from edgeq.files.vqa_questions import load_questions

    if questions is None:
        raise UserInputError(f"recipe '{recipe}' has msq without aifs: the static deployment keeps the image at its "
                             f"prompt position, read from the export's {QUESTIONS_FILE}, which is not beside the model; "
                             "add aifs to the recipe (visual rows first, any position)")
    q = load_questions(questions)
    starts = sorted({q.visual_span(i)[0] for i in range(len(q))})
    if len(starts) != 1:
        raise UserInputError(f"recipe '{recipe}' has msq without aifs, which fixes the image's prompt position, but "
                             f"{questions} puts it at positions {starts[:6]}: add aifs to the recipe")
    return starts[0]


def _vision_shape(vision: Path) -> tuple[int, int, int]:
    """(image size, visual tokens, hidden) of a vision graph, from its declared and inferred shapes."""
    from edgeq.static.specialize import infer_shapes

    model = ir.load_model(vision, load_external=False)
    (inp,) = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    dims = [d.dim_value or None for d in inp.type.tensor_type.shape.dim]
    if len(dims) != 4 or dims[1] is None or dims[1] != dims[2] or dims[3] != 3:
        raise UserInputError(f"{vision}: input {inp.name} must be pixels [batch, S, S, 3] with S fixed, got {dims}")
    _fix_batch(model)
    out = infer_shapes(model).graph.output[0]
    tokens, hidden = (d.dim_value for d in out.type.tensor_type.shape.dim[1:3])
    if not tokens or not hidden:
        raise UserInputError(f"{vision}: output {out.name} has no static [1, tokens, hidden] shape at batch 1")
    return dims[1], tokens, hidden


def _fix_batch(model: onnx.ModelProto) -> None:
    for vi in model.graph.input:
        dim = vi.type.tensor_type.shape.dim[0]
        dim.Clear()
        dim.dim_value = 1


def _check_calibration(calib: Path | None, tokens: int, size: int) -> None:
    """Calibration samples (an .npz of model inputs) must hold visual spans of the vision graph's
    token count: MSQ's visual statistics come from those rows."""
    if calib is None or Path(calib).suffix != ".npz" or not Path(calib).is_file():
        return
    try:
        lengths = read_npz(calib).get("visual_len")
    except NumpyFileError:
        return  # (the calibration loader names what is wrong with the file)
    if lengths is not None and np.any(np.asarray(lengths) != tokens):
        found = sorted({int(v) for v in np.asarray(lengths).reshape(-1)})
        raise UserInputError(f"{calib}: visual spans of {found} tokens, but the model's {size}x{size} images give "
                             f"{tokens}: calibration images of another size than the model's")


def static_vision(layout: StaticVlm, model: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """``vision.onnx`` at batch 1 with its shapes folded, carrying the layout's metadata, from
    ``model`` (the layout's vision graph, loaded; changed) or the file the layout names."""
    from edgeq.static.specialize import fold_static

    if model is None:
        model = ir.load_model(layout.vision)
    _fix_batch(model)
    out = fold_static(model)
    ir.set_metadata(out, VLM_KEY, layout.metadata())
    return out


def order_invariant_mask(model: onnx.ModelProto) -> onnx.ModelProto:
    """The compiled with-past graph with its causal comparison reading positions (see the module
    docstring): query rank = ``position_ids`` [1, 1, S, 1], key rank = the cache slots' indices
    then ``position_ids`` [1, 1, 1, past + S]. Batch 1 (what the static graphs are)."""
    graph = ir.to_graph(model)
    producers = {t.name: t.inputs[0] for t in graph.tensors().values() if t.inputs}
    found = [n for n in graph.nodes if n.op in _CAUSAL and all(_from_range(producers, t) for t in n.inputs)]
    if len(found) != 1:
        raise UserInputError(f"--static of a VLM: expected one causal comparison of index ranges in the attention mask, "
                             f"found {len(found)}; this language graph's mask is not supported")
    (cmp,) = found
    key_slot = 0 if cmp.op == "LessOrEqual" else 1  # key <= query / query >= key
    key_range = _from_range(producers, cmp.inputs[key_slot])
    assert key_range is not None  # (``found`` holds only comparisons whose inputs are both ranges)
    positions = next(t for t in graph.inputs if t.name == "position_ids")
    i64 = np.int64

    def node(op, inputs, dtype=i64, **attrs):
        out = gs.Variable(f"/static_vlm/{op}_{len(graph.nodes)}", dtype=dtype)
        graph.nodes.append(gs.Node(op, f"/static_vlm/{op}_{len(graph.nodes)}", attrs=attrs, inputs=inputs, outputs=[out]))
        return out

    def const(name, value):
        return gs.Constant(f"/static_vlm/{name}", np.asarray(value, i64))

    rank = node("Cast", [positions], to=onnx.TensorProto.INT64)
    seq = node("Gather", [node("Shape", [rank]), const("one", [1])], axis=0)  # [1]: S
    cache_slots = node("Slice", [node("Cast", [key_range.outputs[0]], to=onnx.TensorProto.INT64), const("zero", [0]),
                                 node("Neg", [seq]), const("axis0", [0])])  # [past]: the slot indices
    keys = node("Concat", [node("Unsqueeze", [cache_slots, const("axes0", [0])]), rank], axis=1)  # [1, past + S]
    dtype = cmp.inputs[key_slot].dtype
    cmp.inputs[key_slot] = node("Cast", [node("Unsqueeze", [keys, const("axes12", [1, 2])])], dtype=dtype,
                                to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype or i64)))
    cmp.inputs[1 - key_slot] = node("Cast", [node("Unsqueeze", [rank, const("axes13", [1, 3])])], dtype=dtype,
                                    to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype or i64)))
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return ir.to_model(graph)


def _from_range(producers: dict, tensor: gs.Tensor) -> gs.Node | None:
    """The ``Range`` node ``tensor`` is, through Unsqueeze/Cast/Reshape, if any."""
    node = producers.get(tensor.name)
    while node is not None and node.op in ("Unsqueeze", "Cast", "Reshape"):
        node = producers.get(node.inputs[0].name)
    return node if node is not None and node.op == "Range" else None


def role_graph(layout: StaticVlm, model: onnx.ModelProto, role: str) -> onnx.ModelProto:
    """The graph ``role`` is specialized from: MSQ's is-visual tensor replaced by the role's fixed
    rows (prefill ``[0, V)``, decode none), the span inputs gone, the layout in the metadata."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = ir.to_graph(out)
    del out
    width = layout.prefill if role == "prefill" else 1
    msq = facts.MSQ.get(graph) or {}
    if msq and "visual_mask" not in msq:
        raise UserInputError("--static of a VLM: this msq graph does not record its visual mask; compile it from the "
                             "float export in one compile")
    if "visual_mask" in msq:
        rows = np.zeros((1, width), bool)
        if role == "prefill":
            rows[0, layout.visual_start:layout.visual_start + layout.visual_tokens] = True
        mask = graph.tensors()[msq["visual_mask"]]
        fixed = gs.Constant(f"{mask.name}/{role}_rows", rows)
        for consumer in list(mask.outputs):
            consumer.inputs = [fixed if t is mask else t for t in consumer.inputs]
    span = set(span_input_names(ir.graph_metadata(graph)))
    graph.cleanup(remove_unused_graph_inputs=False)
    readers = {t.name for n in graph.nodes for t in n.inputs}
    left = [n for n in span if n in readers]
    if left:
        raise UserInputError(f"--static of a VLM: the compiled graph still reads {', '.join(left)} (a pass that "
                             "follows the span at run time); the fixed layout cannot replace it")
    graph.inputs = [t for t in graph.inputs if t.name not in span]
    ir.drop_graph_metadata(graph, facts.VISUAL_SPAN_INPUTS.key)  # the inputs it names are gone
    ir.set_graph_metadata(graph, VLM_KEY, layout.metadata())
    return ir.to_model(graph)
