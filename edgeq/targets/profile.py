"""Target profiles: what a deployment target runs, as validated data (TOML), not code branches.

A profile says which ops, element types and quantization parameters a runtime or NPU accepts,
and which lowering passes ``--target`` runs to get there. Adding a target is adding a file;
``edgeq check`` and ``edgeq compile --target`` read nothing else. Layout::

    description = "one line"
    lowering = ["expand-functions"]   # registered passes, run in this order by --target
    ops = ["*"]                       # standard-domain (ai.onnx) ops; "*" = every one
    edgeq_ops = []                    # edgeq custom ops run natively; "*" = every one
    domains = []                      # other op domains accepted wholesale (e.g. com.microsoft)
    dtypes = ["float32", "int64"]     # element types of every tensor but the Q/DQ integer side
    power_of_two_scales = false       # every Q/DQ scale an exact power of two
    ort_kernels = false               # optional: compile selects the onnxruntime-extensions kernels
    int8_weight_range = "u8s8-safe"   # optional: or "full-vnni-only" (CPUs whose uint8 x int8
                                      # kernel cannot saturate: AVX-512 VNNI, AVX-VNNI, AMX, ARM64)
    positive_scales = false           # optional: every constant Q/DQ scale > 0 (Qualcomm's HTP)
    whole_blocks = false              # optional: block-quantized weights in whole blocks only (the HTP)
    [activations]                     # QuantizeLinear, and DequantizeLinear not reading a weight
    dtypes = ["int8", "uint8"]
    symmetric = false                 # true: zero point 0 (signed) or the midpoint (unsigned)
    granularity = ["tensor"]          # of "tensor", "channel", "block"
    [weights]                         # integer initializers feeding a DequantizeLinear
    dtypes = ["int8", "int4"]
    symmetric = true
    granularity = ["tensor", "channel"]

Every key is required (a profile that forgets a rule must not silently allow everything) and
unknown keys, op names onnx does not know, unknown dtypes and unregistered passes are errors.
Built-in profiles live in ``edgeq/targets/profiles/*.toml``; ``--target`` also takes a path.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from edgeq.errors import UserInputError
from edgeq.files.tomlfile import builtin_names, load_named_toml, parse_toml

ANY = "*"
GRANULARITIES = ("tensor", "channel", "block")


def dtype_name(elem_type: int) -> str:
    """onnx element type -> the names profiles and ``QuantSpec`` use (float32, int4, float8e4m3fn)."""
    name = onnx.TensorProto.DataType.Name(elem_type).lower()
    return {"float": "float32", "double": "float64"}.get(name, name)


DTYPES = frozenset(dtype_name(v) for v in onnx.TensorProto.DataType.values() if v != onnx.TensorProto.UNDEFINED)


@dataclass(frozen=True)
class QuantRules:
    """What one side of quantization (activations or weights) may use. ``dtypes`` None: any."""

    dtypes: frozenset[str] | None
    symmetric: bool
    granularity: frozenset[str]

    def allows_dtype(self, dtype: str) -> bool:
        return self.dtypes is None or dtype in self.dtypes

    @property
    def max_bits(self) -> int | None:
        """The widest integer type allowed (None: any width)."""
        if self.dtypes is None:
            return None
        return max((dtype_bits(d) for d in self.dtypes), default=0)


def dtype_bits(dtype: str) -> int:
    """Width of an integer dtype name (int4 -> 4, uint16 -> 16); 0 for anything else."""
    digits = "".join(c for c in dtype if c.isdigit())
    return int(digits) if dtype.startswith(("int", "uint")) and digits else 0


@dataclass(frozen=True)
class TargetProfile:
    """A validated profile. ``None`` in ``ops``/``edgeq_ops``/``dtypes``: "*" (anything)."""

    name: str
    description: str
    lowering: tuple[str, ...]
    ops: frozenset[str] | None
    edgeq_ops: frozenset[str] | None
    domains: frozenset[str]
    dtypes: frozenset[str] | None
    power_of_two_scales: bool
    activations: QuantRules
    weights: QuantRules
    ort_kernels: bool = False  # compile hands edgeq ops to edgeq.runtime_ops.ort_kernels (opt-in)
    # "u8s8-safe": int8 weights of uint8 x int8 linears on the grid no CPU kernel saturates (and
    # ``edgeq check`` flags those that could); "full-vnni-only": the full int8 grid
    int8_weight_range: str = "u8s8-safe"
    # every tensor's shape fixed at compile time (NPU compilers refuse dynamic ones): shape inference
    # must leave no symbolic or unknown dimension (an LLM gets there with ``compile --static``)
    static_shapes: bool = False
    # per-channel weights only inside whole QDQ node units, input and output quantized at one type
    # (Qualcomm's HTP: ``edgeq.targets.node_units``); gathered integer tables judged as activations
    node_units: bool = False
    # whose compiler ``edgeq check`` asks when it is installed ("qnn-htp": onnxruntime-qnn), "" none
    vendor: str = ""
    # every constant Q/DQ scale > 0: onnxruntime's CPU kernels compute negative ones (full-range
    # symmetric weights) exactly; Qualcomm's HTP accepts them and computes unrelated results
    positive_scales: bool = False
    # block-quantized weights only in whole blocks: the blocked axis a multiple of block_size
    # (Qualcomm's HTP takes a partial last block and computes it wrongly, onnxruntime-qnn 2.7.0)
    whole_blocks: bool = False

    def allows_op(self, domain: str, op_type: str) -> bool:
        if domain in ("", "ai.onnx"):
            return self.ops is None or op_type in self.ops
        if domain == "edgeq":
            return self.edgeq_ops is None or op_type in self.edgeq_ops
        return domain in self.domains

    def allows_dtype(self, dtype: str) -> bool:
        return self.dtypes is None or dtype in self.dtypes


_TOP_KEYS = {"description", "lowering", "ops", "edgeq_ops", "domains", "dtypes", "power_of_two_scales",
             "activations", "weights"}
_QUANT_KEYS = {"dtypes", "symmetric", "granularity"}
# optional keys: they never allow anything, so leaving them out cannot silently widen a profile
# (static_shapes restricts; a profile opts into it)
_OPTIONAL_KEYS = {"ort_kernels", "int8_weight_range", "static_shapes", "node_units", "vendor", "positive_scales",
                  "whole_blocks"}


def builtin_target_names() -> list[str]:
    return builtin_names("edgeq.targets", "profiles")


def load_target(name_or_path: str) -> TargetProfile:
    """A built-in profile by name, or a profile file by path (``edgeq.files.tomlfile``)."""
    file = load_named_toml(name_or_path, "edgeq.targets", "profiles", "target")
    return parse_target(file.text, file.name, source=file.where)


def parse_target(text: str, name: str, source: str = "target") -> TargetProfile:
    data = parse_toml(text, source)
    optional = {k: data.pop(k) for k in _OPTIONAL_KEYS & set(data)}
    _require_keys(data, _TOP_KEYS, source)
    description = _typed(data, "description", str, source)
    lowering = tuple(_listed(data, "lowering", source))
    from edgeq.passmanager.registry import get_pass

    for pass_name in lowering:
        get_pass(pass_name)  # unknown pass: UserInputError naming the known ones
    ops = _strings(data, "ops", source)
    if ops is not None:
        unknown = sorted(op for op in ops if not onnx.defs.has(op))
        if unknown:
            raise UserInputError(f"{source}: 'ops' names ops onnx does not know: {', '.join(unknown)}")
    edgeq_ops = _strings(data, "edgeq_ops", source)
    if edgeq_ops is not None:
        from edgeq.runtime_ops.schema import SCHEMAS

        unknown = sorted(set(edgeq_ops) - set(SCHEMAS))
        if unknown:
            raise UserInputError(f"{source}: unknown edgeq ops {', '.join(unknown)} (known: {', '.join(sorted(SCHEMAS))})")
    domains = _listed(data, "domains", source)
    if {"", "ai.onnx", "edgeq"} & set(domains):
        raise UserInputError(f"{source}: 'domains' lists other domains only (standard ops go in 'ops', edgeq ops in 'edgeq_ops')")
    return TargetProfile(
        name=name, description=description, lowering=lowering,
        ops=None if ops is None else frozenset(ops),
        edgeq_ops=None if edgeq_ops is None else frozenset(edgeq_ops),
        domains=frozenset(domains),
        dtypes=_dtypes(data, "dtypes", source),
        power_of_two_scales=_typed(data, "power_of_two_scales", bool, source),
        activations=_quant_rules(data, "activations", source),
        weights=_quant_rules(data, "weights", source),
        ort_kernels=_typed(optional, "ort_kernels", bool, source) if "ort_kernels" in optional else False,
        int8_weight_range=_weight_range(optional, source),
        static_shapes=_typed(optional, "static_shapes", bool, source) if "static_shapes" in optional else False,
        node_units=_typed(optional, "node_units", bool, source) if "node_units" in optional else False,
        vendor=_vendor(optional, source),
        positive_scales=_typed(optional, "positive_scales", bool, source) if "positive_scales" in optional else False,
        whole_blocks=_typed(optional, "whole_blocks", bool, source) if "whole_blocks" in optional else False,
    )


VENDORS = ("qnn-htp", "ort-genai")


def _vendor(optional: dict, source: str) -> str:
    vendor = _typed(optional, "vendor", str, source) if "vendor" in optional else ""
    if vendor and vendor not in VENDORS:
        raise UserInputError(f"{source}: vendor must be one of {', '.join(VENDORS)}, not '{vendor}'")
    return vendor


def _weight_range(optional: dict, source: str) -> str:
    from edgeq.passmanager.passbase import INT8_WEIGHT_RANGES

    if "int8_weight_range" not in optional:
        return INT8_WEIGHT_RANGES[0]
    value = _typed(optional, "int8_weight_range", str, source)
    if value not in INT8_WEIGHT_RANGES:
        raise UserInputError(f"{source}: 'int8_weight_range' must be one of {', '.join(INT8_WEIGHT_RANGES)}, got {value!r}")
    return value


def _quant_rules(data: dict, key: str, source: str) -> QuantRules:
    table = data[key]
    where = f"{source} [{key}]"
    if not isinstance(table, dict):
        raise UserInputError(f"{source}: '{key}' must be a table")
    _require_keys(table, _QUANT_KEYS, where)
    granularity = _listed(table, "granularity", where)
    bad = sorted(set(granularity) - set(GRANULARITIES))
    if bad or not granularity:
        raise UserInputError(f"{where}: granularity must list some of {', '.join(GRANULARITIES)}, got {granularity}")
    return QuantRules(_dtypes(table, "dtypes", where), _typed(table, "symmetric", bool, where), frozenset(granularity))


def _dtypes(data: dict, key: str, where: str) -> frozenset[str] | None:
    values = _strings(data, key, where)
    if values is None:
        return None
    unknown = sorted(set(values) - DTYPES)
    if unknown:
        raise UserInputError(f"{where}: unknown dtype(s) {', '.join(unknown)} (known: {', '.join(sorted(DTYPES))})")
    return frozenset(values)


def _require_keys(data: dict, expected: set[str], where: str) -> None:
    unknown = sorted(set(data) - expected)
    if unknown:
        raise UserInputError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(expected))})")
    missing = sorted(expected - set(data))
    if missing:
        raise UserInputError(f"{where}: missing key(s) {', '.join(missing)}")


def _typed(data: dict, key: str, kind: type, where: str):
    value = data[key]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise UserInputError(f"{where}: '{key}' must be {kind.__name__}, got {value!r}")
    return value


def _listed(data: dict, key: str, where: str) -> list[str]:
    """``_strings`` where ``"*"`` is refused, so always a list."""
    value = _strings(data, key, where, wildcard=False)
    assert value is not None  # (wildcard=False raises on "*")
    return value


def _strings(data: dict, key: str, where: str, wildcard: bool = True) -> list[str] | None:
    """A list of strings; ``["*"]`` (where allowed) means anything and returns None."""
    value = data[key]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserInputError(f"{where}: '{key}' must be a list of strings, got {value!r}")
    if ANY in value:
        if not wildcard or len(value) != 1:
            raise UserInputError(f"{where}: '{key}' " + ("cannot be \"*\"" if not wildcard else "takes \"*\" alone"))
        return None
    return value
