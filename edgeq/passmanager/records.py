"""The record a pass leaves in report.json (``passes``, ``target.lowering``): ``PassRecord``.

The pipeline makes one per pass it runs; a block-wise compile merges a pass's records over the
blocks into one (``edgeq.blockwise.merge_records``, by the pass's ``combine=`` rules). Code reads
the fields; ``to_json`` gives report.json's object, its keys in the order tools have always read
them. Read as a mapping too (``record["summary"]``, ``"verified" in record``: what report.json
readers and the pass tests do), through the same JSON object.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PassRecord:
    """One pass's run: what it is (name, exactness, config), what it did (``modified``, its
    ``summary``, ops added and removed), its cost (seconds, peak RSS), and what the instruments
    said (``verified`` under ``--verify``, ``numerics`` under ``--check-numerics``); why it did not
    apply (``not_applicable``) and, under ``--allow-partial``, that an essential pass did not."""

    name: str
    exactness: str
    config: dict[str, Any]
    seconds: float
    peak_rss_mb: float
    modified: bool
    summary: dict[str, Any]
    ops_added: dict[str, int] = field(default_factory=dict)
    ops_removed: dict[str, int] = field(default_factory=dict)
    verified: bool | None = None
    numerics: dict[str, Any] | None = None
    not_applicable: dict[str, Any] | None = None
    essential_not_applied: bool = False
    # block-wise, merged over the blocks (edgeq.blockwise.merge_records)
    blocks_modified: int | None = None
    blocks_not_applicable: int | None = None
    summary_scope: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "exactness": self.exactness, "config": self.config,
                               "seconds": self.seconds, "peak_rss_mb": self.peak_rss_mb, "modified": self.modified,
                               "summary": self.summary, "ops_added": self.ops_added, "ops_removed": self.ops_removed}
        if self.blocks_modified is not None:
            out["blocks_modified"] = self.blocks_modified
        if self.verified is not None:
            out["verified"] = self.verified
        if self.numerics is not None:
            out["numerics"] = self.numerics
        if self.not_applicable is not None:
            out["not_applicable"] = self.not_applicable
        if self.essential_not_applied:
            out["essential_not_applied"] = True
        if self.blocks_not_applicable is not None:
            out["blocks_not_applicable"] = self.blocks_not_applicable
        if self.summary_scope is not None:
            out["summary_scope"] = self.summary_scope
        return out

    # read as report.json's object (the pass tests and the readers of report.json index it so)
    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.to_json()

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_json().get(key, default)

    def keys(self):
        return self.to_json().keys()
