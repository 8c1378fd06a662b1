"""The parts of one split static graph (``compile --max-context-mb``) run as if they were one.

A ``PartChain`` answers what the decoders ask of an onnxruntime session (``get_inputs``,
``get_outputs``, ``get_modelmeta``, ``run``): its inputs are the whole graph's, its outputs the
whole graph's, and ``run`` feeds each part the graph inputs it reads and the hidden state the
part before it gave (``edgeq.static.split``). The decoders stay unaware of the split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from collections.abc import Callable

from edgeq.errors import UserInputError
from edgeq.static.split import PART_KEY

class PartChain:
    """Sessions of consecutive parts behind one session's interface."""

    def __init__(self, sessions: list[Any], labels: list[str]) -> None:
        self.sessions, self.labels = sessions, labels
        self.part_inputs = [[i.name for i in s.get_inputs()] for s in sessions]
        self.part_outputs = [[o.name for o in s.get_outputs()] for s in sessions]
        for k, session in enumerate(sessions):
            raw = session.get_modelmeta().custom_metadata_map.get(PART_KEY)
            record = json.loads(raw) if raw else {}
            if record.get("index") != k + 1 or record.get("count") != len(sessions):
                raise UserInputError(f"{labels[k]} is not part {k + 1} of {len(sessions)} ({PART_KEY} metadata: {raw})")
        handed = set()
        for k in range(len(sessions) - 1):
            handed.update(self.part_outputs[k])
        inputs: dict[str, Any] = {}
        outputs: dict[str, Any] = {}
        for k, session in enumerate(sessions):
            for i in session.get_inputs():
                if i.name not in handed:
                    inputs.setdefault(i.name, i)
            later = {n for ins in self.part_inputs[k + 1:] for n in ins}
            for o in session.get_outputs():
                if o.name not in later or k == len(sessions) - 1:
                    outputs[o.name] = o
        self._inputs, self._outputs = list(inputs.values()), list(outputs.values())

    def get_inputs(self) -> list[Any]:
        return self._inputs

    def get_outputs(self) -> list[Any]:
        return self._outputs

    def get_modelmeta(self) -> Any:
        return self.sessions[0].get_modelmeta()

    def run(self, output_names: list[str] | None, feeds: dict) -> list:
        values = dict(feeds)
        for names, session, wanted in zip(self.part_inputs, self.sessions, self.part_outputs):
            values.update(zip(wanted, session.run(wanted, {n: values[n] for n in names})))
        names = output_names or [o.name for o in self._outputs]
        return [values[n] for n in names]


def open_chain(files: list[Path], open_one: Callable[[Path], Any]) -> PartChain:
    """A ``PartChain`` over ``files`` (in order), each opened with ``open_one``."""
    return PartChain([open_one(f) for f in files], [str(f) for f in files])
