"""``edgeq compile --static prefill=S,context=C``: one recipe run, two static graphs.

The recipe (and the target's lowering and the u8s8 guard) runs once on the with-past graph, with
one calibration; the compiled graph is then specialized into ``prefill.onnx`` and ``decode.onnx``
(``edgeq.static.specialize``), so both carry the same quantization parameters by construction
(checked: their encodings must be equal). With a recipe's ``[kv_cache] dtype = "int8"`` the cache
scales come from the same calibration windows. With a target, each graph is checked on its own.
"""

from __future__ import annotations

import json

from edgeq import ir
from edgeq.artifacts.encodings import collect_encodings
from edgeq.artifacts.writer import write_static_outputs
from edgeq.errors import UserInputError
from edgeq.kv_cache import PRESENT_PREFIX
from edgeq.static.specialize import build_pair

# the files beside a model that ``edgeq generate`` reads (tokenizer, chat template, stop tokens)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "config.json")


def kv_scales(calibrator, model, layers: int) -> dict[str, float]:
    """Symmetric int8 scales of every layer's keys and values over the calibration windows (the
    ``present`` outputs of the compiled with-past graph, run with an empty past)."""
    from edgeq.calib.observers import MinMaxObserver
    from edgeq.static.kv_cache_int8 import scales_from_ranges

    names = [f"{PRESENT_PREFIX}{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    observers = calibrator.observe(ir.to_graph(model), {n: MinMaxObserver for n in names}, "kv-cache-int8")
    return scales_from_ranges({n: observers[n].range() for n in names})


def run_static(plan) -> dict:
    from edgeq.compiler import build_report, reach_target, run_plan

    shape = plan.static_shape
    model, stages, _, _ = run_plan(plan)
    scales = None
    if shape.cache_dtype == "int8":
        if plan.calibrator is None:
            raise UserInputError("an int8 KV cache needs calibration data: pass --calib FILE")
        scales = kv_scales(plan.calibrator, model, shape.layers)
    pair = build_pair(model, shape, scales)
    del model
    encodings = {name: collect_encodings(m) for name, m in pair.items()}
    first, *rest = encodings.values()
    if any(json.dumps(e, sort_keys=True) != json.dumps(first, sort_keys=True) for e in rest):
        raise RuntimeError("the prefill and decode graphs ended with different quantization parameters")
    target = None
    checks = {}
    for name in pair:
        pair[name], target = reach_target(plan, pair[name], encodings[name], stages["lowering"])
        if target is not None:
            checks[name] = target.pop("check")
    if target is not None:
        target["check"] = checks
    report, u8s8 = build_report(plan, stages, target)
    report["static"] = {
        "prefill": shape.prefill, "context": shape.context, "cache_dtype": shape.cache_dtype,
        "cache": {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
                  "per_layer_shape": [1, shape.kv_heads, shape.context, shape.head_dim]},
        "kv_scales": scales,
        "graphs": {name: {"nodes": len(m.graph.node),
                          "inputs": {vi.name: _dims(vi) for vi in m.graph.input if not vi.name.startswith("past_key_values.") or vi.name.startswith("past_key_values.0.")},
                          "outputs": {vi.name: _dims(vi) for vi in m.graph.output if not vi.name.startswith(PRESENT_PREFIX) or vi.name.startswith(PRESENT_PREFIX + "0.")}}
                   for name, m in pair.items()},
    }
    source = plan.req.model.resolve().parent
    extra = [source / f for f in TOKENIZER_FILES if (source / f).is_file()]
    return write_static_outputs(plan.req.out_dir, pair, report, encodings=first, recipe=plan.recipe,
                                input_model=plan.input_model, target=plan.profile.name if plan.profile else None,
                                u8s8=u8s8, started=plan.started, extra_files=extra)


def _dims(vi) -> list[int]:
    return [d.dim_value for d in vi.type.tensor_type.shape.dim]
