"""Model inputs for calibration and evaluation: token windows from text, or samples from an .npz.

Token windows follow the project protocol (see ``data/wikitext-2/README.md``): tokenize the whole
text file with the model's tokenizer, as one ``encode`` call; cut non-overlapping windows of
``seq_len`` tokens from the start (a partial last window is dropped); use windows
``[offset, offset + windows)``.

Special tokens: by default the tokenizer's own post-processor runs (``add_special_tokens=True``),
once for the whole file. For SmolLM2 that prepends a single ``<|im_start|>`` (id 1) to the file,
so window 0 starts with it and every later window is shifted by one token. This is how the
project's reported figures were measured (SmolLM2-135M, WikiText-2 test, 40 windows: 25.570);
``special_tokens=False`` gives the raw text tokens only (25.615 on the same windows).

BOS: a tokenizer whose ``tokenizer_config.json`` says ``add_bos_token: true`` (Gemma: the model
depends on it, fp32 perplexity 198 with it and 610 without) gets windows that each start with BOS:
the file is tokenized without special tokens, cut into runs of ``seq_len - 1`` tokens, and BOS leads
each run (``window_convention`` names the convention; every figure records it). SmolLM2's exported
tokenizer says ``false`` (its GGUF's word) and keeps the one-stream windows above, so its figures
are unchanged.

Models whose only inputs are ``input_ids`` / ``attention_mask`` / ``position_ids`` are fed from
token windows with ``feeds_for_windows``. Anything else (KV-cache inputs, images, ...) is fed from
an .npz read by ``load_npz_samples``.

Tokenizing a file is cached on disk under ``$EDGEQ_CACHE_DIR`` (default ``~/.cache/edgeq``), keyed
by the text file's hash, the tokenizer file's hash and the ``tokenizers`` version; set
``EDGEQ_CACHE_DIR`` to an empty string to turn the cache off. A broken cache entry is ignored and
rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, cast
from collections.abc import Sequence

import numpy as np

from edgeq.errors import UserInputError
from edgeq.kv_cache import PAST_PREFIX
from edgeq.files.npzfile import NumpyFileError, read_npy, read_user_npz

TOKEN_INPUTS = ("input_ids", "attention_mask", "position_ids")
CACHE_PREFIX = PAST_PREFIX  # KV-cache inputs; calibration runs the prefill with them empty

# onnxruntime NodeArg.type -> numpy dtype
_ORT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint64)": np.uint64,
    "tensor(uint32)": np.uint32,
    "tensor(uint16)": np.uint16,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def ort_dtype(type_str: str, name: str = "") -> np.dtype:
    """numpy dtype of an onnxruntime type string such as ``tensor(int64)``."""
    try:
        return np.dtype(_ORT_DTYPES[type_str])
    except KeyError:
        raise UserInputError(f"model input '{name}' has unsupported type {type_str}") from None


# ---------------------------------------------------------------------------------------------
# Tokenizer and token windows
# ---------------------------------------------------------------------------------------------


def _tokenizer_file(tokenizer_dir: str | os.PathLike) -> Path:
    path = Path(tokenizer_dir)
    if path.is_file() and path.suffix == ".json":
        return path
    if not path.exists():
        raise UserInputError(f"tokenizer folder not found: {path}")
    file = path / "tokenizer.json"
    if not file.is_file():
        raise UserInputError(f"no tokenizer.json in {path} (pass the folder of the exported model)")
    return file


def load_tokenizer(tokenizer_dir: str | os.PathLike) -> Any:
    """Load ``tokenizer_dir/tokenizer.json`` (or that .json file itself) as a ``tokenizers.Tokenizer``.

    Truncation and padding are switched off so a whole file encodes to all its tokens.
    """
    file = _tokenizer_file(tokenizer_dir)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserInputError(
            "the 'tokenizers' library is needed for --text/--tokenizer: pip install -e .[export]"
        ) from None
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise UserInputError(f"cannot load tokenizer {file}: {str(exc).splitlines()[0]}") from None
    tok.no_truncation()
    tok.no_padding()
    return tok


def _read_text(text_path: str | os.PathLike) -> tuple[Path, bytes]:
    path = Path(text_path)
    if not path.exists():
        raise UserInputError(f"text file not found: {path}")
    if not path.is_file():
        raise UserInputError(f"text path is not a file: {path}")
    data = path.read_bytes()
    return path, data


def cache_root() -> Path | None:
    """``$EDGEQ_CACHE_DIR`` (default ``~/.cache/edgeq``); ``None`` when it is set to an empty string
    (caching off)."""
    value = os.environ.get("EDGEQ_CACHE_DIR")
    if value is None:
        return Path.home() / ".cache" / "edgeq"
    return Path(value) if value else None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokenize_file(
    text_path: str | os.PathLike, tokenizer_dir: str | os.PathLike, special_tokens: bool = True
) -> np.ndarray:
    """All token ids of the file (UTF-8, universal newlines): int64 [n_tokens].

    ``special_tokens`` is ``add_special_tokens`` of the one ``encode`` call (see the module
    docstring).

    The whole text is encoded in one ``encode`` call. Splitting into lines and using
    ``encode_batch`` is about 3x faster but only equals whole-text encoding when the tokenizer's
    pre-tokenizer never merges across a newline, which is not guaranteed (e.g. runs of newlines
    in byte-level BPE), so it is not used: encoding the 1.2 MB WikiText-2 test file takes ~1.3 s
    on one core, and the result is cached on disk (see the module docstring).
    """
    path, data = _read_text(text_path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserInputError(f"text file {path} is not UTF-8: {exc}") from None
    # universal newlines, as open(path).read() gives
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        raise UserInputError(f"text file is empty: {path}")
    tok_file = _tokenizer_file(tokenizer_dir)

    cache_file = None
    cache = cache_root()
    if cache is not None:
        try:
            import tokenizers

            version = tokenizers.__version__
        except ImportError:
            version = "none"
        key = _sha256(
            b"\0".join(
                [
                    _sha256(data).encode(),
                    _sha256(tok_file.read_bytes()).encode(),
                    version.encode(),
                    b"special" if special_tokens else b"plain",
                ]
            )
        )[:32]
        cache_file = cache / "tokens" / f"{key}.npy"
        if cache_file.is_file():
            try:
                cached = read_npy(cache_file)
            except NumpyFileError:  # a damaged entry: tokenized again and rewritten
                cached = None
            if cached is not None and cached.ndim == 1 and cached.size and np.issubdtype(cached.dtype, np.integer):
                return cached.astype(np.int64)

    tok = load_tokenizer(tok_file)
    ids = np.asarray(tok.encode(text, add_special_tokens=special_tokens).ids, dtype=np.int64)
    if ids.size == 0:
        raise UserInputError(f"text file {path} gives no tokens")

    if cache_file is not None:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache_file.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                np.save(fh, ids.astype(np.int32 if ids.max() < 2**31 else np.int64))
            os.replace(tmp, cache_file)
        except OSError:
            pass  # the cache is an optimisation only
    return ids


def default_tokenizer_dir(model_path: str | os.PathLike) -> Path | None:
    """The model's own folder when it holds tokenizer files (what ``edgeq export`` writes)."""
    folder = Path(model_path).parent.resolve()  # (a linked model.onnx: its siblings, not the link target's)
    return folder if (folder / "tokenizer.json").is_file() else None


def hf_config(folder: str | os.PathLike) -> dict:
    """The Hugging Face ``config.json`` in ``folder`` (or beside that file); {} when unreadable."""
    path = Path(folder)
    path = path / "config.json" if path.is_dir() else path.parent / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def max_positions(folder: str | os.PathLike) -> int | None:
    """The context length a Hugging Face ``config.json`` beside the tokenizer declares
    (``max_position_embeddings`` / ``n_positions``), or None when there is none to read."""
    config = hf_config(folder)
    for key in ("max_position_embeddings", "n_positions"):
        if _positive_int(config.get(key)):
            return config[key]
    return None


def image_dims(folder: str | os.PathLike) -> tuple[int | None, int, int] | None:
    """(channels, height, width) of the images a vision model's ``config.json`` declares
    (``image_size``: one int or [height, width]; ``num_channels``, None when absent), or None."""
    config = hf_config(folder)
    size = config.get("image_size")
    sizes = size if isinstance(size, list) and len(size) == 2 else [size, size]
    if not all(_positive_int(v) for v in sizes):
        return None
    # (both sizes checked positive ints above)
    return _positive_int(config.get("num_channels")), cast(int, sizes[0]), cast(int, sizes[1])


BOS_EACH_WINDOW = "bos-each-window"  # every window is BOS + seq_len - 1 text tokens
ONE_STREAM = "one-stream"  # windows cut from one token stream (the tokenizer's specials once, at the start)
RAW_STREAM = "raw-stream"  # windows cut from the text's tokens only (no special tokens at all)


def bos_token_id(tokenizer_dir: str | os.PathLike) -> int | None:
    """The BOS id when the tokenizer's settings say every sequence starts with it, else None.

    ``add_bos_token: true`` in ``tokenizer_config.json`` beside ``tokenizer.json`` (what
    transformers' tokenizers and ``edgeq export`` write) and a ``bos_token`` the vocabulary has."""
    file = _tokenizer_file(tokenizer_dir)
    try:
        settings = json.loads((file.parent / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(settings, dict) or settings.get("add_bos_token") is not True:
        return None
    bos = settings.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    if not isinstance(bos, str):
        return None
    token = load_tokenizer(file).token_to_id(bos)
    return None if token is None else int(token)


def window_convention(tokenizer_dir: str | os.PathLike, special_tokens: bool = True) -> str:
    """How ``token_windows`` cuts windows with this tokenizer (recorded with every figure)."""
    if not special_tokens:
        return RAW_STREAM
    return BOS_EACH_WINDOW if bos_token_id(tokenizer_dir) is not None else ONE_STREAM


def token_windows(
    text_path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    seq_len: int = 512,
    windows: int | None = None,
    offset: int = 0,
    special_tokens: bool = True,
) -> np.ndarray:
    """Windows ``[offset, offset + windows)`` of ``seq_len`` tokens: int64 ``[windows, seq_len]``,
    each led by BOS where the tokenizer says so (``window_convention``).

    ``windows=None`` takes every full window from ``offset`` on. Asking for more windows than the
    file holds is an error (the count is part of every reported figure), not a silent truncation.
    """
    if seq_len < 2:
        raise UserInputError(f"seq_len must be at least 2 (one input and one predicted token), got {seq_len}")
    if offset < 0:
        raise UserInputError(f"offset must be >= 0, got {offset}")
    if windows is not None and windows < 1:
        raise UserInputError(f"windows must be >= 1, got {windows}")
    limit = max_positions(tokenizer_dir)
    if limit is not None and seq_len > limit:
        raise UserInputError(f"seq_len {seq_len} is longer than the model's context of {limit} positions "
                             f"(max_position_embeddings in {Path(tokenizer_dir) / 'config.json'})")
    bos = bos_token_id(tokenizer_dir) if special_tokens else None
    ids = tokenize_file(text_path, tokenizer_dir, special_tokens=special_tokens and bos is None)
    run = seq_len if bos is None else seq_len - 1  # text tokens per window
    available = ids.size // run
    if available == 0:
        raise UserInputError(
            f"text {text_path} has {ids.size} tokens, shorter than one window of {seq_len}"
        )
    if offset >= available:
        raise UserInputError(
            f"offset {offset} is beyond the {available} windows of {seq_len} tokens in {text_path}"
        )
    stop = available if windows is None else offset + windows
    if stop > available:
        raise UserInputError(
            f"{windows} windows from offset {offset} asked, but {text_path} has only "
            f"{available} windows of {seq_len} tokens ({available - offset} from that offset)"
        )
    runs = ids[: available * run].reshape(available, run)[offset:stop]
    if bos is None:
        return runs.copy()
    return np.concatenate([np.full((runs.shape[0], 1), bos, np.int64), runs], axis=1)


# ---------------------------------------------------------------------------------------------
# Model feeds
# ---------------------------------------------------------------------------------------------


def _static(dim: Any) -> int | None:
    return dim if isinstance(dim, int) and dim >= 0 else None


def feeds_for_windows(input_specs: Sequence[Any], ids: np.ndarray) -> dict[str, np.ndarray]:
    """The model's inputs for a batch of token windows ``ids`` [batch, seq_len].

    ``input_specs`` is ``InferenceSession.get_inputs()`` (objects with ``name``, ``type``,
    ``shape``). Inputs are matched by name: ``input_ids`` gets ``ids``, ``attention_mask`` ones,
    ``position_ids`` ``arange(seq_len)`` per row, each in the input's integer type (int64 or
    int32). Any other input means the model cannot be fed from text alone.
    """
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise UserInputError(f"token windows must be [batch, seq_len], got shape {list(ids.shape)}")
    batch, seq_len = ids.shape
    cache_specs = [spec for spec in input_specs if spec.name.startswith(CACHE_PREFIX)]
    input_specs = [spec for spec in input_specs if not spec.name.startswith(CACHE_PREFIX)]
    names = [spec.name for spec in input_specs]
    others = [n for n in names if n not in TOKEN_INPUTS]
    if others:
        raise UserInputError(
            f"model input(s) {', '.join(others)} cannot be built from text (only "
            f"{'/'.join(TOKEN_INPUTS)} can): give the model's inputs as an .npz instead"
        )
    if "input_ids" not in names:
        raise UserInputError("model has no 'input_ids' input: give its inputs as an .npz instead")
    feeds: dict[str, np.ndarray] = {}
    for spec in input_specs:
        dtype = ort_dtype(spec.type, spec.name)
        if dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
            raise UserInputError(f"model input '{spec.name}' is {spec.type}, expected int64 or int32")
        shape = list(spec.shape or [])
        if len(shape) != 2:
            raise UserInputError(
                f"model input '{spec.name}' has rank {len(shape)}, expected 2 ([batch, sequence])"
            )
        for axis, (want, got) in enumerate(zip(shape, (batch, seq_len))):
            if _static(want) is not None and want != got:
                raise UserInputError(
                    f"model input '{spec.name}' has static dim {want} on axis {axis}, "
                    f"the windows give {got} (batch {batch}, seq_len {seq_len})"
                )
        if spec.name == "input_ids":
            if dtype == np.int32 and ids.size and ids.max() >= 2**31:
                raise UserInputError("token ids do not fit the model's int32 input_ids")
            feeds[spec.name] = ids.astype(dtype, copy=False)
        elif spec.name == "attention_mask":
            feeds[spec.name] = np.ones((batch, seq_len), dtype=dtype)
        else:
            feeds[spec.name] = np.broadcast_to(np.arange(seq_len, dtype=dtype), (batch, seq_len)).copy()
    feeds.update(empty_cache_feeds(cache_specs, batch))
    return feeds


def empty_cache_feeds(cache_specs: Sequence[Any], batch: int) -> dict[str, np.ndarray]:
    """Empty KV-cache inputs (past length 0: the prefill run) for ``past_key_values.*`` specs
    [batch, kv_heads, past, head_dim] with static heads and head_dim."""
    feeds = {}
    for spec in cache_specs:
        dims = list(spec.shape or [])
        if len(dims) != 4 or _static(dims[1]) is None or _static(dims[3]) is None:
            raise UserInputError(f"cache input {spec.name} has shape {dims}, expected [batch, kv_heads, past, head_dim]")
        feeds[spec.name] = np.zeros((batch, dims[1], 0, dims[3]), ort_dtype(spec.type, spec.name))
    return feeds


def _batch_of(feed: dict[str, np.ndarray]) -> int:
    """The batch size of one npz sample (the first axis of its first non-scalar input)."""
    return next((v.shape[0] for v in feed.values() if np.ndim(v) >= 1), 1)


def load_npz_samples(npz_path: str | os.PathLike, input_specs: Sequence[Any]) -> list[dict[str, np.ndarray]]:
    """Read model inputs from an .npz into a list of feed dicts, one per sample.

    Format: one array per model input, stored under the input's exact name (``np.savez(path,
    input_ids=..., attention_mask=...)``); no other keys. For an input of rank ``r`` (as the
    session reports it) each array is either

    - rank ``r + 1``: ``[num_samples, *input_shape]``; sample ``i`` is fed ``array[i]`` (its batch
      axis, if the input has one, is part of ``input_shape``), or
    - rank ``r``: the input's own shape, whose first (batch) axis is the sample axis; sample ``i``
      is fed ``array[i:i+1]`` (batch 1). A rank-0 input in this form is a single sample.

    Every array must give the same ``num_samples``. Dtypes must equal the input's type exactly
    (no silent casts), static dims must match, and a symbolic dim (e.g. ``sequence_length``) must
    have one value across all inputs of a sample.
    """
    path = Path(npz_path)
    arrays = read_user_npz(path, ".npz of model inputs")

    specs = {spec.name: spec for spec in input_specs}
    # a KV-cache graph calibrates on prefill: cache inputs absent from the npz start empty
    empty_cache = [n for n in specs if n not in arrays and n.startswith(CACHE_PREFIX)]
    specs = {n: spec for n, spec in specs.items() if n not in empty_cache}
    missing = [n for n in specs if n not in arrays]
    extra = [k for k in arrays if k not in specs]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing input(s) {', '.join(missing)}")
        if extra:
            parts.append(f"unknown key(s) {', '.join(extra)}")
        raise UserInputError(
            f"{path}: {'; '.join(parts)} (model inputs: {', '.join(specs)})"
        )

    per_input: dict[str, tuple[np.ndarray, bool]] = {}  # name -> (array, stacked)
    counts: dict[str, int] = {}
    for name, spec in specs.items():
        arr = arrays[name]
        want_dtype = ort_dtype(spec.type, name)
        if arr.dtype != want_dtype:
            raise UserInputError(
                f"{path}: '{name}' has dtype {arr.dtype}, the model input is {want_dtype} ({spec.type})"
            )
        shape = list(spec.shape or [])
        rank = len(shape)
        if arr.ndim == rank + 1:
            per_input[name] = (arr, True)
            counts[name] = arr.shape[0]
        elif arr.ndim == rank:
            per_input[name] = (arr, False)
            counts[name] = arr.shape[0] if rank else 1
        else:
            raise UserInputError(
                f"{path}: '{name}' has rank {arr.ndim} (shape {list(arr.shape)}), expected {rank} "
                f"(input shape {shape}) or {rank + 1} ([num_samples, *input shape])"
            )
        sample_shape = arr.shape[1:] if arr.ndim == rank + 1 else ((1,) + arr.shape[1:] if rank else ())
        for axis, (want, got) in enumerate(zip(shape, sample_shape)):
            if _static(want) is not None and want != got:
                raise UserInputError(
                    f"{path}: '{name}' sample shape {list(sample_shape)} does not match the input "
                    f"shape {shape} on axis {axis} ({got} != {want})"
                )
        _check_npz_values(path, name, arr, sample_shape)
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{n}: {c}" for n, c in counts.items())
        raise UserInputError(f"{path}: arrays disagree on the number of samples ({detail})")
    num = next(iter(counts.values()), 0)
    if num == 0:
        raise UserInputError(f"{path} holds no samples")

    samples = []
    for i in range(num):
        feed = {}
        for name, (arr, stacked) in per_input.items():
            feed[name] = arr[i] if stacked else (arr[i : i + 1] if arr.ndim else arr)
        samples.append(feed)
    cache_specs = [spec for spec in input_specs if spec.name in empty_cache]
    for feed in samples:
        feed.update(empty_cache_feeds(cache_specs, _batch_of(feed)))

    # symbolic dims must agree across inputs (checked on the first sample: all have equal shapes
    # within one stacked array, so this covers every sample)
    seen: dict[str, tuple[int, str]] = {}
    for name, spec in specs.items():
        for axis, dim in enumerate(spec.shape or []):
            if isinstance(dim, str) and dim:
                got = samples[0][name].shape[axis]
                if dim in seen and seen[dim][0] != got:
                    raise UserInputError(
                        f"{path}: dim '{dim}' is {seen[dim][0]} in '{seen[dim][1]}' but {got} in '{name}'"
                    )
                seen.setdefault(dim, (got, name))
    return samples


def _check_npz_values(path: Path, name: str, arr: np.ndarray, sample_shape: tuple) -> None:
    """What dtypes and static dims do not show: an empty axis (a sequence of length 0; a KV-cache
    input may have an empty past), NaN or inf in a float input (observers would pass over them
    without a word) and negative token ids (Gather would count them from the end of the table)."""
    if 0 in sample_shape and not name.startswith(CACHE_PREFIX):
        raise UserInputError(f"{path}: '{name}' has an empty axis (sample shape {list(sample_shape)}): "
                             "a sample needs at least one element on every axis (sequence length 0?)")
    if np.issubdtype(arr.dtype, np.floating):
        bad = ~np.isfinite(arr)
        if bad.any():
            first = [int(i) for i in np.argwhere(bad)[0]]
            raise UserInputError(f"{path}: '{name}' holds {int(bad.sum())} NaN or inf value(s) (first at index {first})")
    if name == "input_ids" and arr.size and arr.min() < 0:
        raise UserInputError(f"{path}: '{name}' holds a negative token id ({int(arr.min())}); token ids start at 0")


def random_feeds(
    input_specs: Sequence[Any], num_samples: int = 1, seq_len: int = 16, seed: int = 0
) -> list[dict[str, np.ndarray]]:
    """Random inputs from the session's input specs, reproducible from ``seed``.

    Dynamic dims become 1 on axis 0 (batch) and ``seq_len`` elsewhere. By name and type: inputs
    whose name contains ``mask`` are ones, ``position`` gives ``arange`` along the last axis, other
    integer inputs are uniform in [0, 100), floats standard normal, bools True.
    """
    if num_samples < 1:
        raise UserInputError(f"number of random samples must be >= 1, got {num_samples}")
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(num_samples):
        feed = {}
        for spec in input_specs:
            dtype = ort_dtype(spec.type, spec.name)
            # (every dim an int: a dynamic one (None) is replaced)
            shape = cast("tuple[int, ...]", tuple(
                _static(d) if _static(d) is not None else (1 if axis == 0 else seq_len)
                for axis, d in enumerate(spec.shape or [])
            ))
            lname = spec.name.lower()
            if "mask" in lname or dtype == np.bool_:
                arr = np.ones(shape, dtype=dtype)
            elif "position" in lname and shape:
                arr = np.broadcast_to(np.arange(shape[-1]).astype(dtype), shape).copy()
            elif np.issubdtype(dtype, np.integer):
                arr = rng.integers(0, 100, size=shape).astype(dtype)
            else:
                arr = rng.standard_normal(shape).astype(dtype)
            feed[spec.name] = arr
        samples.append(feed)
    return samples

