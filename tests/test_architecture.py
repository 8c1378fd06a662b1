"""ARCHITECTURE.md's example pass is real code: it registers, runs in the pipeline, is exact, and the
framework's lifecycle applies to it (a second run finds nothing and says why, typed)."""

import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeq.graph import ir
from edgeq.passmanager.passbase import PassContext, Reason
from edgeq.passmanager.pipeline import Pipeline, PipelineOptions
from edgeq.passmanager.registry import _PASSES, all_passes

DOC = Path(__file__).resolve().parents[1] / "ARCHITECTURE.md"


def _example_source() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1
    return blocks[0]


def _model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "w")
    nodes = [helper.make_node("Identity", ["x"], ["x_id"]), helper.make_node("MatMul", ["x_id", "w"], ["y0"]),
             helper.make_node("Identity", ["y0"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_the_documented_example_pass_works():
    source = _example_source()
    assert len(source.strip().splitlines()) <= 40
    namespace: dict = {}
    try:
        exec(compile(source, str(DOC), "exec"), namespace)  # noqa: S102 (our own documentation)
        cls = namespace["DropIdentityPass"]
        assert all_passes()["drop-identity"] is cls
        model = _model()
        x = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}
        ref = ir.make_session(model).run(None, x)[0]
        out, records = Pipeline([cls()], PipelineOptions(verify=True)).run(model, PassContext())
        assert records[0]["modified"] and records[0]["summary"] == {"removed": 1}  # the output Identity stays
        assert [n.op_type for n in out.graph.node] == ["MatMul", "Identity"]
        np.testing.assert_array_equal(ir.make_session(out).run(None, x)[0], ref)
        again, rec2 = Pipeline([cls()]).run(out, PassContext())
        assert not rec2[0]["modified"] and rec2[0]["not_applicable"] == {"reason": Reason.NO_SITES.value,
                                                                         "detail": "no Identity node"}
    finally:
        _PASSES.pop("drop-identity", None)


# ------------------------------------------------------------------ the lifecycle declarations

def test_lifecycle_is_declared_in_the_class_line_only():
    import pytest

    from edgeq.passmanager.passbase import Exactness, Pass
    from edgeq.passes.methods.gptq_rewrite import GptqRewrite
    from edgeq.passes.methods.side_branch import SideBranchPass
    from edgeq.passes.methods.static_qdq import StaticQDQ

    with pytest.raises(TypeError, match="name set in the class body; declare name= in the class line"):
        class PlainName(Pass):  # noqa: F841
            name = "test-plain"
    with pytest.raises(TypeError, match="needs_calibration set in the class body; declare calibrates="):
        class CalibProperty(Pass):  # noqa: F841
            @property
            def needs_calibration(self):
                return True
    with pytest.raises(TypeError, match="summary_line set in the class body"):
        class PlainSummary(Pass, name="test-plain-summary", exactness=Exactness.EXACT):  # noqa: F841
            summary_line = "x"
    with pytest.raises(TypeError, match="a shared base declares nothing"):
        class DeclaringBase(Pass, exactness=Exactness.EXACT):  # noqa: F841
            pass
    with pytest.raises(TypeError, match="needs= must be"):
        class UnknownNeed(Pass, name="test-unknown-need", exactness=Exactness.EXACT, needs=("gpu",)):  # noqa: F841
            pass
    with pytest.raises(TypeError, match="declares its exactness="):
        class NoExactness(Pass, name="test-no-exactness"):  # noqa: F841
            pass
    assert not {"test-plain", "test-plain-summary", "test-unknown-need", "test-no-exactness"} & set(all_passes())
    lifecycle = {"name", "exactness", "Config", "requires", "establishes", "calibrates", "needs_calibration",
                 "per_block", "summary_line", "marks_when_not_applicable", "needs"}
    for base in (GptqRewrite, StaticQDQ, SideBranchPass):  # the shared bases declare nothing
        assert not lifecycle & set(vars(base)), base
    for name, cls in all_passes().items():
        assert all(r in all_passes() for r in cls.requires), name
        assert cls.summary_line, name


def _tiny(tiny_models, arch):
    return ir.load_model(tiny_models[arch])


def test_requires_reads_this_runs_outcomes(tiny_models):
    """rotate requires fuse-norms and ln-to-rms, which leave no marker: the pipeline's record of this
    run is what says they ran (applied or not: ln-to-rms finds no LayerNorm on Llama, no-sites)."""
    import pytest

    from edgeq.errors import UserInputError
    from edgeq.passmanager.registry import get_pass

    model = _tiny(tiny_models, "llama")
    with pytest.raises(UserInputError, match=r"rotate: put fuse-norms, ln-to-rms before rotate \(fuse-norms did not "
                                             r"run earlier in this pipeline; ln-to-rms did not run"):
        Pipeline([get_pass("rotate")()]).run(model, PassContext())
    with pytest.raises(UserInputError, match="rotate: put fuse-norms before rotate"):
        Pipeline([get_pass("ln-to-rms")(), get_pass("rotate")()]).run(model, PassContext())
    with pytest.raises(UserInputError, match="rotate: put fuse-norms before rotate"):  # after is not before
        Pipeline([get_pass("ln-to-rms")(), get_pass("rotate")(), get_pass("fuse-norms")()]).run(model, PassContext())
    out, records = Pipeline([get_pass(n)() for n in ("fuse-norms", "ln-to-rms", "rotate")]).run(model, PassContext())
    assert [r["modified"] for r in records] == [True, False, True]
    assert records[1]["not_applicable"]["reason"] == Reason.NO_SITES.value
    # the marker stands for the run that left it: a later run on the output skips rotate as applied
    _, again = Pipeline([get_pass("rotate")()]).run(out, PassContext())
    assert again[0]["not_applicable"]["reason"] == Reason.ALREADY_APPLIED.value


def test_resq_hand_off_is_the_framework_s(tiny_models):
    """resq marks_when_not_applicable: where it does not apply (BERT's post-LN stream) the pipeline
    leaves its marker with the reason, and resq-qdq (requires resq) is skipped with that reason,
    in the same run and in a later one."""
    import json

    from edgeq.graph import facts
    from edgeq.passes.resq import ResqConfig
    from edgeq.passes.resq_qdq import ResqQDQConfig
    from edgeq.passmanager.registry import get_pass

    chain = [get_pass("fuse-norms")(), get_pass("ln-to-rms")(), get_pass("resq")(ResqConfig(basis="hadamard")),
             get_pass("resq-qdq")(ResqQDQConfig(weights="rtn"))]
    out, records = Pipeline(chain).run(_tiny(tiny_models, "bert"), PassContext())
    resq, resq_qdq = records[2], records[3]
    assert resq["modified"] and resq["not_applicable"]["reason"] == Reason.STRUCTURE_NOT_FOUND.value
    why = resq["not_applicable"]["detail"]
    marker = {p.key: p.value for p in out.metadata_props}[facts.RESQ.key]
    assert marker == json.dumps({"basis": "hadamard", "not_applicable": why}, sort_keys=True)
    assert resq_qdq["not_applicable"] == {"reason": Reason.PREREQUISITE_DID_NOT_APPLY.value,
                                          "detail": f"resq did not apply: {why}"}
    _, again = Pipeline(chain[:2] + [get_pass("resq")(), get_pass("resq-qdq")()]).run(out, PassContext())
    assert again[2]["not_applicable"]["reason"] == Reason.ALREADY_APPLIED.value
    assert again[3]["not_applicable"]["detail"] == f"resq did not apply: {why}"
