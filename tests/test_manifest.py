"""manifest.json: input model and recipe hashes, versions, every output file's hash, and
verify_manifest catching modified, truncated, missing and unlisted files."""

from __future__ import annotations

import hashlib
import json
from importlib import resources

import onnx
import onnxruntime
import pytest
from toy import toy_model_dir

import edgeq
from edgeq.errors import UserInputError
from edgeq.artifacts.manifest import MANIFEST_VERSION, build_manifest, verify_manifest, write_manifest


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def folders(tmp_path):
    """(input model path with external data, an output folder with files and a subfolder)."""
    model = toy_model_dir(tmp_path / "in")
    out = tmp_path / "out"
    (out / "aimet").mkdir(parents=True)
    (out / "model.onnx").write_bytes(b"onnx bytes")
    (out / "model.onnx.data").write_bytes(bytes(range(256)) * 8)
    (out / "encodings.json").write_text('{"version": "edgeq-encodings/1"}')
    (out / "aimet" / "model.encodings").write_text("{}")
    return model, out


def test_manifest_records_inputs_versions_and_every_file(folders, monkeypatch):
    model, out = folders
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    m = build_manifest(model, "w8a8", "qnn-htp-v75", out)
    assert m["version"] == MANIFEST_VERSION and m["created"] == "2023-11-14T22:13:20Z"
    assert (m["edgeq"], m["onnx"], m["onnxruntime"]) == (edgeq.__version__, onnx.__version__, onnxruntime.__version__)
    assert m["target"] == "qnn-htp-v75"
    files = m["input_model"]["files"]
    assert set(files) == {"model.onnx", "model.onnx.data"}  # the external data file is found and hashed
    for name, entry in files.items():
        assert entry == {"size": (model.parent / name).stat().st_size, "sha256": _sha(model.parent / name)}
    recipe_file = resources.files("edgeq") / "recipes" / "w8a8.toml"
    assert m["recipe"] == {"name": "w8a8", "source": "builtin", "sha256": hashlib.sha256(recipe_file.read_bytes()).hexdigest()}
    assert sorted(m["files"]) == ["aimet/model.encodings", "encodings.json", "model.onnx", "model.onnx.data"]
    assert m["files"]["model.onnx.data"] == {"size": 2048, "sha256": _sha(out / "model.onnx.data")}


def test_input_hash_covers_external_data(folders):
    model, out = folders
    before = build_manifest(model, "w8a8", None, out)["input_model"]["sha256"]
    data = model.parent / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert build_manifest(model, "w8a8", None, out)["input_model"]["sha256"] != before


def test_recipe_as_dict_or_file(folders, tmp_path):
    model, out = folders
    a = build_manifest(model, {"name": "mine", "pass": [{"name": "qdq"}]}, None, out)["recipe"]
    b = build_manifest(model, {"pass": [{"name": "qdq"}], "name": "mine"}, None, out)["recipe"]
    assert a == b and a["name"] == "mine" and a["source"] == "dict"  # key order does not matter
    toml = tmp_path / "custom.toml"
    toml.write_text('[[pass]]\nname = "qdq"\n')
    r = build_manifest(model, toml, None, out)["recipe"]
    assert r == {"name": "custom", "source": str(toml), "sha256": _sha(toml)}


def test_verify_detects_every_kind_of_change(folders):
    model, out = folders
    path = write_manifest(model, "w8a8", None, out)
    assert path == out / "manifest.json" and json.loads(path.read_text())["files"]
    assert verify_manifest(out) == []
    data = out / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01  # one bit, same size
    data.write_bytes(bytes(raw))
    assert verify_manifest(out) == ["content differs: model.onnx.data (sha256 mismatch)"]
    (out / "encodings.json").write_text("{}")
    (out / "aimet" / "model.encodings").unlink()
    (out / "extra.txt").write_text("x")
    problems = verify_manifest(out)
    assert problems == ["missing: aimet/model.encodings",
                        "size differs: encodings.json (2 bytes, manifest says 32)",
                        "content differs: model.onnx.data (sha256 mismatch)",
                        "not in manifest: extra.txt"]


def test_bad_inputs_are_user_errors(folders, tmp_path):
    model, out = folders
    with pytest.raises(UserInputError, match="no manifest.json"):
        verify_manifest(out)
    (out / "manifest.json").write_text("not json")
    with pytest.raises(UserInputError, match="not a valid manifest"):
        verify_manifest(out)
    with pytest.raises(UserInputError, match="unknown recipe"):
        build_manifest(model, "no-such-recipe", None, out)
    with pytest.raises(UserInputError, match="not found"):
        build_manifest(tmp_path / "missing.onnx", "w8a8", None, out)
    with pytest.raises(UserInputError, match="output folder"):
        build_manifest(model, "w8a8", None, tmp_path / "nowhere")
