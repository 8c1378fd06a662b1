"""What a recipe is measured to cost on a model's family, read at compile time.

Tiny random models prove structure, not accuracy: a recipe can apply exactly to a family and still
be unusable on its real weights (the default recipe was 19.8x fp32 on Gemma 3 before its norm
scales were kept out of the weights). ``edgeq/accuracy/measured.toml`` holds the perplexity ratios
measured on real weights per family (the ``model_type`` of the ``config.json`` beside the model)
with the results file each comes from; ``compile`` records the ratio in ``report.json``
(``measured_accuracy``) and, above the table's ``sane_ratio``, adds ``accuracy_warning`` and prints
one warning line. Unmeasured families and recipe files (not built-in names) get nothing: no claim.
"""

from __future__ import annotations

import os
from importlib import resources

from edgeq.textdata import hf_config
from edgeq.files.tomlfile import is_path, parse_toml


def _table() -> dict:
    text = (resources.files("edgeq") / "accuracy" / "measured.toml").read_text(encoding="utf-8")
    return parse_toml(text, "edgeq/accuracy/measured.toml")


def measured_accuracy(model: str | os.PathLike, recipe: str) -> dict | None:
    """The measured ratio of built-in ``recipe`` on ``model``'s family, or None when unmeasured."""
    if is_path(recipe):
        return None
    family = hf_config(model).get("model_type")
    table = _table()
    entry = table.get(family) if isinstance(family, str) else None
    if not isinstance(entry, dict) or recipe not in entry.get("ratios", {}):
        return None
    measured = entry["ratios"][recipe]
    ratio, sane = float(measured["x_fp32"]), float(table["sane_ratio"])
    return {"family": family, "measured_on": entry["model"], "recipe": recipe, "ppl_x_fp32": ratio,
            "results": measured["results"], "sane_ratio": sane, "sane": ratio <= sane}
