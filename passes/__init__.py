"""Method passes, one per file. Importing this package registers all of them."""

from edgeq.passes import qdq  # noqa: F401
