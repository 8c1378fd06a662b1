"""The output folder of ``compile --target ort-genai``: what onnxruntime-genai opens, and edgeq's records.

``model.onnx`` + ``model.onnx.data`` (genai's graph form, ``edgeq.genai.emit``), ``genai_config.json``,
the tokenizer files (``tokenizer.json`` as onnxruntime-extensions reads it), ``config.json`` and
``generation_config.json``; then, as every compile output, ``encodings.json``, ``report.json`` and
``manifest.json``. All of it is written into a staging folder that replaces the output only when
complete; before that the model must load in onnxruntime and, when onnxruntime-genai is installed,
in onnxruntime-genai too.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from edgeq import ir
from edgeq.artifacts.writer import _check_loads, _write_rest
from edgeq.genai import genai_tokenizer, read_config
from edgeq.genai.emit import build_genai_model, dumps, genai_config
import dataclasses
from collections import Counter

from edgeq.genai.layers import QuantWeight, read_decoder, rtn_int8

COPIED_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "config.json",
                "generation_config.json")


def genai_version() -> str | None:
    """onnxruntime-genai's version, or None when it is not installed (``pip install 'edgeq[genai]'``)."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    return og.__version__


def _linear_summary(dec) -> dict:
    lins = [lin for layer in dec.attention + dec.mlp for lin in layer.values()] + [dec.lm_head]
    packed = sum(isinstance(lin.weight, QuantWeight) for lin in lins)
    return {"matmulnbits": packed, "float": len(lins) - packed,
            "online_ops": sum(len(lin.chain) for lin in lins),
            "lm_head": f"int{dec.lm_head.weight.bits}" if isinstance(dec.lm_head.weight, QuantWeight) else "float32",
            "group_sizes": sorted({lin.weight.group for lin in lins if isinstance(lin.weight, QuantWeight)})}


def write_genai_outputs(out_dir: Path, model: onnx.ModelProto, report: dict, source_model: Path, accuracy_level: int,
                        *, lm_head_bits: int = 8, encodings: dict, recipe, input_model: dict, target: str, started: float, force: bool = False,
                        inputs: tuple = ()) -> dict:
    config, generation = read_config(source_model)
    functions, opsets = list(model.functions), {o.domain: o.version for o in model.opset_import}
    dec = read_decoder(ir.to_graph(model), int(config["hidden_size"]), int(config["num_hidden_layers"]))
    del model
    if lm_head_bits == 8 and not isinstance(dec.lm_head.weight, QuantWeight):  # the recipe left it float
        dec.lm_head = dataclasses.replace(dec.lm_head, weight=rtn_int8(dec.lm_head.weight))
    genai_model = build_genai_model(dec, config, functions, opsets, accuracy_level)
    ops = Counter(n.op_type for n in genai_model.graph.node)
    report["genai"] = {"accuracy_level": accuracy_level, "linears": _linear_summary(dec), "family": config["model_type"],
                       "nodes": {op: ops[op] for op in ("MatMulNBits", "MatMul", "GroupQueryAttention",
                                                        "SkipSimplifiedLayerNormalization")},
                       "context_length": int(config.get("max_position_embeddings", 4096))}
    del dec
    source = Path(source_model).parent
    with ir.atomic_output_dir(out_dir, force=force, inputs=inputs) as tmp:
        model_path = ir.save_model(genai_model, tmp / "model.onnx")
        del genai_model
        (tmp / "genai_config.json").write_text(dumps(genai_config(config, generation)), encoding="utf-8")
        if (source / "tokenizer.json").is_file():
            (tmp / "tokenizer.json").write_text(genai_tokenizer((source / "tokenizer.json").read_text(encoding="utf-8")),
                                                encoding="utf-8")
        for name in COPIED_FILES:
            if (source / name).is_file():
                (tmp / name).write_bytes((source / name).read_bytes())
        _check_loads(model_path)
        version = genai_version()
        if version is not None:  # the folder must open where it is meant to run
            import onnxruntime_genai as og

            og.Model(str(tmp))
        report["genai"]["opened_by_onnxruntime_genai"] = version
        size = sum(f.stat().st_size for f in tmp.iterdir() if f.name.startswith("model.onnx"))
        report["u8s8"] = {"int8_weight_range": "none: 4-bit MatMulNBits and float linears only"}
        _write_rest(tmp, report, encodings, recipe, input_model, target, started, size)
    return report


def load_genai_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "genai_config.json").read_text(encoding="utf-8"))
