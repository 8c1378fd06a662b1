"""The three decoder graph kinds behind one interface, on onnxruntime CPU (batch 1).

``open_decoder(path)`` picks the kind from what it finds:

- ``static-pair``: a folder with ``prefill.onnx`` and ``decode.onnx`` (``edgeq compile --static``),
  each carrying ``edgeq.static`` metadata ``{"role", "prefill": S, "context": C, "layers": L,
  "kv_heads": H, "head_dim": D, "cache_dtype"}``. The host owns the cache: one zero-filled
  ``[1, H, C, D]`` array per layer and key/value. A run over ``W`` positions (``W = S`` for
  prefill.onnx, 1 for decode.onnx) at cache position ``pos`` feeds ``input_ids`` [1, W] (unused
  tail positions 0), ``attention_mask`` [1, C + W] (cache slots ``0..pos-1`` and the ``n`` real
  tokens of the chunk are 1), ``position_ids`` ``pos + arange(W)`` and the whole cache; the graph
  returns ``logits`` [1, W, V] and ``present.*`` [1, H, W, D], the new entries only, whose first
  ``n`` the host copies into ``cache[:, :, pos:pos+n]`` before advancing ``pos`` by ``n``. Fixed
  shapes are the point (an NPU compiles one shape); the cost is that the context is bounded: a
  decoder holding ``C`` tokens accepts no more (``room() == 0``);
- ``dynamic-with-past``: a ``model.onnx`` with ``past_key_values.{i}.key/.value`` inputs and
  ``present.*`` outputs (``edgeq export ... --with-past``): the presents of one run are the pasts of
  the next; no bound on the context but the model's own;
- ``dynamic``: a ``model.onnx`` taking only ``input_ids`` / ``attention_mask`` / ``position_ids``:
  every step re-runs the whole sequence (quadratic; the reference the cached graphs reproduce).

Every decoder keeps its sequence between calls: ``prefill(ids)`` after ``reset()`` feeds the prompt
and returns the last position's logits, ``step(token)`` feeds one more token and returns its logits,
``prefill_all(ids)`` feeds the prompt and returns the logits of every position (teacher forcing);
``position`` is how many tokens it holds. Sessions use onnxruntime's default graph optimizations
(what a deployment runs); ``optimize=False`` runs the graphs as written (exactness tests).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast
from collections.abc import Sequence

import numpy as np

from edgeq.errors import UserInputError
from edgeq.generation.decoder_base import Decoder
from edgeq.kv_cache import PAST_PREFIX, PRESENT_PREFIX
from edgeq.textdata import ort_dtype

STATIC_KEY = "edgeq.static"
STATIC_FILES = ("prefill.onnx", "decode.onnx")
MODES = ("static-pair", "dynamic-with-past", "dynamic")
_TOKEN_INPUTS = ("input_ids", "attention_mask", "position_ids")
_CACHE_DTYPES = {"float32": np.float32, "int8": np.int8, "float16": np.float16, "uint8": np.uint8}


def _run(session: Any, outputs: list[str], feeds: dict, what: str) -> list[np.ndarray]:
    """``session.run`` with onnxruntime's own error types turned into one line."""
    try:
        return session.run(outputs, feeds)
    except Exception as exc:  # onnxruntime raises its own pybind types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserInputError(f"onnxruntime failed on {what}: {first[:300]}") from None


def _as_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        raise UserInputError("the prompt has no tokens")
    return arr


def _check_decoder_graph(session: Any, label: str, token_input: str = "input_ids") -> tuple[list[str], list[str]]:
    """Input and output names of a token-in (``token_input``: ids, or a VLM's ``inputs_embeds``),
    logits-out decoder graph; anything else is refused."""
    inputs = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    if token_input not in inputs or "logits" not in outputs:
        raise UserInputError(
            f"{label} is not a decoder graph (it needs an {token_input} input and a logits output; "
            f"inputs: {', '.join(inputs) or 'none'}; outputs: {', '.join(outputs) or 'none'})"
        )
    others = [n for n in inputs if n not in (token_input, *_TOKEN_INPUTS[1:]) and not n.startswith(PAST_PREFIX)]
    if others:
        raise UserInputError(f"{label} takes inputs a text decoder cannot feed: {', '.join(others)}")
    for name in inputs:
        if name.startswith(PAST_PREFIX) and PRESENT_PREFIX + name[len(PAST_PREFIX):] not in outputs:
            raise UserInputError(f"{label}: cache input {name} has no matching present output")
    return inputs, outputs


class RecomputeDecoder(Decoder):
    """A graph without cache: each call re-runs the whole sequence so far."""

    mode = "dynamic"

    def __init__(self, session: Any, label: str = "model") -> None:
        super().__init__()
        self.session = session
        self.label = label
        self.inputs, _ = _check_decoder_graph(session, label)
        self.vocab = _vocab(session)
        self.ids: list[int] = []

    def reset(self) -> None:
        super().reset()
        self.ids = []

    def _forward(self) -> np.ndarray:
        seq = np.asarray(self.ids, np.int64)[None]
        feeds = {"input_ids": seq}
        if "attention_mask" in self.inputs:
            feeds["attention_mask"] = np.ones_like(seq)
        if "position_ids" in self.inputs:
            feeds["position_ids"] = np.arange(seq.shape[1], dtype=np.int64)[None]
        (logits,) = _run(self.session, ["logits"], feeds, self.label)
        return np.asarray(logits[0], np.float32)

    def prefill_all(self, ids):
        arr = _as_ids(ids)
        start = len(self.ids)
        self.ids.extend(int(t) for t in arr)
        self.position = len(self.ids)
        return self._forward()[start:]

    def step(self, token):
        self.ids.append(int(token))
        self.position = len(self.ids)
        return self._forward()[-1]


class PastDecoder(Decoder):
    """A dynamic graph with a KV cache: the presents of one run are fed back as the next pasts."""

    mode = "dynamic-with-past"

    def __init__(self, session: Any, label: str = "model") -> None:
        super().__init__()
        self.session = session
        self.label = label
        self.inputs, outputs = _check_decoder_graph(session, label)
        self.past_names = [n for n in self.inputs if n.startswith(PAST_PREFIX)]
        if not self.past_names:
            raise UserInputError(f"{label} has no {PAST_PREFIX}* inputs")
        self.outputs = ["logits"] + [PRESENT_PREFIX + n[len(PAST_PREFIX):] for n in self.past_names]
        self.vocab = _vocab(session)
        self._empty = {}
        for spec in session.get_inputs():
            if spec.name in self.past_names:
                dims = list(spec.shape or [])
                if len(dims) != 4 or not all(isinstance(d, int) for d in (dims[1], dims[3])):
                    raise UserInputError(f"{label}: cache input {spec.name} has shape {dims}, "
                                         "expected [batch, kv_heads, past, head_dim]")
                self._empty[spec.name] = np.zeros((1, dims[1], 0, dims[3]), ort_dtype(spec.type, spec.name))
        self.past = dict(self._empty)

    def reset(self) -> None:
        super().reset()
        self.past = dict(self._empty)

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        n = ids.size
        feeds = {"input_ids": ids[None], **self.past}
        if "attention_mask" in self.inputs:
            feeds["attention_mask"] = np.ones((1, self.position + n), np.int64)
        if "position_ids" in self.inputs:
            feeds["position_ids"] = (self.position + np.arange(n, dtype=np.int64))[None]
        result = _run(self.session, self.outputs, feeds, self.label)
        self.past = {name: value for name, value in zip(self.past_names, result[1:])}
        self.position += n
        return np.asarray(result[0][0], np.float32)

    def prefill_all(self, ids):
        return self._forward(_as_ids(ids))

    def step(self, token):
        return self._forward(np.array([int(token)], np.int64))[-1]


def static_meta(session: Any, label: str) -> dict:
    """The ``edgeq.static`` metadata of one graph of a static pair, checked."""
    raw = session.get_modelmeta().custom_metadata_map.get(STATIC_KEY)
    if raw is None:
        raise UserInputError(f"{label} has no {STATIC_KEY} metadata: not a graph of a static pair (edgeq compile --static)")
    try:
        meta = json.loads(raw)
        for key in ("prefill", "context", "layers", "kv_heads", "head_dim"):
            if not isinstance(meta[key], int) or meta[key] < 1:
                raise ValueError(f"{key} = {meta[key]!r}")
        if meta.get("cache_dtype", "float32") not in _CACHE_DTYPES:
            raise ValueError(f"cache_dtype = {meta['cache_dtype']!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise UserInputError(f"{label}: bad {STATIC_KEY} metadata ({exc})") from None
    return meta


class StaticPairDecoder(Decoder):
    """A static pair (see the module docstring): fixed shapes, the cache owned here. Subclasses
    that feed something else than token ids (a VLM's embeddings: ``edgeq.generation.vlm_pair``)
    set ``token_input`` and override ``_chunk``; ``_window`` runs any rows at any positions."""

    mode = "static-pair"
    token_input = "input_ids"
    context: int  # (both set from the checked edgeq.static metadata)
    prefill_length: int

    def __init__(self, prefill_session: Any, decode_session: Any, labels: tuple[str, str] = STATIC_FILES) -> None:
        super().__init__()
        self.sessions = {"prefill": prefill_session, "decode": decode_session}
        self.labels = dict(zip(("prefill", "decode"), labels))
        metas = {}
        for role, session in self.sessions.items():
            _check_decoder_graph(session, self.labels[role], self.token_input)
            meta = static_meta(session, self.labels[role])
            if meta.get("role") != role:
                raise UserInputError(f"{self.labels[role]} says it is the {meta.get('role')!r} graph, expected {role!r}")
            metas[role] = {k: v for k, v in meta.items() if k != "role"}
        if metas["prefill"] != metas["decode"]:
            raise UserInputError(f"{self.labels['prefill']} and {self.labels['decode']} disagree on their static "
                                 f"shapes: {metas['prefill']} vs {metas['decode']}")
        meta = metas["prefill"]
        self.meta = meta
        self.prefill_length = meta["prefill"]
        self.context = meta["context"]
        self.layers = meta["layers"]
        self.cache_dtype = np.dtype(_CACHE_DTYPES[meta.get("cache_dtype", "float32")])
        self.cache_names = [f"{PAST_PREFIX}{i}.{kv}" for i in range(self.layers) for kv in ("key", "value")]
        for role, session in self.sessions.items():
            names = {i.name for i in session.get_inputs()}
            missing = [n for n in (self.token_input, *_TOKEN_INPUTS[1:], *self.cache_names) if n not in names]
            if missing:
                raise UserInputError(f"{self.labels[role]} lacks the static-pair inputs {', '.join(missing[:4])}")
        self.outputs = ["logits"] + [PRESENT_PREFIX + n[len(PAST_PREFIX):] for n in self.cache_names]
        self.vocab = _vocab(prefill_session)
        shape = (1, meta["kv_heads"], self.context, meta["head_dim"])
        self.cache = {name: np.zeros(shape, self.cache_dtype) for name in self.cache_names}

    def reset(self) -> None:
        super().reset()
        for value in self.cache.values():
            value.fill(0)

    def width(self, role: str) -> int:
        return self.prefill_length if role == "prefill" else 1

    def _chunk(self, role: str, ids: np.ndarray) -> np.ndarray:
        """Run ``ids`` (at most W of them) through one graph at the current position; logits [n, vocab]."""
        input_ids = np.zeros((1, self.width(role)), np.int64)
        input_ids[0, :ids.size] = ids
        return self._window(role, {"input_ids": input_ids}, self.position + np.arange(ids.size, dtype=np.int64))

    def _window(self, role: str, rows: dict, positions: np.ndarray) -> np.ndarray:
        """One run of graph ``role`` on ``rows`` (its token input, padded to W) whose first n =
        len(``positions``) are real, at those positions (padding continues after the largest);
        the new cache entries go to slots pos..pos+n-1; logits [n, vocab]."""
        width, n = self.width(role), len(positions)
        pos, ctx = self.position, self.context
        mask = np.zeros((1, ctx + width), np.int64)
        mask[0, :pos] = 1
        mask[0, ctx : ctx + n] = 1
        padding = int(np.max(positions)) + 1 + np.arange(width - n, dtype=np.int64)
        feeds = {**rows, "attention_mask": mask,
                 "position_ids": np.concatenate([np.asarray(positions, np.int64), padding])[None], **self.cache}
        result = _run(self.sessions[role], self.outputs, feeds, self.labels[role])
        for name, present in zip(self.cache_names, result[1:]):
            self.cache[name][:, :, pos : pos + n] = present[:, :, :n]
        self.position += n
        return np.asarray(result[0][0, :n], np.float32)

    def prefill_all(self, ids):
        arr = _as_ids(ids)
        self._check_fits(arr.size)
        s = self.prefill_length
        return np.concatenate([self._chunk("prefill", arr[i : i + s]) for i in range(0, arr.size, s)], axis=0)

    def prefill(self, ids):
        arr = _as_ids(ids)
        self._check_fits(arr.size)
        s = self.prefill_length
        logits = None
        for i in range(0, arr.size, s):
            logits = self._chunk("prefill", arr[i : i + s])[-1]
        return logits

    def step(self, token):
        self._check_fits(1)
        return self._chunk("decode", np.array([int(token)], np.int64))[-1]


def _htp_sessions(files: list[Path], open_one) -> tuple[list[Any], tuple[str, ...]]:
    """The pair's sessions on the HTP: the context binaries its report.json records
    (``edgeq.targets.qnn_htp.QnnLayout``: ``qnn/<role>_ctx.onnx``, or its prepared parts run in
    sequence, ``PartChain``), else the graphs themselves. A shared-weights folder is refused on
    x86-64, where QNN cannot load it."""
    import platform

    from edgeq.generation.part_chain import open_chain
    from edgeq.targets.qnn_htp import QnnLayout

    folder = files[0].parent
    layout = QnnLayout.read(folder)
    if layout is not None and layout.weights_shared and platform.machine() in ("x86_64", "AMD64"):
        raise UserInputError(f"{folder / 'qnn'} holds shared-weights context binaries (compile --share-weights), which "
                             "QNN loads on devices only (on x86-64: \"Shared weights buffer isn't supported on this "
                             "platform\"): run them on the device, or compile without --share-weights to run here")
    if layout is None or not all(layout.contexts.get(f.stem) for f in files):
        return [open_one(f) for f in files], tuple(str(f) for f in files)
    missing = layout.missing()
    if missing:
        raise UserInputError(f"{folder}: {missing[0].relative_to(folder)} is recorded in report.json but missing: "
                             "the folder is incomplete")
    chains = [layout.contexts[f.stem] for f in files]
    sessions = [open_one(c[0]) if len(c) == 1 else open_chain(c, open_one) for c in chains]
    return sessions, tuple(str(c[0]) if len(c) == 1 else f"{c[0].parent}/{f.stem}_part*_ctx.onnx"
                           for c, f in zip(chains, files))


def _vocab(session: Any) -> int:
    out = next(o for o in session.get_outputs() if o.name == "logits")
    dims = list(out.shape or [])
    if len(dims) != 3:
        raise UserInputError(f"logits output has rank {len(dims)}, expected 3 ([batch, sequence, vocab])")
    return dims[2] if isinstance(dims[2], int) else 0


def resolve_model(path: str | os.PathLike) -> tuple[str, list[Path]]:
    """(mode family, graph files) for a folder or a .onnx file: ``("static-pair", [prefill, decode])``
    when the folder holds both graphs, else ``("dynamic", [model.onnx])``; each file passed the
    loader's checks (``ir.check_model_file``)."""
    from edgeq.files.folder_kind import recorded_kind
    from edgeq.graph.ir import check_model_file

    kind = recorded_kind(path)  # a compile's output: what its report says (its files checked present)
    if _is_genai(path, kind):  # genai's graph form (contrib ops in the default domain): genai checks it on opening
        return "genai", [Path(path) / "model.onnx"]
    family, files = _model_files(path, kind)
    return family, [check_model_file(f) for f in files]


def is_genai(path: str | os.PathLike) -> bool:
    """``path`` is a folder onnxruntime-genai opens: as its compile recorded (``--target ort-genai``),
    or, for a folder no compile wrote (``OUT/qnn``, genai's own builder output), by its config file."""
    from edgeq.files.folder_kind import recorded_kind

    return _is_genai(path, recorded_kind(path))


def _is_genai(path: str | os.PathLike, kind: str | None) -> bool:
    from edgeq.genai import is_genai_folder

    return kind == "genai" if kind is not None else is_genai_folder(path)


def _model_files(path: str | os.PathLike, kind: str | None) -> tuple[str, list[Path]]:
    p = Path(path)
    if not p.exists():
        raise UserInputError(f"model folder not found: {p}")
    if kind in ("static-pair", "static-vlm"):
        return "static-pair", [p / f for f in STATIC_FILES]
    if kind is not None:
        return "dynamic", [p / "model.onnx"]
    if p.is_dir():  # a folder no compile wrote (an export): by its files
        pair = [p / f for f in STATIC_FILES]
        present = [f for f in pair if f.is_file()]
        if len(present) == 2:
            return "static-pair", pair
        if present:
            missing = next(f for f in pair if not f.is_file())
            raise UserInputError(f"{p} has {present[0].name} but no {missing.name}: a static pair needs both")
        model = p / "model.onnx"
        if not model.is_file():
            raise UserInputError(f"{p} holds neither prefill.onnx + decode.onnx nor model.onnx")
        return "dynamic", [model]
    if p.suffix != ".onnx":
        raise UserInputError(f"{p} is neither a folder nor a .onnx file")
    return "dynamic", [p]


def model_folder(path: str | os.PathLike) -> Path:
    """The folder whose tokenizer and configs go with the model at ``path``."""
    p = Path(path)
    return p if p.is_dir() else p.parent


PROVIDERS = ("cpu", "qnn-htp")


def open_decoder(path: str | os.PathLike, threads: int | None = None, optimize: bool = True,
                 exact_qdq: bool = False, provider: str = "cpu", htp_arch: int | None = None,
                 max_length: int | None = None) -> Decoder:
    """The decoder for ``path`` (a folder or a .onnx file; see the module docstring for the kinds).

    ``optimize=False``: onnxruntime graph optimizations off (the graphs as written, for exactness
    checks); ``exact_qdq``: Q/DQ not fused into integer kernels (``edgeq.runtime.ort_session``).
    ``provider="qnn-htp"``: a static pair on Qualcomm's (emulated) HTP through onnxruntime-qnn,
    CPU fallback disabled (``edgeq.targets.qnn_vendor.open_htp_session``): the pair's prepared
    context binaries (``qnn/*_ctx.onnx``) when the folder has them, else its graphs.
    A folder written by ``compile --target ort-genai`` runs through onnxruntime-genai
    (``edgeq.generation.genai_decoder.GenaiDecoder``, ``max_length`` cache slots: default the folder's)."""
    from edgeq.runtime.ort_session import open_session, session_options

    family, files = resolve_model(path)  # (the folder's record read once)
    if family == "genai":
        from edgeq.generation.genai_decoder import GenaiDecoder

        if provider != "cpu" or exact_qdq or not optimize:
            raise UserInputError("an onnxruntime-genai folder runs in onnxruntime-genai's own session: "
                                 "drop --exact-qdq/--no-optimize/--provider")
        return GenaiDecoder(path, threads, max_length)

    if provider not in PROVIDERS:
        raise UserInputError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
    if provider == "qnn-htp":
        from edgeq.targets.qnn_vendor import DEFAULT_HTP_ARCH, open_htp_session

        if exact_qdq or not optimize:
            raise UserInputError("--provider qnn-htp runs the HTP's own arithmetic: drop --exact-qdq/--no-optimize")
        if family != "static-pair":
            raise UserInputError("--provider qnn-htp runs a static pair: compile with --static prefill=S,context=C "
                                 "--target qnn-htp")
        arch = htp_arch or DEFAULT_HTP_ARCH
        sessions, labels = _htp_sessions(files, lambda f: open_htp_session(f, arch))
        # (a static pair: two sessions, two labels)
        return StaticPairDecoder(*cast("tuple[Any, Any]", sessions), labels=cast("tuple[str, str]", labels))
    sessions = [open_session(f, options=session_options(threads, optimize=optimize, exact_qdq=exact_qdq))
                for f in files]
    if family == "static-pair":
        return StaticPairDecoder(*cast("tuple[Any, Any]", sessions),
                                 labels=cast("tuple[str, str]", tuple(str(f) for f in files)))
    (session,) = sessions
    if any(i.name.startswith(PAST_PREFIX) for i in session.get_inputs()):
        return PastDecoder(session, str(files[0]))
    return RecomputeDecoder(session, str(files[0]))
