"""Method math: the numpy and graph code of the papers' methods, beside the passes that use it.

A pass module (``edgeq.passes.<name>``) is the thin, registered rewrite; what it computes lives
here (GPTQ sweeps, DPQ/FP8 grids, ResQ bases, Eq. 9, the residual-stream analysis, side branches,
the KV-cache attention sites and their calibration, ...) so that passes share method code instead
of importing each other. Nothing here registers a pass or imports a pass module.
"""
