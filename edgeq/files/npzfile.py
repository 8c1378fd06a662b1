"""The one reader of NumPy files: a user's ``.npz`` (calibration samples, ``eval compare --npz``)
and edgeq's own cache entries (token ids as ``.npy``, observer states as ``.npz``).

Both raise ``NumpyFileError`` for anything that is not what was asked for: a file that cannot be
read, is cut or flipped, is a zip whose member is not a real ``.npy`` (``np.load`` hands such a
member back as ``bytes``), an ``.npz`` where one ``.npy`` array was expected or the other way
round, a pickled (object) array. The caller decides what that means: a one-line
``UserInputError`` for the user's file, a miss (recomputed) for a cache entry.
"""

from __future__ import annotations

import os
import zipfile
import zlib

import numpy as np

from edgeq.errors import UserInputError

# what np.load raises on a damaged file (its header is parsed with ast.literal_eval, its members
# read through zipfile and zlib)
_DAMAGED = (OSError, ValueError, EOFError, KeyError, TypeError, SyntaxError, UnicodeError, zipfile.BadZipFile,
            zlib.error)


class NumpyFileError(ValueError):
    """The file is not the NumPy file asked for; the message says why, in one line."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every member of the ``.npz`` at ``path``, each a real array."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except _DAMAGED as exc:
        raise NumpyFileError(_first_line(exc)) from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise NumpyFileError("a single .npy array, not an .npz of named arrays (use np.savez)")
    arrays = {}
    try:
        with loaded as npz:
            for key in npz.files:
                value = npz[key]
                if not isinstance(value, np.ndarray):
                    raise NumpyFileError(f"member '{key}' is not a .npy array")
                arrays[key] = value
    except _DAMAGED as exc:
        raise NumpyFileError(_first_line(exc)) from None
    return arrays


def read_user_npz(path: str | os.PathLike, kind: str) -> dict[str, np.ndarray]:
    """A user's ``.npz`` (``kind`` names what it should be): every member, or the one-line
    ``UserInputError`` for a missing or unreadable file, worded the same for every kind."""
    if not os.path.isfile(path):
        raise UserInputError(f"{kind} not found: {path}")
    try:
        return read_npz(path)
    except NumpyFileError as exc:
        raise UserInputError(f"cannot read {path} as {kind}: {exc}") from None


def read_npy(path: str | os.PathLike) -> np.ndarray:
    """The one array of the ``.npy`` file at ``path``."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except _DAMAGED as exc:
        raise NumpyFileError(_first_line(exc)) from None
    if not isinstance(loaded, np.ndarray):
        if isinstance(loaded, np.lib.npyio.NpzFile):
            loaded.close()
        raise NumpyFileError("an .npz archive, not one .npy array")
    return loaded
