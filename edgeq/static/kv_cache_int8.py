"""An 8-bit KV cache for a static pair: the cache tensors the host keeps become int8.

Why: the cache is the memory that grows with the context (SmolLM2 at 1024 tokens: 30 layers x 2 x
3 heads x 64 x 1024 x 4 bytes = 47 MB in fp32, 12 MB in int8) and is read in full at every decode
step, so on a bandwidth-bound NPU or CPU it costs time as well as memory.

How: per layer and per K/V one symmetric scale (per tensor: NPU activation encodings are per
tensor), absmax / 127 of that layer's keys or values over the calibration windows
(``calibration_ranges``, read from the compiled dynamic graph's ``present`` outputs, which hold
exactly the new entries when the past is empty). In each static graph:

- ``past_key_values.{i}.*`` is declared int8 and read through a DequantizeLinear;
- the new entries go through QuantizeLinear -> DequantizeLinear before they join the cache
  ``Concat`` (so the tokens of this run see the same rounded values later runs will read), and the
  int8 codes are the ``present.{i}.*`` output the host writes into its cache.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.kv_cache import PAST_PREFIX, PRESENT_PREFIX

QMAX = 127


def scales_from_ranges(ranges: dict[str, tuple[float, float]]) -> dict[str, float]:
    """``present.{i}.key`` -> (lo, hi) calibration ranges => ``{i}.key`` -> symmetric int8 scale."""
    scales = {}
    for name, (lo, hi) in ranges.items():
        absmax = max(abs(float(lo)), abs(float(hi)))
        scales[name[len(PRESENT_PREFIX):]] = (absmax if absmax > 0 else 1.0) / QMAX
    return scales


def quantize_cache(graph: gs.Graph, scales: dict[str, float]) -> int:
    """Rewrite a static graph's cache I/O to int8 with ``scales`` (``{i}.key`` -> scale); returns
    the number of cache tensors rewritten."""
    inputs = {t.name: t for t in graph.inputs}
    outputs = {t.name: t for t in graph.outputs}
    done = 0
    for slot, scale in sorted(scales.items()):
        past, present = inputs[PAST_PREFIX + slot], outputs[PRESENT_PREFIX + slot]
        s = gs.Constant(f"kv_cache.{slot}.scale", np.array(scale, np.float32))
        zp = gs.Constant(f"kv_cache.{slot}.zero_point", np.array(0, np.int8))
        readers = list(past.outputs)
        past_f = gs.Variable(f"{past.name}.dequantized", dtype=np.float32, shape=past.shape)
        graph.nodes.append(gs.Node("DequantizeLinear", name=f"{past.name}/dequantize", inputs=[past, s, zp], outputs=[past_f]))
        for node in readers:
            node.inputs = [past_f if t is past else t for t in node.inputs]
        past.dtype = np.int8
        identity = present.inputs[0]  # Identity(new rows), written by the specialization
        new = identity.inputs[0]
        codes = gs.Variable(f"{present.name}.codes", dtype=np.int8, shape=present.shape)
        rounded = gs.Variable(f"{present.name}.rounded", dtype=np.float32, shape=new.shape)
        graph.nodes.append(gs.Node("QuantizeLinear", name=f"{present.name}/quantize", inputs=[new, s, zp], outputs=[codes]))
        graph.nodes.append(gs.Node("DequantizeLinear", name=f"{present.name}/dequantize", inputs=[codes, s, zp], outputs=[rounded]))
        for node in list(new.outputs):
            if node.op == "Concat":
                node.inputs = [rounded if t is new else t for t in node.inputs]
        identity.inputs = [codes]
        present.dtype = np.int8
        done += 1
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return done
