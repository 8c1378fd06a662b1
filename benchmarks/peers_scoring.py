"""How ``peers.py`` scores every row on edgeq's side, in edgeq's venv, the same way for every tool:
what an ONNX output does with its vocab head and embedding (read off the graph), perplexity with
onnxruntime's defaults and with exact QDQ (teacher-forced windows; a static pair through its prefill
graph), and CPU latency of one 512-token forward pass as interleaved medians."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# categories whose activations are quantized statically in the graph: there onnxruntime's default
# session fuses Q/DQ into integer kernels, so the exact-QDQ perplexity is measured beside it
STATIC_ACTIVATION_CATEGORIES = ("w8a8", "w8a16", "w4a16")


# onnx TensorProto: float, f16, bf16, (u)int16 (AIMET's 16-bit embedding tables), (u)int8, (u)int4
_ELEMENT_BITS = {1: 32, 10: 16, 16: 16, 4: 16, 5: 16, 2: 8, 3: 8, 21: 4, 22: 4}
_PASS_THROUGH = {"Transpose", "Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten"}


def weight_policy(folder: Path) -> dict:
    """What an ONNX output does with the vocab head and the embedding, read off its graph (not
    declared): ``lm_head_bits`` and ``embedding_bits`` (32 = float), the W4 ``group_size`` (the most
    common MatMulNBits block_size; None without MatMulNBits) and ``accuracy_level`` (the most common
    MatMulNBits accuracy_level, 0 when unset; None without MatMulNBits)."""
    from collections import Counter

    import onnx

    graph = onnx.load(str(graph_file(folder)), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}

    def attr(node, name, default):
        return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)

    def tensor_bits(name: str) -> int | None:
        """Bits of the weight that ``name`` carries: an initializer, or one behind DQ / pass-through ops."""
        while name not in inits:
            node = producer.get(name)
            if node is None:
                return None
            if node.op_type == "DequantizeLinear":
                source = inits.get(node.input[0])
                return _ELEMENT_BITS.get(source.data_type) if source is not None else None
            if node.op_type not in _PASS_THROUGH:
                return None
            name = node.input[0]
        return _ELEMENT_BITS.get(inits[name].data_type)

    def activation_qdq(node) -> bool:
        """A Q or DQ on an activation (not a weight's DequantizeLinear): QDQ exports such as
        AIMET's quantize the logits too, so the walk to lm_head steps over them."""
        return node.op_type in ("QuantizeLinear", "DequantizeLinear") and node.input[0] not in inits

    logits = next((o.name for o in graph.output if o.name == "logits"), graph.output[0].name)
    node = producer.get(logits)
    while node is not None and (node.op_type in _PASS_THROUGH | {"Add"} or activation_qdq(node)):
        node = producer.get(node.input[0])
    head = None
    if node is not None and node.op_type == "MatMulNBits":
        head = int(attr(node, "bits", 4))
    elif node is not None and node.op_type in ("MatMul", "Gemm"):
        head = tensor_bits(node.input[1])
    embedding = None
    for n in graph.node:
        if n.op_type == "GatherBlockQuantized" and n.input[1] == "input_ids":
            embedding = int(attr(n, "bits", 4))
        elif n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == "input_ids":
            embedding = tensor_bits(n.input[0])
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    # QDQ graphs with block-quantized weights (AIMET's LPBQ, blocked DequantizeLinear): their block size
    blocked = [int(attr(n, "block_size", 0)) for n in graph.node
               if n.op_type == "DequantizeLinear" and n.input[0] in inits and int(attr(n, "block_size", 0)) > 0]
    group = (Counter(int(attr(n, "block_size", 0)) for n in nbits).most_common(1)[0][0] if nbits else
             Counter(blocked).most_common(1)[0][0] if blocked else None)
    return {"lm_head_bits": head, "embedding_bits": embedding, "group_size": group,
            "accuracy_level": Counter(int(attr(n, "accuracy_level", 0)) for n in nbits).most_common(1)[0][0] if nbits else None}


def _session(path: Path, exact_qdq: bool):
    from edgeq.runtime.ort_session import open_session, session_options

    return open_session(path, options=session_options(optimize=True, exact_qdq=exact_qdq))


def _feeds(session, ids: np.ndarray, folder: Path) -> dict:
    """input_ids / attention_mask / position_ids for one window, and an empty cache for a graph
    with one (the genai build: head size from its genai_config.json)."""
    feeds = {}
    config = folder / "genai_config.json"
    decoder = json.loads(config.read_text())["model"]["decoder"] if config.is_file() else {}
    for inp in session.get_inputs():
        if inp.name == "input_ids":
            feeds[inp.name] = ids[None]
        elif inp.name == "attention_mask":
            feeds[inp.name] = np.ones((1, ids.size), np.int64)
        elif inp.name == "position_ids":
            feeds[inp.name] = np.arange(ids.size, dtype=np.int64)[None]
        elif inp.name.startswith("past_key_values."):
            heads = inp.shape[1] if isinstance(inp.shape[1], int) else decoder["num_key_value_heads"]
            dim = inp.shape[3] if isinstance(inp.shape[3], int) else decoder["head_size"]
            feeds[inp.name] = np.zeros((1, heads, 0, dim), np.float32)
    return feeds


def pair_perplexity(path: Path, windows: np.ndarray, exact_qdq: bool) -> float:
    """Perplexity of a static pair on the same windows, teacher-forced through its prefill graph
    (what ``edgeq eval ppl PAIR --through prefill`` computes), onnxruntime CPU."""
    from edgeq.generation.decoders import open_decoder
    from edgeq.generation.teacher_forced import teacher_forced_nll

    decoder = open_decoder(path, exact_qdq=exact_qdq, max_length=windows.shape[1])
    nll = sum(teacher_forced_nll(decoder, ids, "prefill") for ids in windows)
    return round(float(np.exp(nll / (windows.shape[0] * (windows.shape[1] - 1)))), 3)


def onnx_perplexity(path: Path, windows: np.ndarray, exact_qdq: bool) -> float:
    from edgeq.runtime.nll import window_nll

    if (path / "prefill.onnx").is_file() and not (path / "model.onnx").is_file():
        return pair_perplexity(path, windows, exact_qdq)
    model = path / "model.onnx"
    session = _session(model, exact_qdq)
    logits_name = "logits" if "logits" in [o.name for o in session.get_outputs()] else session.get_outputs()[0].name
    nll = tokens = 0.0
    for ids in windows:
        logits = session.run([logits_name], _feeds(session, ids, path))[0][0].astype(np.float32)
        nll += window_nll(logits, ids)
        tokens += ids.size - 1
    return round(float(np.exp(nll / tokens)), 3)


def graph_file(folder: Path) -> Path:
    """The graph a row's folder holds: model.onnx, or a static pair's prefill.onnx."""
    return folder / "model.onnx" if (folder / "model.onnx").is_file() else folder / "prefill.onnx"


def add_weight_policy(rows: list[dict]) -> None:
    """lm_head / embedding bits, group size and accuracy level of every ONNX row, from its graph
    (OpenVINO IR rows keep what their adapter states)."""
    for row in rows:
        if row.get("format") == "onnx" and row.get("path") and graph_file(Path(row["path"])).is_file():
            row.update(weight_policy(Path(row["path"])))


def add_perplexities(rows: list[dict], windows: np.ndarray) -> None:
    """Perplexity of every ONNX row that ran (and its exact-QDQ value for W8A8 rows), in place."""
    for row in rows:
        if row.get("error") or row.get("format") != "onnx" or not row.get("path"):
            continue
        print(f"[peers] perplexity: {row['tool']} {row['setting']}", file=sys.stderr)
        try:
            row["ppl"] = onnx_perplexity(Path(row["path"]), windows, exact_qdq=False)
            if row["category"] in STATIC_ACTIVATION_CATEGORIES:  # where onnxruntime fuses Q/DQ into integer kernels
                row["ppl_exact"] = onnx_perplexity(Path(row["path"]), windows, exact_qdq=True)
        except Exception as exc:  # noqa: BLE001 (a model that does not run is a row with its error)
            row["error"] = f"evaluation failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


def latencies(rows: list[dict], ids: np.ndarray, repeats: int) -> None:
    """512-token forward pass, batch 1: every ONNX model once per round, interleaved; medians."""
    # static pairs (rows with "through") run 128 tokens per call: not a 512-token forward pass
    timed = [r for r in rows if r.get("path") and r.get("format") == "onnx" and not r.get("error") and not r.get("through")]
    sessions = {id(r): _session(Path(r["path"]) / "model.onnx", exact_qdq=False) for r in timed}
    feeds = {id(r): _feeds(sessions[id(r)], ids, Path(r["path"])) for r in timed}
    samples: dict[int, list[float]] = {id(r): [] for r in timed}
    for round_ in range(repeats + 2):
        for r in timed:
            start = time.perf_counter()
            sessions[id(r)].run(None, feeds[id(r)])
            if round_ >= 2:  # two warm-up rounds
                samples[id(r)].append((time.perf_counter() - start) * 1e3)
    for r in timed:
        r["latency_ms"] = round(statistics.median(samples[id(r)]), 1)
