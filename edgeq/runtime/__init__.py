"""onnxruntime and process helpers every layer uses: CPU sessions on model files (``ort_session``),
a token window's NLL (``nll``), peak RSS (``peak_rss``) and progress lines (``progress``).
"""
