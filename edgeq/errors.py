"""Error types that decide the CLI's exit code.

Bad input from the user (a missing file, an unknown recipe key, calibration data that does not fit
the model) is a ``UserInputError`` and exits with 2 and one line. A pass that breaks is a
``PassFailure`` naming the pass and exits with 1, as does any other internal error.
"""


class EdgeqError(Exception):
    """Base class of every error edgeq raises on purpose."""

    exit_code = 1


class UserInputError(EdgeqError):
    """The user's input is wrong; the message says what and where, in one line."""

    exit_code = 2


class PassFailure(EdgeqError):
    """A pass raised or produced an invalid graph; internal, so exit code 1."""

    exit_code = 1

    def __init__(self, pass_name: str, message: str):
        super().__init__(f"pass '{pass_name}' failed: {message}")
        self.pass_name = pass_name
