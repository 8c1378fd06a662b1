"""Export a local Hugging Face model folder to one ONNX graph that edgeq can rewrite.

Every model builder in ``edgeq.models`` ends here, so all exports share one output layout::

    OUT/model.onnx         the whole model as a single graph (fp32, opset chosen by optimum)
    OUT/model.onnx_data    only if optimum had to store weights externally (models over 2 GB)
    OUT/config.json        the model's transformers config
    OUT/tokenizer.json ... tokenizer / preprocessor files when the source folder has them

Decoder models are exported *without* a KV cache by default (``task="auto"`` resolves to
``text-generation``, not ``text-generation-with-past``): one static graph with inputs
``input_ids``/``attention_mask``/``position_ids`` and output ``logits`` is what calibration,
the passes and evaluation all expect. Ask for ``*-with-past`` explicitly to get the cached form.

torch, transformers and optimum are imported lazily (the ``export`` extra), so importing this
module costs nothing and a missing extra is reported as one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from edgeq.errors import UserInputError
from edgeq.files.output_dir import atomic_output_dir

if TYPE_CHECKING:
    import onnx

EXPORT_EXTRA_HINT = "pip install -e .[export]"
MODEL_FILE = "model.onnx"

# Files that make an exported folder usable on its own (tokenize prompts, preprocess images).
# optimum re-saves the tokenizer it can load; anything it did not write is copied verbatim.
_SIDECAR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "preprocessor_config.json",
    "processor_config.json",
    "generation_config.json",
)


# weight files transformers loads (sharded ones too: model-00001-of-00002.safetensors)
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.h5", "*.msgpack", "*.ckpt.index")


def require_export_deps(*extra: str) -> None:
    """Fail with one line naming the install command when the export extra is missing.

    ``extra`` names further modules of the extra that a caller needs (e.g. ``gguf``).
    """
    missing = []
    for module in ("torch", "transformers", "optimum.exporters.onnx", *extra):
        try:
            __import__(module)
        except ImportError:
            missing.append(module.split(".")[0])
    if missing:
        raise UserInputError(
            f"exporting models needs {', '.join(missing)} (the export extra): {EXPORT_EXTRA_HINT}"
        )
    from edgeq.models.export_log import take_library_loggers

    take_library_loggers()


@contextlib.contextmanager
def private_torch_cache() -> Iterator[None]:
    """Importing ``torch._dynamo`` (optimum's exporter does) creates torch's compile cache folder,
    ``$TMPDIR/torchinductor_<user>``, and leaves it there: a folder outside ``-o``. An export
    compiles nothing, so ``TORCHINDUCTOR_CACHE_DIR`` names a temporary folder of edgeq's from the
    block's start to the process's end (a ``TORCHINDUCTOR_CACHE_DIR`` the user set is left alone).

    The block is entered before anything imports torch (``edgeq.models.cli._held``), so every torch
    import of the process sees the variable. The folder is removed when the block ends and again at
    exit, by a hook registered before torch is imported (so it runs after torch's own exit hooks): an
    import interrupted by a signal can leave torch's exit hooks to create the cache folder as the
    process ends, and they create it in edgeq's folder, which goes last."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        yield
        return
    import atexit
    import getpass

    # torch's default, which an interrupted torch._dynamo import could still create: removed on the
    # way out if it was not there before the block
    default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    existed = default.exists()
    tmp = tempfile.mkdtemp(prefix="edgeq-torch-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp
    atexit.register(shutil.rmtree, tmp, True)
    try:
        yield
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not existed and default.is_dir() and not default.is_symlink():
            _remove_empty_folders(default)


def traced_onnx(export: Callable[[str], object]) -> onnx.ModelProto:
    """The model ``export(path)`` writes (a ``torch.onnx.export`` call), read back into memory: the
    exporter writes into a private temporary folder (with any external data files beside it), so
    nothing is written to, or removed from, an output folder on the way."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="edgeq-trace-") as tmp:
        path = Path(tmp) / "traced.onnx"
        export(str(path))
        return onnx.load(str(path))


def _remove_empty_folders(root: Path) -> None:
    """Remove ``root`` and the folders below it that hold no file, deepest first: an export compiles
    nothing, so torch only made empty folders there; a file (another process's) keeps its folders."""
    for folder, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
        try:
            os.rmdir(folder)
        except OSError:
            pass


def export_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, task: str = "auto", force: bool = False) -> Path:
    """Export the Hugging Face model in ``hf_dir`` to ``out_dir`` and return ``out_dir``.

    ``out_dir`` is written atomically: it only appears (or is replaced) once the export succeeded;
    ``force``: it may replace a non-empty folder edgeq did not write (``edgeq.files.output_dir.check_output_dir``).
    """
    hf_dir = Path(hf_dir)
    if not hf_dir.exists():
        raise UserInputError(f"Hugging Face model folder not found: {hf_dir}")
    if not hf_dir.is_dir():
        raise UserInputError(f"{hf_dir} is a file, not a Hugging Face model folder")
    if not (hf_dir / "config.json").is_file():
        raise UserInputError(f"{hf_dir} is not a Hugging Face model folder (no config.json)")
    if not any(any(hf_dir.glob(pattern)) for pattern in _WEIGHT_FILES):
        raise UserInputError(f"{hf_dir} has a config.json but no weights (no {', '.join(_WEIGHT_FILES)} file)")
    require_export_deps()
    if task == "auto":
        task = infer_task(hf_dir)
    with atomic_output_dir(out_dir, force=force, inputs=(hf_dir,), marker={"export": "hf", "task": task}) as tmp:
        export_to(hf_dir, tmp, task)
    return Path(out_dir).resolve()


def infer_task(hf_dir: Path) -> str:
    """The optimum task of the architecture named in ``config.json`` (no KV cache).

    optimum only infers tasks for hub models, not local folders, so the model class named in
    ``architectures`` is mapped with optimum's own class-to-task table.
    """
    import transformers
    from optimum.exporters.tasks import TasksManager

    try:
        config = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserInputError(f"cannot read {hf_dir / 'config.json'}: {exc}") from None
    architectures = config.get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None:
        raise UserInputError(
            f"cannot infer the task of {hf_dir} (config.json names no known architecture); pass --task"
        )
    try:
        # Private, but it is the table main_export itself uses for models passed as objects.
        return TasksManager._infer_task_from_model_or_model_class(model_class=model_class)  # noqa: SLF001
    except (KeyError, ValueError, RuntimeError):
        raise UserInputError(f"cannot infer the task of {architectures[0]} in {hf_dir}; pass --task") from None


def export_to(hf_dir: Path, out: Path, task: str = "auto") -> None:
    """Run optimum's exporter from ``hf_dir`` into the existing folder ``out`` (not atomic).

    Shared by the model builders, which already write inside an ``atomic_output_dir``.
    """
    import torch
    from optimum.exporters.onnx import main_export
    from safetensors import SafetensorError

    # monolith=True forces one graph for models optimum would split (encoder/decoder); optimum
    # refuses it with a *-with-past task, whose decoder export is one graph anyway.
    monolith = not task.endswith("-with-past")
    try:
        with warnings.catch_warnings():
            # Tracing a transformers model emits dozens of expected TracerWarnings per layer.
            warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
            main_export(
                str(hf_dir),
                str(out),
                task=task,
                monolith=monolith,
                local_files_only=True,
            )
    except (KeyError, ValueError) as exc:
        # optimum reports unsupported architectures and unknown tasks this way.
        raise UserInputError(f"optimum cannot export {hf_dir} (task {task}): {_first_line(exc)}") from exc
    except Exception as exc:
        cause = _load_error(exc, SafetensorError)
        if cause is None:
            raise
        raise UserInputError(f"cannot load the model in {hf_dir}: {_first_line(cause)}") from exc
    if not (out / MODEL_FILE).is_file():
        produced = sorted(p.name for p in out.glob("*.onnx"))
        raise UserInputError(
            f"export of {hf_dir} produced {produced or 'no ONNX file'}, not one {MODEL_FILE}; "
            "edgeq needs a single graph, try another --task"
        )
    externalize_weights(out / MODEL_FILE)
    copy_sidecar_files(hf_dir, out)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _load_error(exc: BaseException | None, safetensor_error: type) -> BaseException | None:
    """transformers' report of a weights or config file it cannot load, anywhere in ``exc``'s chain
    (optimum retries a failed PyTorch load as TensorFlow, so it can sit under an ImportError):
    an ``OSError`` with a message and no errno (an errno is the file system's own error: disk
    full, permissions) or safetensors' error on a file that is not safetensors (empty, truncated)."""
    while exc is not None:
        if isinstance(exc, safetensor_error) or (isinstance(exc, OSError) and exc.errno is None):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


# model files at least this large get their weights moved to an external data file
EXTERNAL_WEIGHTS_MIN_BYTES = 64 * 2**20


def externalize_weights(path: Path) -> None:
    """Store the weights of a large exported model beside it (``model.onnx.data``), as models over
    2 GB must be anyway: a compiler can then read the graph without its weights and the weights
    one block at a time (``edgeq.blockwise``), instead of parsing all of them with the graph.
    Small models (tiny test exports) stay one file."""
    if path.stat().st_size < EXTERNAL_WEIGHTS_MIN_BYTES:
        return
    import onnx

    from edgeq.graph.ir import external_data_locations, save_model

    model = onnx.load_model(str(path))
    if any(True for _ in external_data_locations(model)):
        return  # optimum already wrote external data (a model over 2 GB)
    save_model(model, path)


def copy_sidecar_files(src: Path, out: Path) -> None:
    """Copy tokenizer/preprocessor files that the exporter did not write itself."""
    for name in _SIDECAR_FILES:
        source = src / name
        if source.is_file() and not (out / name).exists():
            shutil.copy2(source, out / name)
