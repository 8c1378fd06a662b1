"""Lowering of block-quantized 4-bit weights to onnxruntime's ``com.microsoft::MatMulNBits``.

Why: ``MatMulNBits`` is onnxruntime's CPU (MLAS) 4-bit weight-only kernel: the weight stays packed
(two codes a byte, one scale per block of ``block_size`` rows of one output column) and is
dequantized block by block inside the GEMM/GEMV, instead of materializing a float weight.
Use it when a user asks for onnxruntime CPU speed (W4A16-style LLM decoding); other runtimes do
not know the contrib op, so the portable output stays ``DequantizeLinear(block) + MatMul``.

Layout written here (the contrib op's spec, confirmed against
``onnxruntime.quantization.matmul_nbits_quantizer``, whose QOperator path quantizes the same way):

* ``B`` uint8 ``[N, k_blocks, blob]``, ``k_blocks = ceil(K / G)``, ``blob = G * 4 / 8``: column
  ``n`` of W, split into blocks of ``G`` rows along K; inside a byte the low nibble holds the even
  row and the high nibble the odd row. Codes are unsigned 4-bit [0, 15].
* ``scales`` float32 ``[N, k_blocks]`` (the transpose of our ``[ceil(K/G), N]``); negative scales
  are fine (it is a plain multiply).
* ``zero_points`` (optional) uint8 ``[N * ceil(k_blocks / 2)]``: per column, two blocks a byte,
  low nibble = even block, the unused nibble of an odd ``k_blocks`` left 0. When absent, the zero
  point of every block is 8 (``2^(bits-1)``).
* ``W[k, n] = (code - zp) * scale``; ``Y = A @ W`` with ``A [..., K]``.

Our weights (``edgeq.passes.methods.gptq.GptqResult``): integers ``q [K, N]`` with ``W = (q - zp) * scale``.
Symmetric signed int4 (``q`` in [-8, 7], zero point 0, scales possibly negative for 'full range'
weights) become ``q + 8`` with the default zero point 8, so no ``zero_points`` input; asymmetric
uint4 (``q`` in [0, 15], zero points in [0, 15]) keep their codes and pass packed zero points.
When ``K`` is not a multiple of ``G`` the last block is padded with each column's zero-point code,
so the padding dequantizes to exactly 0 (the kernel reads only K rows of A anyway).

Fusion by onnxruntime itself: onnxruntime's QDQ optimizer (``DQMatMulToMatMulNBits``, a
selector/action of the QDQ transformer, CPU EP) rewrites a constant
``DequantizeLinear(int4/uint4, axis=0, block_size=G) -> MatMul`` into ``MatMulNBits`` at session
creation. Checked with onnxruntime 1.31.1 CPU by saving the optimized model
(``SessionOptions.optimized_model_filepath``) and counting nodes (``tests/test_matmulnbits.py``
pins all of this):

* it DOES fuse, at ``ORT_ENABLE_EXTENDED`` and ``ORT_ENABLE_ALL`` (the default), both signed int4
  with negative scales (zero point 0) and uint4 with zero points, for K = 256 / 96 (G = 128 / 32)
  and K = 576 with G = 128 (short last block): the graph becomes a single MatMulNBits;
* not at ``ORT_ENABLE_BASIC``, nor with ``session.disable_quant_qdq = 1`` (then the DQ is
  constant-folded into a float weight and a plain MatMul runs);
* its packed B and scales are byte-identical to ``pack_matmulnbits``'s except the padding rows of
  a short last block (onnxruntime writes code 0 there, we write the zero point; the kernel never
  reads them against real A values), and it always passes explicit zero points (0x88 bytes for
  signed int4) where we omit the input.

So on onnxruntime CPU with default settings the portable DQ + MatMul form already runs the 4-bit
kernel. Writing ``MatMulNBits`` ourselves is for (a) graphs loaded without that optimizer pass
(``ORT_DISABLE_ALL``/basic levels, pre-optimized ORT-format models), (b) fixing ``accuracy_level`` per node in the model, not per
session, and (c) no repacking work at load.

accuracy_level subtlety: the fused op gets the session config
``session.qdq_matmulnbits_accuracy_level``, whose default is **4** (documented in
onnxruntime_session_options_config_keys.h and seen in the saved model): the CPU kernel then
quantizes A to int8 per block on the fly (where MLAS has an int8 kernel: x86 AVX2/AVX-512,
ARM NEON), which in our tests (x86, AVX-512 VNNI) moves Y by ~0.4-0.7 % of max|Y|
relative to the float DequantizeLinear + MatMul (run with optimizations disabled). With the
config set to "1" (fp32 compute) the fused op matches the float result to ~1e-6 relative. So
enabling graph optimizations silently changes the numerics of a DQ + MatMul model; evaluate
accuracy under the session settings you ship. ``matmulnbits_node`` defaults to 0 (attribute
omitted, as onnxruntime's quantizer does, since non-CPU EPs often reject it), which the CPU kernel
treats as fp32 compute; pass 4 for the int8 path (same numbers as the fused default).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

BITS = 4
DOMAIN = "com.microsoft"


def _check_group_size(group_size: int) -> None:
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"MatMulNBits needs a block size that is a power of two >= 16, got {group_size}")


def pack_matmulnbits(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, group_size: int,
                     signed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Repack our blockwise 4-bit weight for ``MatMulNBits``.

    q: integers [K, N] (signed int4 in [-8, 7] when ``signed``, else uint4 in [0, 15]);
    scale: float [ceil(K/G), N] (or [N] when K <= G); zero_point: same shape as scale (or None
    for 0 when signed). Returns (B uint8 [N, k_blocks, G/2], scales float32 [N, k_blocks],
    zero_points uint8 [N * ceil(k_blocks/2)] or None when every block uses the default 8).
    """
    _check_group_size(group_size)
    q = np.asarray(q)
    if q.ndim != 2:
        raise ValueError(f"expected a [K, N] weight, got shape {q.shape}")
    k, n = q.shape
    k_blocks = -(-k // group_size)
    scale = np.asarray(scale, np.float32).reshape(k_blocks, n)
    zp = np.zeros((k_blocks, n), np.int64) if zero_point is None else np.asarray(zero_point).astype(np.int64).reshape(k_blocks, n)
    q = q.astype(np.int64)
    lo, hi = (-8, 7) if signed else (0, 15)
    for what, v in (("weights", q), ("zero points", zp)):
        if v.size and (v.min() < lo or v.max() > hi):
            raise ValueError(f"{what} outside the {'int4' if signed else 'uint4'} range [{lo}, {hi}]")
    offset = 8 if signed else 0
    codes, zp_codes = q + offset, zp + offset  # unsigned codes in [0, 15]

    padded = np.repeat(zp_codes, group_size, axis=0)  # [k_blocks*G, N], padding = zero point -> 0
    padded[:k] = codes
    blocks = padded.T.reshape(n, k_blocks, group_size).astype(np.uint8)
    b = (blocks[..., 0::2] | (blocks[..., 1::2] << 4)).astype(np.uint8)  # low nibble = even row

    scales = np.ascontiguousarray(scale.T)
    if np.all(zp_codes == 8):
        return b, scales, None
    zpt = zp_codes.T.astype(np.uint8)  # [N, k_blocks]
    if k_blocks % 2:
        zpt = np.concatenate([zpt, np.zeros((n, 1), np.uint8)], axis=1)
    zp_packed = (zpt[:, 0::2] | (zpt[:, 1::2] << 4)).astype(np.uint8).reshape(-1)  # low nibble = even block
    return b, scales, zp_packed


def matmulnbits_node(name: str, x_name: str, y_name: str, k: int, n: int, group_size: int, b_name: str,
                     scales_name: str, zp_name: str | None = None, accuracy_level: int = 0) -> onnx.NodeProto:
    """A ``com.microsoft::MatMulNBits`` node computing ``y = x @ W`` (x [..., K], y [..., N]).

    ``accuracy_level`` 0 is written by omitting the attribute (onnxruntime's quantizer does the
    same; non-CPU EPs often reject it); 4 makes the CPU kernel quantize x to int8 per block.
    """
    _check_group_size(group_size)
    inputs = [x_name, b_name, scales_name] + ([zp_name] if zp_name else [])
    attrs: dict[str, Any] = {"K": int(k), "N": int(n), "bits": BITS, "block_size": int(group_size)}
    if accuracy_level:
        attrs["accuracy_level"] = int(accuracy_level)
    return onnx.helper.make_node("MatMulNBits", inputs, [y_name], name=name, domain=DOMAIN, **attrs)


def insert_matmulnbits(graph, x, y, q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None,
                       group_size: int, signed: bool, base: str, accuracy_level: int = 0):
    """graphsurgeon variant: append a MatMulNBits node computing ``y = x @ W`` to ``graph``
    (``x``, ``y`` gs.Variables; constants named ``{base}_...``) and return it. Exporting the graph
    adds the ``com.microsoft`` opset import by itself. Constant names must be unique in the
    graph; the caller picks ``base`` (e.g. via ``edgeq.graph.ir.unique_name``)."""
    import onnx_graphsurgeon as gs

    b, scales, zp = pack_matmulnbits(q, scale, zero_point, group_size, signed)
    k, n = np.shape(q)
    inputs = [x, gs.Constant(f"{base}_MatMulNBits_B", b), gs.Constant(f"{base}_MatMulNBits_scales", scales)]
    if zp is not None:
        inputs.append(gs.Constant(f"{base}_MatMulNBits_zero_points", zp))
    attrs = {"K": int(k), "N": int(n), "bits": BITS, "block_size": int(group_size)}
    if accuracy_level:
        attrs["accuracy_level"] = int(accuracy_level)
    node = gs.Node("MatMulNBits", f"{base}_MatMulNBits", attrs, inputs, [y], domain=DOMAIN)
    graph.nodes.append(node)
    return node
