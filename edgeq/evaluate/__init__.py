"""Evaluation with onnxruntime on CPU: perplexity on text (``perplexity``) and model-vs-model
error (``compare``). ``edgeq.evaluate.cli.register`` adds the ``edgeq eval`` subcommands.

``compare`` here is the function; its module is ``edgeq.evaluate.compare`` (imported eagerly so
the package attribute is the function, not the submodule).
"""

from edgeq.evaluate.compare import ErrorStats, compare, sqnr_db
from edgeq.evaluate.ppl import open_session, perplexity

__all__ = ["perplexity", "compare", "ErrorStats", "sqnr_db", "open_session"]
