"""onnxruntime kernels for the edgeq ops, through onnxruntime-extensions' Python custom ops.

Why: onnxruntime runs an edgeq op by inlining its function body, dozens of small nodes for some
ops (the KV-cache attention's unpacking, calibration and softmax, the mixed-precision quantize's
two Q/DQ chains); a kernel runs the op as one call. Why Python kernels and not a compiled library:
a C/C++ custom-op library needs onnxruntime's C API header, which no package of the registries CI
reaches ships (not the onnxruntime or onnxruntime-extensions wheels, no Debian package), so CI
could not build it; onnxruntime-extensions (a PyPI wheel, optional extra ``ort-kernels``) ships
the compiled bridge, and the kernels are the numpy references of ``schema.SCHEMAS`` themselves,
so their semantics are the references' by construction (no second implementation of the math).

Speed (``benchmarks/ort_kernels.py``, SmolLM2 and decode-attention shapes, one thread): the
kernels are 1.3x to 11x SLOWER than the function bodies, whose MatMuls run in onnxruntime's MLAS
while the references compute in float64 numpy (the kernel's time is the reference's; the Python-op
call adds little). They give reference-exact outputs inside onnxruntime and the dispatch a native
kernel would use (same domain and rewrite); they do not speed up CPU inference.

Use::

    model = use_ort_kernels(model)           # edgeq nodes the kernels take -> domain edgeq.ort
    so = ort_kernel_session_options()        # registers the kernels and the library
    sess = onnxruntime.InferenceSession(model.SerializeToString(), so)

- ``KERNEL_OPS``: the op types with a kernel (every op in ``SCHEMAS``).
- ``has_ort_kernels()``: whether onnxruntime-extensions is importable (the kernels can run).
- ``use_ort_kernels(model)``: the rewrite the kernels need (``ort_kernels_rewrite``).
- ``ort_kernel_session_options(so=None)``: SessionOptions with the kernels registered.

Registration happens on the first ``ort_kernel_session_options`` call, never at import. It also
replaces onnxruntime-extensions' process-wide Python-op invocation hook by one that serves the
edgeq kernels itself and hands every other Python op to the original hook unchanged: the original
returns outputs as ``ndarray.tolist()``, which costs ~50 ms per 512 x 1536 float32 output (0.4 ms
as an array; the extension's C++ side copies either with ``numpy.ascontiguousarray``).
"""

from __future__ import annotations

import threading

import numpy as np

from edgeq.runtime_ops.ort_kernels_rewrite import use_ort_kernels
from edgeq.runtime_ops.ort_kernels_spec import (
    EXACT_SUFFIX,
    INPUT_TYPES,
    KERNEL_DOMAIN,
    KERNEL_OPS,
)
from edgeq.runtime_ops.schema import SCHEMAS

_LOCK = threading.Lock()
_REGISTERED: dict[int, object] = {}  # id of the extension's Opdef -> its edgeq kernel


def has_ort_kernels() -> bool:
    """True when onnxruntime-extensions is installed with the Python-op API the kernels use."""
    try:
        from onnxruntime_extensions import _ocos
    except Exception:  # noqa: BLE001  (not installed, or a build without Python ops)
        return False
    return all(hasattr(_ocos, a) for a in ("Opdef", "PyCustomOpDef", "get_library_path", "_on_pyop_invocation"))


class _Kernel:
    """One op's kernel: the schema's numpy reference, its attributes parsed from the strings the
    extension passes (INT as decimal; FLOAT from the exact ``a + EXACT_SUFFIX`` repr that the
    rewrite writes, the extension's own float formatting keeping 6 digits only)."""

    def __init__(self, op_type: str):
        self.schema = SCHEMAS[op_type]

    def declared_attributes(self, dt) -> dict:
        """Attribute name -> the extension's type code: INT as int64, FLOAT as its exact twin string."""
        declared = {}
        for a in self.schema.attributes:
            if a.type == "FLOAT":
                declared[a.name + EXACT_SUFFIX] = dt.dt_string
            else:
                declared[a.name] = dt.dt_int64
        return declared

    def __call__(self, inputs, attributes: dict) -> tuple[np.ndarray, ...]:
        kwargs = {}
        for a in self.schema.attributes:
            if a.type == "FLOAT":
                kwargs[a.name] = float(np.float32(float(attributes[a.name + EXACT_SUFFIX])))
            else:
                kwargs[a.name] = int(attributes[a.name])
        return tuple(self.schema.reference(*inputs, **kwargs))


def _invoke(original):
    """The replacement hook: edgeq kernels answer with flat arrays, others go to ``original``."""

    def hook(k_id, feed, attributes):
        kernel = _REGISTERED.get(k_id)
        if kernel is None:
            return original(k_id, feed, attributes)
        result = [k_id]
        for y in kernel(feed, attributes):
            result += [y.shape, np.ascontiguousarray(y).reshape(-1)]
        return tuple(result)

    return hook


def _register() -> None:
    """Declare the kernels to onnxruntime-extensions (once per process) and install the hook."""
    from onnx import TensorProto
    from onnxruntime_extensions import Opdef, PyCustomOpDef as dt, _ocos

    with _LOCK:
        if _REGISTERED:
            return
        declared = {TensorProto.FLOAT: dt.dt_float, TensorProto.UINT8: dt.dt_uint8, TensorProto.INT8: dt.dt_int8,
                    TensorProto.INT64: dt.dt_int64}
        for op_type in KERNEL_OPS:
            kernel = _Kernel(op_type)
            inputs = [declared[next(iter(t))] if len(t) == 1 else dt.undefined for t in INPUT_TYPES[op_type]]
            # "domain::op" registers the op in that domain (the extension's default is ai.onnx.contrib)
            opdef = Opdef.create(kernel, op_type=f"{KERNEL_DOMAIN}::{op_type}", inputs=inputs,
                                 outputs=[dt.dt_float], attrs=kernel.declared_attributes(dt))
            _REGISTERED[opdef._nativedef.obj_id] = kernel
        dt.install_hooker(_invoke(_ocos._on_pyop_invocation))  # the extension's own hook, for its other ops


def ort_kernel_session_options(so=None):
    """``so`` (or new SessionOptions) with the edgeq kernels and onnxruntime-extensions' library
    registered; call once per SessionOptions. Raises ImportError when onnxruntime-extensions is
    missing (``pip install 'edgeq[ort-kernels]'``)."""
    import onnxruntime as ort

    if not has_ort_kernels():
        raise ImportError("the edgeq onnxruntime kernels need onnxruntime-extensions: pip install 'edgeq[ort-kernels]'")
    from onnxruntime_extensions import get_library_path

    _register()
    so = ort.SessionOptions() if so is None else so
    so.register_custom_ops_library(get_library_path())
    return so


__all__ = ["KERNEL_DOMAIN", "KERNEL_OPS", "has_ort_kernels", "ort_kernel_session_options", "use_ort_kernels"]
