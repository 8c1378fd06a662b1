"""edgeq: a graph-level ONNX rewriting compiler for NPU and edge deployment.

The core package holds the IR helpers, the pass base and registry, recipes, the pipeline,
calibration, evaluation and the CLI. Method passes live in ``edgeq.passes`` (folder ``passes/``),
custom ops in ``edgeq.runtime_ops``, Triton kernels in ``edgeq.kernels`` and model builders in
``edgeq.models``. Importing edgeq does no I/O and configures no logging.
"""

__version__ = "0.1.0"

# the signals the current run of the command line has received, in order (``edgeq.cli`` acts on the
# first), kept here where the program's entry (``edgeq.__main__``) reaches them before it imports
# anything else; ``_note_signal`` is the handler that notes one while nothing may be interrupted.
# Importing edgeq installs no handler.
_signals: list[int] = []


def _note_signal(signum, frame):
    _signals.append(signum)
