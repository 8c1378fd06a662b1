"""What edgeq reads and writes as files, below the graph: output folders and their atomic swap
(``output_dir``), NumPy files (``npzfile``) and TOML (``tomlfile``).
"""
