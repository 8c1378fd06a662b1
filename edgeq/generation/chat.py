"""What the model folder says about text: the chat template, the special tokens it uses, the end of
sequence ids.

The chat template is the Hugging Face one (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``; a list of named templates gives the ``default`` one), rendered the way
``transformers`` renders it: a sandboxed jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``, ``messages=[{"role": "user", "content": prompt}]``,
``add_generation_prompt=True``, the special tokens of ``tokenizer_config.json`` (``bos_token``,
``eos_token``, ...) as strings, and ``raise_exception`` / ``strftime_now``. The rendered text
holds its special tokens already, so it is encoded without the tokenizer's post-processor
(``add_special_tokens=False``, as ``apply_chat_template`` does).

End of sequence: every id named by ``generation_config.json`` or ``config.json``
(``eos_token_id``, an int or a list) or by ``tokenizer_config.json`` (``eos_token``, looked up
in the tokenizer). Their union, because a chat model's configs often disagree (a base model's
``<|endoftext|>`` in config.json, the chat turn's ``<|im_end|>`` in the tokenizer's), and
generation should stop at either.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from edgeq.errors import UserInputError

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def read_json(path: Path) -> dict:
    """A JSON object file, or {} when it is absent; a broken one is a one-line error."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserInputError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_tokens(folder: str | os.PathLike) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... of ``tokenizer_config.json`` (those it names) as strings."""
    config = read_json(Path(folder) / "tokenizer_config.json")
    out = {}
    for key in _SPECIAL_KEYS:
        text = _token_text(config.get(key))
        if text is not None:
            out[key] = text
    return out


def chat_template(folder: str | os.PathLike) -> str:
    """The folder's chat template source, or a one-line error when it has none."""
    folder = Path(folder)
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise UserInputError(f"--chat: no chat template in {folder} (chat_template.jinja or tokenizer_config.json's "
                             "chat_template)")
    return template


def render_chat(folder: str | os.PathLike, prompt: str) -> str:
    """The user turn ``prompt`` through the folder's chat template, ready for the assistant's reply."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserInputError("--chat needs jinja2: pip install jinja2") from None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    source = chat_template(folder)
    try:
        return env.from_string(source).render(
            messages=[{"role": "user", "content": prompt}], add_generation_prompt=True, **special_tokens(folder)
        )
    except Exception as exc:  # noqa: BLE001 (the template is the user's input: whatever it raises, e.g. a range
        # over the sandbox's limit, endless recursion, an include without a loader, 1 / 0, is its failure)
        first = (str(exc).splitlines() or [""])[0]
        reason = first if isinstance(exc, TemplateError) and first else f"{type(exc).__name__}: {first}".rstrip(": ")
        raise UserInputError(f"--chat: the chat template of {folder} fails: {reason}") from None


def _ids(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def eos_ids(folder: str | os.PathLike, tokenizer: Any = None) -> set[int]:
    """The end-of-sequence ids the folder's configs name (see the module docstring); may be empty."""
    folder = Path(folder)
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        ids |= _ids(read_json(folder / name).get("eos_token_id"))
    tok_config = read_json(folder / "tokenizer_config.json")
    ids |= _ids(tok_config.get("eos_token_id"))
    text = _token_text(tok_config.get("eos_token"))
    if text is not None and tokenizer is not None:
        found = tokenizer.token_to_id(text)
        if found is not None:
            ids.add(int(found))
    return ids
