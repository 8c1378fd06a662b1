"""A static pair's QNN context binaries as an onnxruntime-genai ``decoder-pipeline`` folder (``OUT/qnn``).

onnxruntime-genai runs EPContext models (the QNN HTP's prepared context binaries) through its
``decoder-pipeline`` model type, as Qualcomm AI Hub's genai export writes it
(``qai_hub_models/models/_shared/llm/onnxruntime_genai.py``): ``genai_config.json`` lists the
stages in order, each with ``filename``, ``inputs``, ``outputs``, ``session_options`` (the QNN
provider for the EPContext wrappers, none = CPU for the small helper graphs), ``run_on_prompt`` /
``run_on_token_gen``; the prompt goes through in chunks of ``sliding_window.window_size`` tokens.
Read from genai's ``src/config.cpp``, ``src/models/decoder_only_pipeline.cpp``,
``input_ids.cpp``, ``position_inputs.cpp``, ``kv_cache.cpp``, ``windowed_kv_cache.cpp``.

What genai feeds and what edgeq's graphs take differ, and two CPU stages bridge it:

* genai's windowed inputs (``sliding_window`` with ``slide_inputs``) left-pad the prompt to a
  multiple of the window with ``pad_token_id`` (alignment "right") and give each chunk
  ``position_ids`` (pads 0, real tokens 0, 1, ...) and a right-aligned ``attention_mask`` of
  ``context_length`` entries for a cache whose newest entries sit at its END. edgeq's contract:
  a cache whose slot p holds position p (left-aligned), ``attention_mask`` [1, C + W] (1 on slots
  0..pos-1 and on the real new tokens), ``position_ids`` = pos + arange(W). So genai's own mask is
  not used (its name points at no graph input, so genai makes none) and ``position-processor.onnx``
  computes edgeq's inputs from the last entry of genai's ``position_ids`` (the last real token's
  position): positions, mask, the int64 ``input_ids`` (pads replaced by 0) and the cache slots
  the chunk's new entries go to (pads to slots after the real ones, masked until overwritten).
* genai's windowed KV cache (``slide_key_value_cache``, AI Hub's choice) takes only uint8
  quantized caches laid out [H, 1, D, C - W] / [H, 1, C - W, D], right-aligned; edgeq's is float32
  [1, H, C, D] (``--static`` keeps the cache float unless the recipe quantizes it). So the window
  slides the inputs only (``slide_key_value_cache: false``) and genai keeps its default cache:
  the graphs' fixed ``past_key_values.{i}.*`` [1, H, C, D] make it allocate one buffer of C slots
  per tensor shared between past and present (``past_present_share_buffer``, which genai forces
  for fixed cache shapes). The graphs' ``present.{i}.*`` are the NEW entries only [1, H, W, D],
  not genai's whole present cache, so genai's present names point at ``kv-writer.onnx``'s
  outputs, which scatters the new entries into the shared buffer at their slots (in place).

Limits that follow: batch 1, greedy or sampled search without beams, at most C tokens in all
(``search.max_length`` = C), ``pad_token_id`` -1 (no real token id, so no prompt token is taken
for padding).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeq.errors import UserInputError
from edgeq.genai import genai_tokenizer
from edgeq.genai.emit import dumps, genai_config

if TYPE_CHECKING:
    from edgeq.artifacts.report import CompileReport

CONFIG_FILE = "genai_config.json"
POSITION_PROCESSOR = "position-processor.onnx"
KV_WRITER = "kv-writer.onnx"
GENAI_IDS, GENAI_POSITIONS, GENAI_MASK = "genai_input_ids", "genai_position_ids", "genai_attention_mask"
KV_SLOTS = "kv_slots"
CACHE_OUT = "kv_cache.%d"  # genai's present names: kv-writer.onnx's outputs (the shared buffer)
PAD_TOKEN_ID = -1
COPIED_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "config.json",
                "generation_config.json")
STAGE_FILES = {"prefill": "prefill_ctx.onnx", "decode": "decode_ctx.onnx"}
OPSET = 21


def _model(nodes, inputs, outputs, inits, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="edgeq")
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def position_processor(context: int) -> onnx.ModelProto:
    """genai's chunk inputs -> edgeq's: ``genai_input_ids`` int32 [1, W] and ``genai_position_ids``
    int64 [1, W] in; ``input_ids``, ``position_ids`` [1, W], ``attention_mask`` [1, C + W] (int64)
    and ``kv_slots`` [W] out. With ``last`` the last real token's position, token k of the chunk is
    at ``pos_k = last - (W - 1) + k`` (pads: pos_k < 0)."""
    c = lambda name, value: numpy_helper.from_array(np.asarray(value, np.int64), name)  # noqa: E731
    inits = [c("zero", 0), c("one", 1), c("last_index", -1), c("axis0", [0]), c("flat", [-1]),
             c("slots", np.arange(context)), c("w_index", 1)]
    n = helper.make_node
    nodes = [
        n("Shape", [GENAI_POSITIONS], ["shape"]),
        n("Gather", ["shape", "w_index"], ["w"]),  # W, a scalar
        n("Reshape", [GENAI_POSITIONS, "flat"], ["genai_pos"]),
        n("Gather", ["genai_pos", "last_index"], ["last"]),
        n("Sub", ["last", "w"], ["last_minus_w"]),
        n("Add", ["last_minus_w", "one"], ["start"]),  # the chunk's first slot (< 0 in a padded first chunk)
        n("Range", ["zero", "w", "one"], ["k"]),
        n("Add", ["k", "start"], ["pos"]),
        n("GreaterOrEqual", ["pos", "zero"], ["valid"]),
        n("Max", ["pos", "zero"], ["pos_clamped"]),
        n("Unsqueeze", ["pos_clamped", "axis0"], ["position_ids"]),
        n("Less", ["slots", "start"], ["used"]),
        n("Cast", ["used"], ["mask_past"], to=TensorProto.INT64),
        n("Cast", ["valid"], ["mask_new"], to=TensorProto.INT64),
        n("Concat", ["mask_past", "mask_new"], ["mask"], axis=0),
        n("Unsqueeze", ["mask", "axis0"], ["attention_mask"]),
        n("Add", ["pos", "w"], ["pad_slot"]),  # pads: slots last+1 .. W-1, after the real ones
        n("Where", ["valid", "pos", "pad_slot"], [KV_SLOTS]),
        n("Cast", [GENAI_IDS], ["ids64"], to=TensorProto.INT64),
        n("Reshape", ["ids64", "flat"], ["ids_flat"]),
        n("Where", ["valid", "ids_flat", "zero"], ["ids_clean"]),
        n("Unsqueeze", ["ids_clean", "axis0"], ["input_ids"]),
    ]
    vi = helper.make_tensor_value_info
    inputs = [vi(GENAI_IDS, TensorProto.INT32, [1, "window"]), vi(GENAI_POSITIONS, TensorProto.INT64, [1, "window"])]
    outputs = [vi("input_ids", TensorProto.INT64, [1, "window"]), vi("position_ids", TensorProto.INT64, [1, "window"]),
               vi("attention_mask", TensorProto.INT64, [1, "total"]), vi(KV_SLOTS, TensorProto.INT64, ["window"])]
    return _model(nodes, inputs, outputs, inits, "edgeq_position_processor")


def _cache_names(layers: int) -> list[tuple[str, str, str]]:
    """(past input, new-entries output of the graphs, genai's present name) per cache tensor."""
    return [(f"past_key_values.{i}.{kv}", f"present.{i}.{kv}", f"{CACHE_OUT % i}.{kv}")
            for i in range(layers) for kv in ("key", "value")]


def kv_writer(layers: int, kv_heads: int, context: int, head_dim: int, dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """The new entries ``present.{i}.*`` [1, H, W, D] written into the cache ``past_key_values.{i}.*``
    [1, H, C, D] at ``kv_slots``: ``kv_cache.{i}.*``, which genai binds to the same buffer as the
    past (shared past/present), so the cache is updated in place."""
    inits = [numpy_helper.from_array(np.array([1, 1, -1, 1], np.int64), "slot_shape"),
             numpy_helper.from_array(np.array([1, kv_heads, 1, head_dim], np.int64), "index_shape")]
    nodes = [helper.make_node("Reshape", [KV_SLOTS, "slot_shape"], ["slot4"]),
             helper.make_node("Expand", ["slot4", "index_shape"], ["index"])]
    vi = helper.make_tensor_value_info
    inputs, outputs, ins_new = [], [], []
    for past, new, out in _cache_names(layers):
        nodes.append(helper.make_node("ScatterElements", [past, "index", new], [out], axis=2))
        inputs.append(vi(past, dtype, [1, kv_heads, context, head_dim]))
        ins_new.append(vi(new, dtype, [1, kv_heads, "window", head_dim]))
        outputs.append(vi(out, dtype, [1, kv_heads, context, head_dim]))
    inputs += ins_new + [vi(KV_SLOTS, TensorProto.INT64, ["window"])]
    return _model(nodes, inputs, outputs, inits, "edgeq_kv_writer")


def _graph_io(path: Path) -> tuple[list[str], list[str]]:
    model = onnx.load(str(path), load_external_data=False)
    return [i.name for i in model.graph.input], [o.name for o in model.graph.output]


def qnn_provider_options(htp_arch: int, soc_model: int | None = None) -> dict[str, str]:
    """The QNN provider options of the HTP stages: edgeq's own (``htp_provider_options``: backend
    htp, the HTP generation, its SoC, fp16 float ops) for the generation the binaries were prepared
    for. ``enable_htp_shared_memory_allocator`` (AI Hub's, Windows/Linux ARM64 only) is left out:
    genai then keeps its buffers in CPU memory, which works on every platform."""
    from edgeq.targets.qnn_vendor import htp_provider_options

    options = htp_provider_options(int(htp_arch))
    if soc_model is not None:
        options["soc_model"] = str(soc_model)
    return options


def pipeline_config(config: dict, generation: dict, static: dict, stage_files: dict[str, str],
                    stage_io: dict[str, tuple[list[str], list[str]]], provider: dict | None) -> dict:
    """``genai_config.json`` for the pair: ``stage_files`` role -> file (relative to the folder),
    ``stage_io`` role -> (inputs, outputs) of that graph, ``provider``: the HTP stages' QNN options
    (None: those stages on the CPU, e.g. the CPU pair's own graphs, for checking the pipeline)."""
    window, context = int(static["prefill"]), int(static["context"])
    layers = int(static["cache"]["layers"])
    base = genai_config(config, generation)
    model = base["model"]
    decoder = model["decoder"]
    decoder.pop("filename")
    decoder["head_size"] = int(static["cache"]["head_dim"])
    decoder["num_key_value_heads"] = int(static["cache"]["kv_heads"])
    decoder["num_hidden_layers"] = layers
    decoder["inputs"] = {"input_ids": GENAI_IDS, "position_ids": GENAI_POSITIONS, "attention_mask": GENAI_MASK,
                         "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    decoder["outputs"] = {"logits": "logits", "present_key_names": CACHE_OUT + ".key",
                          "present_value_names": CACHE_OUT + ".value"}
    decoder["sliding_window"] = {"window_size": window, "pad_value": 0, "alignment": "right",
                                 "slide_key_value_cache": False, "slide_inputs": True}
    cpu = {"log_id": "onnxruntime-genai", "provider_options": []}
    npu = {"log_id": "onnxruntime-genai", "provider_options": [{"qnn": dict(provider)}]} if provider else cpu
    cache = _cache_names(layers)
    stages = {"position-processor": {"filename": POSITION_PROCESSOR, "inputs": [GENAI_IDS, GENAI_POSITIONS],
                                     "outputs": ["input_ids", "position_ids", "attention_mask", KV_SLOTS],
                                     "session_options": cpu, "run_on_prompt": True, "run_on_token_gen": True}}
    for role in ("prefill", "decode"):
        inputs, outputs = stage_io[role]
        stages[f"{role}-htp"] = {"filename": stage_files[role], "inputs": inputs, "outputs": outputs,
                                 "session_options": npu, "run_on_prompt": role == "prefill",
                                 "run_on_token_gen": role == "decode", "is_lm_head": False,
                                 "reset_session_idx": -1}
    stages["kv-writer"] = {"filename": KV_WRITER, "inputs": [p for p, _, _ in cache] + [n for _, n, _ in cache] + [KV_SLOTS],
                           "outputs": [o for _, _, o in cache], "session_options": cpu,
                           "run_on_prompt": True, "run_on_token_gen": True}
    decoder["pipeline"] = [stages]  # one object: its keys are the stages, run in this order
    # the helper stages run on the CPU: the model's default device is the CPU (AI Hub does the same)
    decoder["session_options"] = dict(cpu)
    model.update({"type": "decoder-pipeline", "context_length": context, "pad_token_id": PAD_TOKEN_ID})
    base["search"].update({"max_length": context, "past_present_share_buffer": True, "num_beams": 1})
    return base


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _check_pair(folder: Path, static: dict) -> None:
    cache = static.get("cache") or {}
    missing = [k for k in ("prefill", "context") if k not in static] + \
              [k for k in ("layers", "kv_heads", "head_dim") if k not in cache]
    if missing:
        raise UserInputError(f"report.json's static section lacks {', '.join(missing)}")
    if static.get("cache_dtype", "float32") != "float32":
        raise UserInputError(f"genai pipeline: the cache is {static['cache_dtype']}, the kv-writer stage "
                             f"takes a float32 cache")
    if int(static["prefill"]) < 2:
        raise UserInputError("genai pipeline: genai's prompt window must be at least 2 tokens (--static prefill=S, S>=2)")


def write_genai_qnn_config(folder: Path, report_static: dict, qnn_context: dict) -> dict:
    """Make ``folder/qnn`` an onnxruntime-genai folder for the pair's context binaries.

    ``folder``: the compile output (``prefill.onnx``, ``decode.onnx``, tokenizer and configs, and
    ``qnn/{prefill,decode}_ctx.onnx`` with their binaries already prepared); ``report_static``:
    report.json's ``static`` section; ``qnn_context``: its ``qnn_context`` section (``htp_arch``,
    ``soc_model``). Writes ``qnn/genai_config.json``, ``qnn/position-processor.onnx``,
    ``qnn/kv-writer.onnx`` and the tokenizer/config files; returns the record for report.json."""
    folder = Path(folder)
    qnn = folder / "qnn"
    _check_pair(folder, report_static)
    if qnn_context.get("weights_shared"):
        raise UserInputError("genai pipeline: a shared-weights context binary is not wired (one binary per graph is)")
    ctx = {role: qnn / name for role, name in STAGE_FILES.items()}
    absent = [p.name for p in ctx.values() if not p.is_file()]
    if absent:
        raise UserInputError(f"genai pipeline: {qnn} lacks {', '.join(absent)} (compile with --context-binary)")
    config = _read_json(folder / "config.json")
    if not config:
        raise UserInputError(f"genai pipeline: no config.json in {folder}")
    generation = _read_json(folder / "generation_config.json")
    cache = report_static["cache"]
    stage_io = {role: _graph_io(path) for role, path in ctx.items()}
    provider = qnn_provider_options(qnn_context.get("htp_arch", 79), qnn_context.get("soc_model"))
    genai = pipeline_config(config, generation, report_static, dict(STAGE_FILES), stage_io, provider)
    onnx.save(position_processor(int(report_static["context"])), str(qnn / POSITION_PROCESSOR))
    onnx.save(kv_writer(int(cache["layers"]), int(cache["kv_heads"]), int(report_static["context"]),
                        int(cache["head_dim"])), str(qnn / KV_WRITER))
    (qnn / CONFIG_FILE).write_text(dumps(genai), encoding="utf-8")
    copied = []
    if (folder / "tokenizer.json").is_file():
        (qnn / "tokenizer.json").write_text(genai_tokenizer((folder / "tokenizer.json").read_text(encoding="utf-8")),
                                            encoding="utf-8")
        copied.append("tokenizer.json")
    for name in COPIED_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, qnn / name)
            copied.append(name)
    return {"config": f"qnn/{CONFIG_FILE}", "type": "decoder-pipeline",
            "stages": list(genai["model"]["decoder"]["pipeline"][0]),
            "files": [f"qnn/{CONFIG_FILE}", f"qnn/{POSITION_PROCESSOR}", f"qnn/{KV_WRITER}"] + [f"qnn/{n}" for n in copied],
            "window": int(report_static["prefill"]), "max_length": int(report_static["context"]),
            "provider": {"qnn": provider}}


def write_cpu_check_folder(folder: Path, dest: Path) -> Path:
    """A copy of ``folder/qnn``'s genai pipeline whose model stages are the CPU pair's own graphs
    (``folder/prefill.onnx``, ``decode.onnx``) on the CPU provider: the same config and helper
    stages, runnable where the HTP is not (tests, and proving the pipeline wiring on its own)."""
    folder, dest = Path(folder), Path(dest)
    qnn = folder / "qnn"
    genai = json.loads((qnn / CONFIG_FILE).read_text(encoding="utf-8"))
    dest.mkdir(parents=True, exist_ok=True)
    stages = genai["model"]["decoder"]["pipeline"][0]
    cpu = genai["model"]["decoder"]["session_options"]
    for role in ("prefill", "decode"):
        stage = stages[f"{role}-htp"]
        stage["filename"] = f"{role}.onnx"  # genai takes only paths under the folder: linked in
        stage["session_options"] = dict(cpu)
    data = {x.value for role in ("prefill", "decode")
            for t in onnx.load(str(folder / f"{role}.onnx"), load_external_data=False).graph.initializer
            for x in t.external_data if x.key == "location"}
    for name in ["prefill.onnx", "decode.onnx", *sorted(data)]:
        link = dest / name
        if not link.exists():
            try:
                os.symlink(os.path.abspath(folder / name), link)
            except OSError:
                shutil.copyfile(folder / name, link)
    for name in [POSITION_PROCESSOR, KV_WRITER, "tokenizer.json", *COPIED_FILES]:
        if (qnn / name).is_file():
            shutil.copyfile(qnn / name, dest / name)
    (dest / CONFIG_FILE).write_text(dumps(genai), encoding="utf-8")
    return dest


def uses_qnn(config: dict) -> bool:
    """Whether a genai config puts any stage on the QNN provider."""
    decoder = (config.get("model") or {}).get("decoder") or {}
    options = [decoder.get("session_options") or {}]
    for group in decoder.get("pipeline") or []:
        options += [(stage or {}).get("session_options") or {} for stage in group.values()]
    return any(str(name).lower() == "qnn" for so in options for po in so.get("provider_options") or []
               for name in po)


def register_qnn_plugin(og) -> str:
    """Register onnxruntime-qnn's plugin EP with onnxruntime-genai (once per process); its name."""
    try:
        import onnxruntime_qnn
    except ImportError:
        raise UserInputError("this genai folder runs on the QNN HTP: pip install 'edgeq[qnn]' (onnxruntime-qnn)") from None
    name = onnxruntime_qnn.get_ep_name() if hasattr(onnxruntime_qnn, "get_ep_name") else "QNNExecutionProvider"
    if not getattr(register_qnn_plugin, "done", False):
        og.register_execution_provider_library(name, onnxruntime_qnn.get_library_path())
        cast(Any, register_qnn_plugin).done = True  # (a function attribute: the once-per-process flag)
    return name


class GenaiQnnPipeline:
    """``genai-qnn-pipeline``, the output stage after the context binaries (``edgeq.targets.qnn_htp``):
    ``OUT/qnn/genai_config.json`` and its CPU stages, so that onnxruntime-genai opens ``OUT/qnn`` and
    runs the binaries; written for one binary per graph and a float cache, otherwise the record
    (``qnn_context.genai`` in report.json) says why not."""

    name = "genai-qnn-pipeline"

    def __init__(self, split: bool, share_weights: bool) -> None:
        self.split = split
        self.share_weights = share_weights

    def run(self, folder: Path, report: CompileReport) -> None:
        assert report.static is not None and report.qnn_context is not None  # (after the pair and its binaries)
        why = ("the parts (--max-context-mb) are not wired into a genai pipeline" if self.split
               else "a shared-weights binary (--share-weights) does not load on x86-64, where the pipeline is tested"
               if self.share_weights else "the genai pipeline's kv-writer stage takes a float32 cache"
               if report.static.get("cache_dtype", "float32") != "float32" else "")
        report.qnn_context.genai = ({"written": False, "why": why} if why else
                                    {"written": True, **write_genai_qnn_config(folder, report.static,
                                                                               report.qnn_context.to_json())})
