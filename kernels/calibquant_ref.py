"""CalibQuant (paper 001) reference: 1/2-bit channel-wise visual KV cache, post-scaled decode attention.

Why: the Triton decode kernels (``calibquant_triton``) never materialize the dequantized cache; this
module states, in plain torch (CPU or GPU, any float dtype, float64 by default), exactly what they
compute, so that the GPU tests and the benchmark can check them. Torch only: the CPU suite imports it.

Quantization (section 4.1, Eq. 5), per (batch, kv head, channel) over the N cached tokens:
``alpha = min_t x``, ``beta = max_t x``, ``scale = (beta - alpha) / (2^b - 1)``,
``code = clip(round((x - alpha) / scale), 0, 2^b - 1)`` (round half to even, float32 arithmetic);
a channel with ``beta == alpha`` stores ``scale = 0`` and codes 0 (it dequantizes to alpha exactly).

Packing (appendix A.1, MSB first) along head_dim into uint8: ``PER = 8 / b`` consecutive channels
form one byte; element ``i`` (0-based) of a group sits at shift ``8 - b (i + 1)``: for b = 1 channel
8j is bit 7 of byte j, channel 8j + 7 bit 0; for b = 2 channel 4j is bits 7..6. Unpacking is
``(byte >> (8 - b (i + 1))) & (2^b - 1)``. Packed shape ``[B, KVH, N, D * b / 8]``.

Post-scaled attention (Eq. 6) for one decode query per head, ``q [B, H, D]``, GQA allowed (query
head h reads kv head ``h // (H / KVH)``, the ``repeat_kv`` convention):
``logit_t = ((q * scale_k) . code_k[t] + q . alpha_k) * sm_scale`` (sm_scale = 1/sqrt(D));
calibration (section 4.2, Eq. 7) over that head's logits ``[gamma, delta]`` (min, max over tokens):
``g(x) = (delta - gamma + tau1 - tau2) / (delta - gamma) * (x - gamma) + gamma - tau1``, skipped
where ``delta == gamma``; ``p = softmax(g(logit))``; ``out = scale_v * (p . code_v) + alpha_v * sum(p)``.
``dequant_attention_ref`` dequantizes first (``alpha + code * scale``) and attends: the same value
up to rounding (the identity the kernels rely on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BITS = (1, 2)


@dataclass
class CalibQuantCache:
    """One quantized K or V cache: ``packed`` uint8 ``[B, KVH, N, D*b/8]``, ``alpha`` / ``scale``
    float32 ``[B, KVH, D]`` (the per-channel minimum and step)."""

    packed: torch.Tensor
    alpha: torch.Tensor
    scale: torch.Tensor
    bits: int

    @property
    def head_dim(self) -> int:
        return self.alpha.shape[-1]

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.packed, self.alpha, self.scale, self.bits)


def _check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    return 8 // bits


def shifts(bits: int) -> list[int]:
    """The left shift of element i of a byte's group: ``8 - b (i + 1)`` (MSB first)."""
    return [8 - bits * (i + 1) for i in range(_check_bits(bits))]


def quantize_channelwise(x: torch.Tensor, bits: int):
    """``x [..., N, D]`` -> (codes uint8 ``[..., N, D]``, alpha, scale float32 ``[..., D]``)."""
    _check_bits(bits)
    if x.dim() < 2 or x.shape[-2] == 0:
        raise ValueError(f"quantize_channelwise: need [..., N, D] with N > 0, got {tuple(x.shape)}")
    xf = x.to(torch.float32)
    alpha = xf.amin(dim=-2)
    beta = xf.amax(dim=-2)
    scale = (beta - alpha) / (2**bits - 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero range: codes 0, scale 0
    codes = torch.round((xf - alpha.unsqueeze(-2)) / safe.unsqueeze(-2)).clamp_(0, 2**bits - 1)
    return codes.to(torch.uint8), alpha, scale


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (D a multiple of 8 / b) -> uint8 ``[..., D * b / 8]``, MSB first."""
    per = _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_codes: need uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % per:
        raise ValueError(f"pack_codes: head_dim {codes.shape[-1]} is not a multiple of {per}")
    if codes.numel() and int(codes.max()) >= 2**bits:
        raise ValueError(f"pack_codes: codes must be in [0, {2**bits - 1}]")
    g = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = torch.zeros(g.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i, s in enumerate(shifts(bits)):
        out |= g[..., i] << s
    return out


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``[..., D * b / 8]`` -> uint8 codes ``[..., D]``, the inverse of ``pack_codes``."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_codes: need uint8, got {packed.dtype}")
    planes = [(packed >> s) & (2**bits - 1) for s in shifts(bits)]
    return torch.stack(planes, dim=-1).reshape(*packed.shape[:-1], -1)


def quantize_kv(x: torch.Tensor, bits: int) -> CalibQuantCache:
    """Quantize and pack one cache ``[B, KVH, N, D]``."""
    if x.dim() != 4:
        raise ValueError(f"quantize_kv: need [B, KVH, N, D], got {tuple(x.shape)}")
    codes, alpha, scale = quantize_channelwise(x, bits)
    return CalibQuantCache(pack_codes(codes, bits), alpha, scale, bits)


def dequantize(packed: torch.Tensor, alpha: torch.Tensor, scale: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``alpha + code * scale`` ``[B, KVH, N, D]`` in ``dtype``."""
    codes = unpack_codes(packed, bits).to(dtype)
    return alpha.to(dtype).unsqueeze(-2) + codes * scale.to(dtype).unsqueeze(-2)


def calibrate_logits(x: torch.Tensor, tau1: float, tau2: float, dim: int = -1) -> torch.Tensor:
    """Eq. 7 along ``dim``: maps ``[gamma, delta]`` (the min / max) onto ``[gamma - tau1, delta - tau2]``;
    rows with ``delta == gamma`` are returned unchanged."""
    gamma = x.amin(dim=dim, keepdim=True)
    delta = x.amax(dim=dim, keepdim=True)
    width = delta - gamma
    flat = width == 0
    slope = (width + tau1 - tau2) / torch.where(flat, torch.ones_like(width), width)
    y = slope * (x - gamma) + gamma - tau1
    return torch.where(flat, x, y)


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """kv-head tensor ``[B, KVH, ...]`` -> ``[B, H, ...]`` (query head h reads kv head h // G)."""
    kvh = t.shape[1]
    if heads % kvh:
        raise ValueError(f"query heads {heads} are not a multiple of kv heads {kvh}")
    return t.repeat_interleave(heads // kvh, dim=1)


def _check_q(q: torch.Tensor, d: int) -> None:
    if q.dim() != 3 or q.shape[-1] != d:
        raise ValueError(f"q must be [B, H, D={d}], got {tuple(q.shape)}")


def calibquant_logits_ref(q, k_packed, k_alpha, k_scale, bits, sm_scale=None, dtype=torch.float64):
    """Post-scaled pre-softmax logits ``[B, H, N]`` (before calibration), in ``dtype``."""
    d = k_alpha.shape[-1]
    _check_q(q, d)
    sm = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    heads = q.shape[1]
    qd = q.to(dtype)
    codes = _expand_kv(unpack_codes(k_packed, bits), heads).to(dtype)  # [B, H, N, D]
    qs = qd * _expand_kv(k_scale, heads).to(dtype)
    bias = (qd * _expand_kv(k_alpha, heads).to(dtype)).sum(-1, keepdim=True)
    return (torch.einsum("bhd,bhnd->bhn", qs, codes) + bias) * sm


def calibquant_attention_ref(q, k_packed, k_alpha, k_scale, v_packed, v_alpha, v_scale, bits,
                             tau1: float = 0.0, tau2: float = 0.0, calibrate: bool = True,
                             sm_scale=None, dtype=torch.float64) -> torch.Tensor:
    """Post-scaled decode attention ``[B, H, D]`` in ``dtype`` (see the module docstring)."""
    heads = q.shape[1]
    logits = calibquant_logits_ref(q, k_packed, k_alpha, k_scale, bits, sm_scale, dtype)
    if calibrate:
        logits = calibrate_logits(logits, tau1, tau2)
    p = torch.softmax(logits, dim=-1)
    codes = _expand_kv(unpack_codes(v_packed, bits), heads).to(dtype)
    pv = torch.einsum("bhn,bhnd->bhd", p, codes)
    return _expand_kv(v_scale, heads).to(dtype) * pv + _expand_kv(v_alpha, heads).to(dtype) * p.sum(-1, keepdim=True)


def dequant_attention_ref(q, k_packed, k_alpha, k_scale, v_packed, v_alpha, v_scale, bits,
                          tau1: float = 0.0, tau2: float = 0.0, calibrate: bool = True,
                          sm_scale=None, dtype=torch.float64) -> torch.Tensor:
    """Dequantize K and V, then plain attention (with the same calibration): the check of Eq. 6."""
    d = k_alpha.shape[-1]
    _check_q(q, d)
    sm = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    heads = q.shape[1]
    k = _expand_kv(dequantize(k_packed, k_alpha, k_scale, bits, dtype), heads)
    v = _expand_kv(dequantize(v_packed, v_alpha, v_scale, bits, dtype), heads)
    logits = torch.einsum("bhd,bhnd->bhn", q.to(dtype), k) * sm
    if calibrate:
        logits = calibrate_logits(logits, tau1, tau2)
    return torch.einsum("bhn,bhnd->bhd", torch.softmax(logits, dim=-1), v)

