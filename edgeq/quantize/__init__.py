"""Quantization math shared by passes, targets and the writer: scales and grids (``quant``),
Q/DQ node pairs (``qdq_nodes``), the encodings read back from a graph (``qdq_encodings``) and
the SQNR (``sqnr``).
"""
