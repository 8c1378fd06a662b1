"""What the onnxruntime kernels of the edgeq ops accept: the kernel domain and, per op, the input
element types a kernel can take. Pure data, shared by the registration (``ort_kernels``) and the
model rewrite (``ort_kernels_rewrite``), so neither imports the other.

Why a domain of their own (``edgeq.ort``) rather than ``edgeq``: onnxruntime-extensions can
register a Python kernel for any domain (op type ``"edgeq::Op"``), and a registered kernel then
wins over the model's FunctionProto of the same domain and name (probed with onnxruntime 1.32,
onnxruntime-extensions 0.15.2, both optimization levels). But such a kernel is rigid: it needs every
attribute written on the node (no function defaults), rejects empty optional inputs ("input 1 is
marked single"), reads FLOAT attributes through ``ostream << float`` (6 significant digits), takes no
4-bit tensors, and fails the session on an input type it does not declare instead of falling back
to the body. Registered for ``edgeq``, it would break edgeq models that the function bodies run
fine. Registered for ``edgeq.ort``, it only ever sees nodes that ``use_ort_kernels`` has checked
and prepared, and every other node keeps running its function body.
"""

from __future__ import annotations

from onnx import TensorProto

KERNEL_DOMAIN = "edgeq.ort"
KERNEL_DOMAIN_VERSION = 1
EXACT_SUFFIX = "__exact"  # FLOAT attribute a is also written as the STRING attribute a + EXACT_SUFFIX: repr(a)

_F32, _U8 = TensorProto.FLOAT, TensorProto.UINT8
_INT_ZP = frozenset({TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16})
_4BIT = frozenset({TensorProto.INT4, TensorProto.UINT4})

# op type -> one set of accepted onnx element types per input, in the schema's input order. A set
# with more than one type is declared to onnxruntime as "undefined" (any type), a single type as
# itself. Every kernel's output is declared float32: onnxruntime derives an "undefined" output type
# only from exactly one "undefined" input, so OnlineHadamard's kernel (x, h_k, h_p of one type)
# takes float32 only; float64 OnlineHadamard nodes keep their function body.
INPUT_TYPES: dict[str, tuple[frozenset, ...]] = {
    "OnlineHadamard": (frozenset({_F32}),) * 3,
    "ModalityQDQ": (frozenset({_F32}), frozenset({TensorProto.INT64}), frozenset({_F32}), _INT_ZP,
                    frozenset({_F32}), _INT_ZP),
    # 4-bit w / w_zero_point reach the kernel through a Cast to int8 (the rewrite inserts it)
    "W4A8Linear": (frozenset({_F32}), _4BIT | {TensorProto.INT8, _U8}, frozenset({_F32}),
                   _4BIT | {TensorProto.INT8, _U8}, frozenset({_F32}), frozenset({_F32})),
    "SubspaceQDQ": (frozenset({_F32}), frozenset({_F32}), frozenset({TensorProto.INT8, _U8}), frozenset({_F32}),
                    frozenset({TensorProto.INT8, _U8})),
    "VisualKVAttention": (frozenset({_F32}), frozenset({_U8}), *(frozenset({_F32}),) * 2, frozenset({_U8}),
                          *(frozenset({_F32}),) * 5),
}
INPUT_TYPES["VisualKVAttentionKIVI"] = INPUT_TYPES["VisualKVAttention"]
CAST_TO_INT8 = {"W4A8Linear": (1, 3)}  # input indices whose 4-bit tensors are cast to int8 first
FOUR_BIT = _4BIT

KERNEL_OPS: tuple[str, ...] = tuple(INPUT_TYPES)
