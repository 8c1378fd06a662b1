"""AIMET/QNN encodings JSON: our quantization parameters in the layout Qualcomm's converters read.

Why: ``qnn-onnx-converter --quantization_overrides FILE`` (and the QAIRT converters) take AIMET's
encodings file and use its scales and offsets instead of calibrating again, so the NPU build runs
exactly the grid edgeq chose (GPTQ'd integers, rotations and all) instead of a fresh min/max.

Formats written, checked against AIMET's own exporter (``aimet_onnx`` ``AffineEncoding._to_0_6_1``
/ ``_to_1_0_0``, qualcomm/aimet), AIMET's "Encoding Format Specification" (0.4.0 to 0.6.1), the
expected outputs in the tests of Qualcomm's FastForward exporter (0.6.1, 1.0.0) and the QNN API's
``Qnn_BwScaleOffset_t`` (``float = (quantized + offset) * scale``):

- ``"0.6.1"`` (legacy)::

    {"version": "0.6.1",
     "activation_encodings": {tensor: [enc]}, "param_encodings": {tensor: [enc, ...]}}
    enc = {"bitwidth": int, "dtype": "int", "is_symmetric": "True"|"False" (a string),
           "max": float, "min": float, "offset": int, "scale": float}

  One dict per tensor, or one per output channel (list order = channel order; the channel axis
  is implied by the consuming op). No per-block form.

- ``"1.0.0"``::

    {"version": "1.0.0", "activation_encodings": [enc], "param_encodings": [enc]}
    enc = {"name": tensor, "dtype": "INT", "enc_type": "PER_TENSOR"|"PER_CHANNEL"|"PER_BLOCK",
           "is_sym": bool, "bw": int, "scale": [float], "offset": [float], "block_size": int}

  ``block_size`` only with PER_BLOCK. Per-block scales of a 2-D weight are listed channel-major,
  ``(channel, block)``: a MatMul weight [K, N] blocked along K (DequantizeLinear axis 0, scales
  [K/bs, N]) is transposed to [N, K/bs] first, as AIMET does for MatMul/Gemm weights.

Semantics (both versions): the integer ``u`` is unsigned, ``0 <= u <= 2**bw - 1``, and
``real = scale * (u + offset)``; ``min = scale * offset``, ``max = scale * (2**bw - 1 + offset)``.
``is_sym`` true means AIMET/QNN store the tensor as signed with zero offset; AIMET then still
writes the offset in this unsigned convention (``-2**(bw - 1)``).

Conversion from ONNX ``real = (q - zp) * scale``, ``qmin <= q <= qmax`` (``qmin``/``qmax`` the
usable range from ``edgeq.quantize.qdq_encodings``, ``2**bw = qmax - qmin + 1``): ``u = q - qmin`` and

    offset = qmin - zp

e.g. int8 symmetric (zp 0): offset -128; int8 asymmetric zp 5: -133; uint8 zp 128: -128; uint8
zp 10: -10 (``-zp``, AIMET's usual "offset = -zero point"); int4 zp 0: -8; 6-bit values in int8
(Clip [-32, 31]) zp 0: bw 6, offset -32. Then ``u + offset = q - zp`` for every representable
integer, so both grids are the same floats. ``is_sym`` is written true only for a signed type with
every zero point 0 (the case AIMET produces); signed asymmetric and all unsigned encodings are
written ``is_sym`` false with the equivalent offset, so a converter stores them unsigned.

Names: activation encodings are keyed by the float tensor a QuantizeLinear quantizes (the same
name in our QDQ graph and in a float graph without the Q/DQ). Parameter encodings are keyed by
``float_name``, the float weight tensor the consuming op reads: our graph stores an integer
initializer + DequantizeLinear, no float op reads the integer initializer, and once the
DequantizeLinear is folded into a float initializer (the float-model + overrides flow AIMET uses)
the weight carries the DequantizeLinear's output name. That folding rule is our choice, not
checked against QNN's converter internals: hand the converter a float model whose weights carry
these names. Encodings files from before ``float_name`` existed fall back to their key.

Not expressible here, so refused (``strict=True``) or left out (``strict=False``;
``aimet_unsupported`` lists them): FP8/FP4 grids (AIMET writes only float16 in these versions),
per-block encodings in 0.6.1, per-block encodings of weights that are not 2-D or whose blocked
axis is not a multiple of the block size (1.0.0 infers the layout from the shape), usable ranges
that are not a full power-of-two grid, and two different encodings for one tensor name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx

from edgeq.graph import ir
from edgeq.artifacts.encodings import write_strict_json
from edgeq.errors import UserInputError
from edgeq.quantize.qdq_encodings import ENCODINGS_VERSION, STORAGE_RANGES, collect_encodings

AIMET_VERSIONS = ("1.0.0", "0.6.1")


def export_aimet(model_or_encodings, version: str = "1.0.0", strict: bool = True) -> dict:
    """The AIMET encodings dict of a model (ModelProto or .onnx path) or of an edgeq encodings
    dict / ``encodings.json`` path. ``strict``: refuse encodings AIMET cannot express (else skip)."""
    return _export(_as_encodings(model_or_encodings), version, strict)


def _export(encodings: dict, version: str, strict: bool) -> dict:
    if version not in AIMET_VERSIONS:
        raise UserInputError(f"unknown AIMET encodings version '{version}' (known: {', '.join(AIMET_VERSIONS)})")
    entries, problems = _plan(encodings, version)
    if problems and strict:
        first = next(iter(problems.items()))
        raise UserInputError(f"{len(problems)} encoding(s) have no AIMET {version} form, e.g. '{first[0]}': {first[1]} "
                             "(strict=False leaves them out)")
    if version == "0.6.1":
        acts = {name: _legacy(enc) for kind, name, enc in entries if kind == "activation"}
        params = {name: _legacy(enc) for kind, name, enc in entries if kind == "param"}
        return {"version": "0.6.1", "activation_encodings": acts, "param_encodings": params}
    return {"version": "1.0.0",
            "activation_encodings": [_v1(name, enc) for kind, name, enc in entries if kind == "activation"],
            "param_encodings": [_v1(name, enc) for kind, name, enc in entries if kind == "param"]}


def write_aimet(path, model_or_encodings, version: str = "1.0.0", strict: bool = True) -> Path:
    """Write ``export_aimet(...)`` as JSON to ``path`` (replaced atomically); returns the path."""
    path = Path(path)
    encodings = _as_encodings(model_or_encodings)
    exported = _export(encodings, version, strict)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    ours = not tmp.exists()  # (only a temporary file this call made is removed on failure)
    try:
        write_strict_json(tmp, exported, encodings)
    except BaseException:
        if ours:
            tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


def aimet_unsupported(model_or_encodings, version: str = "1.0.0") -> dict[str, str]:
    """tensor name -> why its encoding has no AIMET ``version`` form (empty: everything exports)."""
    return _plan(_as_encodings(model_or_encodings), version)[1]


def aimet_offsets(enc: dict) -> list[int]:
    """AIMET's unsigned-convention offsets of an edgeq encoding: ``offset = qmin - zero_point``."""
    return [int(enc["qmin"]) - int(z) for z in enc["zero_point"]]


# -- internals ---------------------------------------------------------------------------------
def _as_encodings(obj) -> dict:
    if isinstance(obj, onnx.ModelProto):
        return collect_encodings(obj)
    if isinstance(obj, (str, os.PathLike)):
        path = Path(obj)
        if path.suffix == ".json":
            try:
                obj = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise UserInputError(f"cannot read encodings file {path}: {exc}") from None
        else:
            return collect_encodings(ir.load_model(path))
    if not isinstance(obj, dict) or obj.get("version") != ENCODINGS_VERSION:
        raise UserInputError(f"expected an ONNX model or an edgeq encodings dict (version {ENCODINGS_VERSION})")
    return {kind: {k: _with_range(e) for k, e in obj.get(kind, {}).items()} for kind in ("activations", "weights")}


def _with_range(enc: dict) -> dict:
    """Files written before ``qmin``/``qmax`` existed: the storage type's full range."""
    if "qmin" in enc:
        return enc
    lo, hi = STORAGE_RANGES.get(enc["dtype"], (None, None))
    return {**enc, "qmin": lo, "qmax": hi}


def _plan(encodings: dict, version: str) -> tuple[list[tuple[str, str, dict]], dict[str, str]]:
    """(kind, AIMET name, encoding) of every exportable entry, and name -> reason for the rest."""
    entries: list[tuple[str, str, dict]] = []
    problems: dict[str, str] = {}
    seen: dict[str, str] = {}
    for kind, table in (("activation", encodings.get("activations", {})), ("param", encodings.get("weights", {}))):
        for key, enc in table.items():
            name = enc.get("float_name") or key
            reason = _unsupported(enc, version)
            if reason is None and name in seen and seen[name] != enc:
                reason = "the tensor has two different encodings"
            if reason is not None:
                problems[name] = reason
                continue
            if name not in seen:
                seen[name] = enc
                entries.append((kind, name, enc))
    for name in problems:  # a name refused once is refused everywhere (no half-described tensor)
        entries = [e for e in entries if e[1] != name]
    return entries, problems


def _unsupported(enc: dict, version: str) -> str | None:
    if enc.get("qmin") is None:
        return f"{enc['dtype']} grids have no AIMET {version} integer form"
    levels = int(enc["qmax"]) - int(enc["qmin"]) + 1
    if levels != 2 ** int(enc["bits"]):
        return f"usable range [{enc['qmin']}, {enc['qmax']}] is not a full {enc['bits']}-bit grid"
    if enc["granularity"] == "block":
        if version == "0.6.1":
            return "per-block encodings need AIMET 1.0.0"
        shape, bs = enc.get("shape"), int(enc["block_size"])
        if "scale_shape" not in enc:
            return "the encodings file predates scale_shape; collect it again from the model"
        if shape is None or len(shape) != 2:
            return "AIMET 1.0.0 per-block encodings are written for 2-D weights only"
        if shape[enc["axis"]] % bs:
            return f"blocked axis of length {shape[enc['axis']]} is not a multiple of block_size {bs}"
    return None


def _legacy(enc: dict) -> list[dict]:
    bw = int(enc["bits"])
    is_sym = str(_is_sym(enc))
    out = []
    for scale, offset in zip(enc["scale"], aimet_offsets(enc)):
        out.append({"bitwidth": bw, "dtype": "int", "is_symmetric": is_sym,
                    "max": scale * (2**bw - 1 + offset), "min": scale * offset,
                    "offset": offset, "scale": scale})
    return out


def _v1(name: str, enc: dict) -> dict:
    scale = np.asarray(enc["scale"], np.float64)
    offset = np.asarray(aimet_offsets(enc), np.float64)
    enc_type = {"tensor": "PER_TENSOR", "channel": "PER_CHANNEL", "block": "PER_BLOCK"}[enc["granularity"]]
    if enc_type == "PER_BLOCK" and enc["axis"] == 0:  # [blocks, channels] -> channel-major
        shape = enc["scale_shape"]
        scale, offset = scale.reshape(shape).T.ravel(), offset.reshape(shape).T.ravel()
    out = {"name": name, "dtype": "INT", "enc_type": enc_type, "is_sym": _is_sym(enc), "bw": int(enc["bits"]),
           "scale": scale.tolist(), "offset": offset.tolist()}
    if enc_type == "PER_BLOCK":
        out["block_size"] = int(enc["block_size"])
    return out


def _is_sym(enc: dict) -> bool:
    return int(enc["qmin"]) < 0 and all(int(z) == 0 for z in enc["zero_point"])
