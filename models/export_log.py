"""What torch, transformers and optimum print during ``edgeq export``: held back, shown only after.

An export runs those libraries, which report through Python's ``warnings`` and ``logging``
(transformers and optimum with their own stderr handlers). ``held_library_output`` holds both
while an export runs and passes them on when it ends (to the loggers' own handlers and
``warnings.showwarning``, as they would have gone), unless it ended with edgeq's own error: a bad
input is then the one line ``edgeq: error: ...`` on stderr, not that line after the libraries'
warnings about a model that was never built. Messages that come with every export and ask nothing
of the user (``NOISE``) are dropped; an internal error (exit 1) still shows everything, before its
line. edgeq's own progress lines are plain prints and are not held.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from typing import cast

from edgeq.errors import EdgeqError

# every export prints these; none depends on the model or is the user's to act on
NOISE = (
    re.compile(r"`torch_dtype` is deprecated"),  # optimum passes torch_dtype to transformers
    re.compile(r"You are using the default legacy behaviour of the <class"),  # Llama tokenizers
    re.compile(r"Exporting aten::index operator of advanced indexing"),  # torch's exporter on rotary caches
)

_ACTIVE: list[_Held] = []


class _Held(logging.Handler):
    """The messages held back, in order, and the library loggers whose stderr handlers were taken
    off meanwhile."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[logging.LogRecord | tuple] = []  # log records and showwarning arguments
        self.taken: dict[logging.Logger, tuple[list[logging.Handler], bool]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record)

    def show_warning(self, *args) -> None:
        self.messages.append(args)

    def take_loggers(self) -> None:
        """Loggers that print by themselves (a stream handler of their own) send to the root
        logger instead, where this handler sits, until the export ends."""
        for logger in list(logging.Logger.manager.loggerDict.values()):
            if not isinstance(logger, logging.Logger) or logger in self.taken:
                continue
            if any(type(h) is logging.StreamHandler for h in logger.handlers):
                self.taken[logger] = (list(logger.handlers), logger.propagate)
                logger.handlers = [h for h in logger.handlers if type(h) is not logging.StreamHandler]
                logger.propagate = True

    def give_back(self) -> None:
        for logger, (handlers, propagate) in self.taken.items():
            logger.handlers, logger.propagate = handlers, propagate
        self.taken.clear()

    def pass_on(self) -> None:
        """What was held, through the loggers' own handlers and ``warnings.showwarning`` again
        (call once both are back), less ``NOISE``."""
        for message in self.messages:
            text = message.getMessage() if isinstance(message, logging.LogRecord) else str(message[0])
            if any(p.search(text) for p in NOISE):
                continue
            if isinstance(message, logging.LogRecord):
                logging.getLogger(message.name).handle(message)
            else:
                warnings.showwarning(*message)


def take_library_loggers() -> None:
    """Call after importing torch/transformers/optimum (``require_export_deps`` does): their
    handlers exist from their import on. Does nothing outside ``held_library_output``."""
    if _ACTIVE:
        _ACTIVE[-1].take_loggers()


@contextlib.contextmanager
def held_library_output() -> Iterator[None]:
    """Hold the libraries' warnings and log lines while the block runs (see the module docstring)."""
    held = _Held()
    root = logging.getLogger()
    shown = False
    try:
        with warnings.catch_warnings():
            warnings.showwarning = cast(Callable[..., None], held.show_warning)  # it takes showwarning's args
            root.addHandler(held)
            _ACTIVE.append(held)
            held.take_loggers()
            try:
                yield
            except Exception as exc:
                shown = not isinstance(exc, EdgeqError)  # an internal error: what they said may explain it
                raise
            else:
                shown = True
            finally:
                _ACTIVE.remove(held)
                root.removeHandler(held)
                held.give_back()
    finally:
        if shown:
            held.pass_on()
