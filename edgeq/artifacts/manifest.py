"""``manifest.json``: what an output folder was built from, and a hash of every file in it.

Why: an NPU hand-off passes through several hands and tools; the manifest lets anyone tell later
which input model (its .onnx and external data), which recipe (name and content), which edgeq,
onnx and onnxruntime produced the folder, and ``verify_manifest`` detects any file that was
changed, truncated, removed or added since (corruption in transit, tampering, a stale copy).

Layout, version ``edgeq-manifest/1``::

    {"version", "created": ISO 8601 UTC, "edgeq": version, "onnx": version, "onnxruntime": version,
     "target": name or null,
     "input_model": {"path", "sha256", "files": {name: {"size", "sha256"}}},
     "recipe": {"name", "source", "sha256"},
     "files": {relative posix path: {"size", "sha256"}}}

``input_model.sha256`` is the sha256 of the sorted ``name sha256`` lines of the model file and its
external data files (one digest for the whole model). ``files`` lists every file under the output
folder except ``manifest.json`` itself; its names are also what a later run may replace without
``--force`` (``edgeq.files.output_dir.written_by_edgeq``: a file the user saved into the folder is not
listed, so it is never deleted silently). ``created`` honours ``SOURCE_DATE_EPOCH`` (reproducible
builds). The recipe hash is the sha256 of the recipe's TOML text, or of the canonical JSON of a
recipe given as a dict.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from importlib import metadata
from pathlib import Path
from typing import Mapping

import onnx

import edgeq
from edgeq.graph import ir
from edgeq.errors import UserInputError
from edgeq.files.tomlfile import load_named_toml

MANIFEST_VERSION = "edgeq-manifest/1"
MANIFEST_NAME = "manifest.json"
_CHUNK = 1 << 20


def build_manifest(input_model, recipe_name_or_dict, target: str | None, out_dir) -> dict:
    """The manifest of ``out_dir`` (see the module docstring); reads every output file once.
    ``input_model``: the model's path, or its ``input_model_record`` taken when it was read."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise UserInputError(f"output folder not found: {out_dir}")
    return {
        "version": MANIFEST_VERSION,
        "created": _timestamp(),
        "edgeq": _edgeq_version(),
        "onnx": onnx.__version__,
        "onnxruntime": _onnxruntime_version(),
        "target": target,
        "input_model": dict(input_model) if isinstance(input_model, Mapping) else input_model_record(Path(input_model)),
        "recipe": _recipe(recipe_name_or_dict),
        "files": _folder_files(out_dir),
    }


def write_manifest(input_model, recipe_name_or_dict, target: str | None, out_dir) -> Path:
    """Build the manifest of ``out_dir`` and write it to ``out_dir/manifest.json`` (atomically)."""
    data = build_manifest(input_model, recipe_name_or_dict, target, out_dir)
    path = Path(out_dir) / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def verify_manifest(out_dir) -> list[str]:
    """One line per mismatch between ``out_dir`` and its manifest: modified, missing or unlisted
    files (empty: the folder is what the manifest describes)."""
    out_dir = Path(out_dir)
    path = out_dir / MANIFEST_NAME
    try:
        recorded = json.loads(path.read_text())["files"]
    except FileNotFoundError:
        raise UserInputError(f"no {MANIFEST_NAME} in {out_dir}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserInputError(f"{path} is not a valid manifest: {exc}") from None
    present = {p.relative_to(out_dir).as_posix(): p for p in _walk(out_dir)}
    problems = []
    for name, want in sorted(recorded.items()):
        file = present.pop(name, None)
        if file is None:
            problems.append(f"missing: {name}")
        elif file.stat().st_size != want.get("size"):
            problems.append(f"size differs: {name} ({file.stat().st_size} bytes, manifest says {want.get('size')})")
        elif _sha256(file) != want.get("sha256"):
            problems.append(f"content differs: {name} (sha256 mismatch)")
    problems += [f"not in manifest: {name}" for name in sorted(present)]
    return problems


# -- pieces ------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _walk(folder: Path) -> list[Path]:
    """Every file under ``folder`` but the manifest (and its temporary twin)."""
    def ours(p: Path) -> bool:
        return p.parent == folder and (p.name == MANIFEST_NAME or p.name.startswith(f".{MANIFEST_NAME}.tmp-"))

    return sorted(p for p in folder.rglob("*") if p.is_file() and not ours(p))


def _folder_files(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): _entry(p) for p in _walk(folder)}


def input_model_record(path: Path, locations: set[str] | None = None) -> dict:
    """Hashes of the model file and every external data file it references (``locations``: those
    files' names when the caller read the model already; else read from its structure)."""
    path = Path(path)
    if locations is None:
        # validates locations (inside the folder, present); every data file, also one whose tensors it read in
        locations = ir.load_model_and_locations(path, load_external=False)[1]
    files = {path.name: _entry(path)}
    for location in sorted(locations):
        files[location] = _entry(path.parent / location)
    digest = hashlib.sha256("".join(f"{n} {e['sha256']}\n" for n, e in sorted(files.items())).encode()).hexdigest()
    return {"path": str(path), "sha256": digest, "files": files}


def _recipe(recipe) -> dict:
    """name, origin and sha256 of the recipe: a loaded ``Recipe`` (what compile passes: the text it
    actually ran), a dict (canonical JSON), or a name / path read through ``edgeq.files.tomlfile``."""
    from edgeq.recipes import Recipe

    if isinstance(recipe, Recipe):
        return {"name": recipe.name, "source": recipe.origin, "sha256": recipe.sha256}
    if isinstance(recipe, Mapping):
        text = json.dumps(recipe, sort_keys=True, separators=(",", ":"), default=str)
        return {"name": recipe.get("name"), "source": "dict", "sha256": hashlib.sha256(text.encode()).hexdigest()}
    file = load_named_toml(str(recipe), "edgeq", "recipes", "recipe")
    return {"name": file.name, "source": file.source, "sha256": file.sha256}


def _timestamp() -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    try:
        seconds = int(epoch) if epoch else time.time()
    except ValueError:
        raise UserInputError(f"SOURCE_DATE_EPOCH must be an integer, got '{epoch}'") from None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _edgeq_version() -> str | None:
    return getattr(edgeq, "__version__", None) or _dist_version("edgeq")


def _onnxruntime_version() -> str:
    import onnxruntime  # here, not at import: importing edgeq.artifacts.manifest stays cheap

    return onnxruntime.__version__


def _dist_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
