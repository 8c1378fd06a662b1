"""The passes, one per file: each module registers its pass with ``@register_pass``, and
``edgeq.registry`` finds them by listing this folder. Method code shared by passes lives in
``methods/``; a pass imports it, never another pass module."""
