"""Device code shared by CalibQuant's q.K and p.V kernels: where one program of their
``(B * KVH, chunks)`` grids works (``_program_chunk``), and the register unpacking of the packed 1/2-bit
codes into fp16 bit planes (``calibquant_triton`` documents the modes: inline PTX or plain Triton,
the 1024 form or the subnormal form scaled by ``PLANE_SCALE`` after the dot). Bit order:
``calibquant_ref`` (element i of a byte at shift ``8 - b(i+1)``)."""

from __future__ import annotations

import triton
import triton.language as tl

# unpack modes (the kernels' UNPACK constexpr): the 1024 form in plain Triton / inline PTX, the
# subnormal form in inline PTX / plain Triton. PLANE_SCALE: what the subnormal planes are scaled by.
UNPACK_MODES = {"triton": 0, "asm": 1, "asm-sub": 2, "triton-sub": 3}
PLANE_SCALE = tl.constexpr(16777216.0)  # 2^24


def _asm_unpack(bits: int, subnormal: bool) -> str:
    """PTX: $0.. the planes (2 regs each: fp16 pairs of bytes 0-1, 2-3), last operand the 4 bytes.
    1024 form: ``0x64XX & (0xFF00 | mask)`` = 1024 + v, minus 1024; subnormal form: ``0x00XX & mask``
    is the fp16 subnormal ``v * 2^-24`` (no subtraction; the 2^24 is applied in fp32 later)."""
    per = 8 // bits
    body = [".reg .b32 t0, t1, mg, off;", f"mov.b32 mg, {'0x00000000' if subnormal else '0x64646464'};",
            "mov.b32 off, 0x64006400;",
            f"prmt.b32 t0, ${2 * per}, mg, 0x4140;", f"prmt.b32 t1, ${2 * per}, mg, 0x4342;"]
    for i in range(per):
        m = ((2**bits - 1) << (8 - bits * (i + 1))) | (0 if subnormal else 0xFF00)
        mask = f"0x{m:04X}{m:04X}"
        for r, t in ((2 * i, "t0"), (2 * i + 1, "t1")):
            body.append(f"and.b32 ${r}, {t}, {mask};")
            if not subnormal:
                body.append(f"sub.rn.f16x2 ${r}, ${r}, off;")
    return "{\n" + "\n".join(body) + "\n}"


_ASM_B1 = tl.constexpr(_asm_unpack(1, False))
_ASM_B2 = tl.constexpr(_asm_unpack(2, False))
_ASM_B1_SUB = tl.constexpr(_asm_unpack(1, True))
_ASM_B2_SUB = tl.constexpr(_asm_unpack(2, True))


@triton.jit
def _program_chunk(N, G, KVH, DP, CHUNK, G_PAD: tl.constexpr, DPC: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's batch b, kv head kh and token chunk; the chunk's tokens ``[t_start, t_end)``,
    whole BLOCK_T blocks up to t_full (then at most one partial block); and its lanes with their
    masks: the group's query heads (offs_g, gm), the packed byte columns (offs_j, jm) and the tokens
    of one block (offs_t)."""
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    t_start = chunk * CHUNK
    t_end = tl.minimum(t_start + CHUNK, N)
    t_full = t_start + (t_end - t_start) // BLOCK_T * BLOCK_T
    offs_g = tl.arange(0, G_PAD)
    offs_j = tl.arange(0, DPC)
    return (pid // KVH, pid % KVH, chunk, t_start, t_end, t_full,
            offs_g, offs_g < G, offs_j, offs_j < DP, tl.arange(0, BLOCK_T))


@triton.jit
def _plane(x, MASK: tl.constexpr, UNPACK: tl.constexpr):
    """One plane of int32 bytes in plain Triton: the asm modes' arithmetic (exact either way)."""
    if UNPACK == 3:
        return (x & MASK).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        return ((x & MASK) | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _unpack_planes(packed, BITS: tl.constexpr, UNPACK: tl.constexpr):
    """The ``8 // BITS`` planes of BITS-bit bytes: fp16 ``code_i * 2^(8 - BITS(i+1))`` (times 2^-24
    in the subnormal modes), i.e. ``bit_i * 2^(7-i)`` at 1 bit and ``code_i * 2^(6-2i)`` at 2 bits.
    The PTX takes 2 output registers a plane and the 4 bytes last."""
    if UNPACK == 1 or UNPACK == 2:
        return tl.inline_asm_elementwise(
            asm=(_ASM_B1_SUB if UNPACK == 2 else _ASM_B1) if BITS == 1 else (_ASM_B2_SUB if UNPACK == 2 else _ASM_B2),
            constraints="=r," * (16 // BITS) + "r", args=[packed], dtype=(tl.float16,) * (8 // BITS),
            is_pure=True, pack=4)
    elif BITS == 1:
        x = packed.to(tl.int32)
        return (_plane(x, 0x80, UNPACK), _plane(x, 0x40, UNPACK), _plane(x, 0x20, UNPACK),
                _plane(x, 0x10, UNPACK), _plane(x, 0x08, UNPACK), _plane(x, 0x04, UNPACK),
                _plane(x, 0x02, UNPACK), _plane(x, 0x01, UNPACK))
    else:
        x = packed.to(tl.int32)
        return _plane(x, 0xC0, UNPACK), _plane(x, 0x30, UNPACK), _plane(x, 0x0C, UNPACK), _plane(x, 0x03, UNPACK)
