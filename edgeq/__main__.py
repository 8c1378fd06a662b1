"""Allow ``python -m edgeq``."""
from edgeq.cli import main

raise SystemExit(main())
