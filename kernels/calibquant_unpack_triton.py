"""Register unpacking of CalibQuant's packed 1/2-bit codes into fp16 bit planes, shared by the q.K
and p.V kernels (``calibquant_triton`` documents the modes: inline PTX or plain Triton, the 1024
form or the subnormal form scaled by ``PLANE_SCALE`` after the dot). Bit order: ``calibquant_ref``
(element i of a byte at shift ``8 - b(i+1)``)."""

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
def _plane(x, MASK: tl.constexpr, UNPACK: tl.constexpr):
    """One plane of int32 bytes in plain Triton: the asm modes' arithmetic (exact either way)."""
    if UNPACK == 3:
        return (x & MASK).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        return ((x & MASK) | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _unpack_b1(packed, UNPACK: tl.constexpr):
    """The 8 planes (fp16 ``bit_i * 2^(7-i)``, times 2^-24 in the subnormal modes) of 1-bit bytes."""
    if UNPACK == 1:
        return tl.inline_asm_elementwise(asm=_ASM_B1, constraints="=r," * 16 + "r", args=[packed],
                                         dtype=(tl.float16,) * 8, is_pure=True, pack=4)
    elif UNPACK == 2:
        return tl.inline_asm_elementwise(asm=_ASM_B1_SUB, constraints="=r," * 16 + "r", args=[packed],
                                         dtype=(tl.float16,) * 8, is_pure=True, pack=4)
    else:
        x = packed.to(tl.int32)
        return (_plane(x, 0x80, UNPACK), _plane(x, 0x40, UNPACK), _plane(x, 0x20, UNPACK),
                _plane(x, 0x10, UNPACK), _plane(x, 0x08, UNPACK), _plane(x, 0x04, UNPACK),
                _plane(x, 0x02, UNPACK), _plane(x, 0x01, UNPACK))


@triton.jit
def _unpack_b2(packed, UNPACK: tl.constexpr):
    """The 4 planes (fp16 ``code_i * 2^(6-2i)``, times 2^-24 in the subnormal modes) of 2-bit bytes."""
    if UNPACK == 1:
        return tl.inline_asm_elementwise(asm=_ASM_B2, constraints="=r," * 8 + "r", args=[packed],
                                         dtype=(tl.float16,) * 4, is_pure=True, pack=4)
    elif UNPACK == 2:
        return tl.inline_asm_elementwise(asm=_ASM_B2_SUB, constraints="=r," * 8 + "r", args=[packed],
                                         dtype=(tl.float16,) * 4, is_pure=True, pack=4)
    else:
        x = packed.to(tl.int32)
        return _plane(x, 0xC0, UNPACK), _plane(x, 0x30, UNPACK), _plane(x, 0x0C, UNPACK), _plane(x, 0x03, UNPACK)
