"""Evaluation with onnxruntime on CPU: perplexity on text (``perplexity``), model-vs-model
error (``compare``) and a VLM's VQA accuracy from pixels (``edgeq.evaluate.vqa``).
``edgeq.evaluate.cli.register`` adds the ``edgeq eval`` subcommands.

``compare`` here is the function; its module is ``edgeq.evaluate.compare`` (imported eagerly so
the package attribute is the function, not the submodule). What evaluation shares with the rest of
edgeq lives below it: the SQNR in ``edgeq.quantize.sqnr``, the CPU sessions in ``edgeq.runtime.ort_session``, a
window's NLL in ``edgeq.runtime.nll``.
"""

from edgeq.evaluate.compare import ErrorStats, compare
from edgeq.evaluate.ppl import perplexity

__all__ = ["perplexity", "compare", "ErrorStats"]
