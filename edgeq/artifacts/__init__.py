"""What ``edgeq compile`` writes, and how: ``writer`` (the output folder, atomically), ``encodings``
(every quantized tensor read back from the graph), ``aimet`` (the same in the AIMET/QNN layout)
and ``manifest`` (hashes of the inputs and of every output file)."""
