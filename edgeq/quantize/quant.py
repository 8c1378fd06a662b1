"""Quantization specs and the numpy math behind every QDQ edgeq writes.

Specs are frozen dataclasses (pt2e style); scales and zero points are derived here and nowhere
else, so the graph, ``encodings.json`` and the numpy fake-quant reference used by tests agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx

from edgeq.errors import UserInputError

# dtype name -> (qmin, qmax, onnx elem type, numpy storage dtype, minimum default-domain opset)
_DTYPES = {
    "int8": (-128, 127, onnx.TensorProto.INT8, np.int8, 13),
    "uint8": (0, 255, onnx.TensorProto.UINT8, np.uint8, 13),
    "int16": (-32768, 32767, onnx.TensorProto.INT16, np.int16, 21),
    "uint16": (0, 65535, onnx.TensorProto.UINT16, np.uint16, 21),
    "int4": (-8, 7, onnx.TensorProto.INT4, np.int8, 21),
    "uint4": (0, 15, onnx.TensorProto.UINT4, np.uint8, 21),
}


@dataclass(frozen=True)
class QuantSpec:
    """One quantization choice: integer type, symmetry, and granularity.

    ``axis`` is the channel axis for per-channel scales (None: per-tensor); ``block_size`` > 0
    means blocks of that many elements along ``axis`` (opset 21 block quantization).
    Symmetric specs use the restricted range [-qmax, qmax] (zero point 0, or the midpoint for
    unsigned types) so that negation is exact and integer kernels need no zero-point correction.

    ``value_bits`` (0: the storage type's width) narrows the usable integer range inside the
    storage type, e.g. 6-bit values in int8 storage: how bit-width sweeps (A6W8, W5A8) are
    expressed with the integer types ONNX has. Activations then need a Clip after the
    QuantizeLinear (``qdq_nodes.insert_quantize`` adds it); weights are quantized offline.

    ``pair_axis`` (weights only; None: no bound) is the K axis of a weight that onnxruntime's
    uint8 x int8 kernel will read: a symmetric 8-bit int8 weight then gets the pair-bounded grid
    that cannot saturate VPMADDUBSW on CPUs without VNNI (``edgeq.targets.saturation``). Other
    dtypes and widths cannot saturate and ignore it.
    """

    dtype: str = "int8"
    symmetric: bool = True
    axis: int | None = None
    block_size: int = 0
    value_bits: int = 0
    pair_axis: int | None = None

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise UserInputError(f"unknown quantized dtype '{self.dtype}' (known: {', '.join(_DTYPES)})")
        storage = int(np.log2(_DTYPES[self.dtype][1] - _DTYPES[self.dtype][0] + 1))
        if self.value_bits and not 2 <= self.value_bits <= storage:
            raise UserInputError(f"{self.value_bits}-bit values do not fit {self.dtype} (2 to {storage} bits)")

    @property
    def narrowed(self) -> bool:
        """Whether the usable range is narrower than the storage type's."""
        return bool(self.value_bits) and (self.qmin, self.qmax) != _DTYPES[self.dtype][:2]

    @property
    def qmin(self) -> int:
        lo = _DTYPES[self.dtype][0]
        if not self.value_bits:
            return lo
        return -(2 ** (self.value_bits - 1)) if lo < 0 else 0

    @property
    def qmax(self) -> int:
        lo, hi = _DTYPES[self.dtype][:2]
        if not self.value_bits:
            return hi
        return 2 ** (self.value_bits - 1) - 1 if lo < 0 else 2 ** self.value_bits - 1

    @property
    def onnx_type(self) -> int:
        return _DTYPES[self.dtype][2]

    @property
    def np_dtype(self):
        return _DTYPES[self.dtype][3]

    @property
    def min_opset(self) -> int:
        return _DTYPES[self.dtype][4]

    @property
    def bits(self) -> int:
        return int(np.log2(self.qmax - self.qmin + 1))

    @property
    def signed(self) -> bool:
        return _DTYPES[self.dtype][0] < 0


def require_finite(values: np.ndarray, what: str) -> None:
    """Refuse (one line naming ``what``) values about to be quantized that hold NaN or inf: their
    scale would be NaN or inf, and so would everything the model computes from them. Checked in
    slices, so a vocabulary head needs no full-size temporary."""
    flat = np.asarray(values).reshape(-1)
    step = 1 << 24
    for start in range(0, flat.size, step):
        bad = np.flatnonzero(~np.isfinite(flat[start:start + step]))
        if bad.size:
            first = start + int(bad[0])
            where = np.unravel_index(first, np.shape(values))
            count = int(np.count_nonzero(~np.isfinite(flat)))
            raise UserInputError(f"{what} holds {count} non-finite value(s) (NaN or inf; first {flat[first]} at "
                                 f"index {[int(i) for i in where]}): it cannot be quantized; fix or re-export the model")


def scale_zero_point(lo: np.ndarray, hi: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point covering [lo, hi] (arrays broadcast; zero is always representable)."""
    lo = np.minimum(np.asarray(lo, np.float64), 0.0)
    hi = np.maximum(np.asarray(hi, np.float64), 0.0)
    tiny = np.finfo(np.float32).tiny
    if spec.symmetric:
        half = (spec.qmax - spec.qmin) // 2  # 127 for int8/uint8, 7 for int4
        scale = np.maximum(np.maximum(-lo, hi) / half, tiny)
        mid = 0 if spec.signed else (spec.qmax + spec.qmin + 1) // 2
        zp = np.full(scale.shape, mid, np.int64)
    else:
        scale = np.maximum((hi - lo) / (spec.qmax - spec.qmin), tiny)
        zp = np.clip(np.round(spec.qmin - lo / scale), spec.qmin, spec.qmax).astype(np.int64)
    return scale.astype(np.float32), zp.astype(spec.np_dtype)


def quantize(x: np.ndarray, scale: np.ndarray, zp: np.ndarray, spec: QuantSpec) -> np.ndarray:
    """QuantizeLinear semantics: round half to even, saturate."""
    q = np.round(x.astype(np.float32) / scale) + zp.astype(np.float32)
    return np.clip(q, spec.qmin, spec.qmax).astype(spec.np_dtype)


def dequantize(q: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> np.ndarray:
    return ((q.astype(np.float32) - zp.astype(np.float32)) * scale).astype(np.float32)


def expand_blocks(param: np.ndarray, axis: int, block_size: int, length: int) -> np.ndarray:
    """Repeat block parameters along ``axis`` so they broadcast against the full tensor."""
    return np.repeat(param, block_size, axis=axis).take(np.arange(length), axis=axis)


def quantize_weight(w: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize a constant weight per tensor, per channel (``spec.axis``) or per block.

    Returns (q, scale, zero_point) in the layout DequantizeLinear expects: per-channel parameters
    are 1-D along ``axis``; block parameters have the weight's shape with ``axis`` divided
    (rounded up) by ``block_size``.
    """
    w = np.asarray(w, np.float32)
    if pair_bounded(spec, w.ndim):
        return _quantize_pair_bounded(w, spec)
    if spec.axis is None:
        scale, zp = scale_zero_point(w.min(), w.max(), spec)
        return quantize(w, scale, zp, spec), scale, zp
    axis = spec.axis % w.ndim
    if spec.block_size:
        n = w.shape[axis]
        nblocks = -(-n // spec.block_size)
        pad = nblocks * spec.block_size - n
        padded = np.pad(w, [(0, pad) if a == axis else (0, 0) for a in range(w.ndim)])
        shape = list(padded.shape)
        shape[axis:axis + 1] = [nblocks, spec.block_size]
        blocks = padded.reshape(shape)
        scale, zp = scale_zero_point(blocks.min(axis=axis + 1), blocks.max(axis=axis + 1), spec)
        full_scale = expand_blocks(scale, axis, spec.block_size, n)
        full_zp = expand_blocks(zp, axis, spec.block_size, n)
        return quantize(w, full_scale, full_zp, spec), scale, zp
    reduce_axes = tuple(a for a in range(w.ndim) if a != axis)
    scale, zp = scale_zero_point(w.min(axis=reduce_axes), w.max(axis=reduce_axes), spec)
    bshape = [1] * w.ndim
    bshape[axis] = -1
    return quantize(w, scale.reshape(bshape), zp.reshape(bshape), spec), scale, zp


def dequantize_weight(q: np.ndarray, scale: np.ndarray, zp: np.ndarray, spec: QuantSpec) -> np.ndarray:
    """Inverse of ``quantize_weight`` (the numpy reference of the weight's DequantizeLinear)."""
    if spec.axis is None:
        return dequantize(q, scale, zp)
    axis = spec.axis % q.ndim
    if spec.block_size:
        n = q.shape[axis]
        return dequantize(q, expand_blocks(scale, axis, spec.block_size, n), expand_blocks(zp, axis, spec.block_size, n))
    bshape = [1] * q.ndim
    bshape[axis] = -1
    return dequantize(q, scale.reshape(bshape), zp.reshape(bshape))


def pair_bounded(spec: QuantSpec, ndim: int) -> bool:
    """Whether ``quantize_weight`` puts this weight on the u8s8 pair-bounded grid: a symmetric
    full-width int8 weight, per tensor or per channel, 2-D, with a K axis given."""
    return (spec.pair_axis is not None and spec.dtype == "int8" and spec.symmetric and not spec.block_size
            and not spec.narrowed and ndim == 2 and (spec.axis is None or spec.axis % 2 != spec.pair_axis % 2))


def _quantize_pair_bounded(w: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k_axis = cast(int, spec.pair_axis) % 2  # pair_bounded(spec): pair_axis is set
    q_kn, scale = quantize_pair_bounded(np.moveaxis(w, k_axis, 0), per_channel=spec.axis is not None)
    q = np.moveaxis(q_kn, 0, k_axis).astype(spec.np_dtype)
    scale = np.asarray(scale, np.float32)
    return q, scale, np.zeros(scale.shape, spec.np_dtype)


# ---------------------------------------------------------------- the u8s8 pair-bounded int8 grid
# onnxruntime's uint8 x int8 kernel on x86 without VNNI sums adjacent K pairs of products into a
# saturating int16 (edgeq.targets.saturation has the kernel model and what MLAS does). With
# activation codes anywhere in [0, 255], |u0 q0 + u1 q1| <= 255 (|q0| + |q1|) for same-sign pairs
# and 255 max(|q0|, |q1|) otherwise, so codes with |q0| + |q1| <= 128 in every same-sign adjacent
# pair along K never saturate (255 x 128 = 32640; 129 would overflow). The grid's per-channel scale
# is max(largest same-sign pair sum / 128, max |w| / 127): between the 8-bit grid and the 7-bit one
# of onnxruntime's reduce_range / NNCF's overflow_fix, never coarser than the 7-bit one.

# Per-channel work on a [K, N] weight runs in column blocks of about this many elements: its
# float64 and int64 temporaries on a 128k-vocabulary head would otherwise take several GB. Columns
# are independent, so the result is the same as in one piece.
COLUMN_BLOCK_ELEMENTS = 1 << 22


def column_blocks(w_kn: np.ndarray) -> list[slice]:
    """Slices of the columns of ``w_kn`` ([K, N]) of about ``COLUMN_BLOCK_ELEMENTS`` each."""
    k, n = w_kn.shape[0], int(np.prod(w_kn.shape[1:], dtype=np.int64))
    step = max(1, COLUMN_BLOCK_ELEMENTS // max(k, 1))
    return [slice(j, min(j + step, n)) for j in range(0, n, step)]


ACTIVATION_CODE_MAX = 255
PAIR_LIMIT = 32767 // ACTIVATION_CODE_MAX  # 128: the largest same-sign |q0| + |q1| that cannot saturate
INT8_SYMMETRIC_MAX = 127


def adjacent_pairs(q_kn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (2j, 2j + 1) rows of a [K, ...] array, K zero-padded to even (MLAS pads K with zeros)."""
    q = np.asarray(q_kn)
    if q.shape[0] % 2:
        q = np.concatenate([q, np.zeros((1,) + q.shape[1:], q.dtype)])
    return q[0::2], q[1::2]


def pair_magnitudes(q_kn: np.ndarray) -> np.ndarray:
    """Worst-case ``|u0 q0 + u1 q1| / 255`` of each adjacent K pair over u in [0, 255]^2:
    ``|q0| + |q1|`` for same-sign pairs, ``max(|q0|, |q1|)`` otherwise. Shape [ceil(K/2), ...]."""
    a, b = adjacent_pairs(q_kn)
    if np.issubdtype(a.dtype, np.integer):
        a, b = a.astype(np.int64), b.astype(np.int64)
    same = (a >= 0) == (b >= 0)
    return np.where(same, np.abs(a) + np.abs(b), np.maximum(np.abs(a), np.abs(b)))


def worst_pair(q_kn: np.ndarray) -> np.ndarray:
    """Per output column (all trailing axes) the largest ``pair_magnitudes``; <= 128 is safe."""
    if np.ndim(q_kn) == 2 and np.size(q_kn) > COLUMN_BLOCK_ELEMENTS:
        return np.concatenate([pair_magnitudes(q_kn[:, cols]).max(axis=0) for cols in column_blocks(q_kn)])
    return pair_magnitudes(q_kn).max(axis=0)


def is_saturation_free(q_kn: np.ndarray) -> bool:
    return bool(np.all(worst_pair(q_kn) <= PAIR_LIMIT))


def pair_bounded_scale(w_kn: np.ndarray, per_channel: bool = True) -> np.ndarray:
    """The finest symmetric int8 scale whose codes cannot saturate the u8s8 kernel (see module
    docstring). ``w_kn`` is [K, N]; returns [N] (per channel) or a scalar (per tensor)."""
    if per_channel and np.ndim(w_kn) == 2 and np.size(w_kn) > COLUMN_BLOCK_ELEMENTS:
        return np.concatenate([pair_bounded_scale(w_kn[:, cols]) for cols in column_blocks(w_kn)])
    w = np.asarray(w_kn, np.float64)
    mag = pair_magnitudes(w)  # same formula on real values
    if per_channel:
        need = np.maximum(mag.max(axis=0) / PAIR_LIMIT, np.abs(w).max(axis=0) / INT8_SYMMETRIC_MAX)
    else:
        need = np.maximum(mag.max() / PAIR_LIMIT, np.abs(w).max() / INT8_SYMMETRIC_MAX)
    return np.maximum(need, np.finfo(np.float32).tiny).astype(np.float32)


def fix_pairs(q_kn: np.ndarray, target_kn: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Codes with every same-sign adjacent pair at ``|q0| + |q1| <= 128``: the excess is taken off
    the magnitude of the element whose rounding went up the most (``|q| - |target|``; without
    ``target`` the larger element), the rest off the other. Returns (codes, pairs changed)."""
    q = np.array(q_kn, np.int64)
    target = np.asarray(target_kn, np.float64) if target_kn is not None else q.astype(np.float64)
    odd = q.shape[0] % 2
    if odd:
        q = np.concatenate([q, np.zeros((1,) + q.shape[1:], np.int64)])
        target = np.concatenate([target, np.zeros((1,) + target.shape[1:])])
    a, b = q[0::2], q[1::2]
    excess = np.where((a >= 0) == (b >= 0), np.abs(a) + np.abs(b) - PAIR_LIMIT, 0)
    over = excess > 0
    changed = int(over.sum())
    if changed:
        first_a = (np.abs(a) - np.abs(target[0::2])) >= (np.abs(b) - np.abs(target[1::2]))
        big, small = np.where(first_a, a, b), np.where(first_a, b, a)
        cut_big = np.minimum(np.where(over, excess, 0), np.abs(big))
        cut_small = np.where(over, excess, 0) - cut_big
        big = big - np.sign(big) * cut_big
        small = small - np.sign(small) * cut_small
        q[0::2] = np.where(first_a, big, small)
        q[1::2] = np.where(first_a, small, big)
    return (q[:-1] if odd else q), changed


def quantize_pair_bounded(w_kn: np.ndarray, per_channel: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes [K, N] and scale ([N] or scalar) on the pair-bounded grid."""
    if per_channel and np.ndim(w_kn) == 2 and np.size(w_kn) > COLUMN_BLOCK_ELEMENTS:
        q = np.empty(np.shape(w_kn), np.int8)
        scale = np.empty(np.shape(w_kn)[1], np.float32)
        for cols in column_blocks(w_kn):
            q[:, cols], scale[cols] = quantize_pair_bounded(w_kn[:, cols])
        return q, scale
    w = np.asarray(w_kn, np.float32)
    scale = pair_bounded_scale(w, per_channel)
    target = w / (scale if per_channel else scale.reshape(()))
    q = np.clip(np.round(target), -INT8_SYMMETRIC_MAX, INT8_SYMMETRIC_MAX)
    q, _ = fix_pairs(q.astype(np.int64), target)
    return q, scale
