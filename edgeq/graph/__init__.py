"""The graph layer: loading and checking ONNX files (``ir``, ``modelcheck``, ``loadcheck``), walking
protobufs (``protowalk``), building small graphs (``graph_builder``), temporary model files for
onnxruntime sessions (``session_files``), content hashes (``fingerprint``) and the typed facts that
passes leave on a graph for later passes and later compiles (``facts``). Of edgeq's subpackages it
imports only ``files``.
"""
