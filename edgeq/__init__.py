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


# The Python API (``edgeq.api``): ``edgeq.compile(model, out=..., recipe=..., calib=..., target=...)``
# returns the typed report, ``edgeq.load(out)`` opens an output folder; errors are ``EdgeqError``s
# whose ``exit_code`` is the command line's. Loaded on first use, so that ``import edgeq`` (and the
# program's entry, which takes the signals over first) stays free of onnx and numpy.
_API = {"compile": "edgeq.api", "load": "edgeq.api", "Output": "edgeq.api", "QnnLayout": "edgeq.api",
        "CompileReport": "edgeq.artifacts.report", "EdgeqError": "edgeq.errors", "UserInputError": "edgeq.errors",
        "PassFailure": "edgeq.errors", "EssentialPassNotApplied": "edgeq.errors",
        "TargetUnreachable": "edgeq.targets.check"}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'edgeq' has no attribute {name!r}")
