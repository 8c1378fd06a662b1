"""The output folder of ``compile --target ort-genai``: what onnxruntime-genai opens, and edgeq's records.

``model.onnx`` + ``model.onnx.data`` (genai's graph form, ``edgeq.genai.emit``), ``genai_config.json``,
the tokenizer files (``tokenizer.json`` as onnxruntime-extensions reads it), ``config.json`` and
``generation_config.json``; then, as every compile output, ``encodings.json``, ``report.json`` and
``manifest.json``. All of it is written into a staging folder that replaces the output only when
complete; before that the model must load in onnxruntime and, when onnxruntime-genai is installed,
in onnxruntime-genai too. ``genai_graphs`` builds the graph (the route's part), ``GenaiGraphs`` writes
it behind ``edgeq.artifacts.writer.write``, which adds the records every compile output gets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import onnx

from edgeq.graph import ir
from edgeq.artifacts.report import CompileReport, GenaiSection
from edgeq.graph.ir import check_loads
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


def genai_graphs(model: onnx.ModelProto, report: CompileReport, source_model: Path, accuracy_level: int,
                 lm_head_bits: int = 8) -> GenaiGraphs:
    """genai's graph from the compiled ``model`` (which it clears as it reads it), and report.json's
    ``genai`` section."""
    config, generation = read_config(source_model)
    functions, opsets = list(model.functions), {o.domain: o.version for o in model.opset_import}
    dec = read_decoder(ir.to_graph(model), int(config["hidden_size"]), int(config["num_hidden_layers"]))
    del model
    assert dec.lm_head is not None  # (read_decoder sets it)
    if lm_head_bits == 8 and not isinstance(dec.lm_head.weight, QuantWeight):  # the recipe left it float
        dec.lm_head = dataclasses.replace(dec.lm_head, weight=rtn_int8(dec.lm_head.weight))
    genai_model = build_genai_model(dec, config, functions, opsets, accuracy_level)
    ops = Counter(n.op_type for n in genai_model.graph.node)
    report.genai = GenaiSection(accuracy_level, _linear_summary(dec), config["model_type"],
                                {op: ops[op] for op in ("MatMulNBits", "MatMul", "GroupQueryAttention",
                                                        "SkipSimplifiedLayerNormalization")},
                                int(config.get("max_position_embeddings", 4096)))
    del dec
    return GenaiGraphs(genai_model, config, generation, Path(source_model).parent)


@dataclass
class GenaiGraphs:
    """The files onnxruntime-genai opens (``edgeq.artifacts.writer.write`` writes the records)."""

    model: onnx.ModelProto | None
    config: dict
    generation: dict
    source: Path  # the input model's folder: tokenizer and config files

    def write_into(self, tmp: Path, report: CompileReport) -> int:
        source = self.source
        model_path = ir.save_model(cast(onnx.ModelProto, self.model), tmp / "model.onnx")  # (held until written)
        self.model = None  # written: not held while onnxruntime loads it
        (tmp / "genai_config.json").write_text(dumps(genai_config(self.config, self.generation)), encoding="utf-8")
        if (source / "tokenizer.json").is_file():
            (tmp / "tokenizer.json").write_text(genai_tokenizer((source / "tokenizer.json").read_text(encoding="utf-8")),
                                                encoding="utf-8")
        for name in COPIED_FILES:
            if (source / name).is_file():
                (tmp / name).write_bytes((source / name).read_bytes())
        check_loads(model_path)
        version = genai_version()
        if version is not None:  # the folder must open where it is meant to run
            import onnxruntime_genai as og

            og.Model(str(tmp))
        genai = cast(GenaiSection, report.genai)  # (set by genai_graphs)
        genai.opened_by_onnxruntime_genai, genai.opened = version, True
        size = sum(f.stat().st_size for f in tmp.iterdir() if f.name.startswith("model.onnx"))
        # no uint8 x int8 MatMulInteger to saturate: every quantized linear is a MatMulNBits (4-bit, and
        # the lm_head 8-bit unless --lm-head-bits 32 leaves it float or the recipe made it 4-bit)
        report.u8s8 = {"int8_weight_range": "none: MatMulNBits (4-bit; lm_head 8-bit by default) and float linears only"}
        return size


def load_genai_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "genai_config.json").read_text(encoding="utf-8"))
