"""The passes, one per file: each module declares its pass in the class line (which registers it), and
``edgeq.passmanager.registry`` finds them by listing this folder. Method code shared by passes lives in
``methods/``; a pass imports it, never another pass module."""
