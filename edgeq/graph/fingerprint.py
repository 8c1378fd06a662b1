"""Content hashes of models and graphs: what the calibration cache and report.json key on.

- ``model_fingerprint``: a ModelProto's structure and every initializer's bytes, streamed into the
  hash (no second copy of the weights; models over 2 GB too; external data read one tensor at a
  time), recorded as ``input_fingerprint`` in report.json;
- ``graph_fingerprint``: a graphsurgeon graph's, taken without exporting it, with a memo that
  keeps the digests of constants no pass has rewritten (calibration keys its cache with it).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from edgeq.graph.ir import external_bytes, nodes_with_graphs


def model_fingerprint(model: onnx.ModelProto, base_dir: str | os.PathLike | None = None) -> str:
    """A content hash of a model (graph structure and every initializer's bytes).

    Streams initializer bytes into the hash so no second copy of the weights is made, and works
    for models over 2 GB where ``SerializeToString`` would fail. Initializers still stored as
    external data are read from ``base_dir`` one at a time (same hash as when loaded).
    """
    h = hashlib.sha256()
    for init in model.graph.initializer:
        h.update(init.name.encode())
        h.update(repr(list(init.dims)).encode())
        if init.data_location == onnx.TensorProto.EXTERNAL and base_dir is not None:
            h.update(external_bytes(init, base_dir))
            continue
        h.update(onnx.numpy_helper.to_array(init).tobytes() if not init.raw_data else init.raw_data)
    skeleton = onnx.GraphProto()
    skeleton.CopyFrom(model.graph)
    del skeleton.initializer[:]
    h.update(skeleton.SerializeToString())
    for imp in model.opset_import:
        h.update(f"{imp.domain}:{imp.version}".encode())
    return h.hexdigest()[:32]


def graph_fingerprint(graph: gs.Graph, memo: dict | None = None) -> str:
    """A content hash of a graphsurgeon graph (structure, attributes, every constant's bytes), taken
    without exporting it to a ModelProto. ``memo`` (kept by the caller across calls) remembers the
    digest of each constant still held as the original, immutable ``LazyValues`` (a tensor no pass
    has rewritten), so repeated fingerprints of one compile hash only the weights that changed.
    Calibration keys its cache with it (``edgeq.calib.session``)."""
    h = hashlib.sha256()
    _hash_graph(graph, h, memo if memo is not None else {})
    h.update(f"opset:{graph.opset}".encode())
    # the custom domains the nodes use, not graph.import_domains: exporting a graph (which a
    # calibration miss does and a cache hit does not) registers domains there as a side effect,
    # and a key that depends on it misses on the next warm compile
    for domain in sorted({node.domain or "" for g, node in nodes_with_graphs(graph)}):
        h.update(f"domain:{domain}".encode())
    return h.hexdigest()[:32]


def _hash_graph(graph: gs.Graph, h, memo: dict) -> None:
    for kind, tensors in (("in", graph.inputs), ("out", graph.outputs)):
        for t in tensors:
            h.update(f"{kind}:{t.name}:{t.dtype}:{t.shape}\n".encode())
    for node in graph.nodes:
        h.update(f"node:{node.op}:{node.domain}:{node.name}\n".encode())
        for key in sorted(node.attrs):
            value = node.attrs[key]
            h.update(f"attr:{key}:".encode())
            if isinstance(value, gs.Graph):
                _hash_graph(value, h, memo)
            elif isinstance(value, gs.Constant):
                _hash_constant(value, h, memo)
            elif isinstance(value, np.ndarray):
                h.update(np.ascontiguousarray(value).tobytes())
            else:
                h.update(repr(value).encode())
        for t in node.inputs:
            if isinstance(t, gs.Constant):
                _hash_constant(t, h, memo)
            else:
                h.update(f"i:{t.name}\n".encode())
        for t in node.outputs:
            h.update(f"o:{t.name}:{t.dtype}\n".encode())


def _hash_constant(const: gs.Constant, h, memo: dict) -> None:
    from onnx_graphsurgeon.ir.tensor import LazyValues

    values = const._values  # noqa: SLF001 (no public accessor that leaves lazy tensors unloaded)
    h.update(f"c:{const.name}:{const.dtype}:{const.shape}\n".encode())
    if isinstance(values, LazyValues):  # immutable: the digest of this object never changes
        hit = memo.get(id(values))
        if hit is None or hit[0] is not values:
            proto = values.tensor
            data = proto.raw_data if proto.raw_data else onnx.numpy_helper.to_array(proto).tobytes()
            hit = memo[id(values)] = (values, hashlib.sha256(data).digest())
        h.update(hit[1])
    else:
        h.update(hashlib.sha256(np.ascontiguousarray(values).tobytes()).digest())
