"""The JSON of an output folder: ``strict_json`` (the one writer of its files, which refuses a
non-finite quantization parameter of ``encodings.json``) and ``json_safe`` (the floats JSON cannot
hold as strings). The encodings themselves, and the layout of ``encodings.json``, are
``edgeq.quantize.qdq_encodings``'s: they are read back from the graph there."""

from __future__ import annotations

import json
import math

import numpy as np

from edgeq.errors import UserInputError


def strict_json(data: dict, encodings: dict | None = None) -> str:
    """``data`` as strict JSON: NaN and inf are not JSON (``allow_nan=False``), the one writer of
    every JSON file of an output folder. ``encodings``: ``data`` is ``encodings`` itself, or what is
    made of it (AIMET's layout), where a quantization parameter that is not finite means a broken
    model (a NaN or inf in its weights, or its scales): a one-line ``UserInputError`` naming the
    tensor. Elsewhere (``report.json``: an exact step's SQNR is inf) pass ``json_safe(data)``."""
    _check_finite(encodings)
    return json.dumps(data, indent=1, allow_nan=False)


def write_strict_json(path, data: dict, encodings: dict | None = None) -> None:
    """``strict_json(data, encodings)`` written to ``path`` as it is encoded, never held whole: a
    1.5B model's int4 block encodings are a 0.6 GB text."""
    _check_finite(encodings)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, allow_nan=False)


def _check_finite(encodings: dict | None) -> None:
    bad = [(side[:-1], name) for side in ("activations", "weights") for name, enc in (encodings or {}).get(side, {}).items()
           if not all(math.isfinite(v) for v in (*enc["scale"], *enc["zero_point"]))]
    if bad:
        side, name = bad[0]
        more = f" ({len(bad)} tensors in all)" if len(bad) > 1 else ""
        raise UserInputError(f"{side} '{name}' has a non-finite scale or zero point (NaN or inf){more}: "
                             "a NaN or inf in the model's weights or quantization parameters")


def json_safe(value, default=None):
    """``value`` with every float JSON cannot hold written as the string "inf", "-inf" or "nan"
    (numpy scalars first made Python ones); ``default(obj)`` converts any other object JSON does
    not know (as ``json.dumps``'s ``default``)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, dict):
        return {k: json_safe(v, default) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, default) for v in value]
    return value if default is None else json_safe(default(value))
