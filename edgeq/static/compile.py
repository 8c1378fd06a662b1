"""``edgeq compile --static prefill=S,context=C``: what the compiler needs beyond one recipe run.

The recipe (and the target's lowering and the u8s8 guard) runs once on the with-past graph, with
one calibration; the compiled graph is then specialized into ``prefill.onnx`` and ``decode.onnx``
(``edgeq.static.specialize``), so both carry the same quantization parameters by construction
(checked: their encodings must be equal). With a recipe's ``[kv_cache] dtype = "int8"`` the cache
scales come from the same calibration windows. With a target, each graph is checked on its own.
"""

from __future__ import annotations

import json

from pathlib import Path

from edgeq.graph import ir
from edgeq.kv_cache import PAST_PREFIX, PRESENT_PREFIX
from edgeq.quantize.qdq_encodings import collect_encodings

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


def pair_encodings(pair: dict, weights_dir: Path | None = None) -> dict:
    """The encodings of the pair, which must be the same for both graphs (one recipe run);
    ``weights_dir``: where initializers stored as external data are read from."""
    models = iter(pair.values())
    first = collect_encodings(next(models), str(weights_dir or ""))
    for model in models:  # one more at a time (a 1.5B model's int4 block encodings are 0.9 GB in Python)
        other = collect_encodings(model, str(weights_dir or ""))
        # (equal values compare equal in place; the JSON texts decide otherwise: a NaN in both is
        # the same encoding here, refused as a non-finite parameter when encodings.json is written)
        if other != first and json.dumps(other, sort_keys=True) != json.dumps(first, sort_keys=True):
            raise RuntimeError("the prefill and decode graphs ended with different quantization parameters")
        del other
    return first


def static_report(shape, pair: dict, scales: dict | None) -> dict:
    """report.json's ``static`` section: the cache layout, the KV scales and each graph's I/O
    (the cache tensors of layer 0 stand for every layer)."""
    def io(values, prefix):
        return {vi.name: _dims(vi) for vi in values if not vi.name.startswith(prefix) or vi.name.startswith(prefix + "0.")}

    return {
        "prefill": shape.prefill, "context": shape.context, "cache_dtype": shape.cache_dtype,
        "cache": {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
                  "per_layer_shape": [1, shape.kv_heads, shape.context, shape.head_dim]},
        "kv_scales": scales,
        "graphs": {name: {"nodes": len(m.graph.node), "inputs": io(m.graph.input, PAST_PREFIX),
                          "outputs": io(m.graph.output, PRESENT_PREFIX)} for name, m in pair.items()},
    }


def tokenizer_files(model_path: Path) -> list[Path]:
    source = model_path.parent.resolve()  # (a linked model.onnx: its siblings, not the link target's)
    return [source / f for f in TOKENIZER_FILES if (source / f).is_file()]


def _dims(vi) -> list[int]:
    return [d.dim_value for d in vi.type.tensor_type.shape.dim]
