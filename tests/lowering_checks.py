"""The harness duties of a lowering pass, shared by its tests: run it verified, check idempotence
(a second run changes nothing) and a save/load round trip with external data; for exact passes
also bitwise-equal outputs (onnxruntime graph optimizations off)."""

from __future__ import annotations

import numpy as np

from edgeq.graph import ir
from edgeq.passmanager.passbase import PassContext
from edgeq.passmanager.pipeline import Pipeline, PipelineOptions
from edgeq.passmanager.registry import get_pass


def outputs(model, feeds):
    return ir.make_session(model).run(None, feeds)  # graph optimizations off


def lower_checked(model, name: str, feeds, tmp_path, exact: bool = False, external_data: bool = True):
    """Returns (lowered model, its pass record, its outputs, the second run's record).
    ``external_data``: the saved model must have weights large enough to go to external data."""
    reference = outputs(model, feeds) if exact else None
    out, records = Pipeline([get_pass(name)()], PipelineOptions(verify=True)).run(model, PassContext())
    got = outputs(out, feeds)
    if exact:
        for ref, new in zip(reference, got):
            np.testing.assert_array_equal(new, ref)
    again, records2 = Pipeline([get_pass(name)()]).run(out, PassContext())
    assert records2[0]["modified"] is False, f"{name} is not idempotent"
    for a, b in zip(got, outputs(again, feeds)):
        np.testing.assert_array_equal(a, b)
    path = ir.save_model(out, tmp_path / f"saved-{name}" / "model.onnx")
    if external_data:
        assert path.with_name("model.onnx.data").exists()
    for a, b in zip(got, outputs(ir.load_model(path), feeds)):
        np.testing.assert_array_equal(a, b)
    return out, records[0], got, records2[0]
