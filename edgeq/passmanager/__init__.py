"""The pass manager: the pass base and lifecycle (``passbase``), the registry and the pipeline. It
imports no evaluation (``edgeq.evaluate``): the SQNR and the peak RSS come from ``quantize`` and
``runtime``.
"""
