"""Error types that decide the CLI's exit code.

Bad input from the user (a missing file, an unknown recipe key, calibration data that does not fit
the model) is a ``UserInputError`` and exits with 2 and one line. A pass that breaks is a
``PassFailure`` naming the pass and exits with 1, as does any other internal error. A pass the
recipe marks essential that did not apply to the model is an ``EssentialPassNotApplied`` (exit 4):
the model is not broken, the recipe just cannot do its job on it. (Exit 3 is the target check.)
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


class EssentialPassNotApplied(EdgeqError):
    """A pass the recipe cannot do without did not apply to this model (exit 4); nothing is written."""

    exit_code = 4

    def __init__(self, recipe: str, pass_name: str, reason: str, detail: str):
        super().__init__(f"recipe '{recipe}' needs pass '{pass_name}', which did not apply to this model "
                         f"({reason}: {detail}); nothing written (--allow-partial writes the model anyway)")
        self.pass_name = pass_name
