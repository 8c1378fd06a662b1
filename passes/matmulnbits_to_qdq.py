"""``matmulnbits-to-qdq``: onnxruntime's ``com.microsoft::MatMulNBits`` back into standard ONNX.

Why: ``MatMulNBits`` is an onnxruntime contrib op; other runtimes and NPU toolchains read only the
standard form, an integer weight behind an opset-21 block ``DequantizeLinear`` feeding a
``MatMul`` (the form ``gptq``'s default lowering writes, and the one onnxruntime fuses back into
``MatMulNBits`` at its default optimization level, ``edgeq/matmulnbits.py``). Each 4-bit node
``Y = MatMulNBits(A, B, scales[, zero_points][, g_idx][, bias])`` becomes::

    W = DequantizeLinear(q [K, N] int4|uint4, scale [ceil(K/G), N], zero_point, axis=0, block_size=G)
    Y = MatMul(A, W)  (+ Add(., bias))

Unpacking (the inverse of ``edgeq.passes.methods.matmulnbits.pack_matmulnbits``; the contrib op's layout, which
``onnxruntime.quantization``'s MatMulNBits quantizer writes too): ``B`` uint8 ``[N, k_blocks,
G/2]`` (any shape of that size), low nibble = even row; the padding rows of a short last block are
dropped. Zero points: absent = 8 for every block; uint8 packed per column, two blocks a byte
(``[N * ceil(k_blocks/2)]`` or ``[N, ceil(k_blocks/2)]``); or float (same type and size as
``scales``, HQQ style), taken only when every value is an integer in [0, 15]. When every zero point
is 8 the weight is written signed, ``int4 q = code - 8`` with zero point 0 (what ``gptq`` writes for
symmetric weights), else ``uint4`` with the zero points as they are.

Exactness: FLOAT_EQUIV. The dequantized weights equal the kernel's bit for bit for uint8 or absent
zero points (checked by feeding the identity matrix as A); only the summation order of the GEMM
differs (tolerance ``FLOAT_EQUIV_RTOL``). Float zero points: onnxruntime's kernel computes
``q*s - zp*s`` (two roundings), the DequantizeLinear ``(q - zp)*s`` (one), so a weight may differ by
an ulp. ``accuracy_level`` is not carried over (the op's spec calls it a *minimum* accuracy for A):
the lowered graph computes in float, the semantics of levels 0/1; a node that had level 4 (int8 A
on CPUs with MLAS int8 kernels) moves by that quantization (~0.5 % of max|Y|), counted in the
summary. onnxruntime re-fuses the lowered form at its default session level with
``session.qdq_matmulnbits_accuracy_level`` (default 4).

Refused (left as they are, with the reason in the summary's ``nodes_refused``): ``bits`` != 4; a
``B``/``scales``/``zero_points``/``g_idx`` that is not a constant; sizes that do not match
``K``/``N``/``block_size``; scales other than float32/float16 (bfloat16); fractional or
out-of-range float zero points (HQQ's; no integer zero point expresses them); ``g_idx`` other than
the plain ``k // block_size`` (act-order groups are not contiguous blocks); and a plain ``g_idx``
together with zero points (onnxruntime 1.32's CPU kernel then ignores uint8 zero points, so the
node's meaning depends on the runtime). Nodes inside If/Loop/Scan bodies are lowered in place.
The default opset goes to 21 (``qdq_nodes.ensure_opset``: opset 18-20 graphs are bumped, older
ones refused with an error, only when some node is lowered); the ``com.microsoft`` import is
dropped once no node of that domain is left.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from edgeq.graph import ir
from edgeq.passes.methods.matmulnbits import BITS, DOMAIN
from edgeq.passmanager.passbase import Exactness, Pass, PassContext, PassNotApplicable, PassResult, Reason
from edgeq.quantize.qdq_nodes import ensure_opset, insert_weight_dequantize
from edgeq.quantize.quant import QuantSpec
from edgeq.targets.requant import read_constant

_SUFFIX = "_MatMulNBits"  # what edgeq.passes.methods.matmulnbits.insert_matmulnbits appends to the linear's name


class Refused(Exception):
    """A node this pass leaves as it is; the message is the reason reported in the summary."""


def unpack_matmulnbits(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int,
                       block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """The inverse of ``edgeq.passes.methods.matmulnbits.pack_matmulnbits``: (q [K, N], scale [ceil(K/G), N],
    zero point [ceil(K/G), N], signed). Codes and zero points are unsigned 4-bit values; when every
    zero point is 8 the result is signed (``q = code - 8``, zero point 0). Raises ``Refused`` when
    the arrays do not fit the op's layout."""
    if block_size < 2 or block_size % 2:
        raise Refused(f"block_size {block_size} is not an even number of rows")
    k_blocks = -(-k // block_size)
    blob = block_size * BITS // 8
    b = np.asarray(b)
    if b.dtype != np.uint8:
        raise Refused(f"B has type {b.dtype}, not packed uint8")
    if b.size != n * k_blocks * blob:
        raise Refused(f"B has {b.size} bytes, not N * ceil(K/block_size) * block_size/2 = {n * k_blocks * blob}")
    packed = b.reshape(n, k_blocks * blob)
    codes = np.empty((n, k_blocks * block_size), np.uint8)
    codes[:, 0::2] = packed & 0x0F  # low nibble = even row
    codes[:, 1::2] = packed >> 4
    codes = codes[:, :k].T  # [K, N]; a short last block's padding rows dropped

    scales = np.asarray(scales)
    if scales.dtype not in (np.float32, np.float16):
        raise Refused(f"scales of type {scales.dtype} (float32 and float16 are lowered)")
    if scales.size != n * k_blocks:
        raise Refused(f"scales have {scales.size} values, not N * ceil(K/block_size) = {n * k_blocks}")
    scale = np.ascontiguousarray(scales.reshape(n, k_blocks).T)  # [k_blocks, N]

    if zero_points is None:
        zp = np.full((k_blocks, n), 8, np.uint8)
    else:
        zero_points = np.asarray(zero_points)
        if zero_points.dtype == np.uint8:
            per_col = -(-k_blocks // 2)
            if zero_points.size != n * per_col:
                raise Refused(f"packed zero points have {zero_points.size} bytes, not N * ceil(k_blocks/2) = {n * per_col}")
            zpb = zero_points.reshape(n, per_col)
            both = np.empty((n, 2 * per_col), np.uint8)
            both[:, 0::2] = zpb & 0x0F  # low nibble = even block
            both[:, 1::2] = zpb >> 4
            zp = np.ascontiguousarray(both[:, :k_blocks].T)
        elif zero_points.dtype in (np.float32, np.float16):
            if zero_points.size != n * k_blocks:
                raise Refused(f"float zero points have {zero_points.size} values, not N * ceil(K/block_size) = {n * k_blocks}")
            zf = zero_points.astype(np.float64).reshape(n, k_blocks).T
            if not (np.all(zf == np.round(zf)) and zf.min() >= 0 and zf.max() <= 15):
                raise Refused("float zero points that are not integers in [0, 15] (e.g. HQQ's) have no integer "
                              "DequantizeLinear form")
            zp = np.ascontiguousarray(zf.astype(np.uint8))
        else:
            raise Refused(f"zero points of type {zero_points.dtype} (packed uint8 and float32/float16 are lowered)")

    if np.all(zp == 8):
        return codes.astype(np.int8) - 8, scale, np.zeros_like(zp, np.int8), True
    return codes, scale, zp, False


@dataclass
class _Plan:
    """One MatMulNBits node, decoded."""

    owner: gs.Graph
    node: gs.Node
    key: tuple  # the constants it reads (nodes sharing them share the new constants)
    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    signed: bool
    block_size: int
    bias: gs.Tensor | None
    float_zero_points: bool
    accuracy_level: int

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec("int4" if self.signed else "uint4", self.signed, axis=0, block_size=self.block_size)


def _optional(node: gs.Node, i: int) -> gs.Tensor | None:
    return node.inputs[i] if len(node.inputs) > i and node.inputs[i].name else None


def _constant(index: ir.GraphIndex, tensor: gs.Tensor, what: str) -> np.ndarray:
    value = read_constant(index, tensor)
    if value is None:
        raise Refused(f"{what} '{tensor.name}' is not a constant")
    return np.asarray(value)


def _plan(owner: gs.Graph, index: ir.GraphIndex, node: gs.Node) -> _Plan:
    attrs = node.attrs
    bits = int(attrs.get("bits", 4))
    if bits != BITS:
        raise Refused(f"bits={bits}: only 4-bit MatMulNBits is lowered")
    missing = [a for a in ("K", "N", "block_size") if a not in attrs]
    if missing:
        raise Refused(f"attribute(s) {', '.join(missing)} missing")
    k, n, g = int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"])
    if not 3 <= len(node.inputs) <= 6 or len(node.outputs) != 1:
        raise Refused(f"{len(node.inputs)} inputs and {len(node.outputs)} outputs (the op has 3 to 6 inputs, one output)")
    b = _constant(index, node.inputs[1], "B")
    scales = _constant(index, node.inputs[2], "scales")
    zp_t, g_idx_t, bias = _optional(node, 3), _optional(node, 4), _optional(node, 5)
    zps = _constant(index, zp_t, "zero_points") if zp_t is not None else None
    if g_idx_t is not None:
        g_idx = _constant(index, g_idx_t, "g_idx")
        if g_idx.shape != (k,) or not np.array_equal(g_idx, np.arange(k) // g):
            raise Refused("g_idx other than k // block_size (act-order groups are not contiguous blocks)")
        if zps is not None:
            raise Refused("g_idx together with zero points (onnxruntime's CPU kernel then ignores uint8 zero points)")
    q, scale, zp, signed = unpack_matmulnbits(b, scales, zps, k, n, g)
    key = (node.inputs[1].name, node.inputs[2].name, zp_t.name if zp_t is not None else "", k, n, g)
    return _Plan(owner, node, key, q, scale, zp, signed, g, bias,
                 zps is not None and zps.dtype != np.uint8, int(attrs.get("accuracy_level", 0)))


def _fresh(names: set[str], base: str) -> str:
    name, i = base, 0
    while name in names:
        i += 1
        name = f"{base}_{i}"
    names.add(name)
    return name


class MatMulNBitsToQDQPass(Pass, name="matmulnbits-to-qdq", per_block=True, exactness=Exactness.FLOAT_EQUIV,
                           summary="com.microsoft::MatMulNBits -> int4/uint4 block DequantizeLinear + MatMul (target lowering)"):
    def run(self, graph: gs.Graph, ctx: PassContext) -> PassResult:
        index = ir.GraphIndex(graph)
        sites = [(g, n) for g, n in ir.nodes_with_graphs(graph) if n.op == "MatMulNBits" and n.domain == DOMAIN]
        names = {n.name for _, n in ir.nodes_with_graphs(graph)}
        shared: dict[tuple, gs.Node] = {}
        refused: dict[str, str] = {}
        weights: Counter[str]
        levels: Counter[str]
        weights, bias_adds, float_zps, levels = Counter(), 0, 0, Counter()
        for owner, node in sites:  # one node at a time: only one weight is unpacked at once
            try:
                p = _plan(owner, index, node)
            except Refused as why:
                refused[node.name or node.outputs[0].name] = str(why)
                continue
            if not weights:  # before the first change; block DequantizeLinear and int4/uint4 need opset 21
                ensure_opset(graph, p.spec)
            self._rewrite(p, index, names, shared)
            weights[p.spec.dtype] += 1
            bias_adds += p.bias is not None
            float_zps += p.float_zero_points
            if p.accuracy_level not in (0, 1):  # computed in float now; level 4 quantized A to int8 in the kernel
                levels[str(p.accuracy_level)] += 1
        summary = {"nodes_rewritten": sum(weights.values()), "nodes_refused": refused}
        if not sites:
            raise PassNotApplicable(Reason.STRUCTURE_NOT_FOUND, "no com.microsoft MatMulNBits node", **summary)
        if not weights:  # the graph is unchanged: each node was refused before its rewrite
            raise PassNotApplicable(Reason.NO_SITES, f"every MatMulNBits node ({len(sites)}) was refused "
                                    "(nodes_refused says why)", **summary)
        graph.cleanup()
        if not any(n.domain == DOMAIN for _, n in ir.nodes_with_graphs(graph)):
            ir.drop_domain_import(graph, DOMAIN)
        summary.update(weights=dict(sorted(weights.items())), bias_adds=bias_adds)
        if float_zps:
            summary["float_zero_points_converted"] = float_zps
        if levels:
            summary["accuracy_levels_dropped"] = dict(sorted(levels.items()))
        return PassResult(True, summary)

    @staticmethod
    def _rewrite(p: _Plan, index: ir.GraphIndex, names: set[str], shared: dict[tuple, gs.Node]) -> None:
        """Replace ``p.node`` in its graph by DequantizeLinear (+ constants, shared between nodes
        reading the same packed weight) -> MatMul (-> Add bias)."""
        node, owner = p.node, p.owner
        base = node.name[: -len(_SUFFIX)] if node.name.endswith(_SUFFIX) else (node.name or node.outputs[0].name)
        a, y = node.inputs[0], node.outputs[0]
        dtype = p.scale.dtype
        if p.key in shared:  # same packed weight: its constants, a DequantizeLinear of its own (onnxruntime fuses one-reader DQs)
            first = shared[p.key]
            w = gs.Variable(ir.unique_name(index, f"{base}_dequantized"), dtype=dtype, shape=list(p.q.shape))
            owner.nodes.append(gs.Node("DequantizeLinear", _fresh(names, f"{base}_DequantizeLinear"), dict(first.attrs),
                                       list(first.inputs), [w]))
        else:
            w = insert_weight_dequantize(owner, index, np.broadcast_to(np.float32(0), p.q.shape), p.spec, base,
                                         (p.q, p.scale, p.zero_point))
            dq = owner.nodes[-1]
            dq.name = _fresh(names, dq.name)
            if dtype != np.float32:  # insert_weight_dequantize writes float32 scales; keep the model's type
                dq.inputs[1] = gs.Constant(dq.inputs[1].name, p.scale)
                w.dtype = dtype
            shared[p.key] = dq
        node.inputs.clear()
        node.outputs.clear()
        owner.nodes.remove(node)
        names.discard(node.name)  # the MatMul may take the name back (gptq's linear name, before "_MatMulNBits")
        if p.bias is None:
            owner.nodes.append(gs.Node("MatMul", _fresh(names, base), inputs=[a, w], outputs=[y]))
        else:
            mm = gs.Variable(ir.unique_name(index, f"{base}_matmul"), dtype=y.dtype)
            owner.nodes.append(gs.Node("MatMul", _fresh(names, base), inputs=[a, w], outputs=[mm]))
            owner.nodes.append(gs.Node("Add", _fresh(names, f"{base}_bias"), inputs=[mm, p.bias], outputs=[y]))
