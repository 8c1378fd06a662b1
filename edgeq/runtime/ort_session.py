"""onnxruntime CPU sessions on model files, as evaluation and generation open them: ``session_options``
(``edgeq.graph.ir.session_options`` plus the exact-QDQ switch) and ``open_session`` (a model onnxruntime
cannot load is the user's problem, one line). Below both ``edgeq.evaluate`` (perplexity, compare) and
``edgeq.generation`` (the decoders), which share it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from edgeq.errors import UserInputError


# onnxruntime session config that keeps every Q/DQ as written (no integer-kernel fusion: no
# MatMulIntegerToFloat / QLinearMatMul / QGemm), all other optimizations on: the exact-QDQ
# reference that a kernel's result is compared with (docs/cpu-int8-kernels.md).
EXACT_QDQ_CONFIG = {"session.disable_quant_qdq": "1"}


def session_options(threads: int | None = None, optimize: bool = True, exact_qdq: bool = False) -> Any:
    """onnxruntime SessionOptions (``edgeq.graph.ir.session_options``, the one base: log level fatal
    only): default graph optimizations (or none), ``threads`` intra-op; ``exact_qdq``: Q/DQ
    evaluated as written, not fused into integer kernels."""
    from edgeq.graph.ir import session_options as base_options

    if threads is not None and threads < 1:
        raise UserInputError(f"threads must be >= 1, got {threads}")
    opts = base_options(optimize=optimize, threads=threads)
    if exact_qdq:
        for key, value in EXACT_QDQ_CONFIG.items():
            opts.add_session_config_entry(key, value)
    return opts


def open_session(
    model: str | os.PathLike | bytes,
    threads: int | None = None,
    optimize: bool = True,
    options: Any = None,
) -> Any:
    """A CPU ``InferenceSession``; a model onnxruntime cannot load is a ``UserInputError``.

    ``model`` is a path (external data next to it is found by onnxruntime) or serialized bytes.
    """
    import onnxruntime as ort

    if not isinstance(model, (bytes, bytearray)):
        path = Path(model)
        if not path.exists():
            raise UserInputError(f"model file not found: {path}")
        if not path.is_file():
            raise UserInputError(f"model path is not a file: {path}")
        model = str(path)
        label = model
    else:
        label = "model"
    opts = options if options is not None else session_options(threads, optimize)
    try:
        return ort.InferenceSession(model, sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own pybind types (Fail, InvalidGraph, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(model, str) and _EXTERNAL_ATTRIBUTE_REFUSAL in first:
            return _open_with_attributes_read_in(Path(model), opts, label)
        raise UserInputError(f"onnxruntime cannot load {label}: {first}") from None


# what onnxruntime says of a model whose attribute tensor (a ConstantOfShape's value) is external data
_EXTERNAL_ATTRIBUTE_REFUSAL = "Cannot parse data from external tensors"


def _open_with_attributes_read_in(path: Path, opts: Any, label: str) -> Any:
    """The session onnxruntime refuses on the file itself (it reads some operators' attribute
    tensors only from the proto): built on the model as edgeq's loader reads it without its weights
    (attribute tensors and small initializers read in, ``edgeq.graph.ir.load_model``), the weights
    still mapped from their files in the model's folder."""
    import onnxruntime as ort

    from edgeq.graph.ir import load_model, model_folder

    source = load_model(path, load_external=False).SerializeToString()
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(model_folder(path)))
    try:
        return ort.InferenceSession(source, sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 (onnxruntime's pybind types)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserInputError(f"onnxruntime cannot load {label}: {first}") from None
