"""onnxruntime-genai as a deployment target (``--target ort-genai``): the options its folder takes
(``--accuracy-level``, ``--lm-head-bits``), parsed and checked here.

The folder itself (``model.onnx`` in genai's graph form, ``genai_config.json``, the tokenizer) is
emitted by ``edgeq.genai`` from the compiled with-past graph; what the recipe and the export must be
for it (a weight-only recipe, a Llama-form ``config.json``) is checked there, since it reads them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from edgeq.errors import UserInputError

# MatMulNBits' accuracy_level values (onnxruntime's contrib op schema)
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
DEFAULT_ACCURACY_LEVEL = 4  # onnxruntime-genai's own CPU setting
DEFAULT_LM_HEAD_BITS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``edgeq compile``'s options of this target."""
    parser.add_argument("--accuracy-level", type=int, metavar="N",
                        help="with --target ort-genai: MatMulNBits accuracy_level of the 4-bit linears: 4 (default, "
                             "onnxruntime-genai's own CPU setting: activations quantized to int8 per block inside the "
                             "op, int8 x int4 GEMM) or 0 (float activations)")
    parser.add_argument("--lm-head-bits", type=int, metavar="B",
                        help="with --target ort-genai, when the recipe leaves lm_head in float: 8 (default) writes it as "
                             "int8 MatMulNBits (round to nearest, blocks of 128: genai reads it every token, 4x fewer "
                             "bytes than float), 32 keeps it float")


@dataclass(frozen=True)
class OrtGenaiOptions:
    """The settings of the folder ``--target ort-genai`` writes (None: the default)."""

    accuracy_level: int | None = None  # MatMulNBits accuracy_level of the 4-bit linears
    lm_head_bits: int | None = None  # a float lm_head as int8 MatMulNBits (8) or kept float (32)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OrtGenaiOptions:
        return cls(args.accuracy_level, args.lm_head_bits)

    @property
    def level(self) -> int:
        return DEFAULT_ACCURACY_LEVEL if self.accuracy_level is None else self.accuracy_level

    @property
    def head_bits(self) -> int:
        return DEFAULT_LM_HEAD_BITS if self.lm_head_bits is None else self.lm_head_bits

    def validate(self, genai: bool, static: bool) -> None:
        """Refused before any work: a setting without ``--target ort-genai``, a value genai does not
        take, or ``--static`` (genai's folder has dynamic shapes)."""
        if not genai:
            if self.accuracy_level is not None or self.lm_head_bits is not None:
                raise UserInputError("--accuracy-level and --lm-head-bits are settings of --target ort-genai")
            return
        if self.accuracy_level is not None and self.accuracy_level not in ACCURACY_LEVELS:
            raise UserInputError(f"--accuracy-level must be one of {', '.join(map(str, ACCURACY_LEVELS))}")
        if self.lm_head_bits is not None and self.lm_head_bits not in (8, 32):
            raise UserInputError("--lm-head-bits must be 8 or 32")
        if static:
            raise UserInputError("--target ort-genai writes a dynamic-shape folder for onnxruntime-genai: drop --static")
