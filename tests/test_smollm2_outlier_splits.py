"""On the real model, before quantization: muxq (both forms, llm-int8) and massive-split (float
branch, after the rotation chain) keep SmolLM2's logits within the fp32 tolerance (graph
optimizations off), on real outliers found from 2 calibration windows of valid."""

import numpy as np
import pytest

from edgeq.graph import ir
from edgeq.calib.dataset import build_calibration_set
from edgeq.calib.session import Calibrator
from edgeq.passmanager.passbase import FLOAT_EQUIV_RTOL, PassContext
from edgeq.passes.massive_split import MassiveSplitConfig, MassiveSplitPass
from edgeq.passes.muxq import MuxqConfig, MuxqPass
from edgeq.passmanager.pipeline import Pipeline
from edgeq.passmanager.registry import get_pass

DATA = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "wikitext-2"


def _setup(smollm2_dir, tmp_path):
    model = ir.load_model(smollm2_dir / "model.onnx")
    data = build_calibration_set(DATA / "valid.txt", ir.input_specs(model), smollm2_dir, 2, 128)
    ids = np.random.default_rng(0).integers(0, 49152, (1, 48))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(48)[None]}
    (reference,) = ir.make_session(model).run(None, feeds)
    return model, PassContext(Calibrator(data, cache_dir=tmp_path / "cache")), feeds, reference


def _check(out, feeds, reference):
    (got,) = ir.make_session(out).run(None, feeds)
    scale = max(float(np.abs(reference).max()), 1.0)
    np.testing.assert_allclose(got, reference, rtol=0, atol=FLOAT_EQUIV_RTOL * scale)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [MuxqConfig(exponent_mode="auto", threshold=2.0), MuxqConfig(form="two-gemm"),
                                 MuxqConfig(method="llm-int8")], ids=["concat-auto", "two-gemm", "llm-int8"])
def test_muxq_is_float_equivalent_on_smollm2(cfg, smollm2_dir, tmp_path):
    model, ctx, feeds, reference = _setup(smollm2_dir, tmp_path)
    out, rec = Pipeline([MuxqPass(cfg)]).run(model, ctx, consume=True)
    assert rec[0]["summary"]["decomposed"] >= 30, rec[0]["summary"]
    _check(out, feeds, reference)


@pytest.mark.slow
def test_massive_split_is_float_equivalent_on_smollm2(smollm2_dir, tmp_path):
    model, ctx, feeds, reference = _setup(smollm2_dir, tmp_path)
    chain = [get_pass(n)() for n in ("fuse-norms", "ln-to-rms", "rotate")]
    out, rec = Pipeline(chain + [MassiveSplitPass(MassiveSplitConfig(branch="float"))]).run(model, ctx, consume=True)
    summary = rec[-1]["summary"]
    assert summary["split"] >= 3 and "/model/layers.11/mlp/down_proj/MatMul" in summary["per_linear"]
    assert 1229 in summary["per_linear"]["/model/layers.11/mlp/down_proj/MatMul"]["channels"]
    _check(out, feeds, reference)
