"""The packed low-bit code layout of ``edgeq::VisualKVAttention`` / ``VisualKVAttentionKIVI``
(numpy): packing, unpacking, channel-wise and per-token min/max quantization.

Bits b in {1, 2, 4, 8}; G = 8 / b codes per byte along head_dim (D a multiple of G), MSB first
(CalibQuant A.1): entry i of a group is stored shifted left by 8 - b * (i + 1), so
``code[g * G + i] = (byte[g] >> (8 - b * (i + 1))) & (2^b - 1)`` (b = 2: [3, 0, 1, 2] -> 198;
b = 1: [1, 0, 1, 1, 0, 0, 0, 1] -> 0b10110001; b = 4: [3, 10] -> 0x3A = 58, the first entry in
the high nibble; b = 8: one code per byte, shift 0). The ops' spec is ``visual_kv_attention``'s
docstring; code that packs or quantizes for them imports these names from here. The Triton
kernels (``kernels/``) have their own torch packing at 1 and 2 bits (same bit order).
"""

from __future__ import annotations

import numpy as np

_PREFIX = "VisualKVAttention"  # error messages: the op whose inputs these are
SUPPORTED_BITS = (1, 2, 4, 8)


def _check_bits(bits, op: str = _PREFIX) -> int:
    if bits is None:
        raise ValueError(f"{op}: the bits attribute is required (one of {SUPPORTED_BITS})")
    if int(bits) != bits or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"{op}: bits {bits} not in {SUPPORTED_BITS}")
    return int(bits)


def _group(bits: int) -> int:
    """Codes per byte."""
    return 8 // bits


def pack_codes(codes, bits: int) -> np.ndarray:
    """uint8 [..., D * b / 8] from integer codes [..., D] in [0, 2^b - 1], MSB first: entry i of
    each group of 8 / b is shifted left by 8 - b * (i + 1) (CalibQuant A.1)."""
    bits = _check_bits(bits)
    c = np.asarray(codes)
    g = _group(bits)
    if c.ndim < 1 or c.shape[-1] % g:
        raise ValueError(f"{_PREFIX}: head_dim {c.shape[-1] if c.ndim else None} is not a multiple of {g} (8 / bits)")
    if c.size and (c.min() < 0 or c.max() > 2 ** bits - 1):
        raise ValueError(f"{_PREFIX}: codes outside [0, {2 ** bits - 1}]")
    grouped = c.astype(np.uint8).reshape(*c.shape[:-1], c.shape[-1] // g, g)
    shifts = (8 - bits * (np.arange(g) + 1)).astype(np.uint8)
    return np.bitwise_or.reduce(np.left_shift(grouped, shifts), axis=-1).astype(np.uint8)


def unpack_codes(packed, bits: int, d: int) -> np.ndarray:
    """uint8 codes [..., d] from packed bytes [..., d * b / 8] (the inverse of ``pack_codes``)."""
    bits = _check_bits(bits)
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        raise ValueError(f"{_PREFIX}: packed codes must be uint8, got {p.dtype}")
    g = _group(bits)
    if d % g or p.ndim < 1 or p.shape[-1] * g != d:
        raise ValueError(f"{_PREFIX}: packed width {p.shape[-1] if p.ndim else None} does not hold head_dim {d} "
                         f"at {bits} bits (needs {d} * {bits} / 8 = {d * bits / 8:g} bytes)")
    shifts = (8 - bits * (np.arange(g) + 1)).astype(np.uint8)
    codes = np.right_shift(p[..., None], shifts) & np.uint8(2 ** bits - 1)
    return codes.reshape(*p.shape[:-1], d).astype(np.uint8)


_REDUCE = {"channel": (-2,), "token": (-1,), "global": (-2, -1)}


def quantize_rows(x, bits: int, axis: str = "channel", clip: float = 1.0,
                  name: str = "quantize_rows") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric min/max quantization of x [..., N, D]; ``axis`` picks what one range covers:
    ``channel`` (per channel over the N tokens; alpha/scale float32 [..., 1, D]), ``token`` (per
    token over its D channels; [..., N, 1]) or ``global`` ([..., 1, 1]). ``clip`` < 1 shrinks each
    range about its midpoint (values outside saturate). ``alpha`` = the range's low end,
    ``scale = (high - low) / (2^b - 1)``; codes uint8 [..., N, D] = clip(round((x - alpha) /
    scale), 0, 2^b - 1), rounding half to even, in float32. A constant range gets scale 0 and codes
    0, so it dequantizes to alpha exactly. Returns ``(codes, alpha, scale)``; pack the codes with
    ``pack_codes``. ``name``: the caller, for error messages."""
    bits = _check_bits(bits)
    x = np.asarray(x, np.float32)
    if x.ndim < 2 or x.shape[-2] == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} needs [..., N >= 1, D >= 1], got {x.shape}")
    reduce = _REDUCE[axis]
    lo, hi = x.min(axis=reduce, keepdims=True), x.max(axis=reduce, keepdims=True)
    if clip != 1.0:
        mid, half = (lo + hi) / np.float32(2), (hi - lo) / np.float32(2) * np.float32(clip)
        lo, hi = mid - half, mid + half
    scale = ((hi - lo) / np.float32(2 ** bits - 1)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.round((x - lo) / safe), 0, 2 ** bits - 1).astype(np.uint8)
    return codes, lo.astype(np.float32), scale


def quantize_channelwise(x, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CalibQuant's channel-wise quantization (Eq. 3/5): ``quantize_rows`` over the tokens, one
    (alpha, scale) per (leading index, channel), float32 [..., 1, D]."""
    return quantize_rows(x, bits, "channel", name="quantize_channelwise")


def quantize_pertoken(x, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """KIVI's per-token quantization of values: ``quantize_rows`` over the channels, one
    (alpha, scale) per token, float32 [..., N, 1]."""
    return quantize_rows(x, bits, "token", name="quantize_pertoken")


def dequantize_channelwise(codes, alpha, scale) -> np.ndarray:
    """float64 ``codes * scale + alpha`` (the cache the op never forms; for checks and error
    measurements). Any layout that broadcasts: channel-wise [..., 1, D], global [..., 1, 1],
    per token [..., N, 1]."""
    return np.asarray(codes, np.float64) * np.asarray(scale, np.float64) + np.asarray(alpha, np.float64)
