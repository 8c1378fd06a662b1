"""edgeq: a graph-level ONNX rewriting compiler for NPU and edge deployment.

The core package holds the IR helpers, the pass base and registry, recipes, the pipeline,
calibration, evaluation and the CLI. Method passes live in ``edgeq.passes`` (folder ``passes/``),
custom ops in ``edgeq.runtime_ops``, Triton kernels in ``edgeq.kernels`` and model builders in
``edgeq.models``. Importing edgeq does no I/O and configures no logging.
"""

__version__ = "0.1.0"
