"""Qualcomm's own compiler in the loop (onnxruntime-qnn, the ``[qnn]`` extra that ``make test`` installs).

- probe graphs (x -> MatMul with an integer weight DequantizeLinear) over weight type and
  granularity, quantized input and output and their activation types: edgeq's ``qnn-htp``
  profile (``--profile-only``) must give the vendor's verdict on every one;
- the lowering makes the tiny static pairs of the HTP recipes load whole on the HTP, and
  ``--context-binary`` writes EPContext models that load back with CPU fallback disabled and give
  onnxruntime CPU's logits within quantization noise;
- ``edgeq check --target qnn-htp`` lists the nodes the HTP refuses (exit 3) with its reason.

The vendor emulates the HTP on x86-64 Linux only (Python >= 3.11): elsewhere the module is
skipped with that reason, never silently.
"""

from __future__ import annotations

import itertools
import json
import platform
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeq.cli import main
from edgeq.passmanager.passbase import PassContext
from edgeq.passmanager.pipeline import Pipeline
from edgeq.passmanager.registry import get_pass
from edgeq.targets.qnn_vendor import ask_htp, htp_session_options, vendor_version

if platform.machine() != "x86_64" or sys.version_info < (3, 11) or not sys.platform.startswith("linux"):
    pytest.skip("onnxruntime-qnn emulates the HTP on x86-64 Linux, Python >= 3.11 only", allow_module_level=True)
if vendor_version() is None:
    pytest.fail("onnxruntime-qnn is not installed: `pip install -e .[qnn]` (make test installs it)", pytrace=False)

_ZP = {"uint8": (np.uint8, 128), "uint16": (np.uint16, 32768), "int16": (np.int16, 0), "int8": (np.int8, 0)}
K, N = 64, 32


def probe(weight: str, granularity: str, act_in: str | None, act_out: str | None,
          negative: bool = False) -> onnx.ModelProto:
    """x -> [Q/DQ act_in] -> MatMul(DQ(weight)) -> [Q/DQ act_out] -> y. ``negative``: every other
    channel stored as (-q, -scale), the same real weight (what full-range symmetric quantizers write)."""
    w = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32)
    qmax = 127 if weight == "int8" else 7
    if granularity == "channel":
        scale, zp, attrs = (np.abs(w).max(0) / qmax).astype(np.float32), np.zeros(N, np.int8), {"axis": 1}
    else:
        scale, zp, attrs = np.array(np.abs(w).max() / qmax, np.float32), np.array(0, np.int8), {}
    q = np.clip(np.round(w / scale), -qmax, qmax).astype(np.int8)
    if negative:
        scale[::2] *= -1
        q[:, ::2] *= -1
    if weight == "int4":
        inits = [helper.make_tensor("wq", TensorProto.INT4, q.shape, q.ravel().tolist()),
                 helper.make_tensor("wz", TensorProto.INT4, zp.shape, zp.ravel().tolist())]
    else:
        inits = [numpy_helper.from_array(q, "wq"), numpy_helper.from_array(zp, "wz")]
    inits.append(numpy_helper.from_array(scale, "ws"))
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], name="weight_dq", **attrs)]

    def qdq(src: str, dst: str, dtype: str, tag: str, step: float) -> None:
        np_type, mid = _ZP[dtype]
        inits.extend([numpy_helper.from_array(np.array(step, np.float32), f"{tag}_s"),
                      numpy_helper.from_array(np.array(mid, np_type), f"{tag}_z")])
        nodes.extend([helper.make_node("QuantizeLinear", [src, f"{tag}_s", f"{tag}_z"], [f"{tag}_q"], name=f"{tag}_q"),
                      helper.make_node("DequantizeLinear", [f"{tag}_q", f"{tag}_s", f"{tag}_z"], [dst], name=f"{tag}_dq")])

    x = "x"
    if act_in:
        qdq("x", "x_dq", act_in, "in", 0.05 if act_in.endswith("8") else 0.0002)
        x = "x_dq"
    nodes.append(helper.make_node("MatMul", [x, "w"], ["y_raw" if act_out else "y"], name="matmul"))
    if act_out:
        qdq("y_raw", "y", act_out, "out", 0.2 if act_out.endswith("8") else 0.001)
    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


_ACTS = [(None, None), (None, "uint8"), ("uint8", None), ("uint8", "uint8"), ("uint8", "uint16"), ("uint16", "uint16"),
         ("uint16", "int16"), ("int16", "int16"), ("int8", "int8")]
PROBES = [(w, g, a, b) for w, g, (a, b) in itertools.product(("int8", "int4"), ("channel", "tensor"), _ACTS)]


def test_profile_gives_the_vendors_verdict_on_every_probe(tmp_path, capsys):
    disagree, refused = [], 0
    for i, case in enumerate(PROBES):
        path = tmp_path / f"probe{i}.onnx"
        onnx.save(probe(*case), path)
        vendor = ask_htp(path)
        refused += not vendor.accepted
        code = main(["check", str(path), "--target", "qnn-htp", "--profile-only"])
        capsys.readouterr()
        if (code == 0) != vendor.accepted:
            disagree.append((case, vendor.accepted, vendor.refusals[:1]))
    assert 0 < refused < len(PROBES)  # the matrix holds both verdicts
    assert not disagree, f"profile and vendor disagree on {len(disagree)} of {len(PROBES)} probes: {disagree}"


@pytest.mark.parametrize("unbuffered", ["1", None])
def test_the_vendors_answer_is_read_whatever_python_buffers(tmp_path, monkeypatch, unbuffered):
    """The vendor library prints its own banner to the child's stdout from C; where Python buffers
    stdout (no PYTHONUNBUFFERED, as under cron or CI) it lands after the child's answer line."""
    from edgeq.targets.qnn_vendor import prepare_context

    if unbuffered is None:
        monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    else:
        monkeypatch.setenv("PYTHONUNBUFFERED", unbuffered)
    path = tmp_path / "probe.onnx"
    onnx.save(probe("int8", "channel", "uint8", "uint8"), path)
    assert ask_htp(path).accepted
    result = prepare_context(path, tmp_path / "probe_ctx.onnx")
    assert result.get("ok"), result


def test_check_asks_the_vendor_and_lists_refused_nodes(tmp_path, capsys):
    path = tmp_path / "refused.onnx"
    onnx.save(probe("int8", "channel", "uint8", None), path)
    assert main(["check", str(path), "--target", "qnn-htp"]) == 3
    out = capsys.readouterr().out
    assert "node weight_dq (DequantizeLinear): refused by QNN HTP: " in out and "per-channel" in out
    assert main(["check", str(path), "--target", "qnn-htp", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["decided_by"] == "vendor" and report["vendor"]["refusals"][0]["node"] == "weight_dq"
    onnx.save(probe("int8", "channel", "uint8", "uint8"), path)
    assert main(["check", str(path), "--target", "qnn-htp"]) == 0


def test_check_without_the_vendor_says_it_approximates(tmp_path, capsys, monkeypatch):
    import edgeq.targets.qnn_vendor as vendor

    monkeypatch.setattr(vendor, "vendor_version", lambda: None)
    path = tmp_path / "p.onnx"
    onnx.save(probe("int8", "channel", "uint8", "uint8"), path)
    assert main(["check", str(path), "--target", "qnn-htp"]) == 0
    assert "approximation of Qualcomm's compiler, which is not installed" in capsys.readouterr().out


def test_negative_weight_scales_are_taken_and_computed_wrongly(tmp_path, capsys):
    """Why the qnn-htp profile has ``positive_scales`` and its lowering ``positive-weight-scales``:
    the vendor accepts a negative per-channel weight scale and computes as if it were positive."""
    import onnxruntime as ort

    from edgeq.targets.qnn_vendor import open_htp_session

    x = {"x": (np.random.default_rng(1).standard_normal((1, 8, K)) * 0.5).astype(np.float32)}
    for weight in ("int8", "int4"):
        path = tmp_path / f"neg-{weight}.onnx"
        onnx.save(probe(weight, "channel", "uint16", "uint16", negative=True), path)
        want = ort.InferenceSession(probe(weight, "channel", "uint16", "uint16").SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, x)[0]
        cpu = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, x)[0]
        np.testing.assert_array_equal(cpu, want)  # the same weights for onnxruntime's CPU kernels
        assert ask_htp(path).accepted
        assert np.abs(open_htp_session(path).run(None, x)[0] - want).max() > 0.5 * np.abs(want).max()
        assert main(["check", str(path), "--target", "qnn-htp", "--profile-only"]) == 3
        assert "positive-scale" in capsys.readouterr().out
        lowered, records = Pipeline([get_pass("positive-weight-scales")()]).run(onnx.load(path), PassContext())
        assert records[0]["summary"]["channels_flipped"] == N // 2 and records[0]["summary"]["codes_saturated"] == 0
        onnx.save(lowered, tmp_path / "lowered.onnx")
        got = open_htp_session(tmp_path / "lowered.onnx").run(None, x)[0]
        assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


def _block_probe(k: int, block: int = 64) -> onnx.ModelProto:
    """x[1, 8, k] -> Q/DQ uint16 -> MatMul(int4 DequantizeLinear in blocks of ``block`` along K,
    float block scales) -> Q/DQ uint16: the weight form of mquant-w4a16."""
    w = np.random.default_rng(2).standard_normal((k, N)).astype(np.float32)
    blocks = -(-k // block)
    padded = np.concatenate([w, np.zeros((blocks * block - k, N), np.float32)]).reshape(blocks, block, N)
    scale = (np.abs(padded).max(1) / 7.0 + 1e-8).astype(np.float32)
    q = np.clip(np.round(padded / scale[:, None, :]), -8, 7).astype(np.int8).reshape(blocks * block, N)[:k]
    inits = [helper.make_tensor("wq", TensorProto.INT4, q.shape, q.ravel().tolist()), numpy_helper.from_array(scale, "ws"),
             helper.make_tensor("wz", TensorProto.INT4, scale.shape, [0] * scale.size)]
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], name="weight_dq", axis=0, block_size=block)]
    for src, dst, tag, step in (("x", "x_dq", "in", 0.0002), ("y_raw", "y", "out", 0.002)):
        inits += [numpy_helper.from_array(np.array(step, np.float32), f"{tag}_s"),
                  numpy_helper.from_array(np.array(32768, np.uint16), f"{tag}_z")]
        nodes += [helper.make_node("QuantizeLinear", [src, f"{tag}_s", f"{tag}_z"], [f"{tag}_q"], name=f"{tag}_q"),
                  helper.make_node("DequantizeLinear", [f"{tag}_q", f"{tag}_s", f"{tag}_z"], [dst], name=f"{tag}_dq")]
        if tag == "in":
            nodes.append(helper.make_node("MatMul", ["x_dq", "w"], ["y_raw"], name="matmul"))
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def test_block_int4_weights_are_computed_right_in_whole_blocks_only(tmp_path, capsys):
    """Why the qnn-htp profile allows int4 blocks with ``whole_blocks`` (and mquant-w4a16's gptq sets
    ``whole_blocks``): the HTP takes a block-quantized int4 weight whole either way, computes it as
    onnxruntime CPU does when the blocks divide K, and computes something unrelated when the last
    block is partial (K = 127 in blocks of 64, as RMS's Eq. 9 split leaves SmolLM2's K = 1535; where
    K / blocks rounds up to another block size, K = 96 say, it refuses the weight instead)."""
    import onnxruntime as ort

    from edgeq.targets.qnn_vendor import open_htp_session

    for k, right in ((128, True), (127, False)):
        path = tmp_path / f"block-{k}.onnx"
        onnx.save(_block_probe(k), path)
        x = {"x": (np.random.default_rng(3).standard_normal((1, 8, k)) * 0.5).astype(np.float32)}
        want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, x)[0]
        assert ask_htp(path).accepted, k
        departure = np.abs(open_htp_session(path).run(None, x)[0] - want).max() / np.abs(want).max()
        assert (departure <= 0.05) if right else (departure > 0.5), (k, departure)
        assert main(["check", str(path), "--target", "qnn-htp", "--profile-only"]) == (0 if right else 3)
        assert ("partial-block" in capsys.readouterr().out) is not right


# --------------------------------------------------------------------------------------------
# tiny static pairs through the lowering, the vendor and its context binaries
# --------------------------------------------------------------------------------------------


def _compile(tiny_past, out, recipe, *extra):
    return main(["compile", str(tiny_past / "model" / "model.onnx"), "--recipe", recipe, "--calib",
                 str(tiny_past / "calib.txt"), "--seq-len", "32", "--calib-windows", "2", "--no-cache",
                 "--static", "prefill=8,context=48", "--target", "qnn-htp", "-o", str(out), *extra])


def _feeds(session, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in session.get_inputs():
        if "int" in i.type:
            feeds[i.name] = rng.integers(3, 200, size=i.shape).astype(np.int64 if "64" in i.type else np.int32)
        else:
            feeds[i.name] = (rng.standard_normal(i.shape) * 0.1).astype(np.float32)
    return feeds


@pytest.mark.parametrize("recipe", ["mquant-w8a8", "w8a16", "mquant-w4a16"])
def test_htp_recipes_load_whole_on_the_htp(tiny_past, tmp_path, recipe, capsys):
    out = tmp_path / recipe
    assert _compile(tiny_past, out, recipe) == 0, capsys.readouterr().err
    for graph in ("prefill.onnx", "decode.onnx"):
        verdict = ask_htp(out / graph)
        assert verdict.accepted, (graph, verdict.refusals[:3], verdict.error)
    # and computes what onnxruntime CPU does (mquant-w4a16 once loaded whole and gave unrelated logits:
    # GPTQ's full-range scales were negative, which the HTP takes and computes as positive)
    import onnxruntime as ort

    from edgeq.targets.qnn_vendor import open_htp_session

    cpu = ort.InferenceSession(out / "prefill.onnx", providers=["CPUExecutionProvider"])
    feeds = _feeds(cpu)
    want, got = cpu.run(None, feeds)[0], open_htp_session(out / "prefill.onnx").run(None, feeds)[0]
    _htp_matches_cpu(recipe, "prefill", got, want)


# issue 43 item 5: with 8-bit node units the default recipe's HTP form departed from onnxruntime CPU
# on the same graph (0.131 against the 0.032 bound here, 12% relative L2 on SmolLM2); the lowering's
# units are 16-bit now (passes/linear_output_qdq.py) and every recipe is held to the bound.
def _htp_matches_cpu(recipe: str, role: str, got, want) -> None:
    departure, bound = float(np.abs(got - want).max()), 0.05 * float(np.abs(want).max())
    assert departure <= bound, (recipe, role, departure, bound)


def test_context_binaries_load_back_and_match_cpu(tiny_past, tmp_path, capsys):
    import onnxruntime as ort

    out = tmp_path / "ctx"
    assert _compile(tiny_past, out, "mquant-w8a8", "--context-binary", "--htp-arch", "79") == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    departures = []
    for role in ("prefill", "decode"):
        ctx = out / "qnn" / f"{role}_ctx.onnx"
        assert [n.op_type for n in onnx.load(ctx).graph.node] == ["EPContext"]
        assert f"qnn/{role}_ctx.onnx" in json.dumps(manifest)
        assert report["qnn_context"]["graphs"][f"{role}.onnx"]["bytes"] > 0
        htp = ort.InferenceSession(ctx, htp_session_options(79))
        cpu = ort.InferenceSession(out / f"{role}.onnx", providers=["CPUExecutionProvider"])
        feeds = _feeds(cpu)
        got, want = htp.run(None, feeds)[0], cpu.run(None, feeds)[0]
        # the HTP computes float ops in fp16 and requantizes at every unit: within a few 8-bit steps
        departures.append((role, got, want))
    for role, got, want in departures:  # (both graphs loaded and ran before any verdict)
        _htp_matches_cpu("mquant-w8a8", role, got, want)


def test_context_binary_needs_a_static_pair_for_the_htp(tiny_past, tmp_path, capsys):
    code = main(["compile", str(tiny_past / "model" / "model.onnx"), "--recipe", "w8a8", "--calib",
                 str(tiny_past / "calib.txt"), "--context-binary", "-o", str(tmp_path / "o")])
    assert code == 2 and "--context-binary" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert _compile(tiny_past, tmp_path / "o", "w8a16", "--context-binary", "--htp-arch", "12") == 2
    assert not (tmp_path / "o").exists()


def test_fp16_safe_norms_rescales_exactly(tiny_past):
    """Forced onto the tiny model (limit far below its sums of squares): same outputs in fp32."""
    import onnxruntime as ort

    from edgeq.graph import ir
    from edgeq.calib.dataset import build_calibration_set
    from edgeq.calib.session import Calibrator
    from edgeq.passmanager.passbase import PassContext
    from edgeq.passes.fp16_safe_norms import Fp16SafeNormsConfig, Fp16SafeNormsPass
    from edgeq.passmanager.pipeline import Pipeline

    path = tiny_past / "model" / "model.onnx"
    model = ir.load_model(path)
    data = build_calibration_set(tiny_past / "calib.txt", ir.input_specs(model), tiny_past / "model", 1, 16, 1)
    ctx = PassContext(calibrator=Calibrator(data, use_cache=False))
    rewritten, records = Pipeline([Fp16SafeNormsPass(Fp16SafeNormsConfig(limit=1e-4))]).run(ir.load_model(path), ctx)
    assert records[0]["summary"]["rescaled"] == records[0]["summary"]["norms"] > 0
    assert records[0]["summary"]["max_sum_of_squares_after"] <= 1e-4
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    feeds = data.batches[0]
    want = ort.InferenceSession(model.SerializeToString(), opts).run(["logits"], feeds)[0]
    got = ort.InferenceSession(rewritten.SerializeToString(), opts).run(["logits"], feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_provider_qnn_htp_on_a_refused_pair_is_one_line(tiny_past, tmp_path, capsys):
    """A static pair compiled without the qnn-htp lowering: the HTP refuses its per-channel weights."""
    out = tmp_path / "cpu-pair"
    assert main(["compile", str(tiny_past / "model" / "model.onnx"), "--recipe", "w8a8", "--calib",
                 str(tiny_past / "calib.txt"), "--seq-len", "32", "--calib-windows", "2", "--no-cache",
                 "--static", "prefill=8,context=48", "-o", str(out)]) == 0
    capsys.readouterr()
    for argv in (["generate", str(out), "--prompt", "a b", "--max-new-tokens", "2", "--provider", "qnn-htp"],
                 ["eval", "ppl", str(out), "--text", str(tiny_past / "calib.txt"), "--tokenizer", str(out),
                  "--seq-len", "17", "--windows", "1", "--provider", "qnn-htp"]):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 3 and err.count("\n") == 1 and "QNN HTP v79 does not run" in err, (argv[0], code, err)


def test_provider_qnn_htp_runs_the_lowered_pair(tiny_past, tmp_path, capsys):
    out = tmp_path / "htp-pair"
    assert _compile(tiny_past, out, "w8a16", "--context-binary") == 0
    capsys.readouterr()
    argv = ["eval", "ppl", str(out), "--text", str(tiny_past / "calib.txt"), "--tokenizer", str(out),
            "--seq-len", "17", "--windows", "1", "--through", "prefill", "--json"]
    assert main(argv) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert main(argv + ["--provider", "qnn-htp"]) == 0
    htp = json.loads(capsys.readouterr().out)
    assert htp["provider"] == "qnn-htp" and cpu["provider"] == "cpu"
    assert abs(htp["ppl"] / cpu["ppl"] - 1) < 0.05, (htp["ppl"], cpu["ppl"])
    assert main(["generate", str(out), "--prompt", "a b", "--max-new-tokens", "3", "--provider", "qnn-htp"]) == 0
