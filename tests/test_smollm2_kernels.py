"""Real SmolLM2: onnxruntime's integer kernels (default session options) compute every shipped
8-bit-activation recipe as exact QDQ does, on whatever CPU the tests run on: no linear they fuse
can saturate, the logits agree within float rounding, and the default recipe's perplexity is the same.

Before the pair-bounded int8 grid, the default mquant-w8a8 graph scored 54.7 instead of 25.5 on 4
windows of an AVX2 machine (onnxruntime's u8s8 kernel saturates); the full-range form is kept
here (``--target ort-cpu-vnni``) to show that the test can fail: on a CPU whose kernel saturates
its gap must be large and the numpy VPMADDUBSW model must predict it; on a VNNI / AMX / ARM64 CPU
the gap must vanish while the model still flags the weights as at risk.

Calibration is cut to 2 windows of 128 tokens (CI time); the benchmark (benchmarks/cpu_kernels.py)
has the 40-window perplexity figures of every recipe.

Checks per graph. The exact one, on every recipe: onnxruntime is asked which linears it fused into integer
kernels (``ort_fused_u8s8``, its optimized graph read back): they are the ones our site finder
predicted, and every int8 weight among them has the pair bound that VPMADDUBSW cannot saturate.
The end-to-end one, on every recipe: the logits of two WikiText-2 windows with the kernels are
as close to exact QDQ's as float summation order alone puts them (SQNR against exact QDQ no more
than 6 dB under that of the unoptimized graph, or above 20 dB: measured 10.7-29.1 dB against
11.3-30.4 dB on an AVX-512 VNNI EPYC, plain W8A8 lowest); it is a sanity check, the exact check is
what rules saturation out. The statistical one, on the default recipe (mquant-w8a8; every
recipe's 40-window figure is in the benchmark, and the full-range form below shows the perplexity
check failing where the kernel saturates): perplexity with the kernels against exact QDQ. Integer accumulation and float
accumulation differ in the last bit, which flips the rounding of a few codes at the next
QuantizeLinear, and those flips compound over 30 layers: they put the logits ~28 dB SQNR apart
and, on 2 windows, perplexity up to ~0.7% (mquant-w8a8: -0.72% on one AVX2 machine, +0.48% on
another); exact QDQ against no optimization at all (the same arithmetic in another float order)
moves it as much. The flips are zero-mean, so over 8 windows they average down below the issue's
bound of 0.5% (40 windows: 0.02%), which is asserted, or three times the graph's own float-order
noise where that is larger (plain W8A8 without rotation sits so close to its rounding boundaries
that float order alone moves it ~1%); a graph past both on 8 windows is measured again on 40, where
the bound must hold (quarot-w8a8 on an AVX-512 VNNI machine: +0.65% on 8 windows, +0.21% on 40). A
saturating kernel moves perplexity by over 100%.
"""

import json

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from edgeq.cli import main
from edgeq.evaluate.machine import machine_info, saturating_cpu
from edgeq.evaluate.ppl import perplexity
from edgeq.targets.saturation import vpmaddubsw_matmul
from edgeq.targets.u8s8_sites import find_u8s8_sites, ort_fused_u8s8, static_risk

DATA = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "wikitext-2"
RECIPES_8BIT = ["w8a8", "w8a8-mse", "quarot-w8a8", "mquant-w8a8", "mquant-w4a8", "muxq-w8a8", "resq-w4a8",
                "mquant-w8a8-a16down"]
GAP = 0.005  # the bound: onnxruntime defaults within 0.5% of exact QDQ
WINDOWS = 8  # enough for rounding flips to average below GAP (module docstring)
RECHECK_WINDOWS = 40  # where 8 are not (quarot-w8a8 on this export, VNNI: +0.65% on 8, +0.46% on 24, +0.21% on 40)
SATURATED = 0.05  # the full-range form on a saturating CPU: far above any rounding effect


def _compile(smollm2_dir, out, recipe, *extra):
    code = main(["compile", str(smollm2_dir / "model.onnx"), "--recipe", recipe, "--calib", str(DATA / "valid.txt"),
                 "--calib-windows", "2", "--seq-len", "128", "-o", str(out), *extra])
    assert code == 0
    return out


def _gap(path, tokenizer, windows: int = WINDOWS) -> tuple[float, float]:
    kernels = perplexity(path, DATA / "test.txt", tokenizer, windows=windows)["ppl"]
    exact = perplexity(path, DATA / "test.txt", tokenizer, windows=windows, exact_qdq=True)["ppl"]
    return kernels, exact


def _saturation_free_in_onnxruntime(out) -> dict:
    """report.json's u8s8 entry, checked against the graph onnxruntime will actually run."""
    u8s8 = json.loads((out / "report.json").read_text())["u8s8"]
    assert u8s8["saturation_free"] and u8s8["linears_at_risk"] == 0 and u8s8["max_pair_rate"] == 0.0
    fused = ort_fused_u8s8(out / "model.onnx")
    assert sorted(fused) == sorted(u8s8["per_linear"])  # the linears we guard are the ones it fuses
    unsafe = {name: v for name, v in fused.items() if not v["saturation_free"]}
    assert not unsafe, unsafe
    return u8s8


def _within_rounding(path, tokenizer, kernels: float, exact: float) -> None:
    print(f"kernel gap {kernels / exact - 1:+.3%} ({kernels:.3f} vs exact {exact:.3f})")
    if abs(kernels / exact - 1) <= GAP:
        return
    noise = _float_noise(path, tokenizer, exact)
    if abs(kernels / exact - 1) <= 3 * noise:
        return
    # rounding flips are zero-mean and average down over more windows; a saturating kernel's gap does not
    kernels, exact = _gap(path, tokenizer, RECHECK_WINDOWS)
    print(f"kernel gap over {RECHECK_WINDOWS} windows {kernels / exact - 1:+.3%}")
    assert abs(kernels / exact - 1) <= GAP, (kernels, exact, noise, machine_info()["u8s8_kernel"])


def _float_noise(path, tokenizer, exact: float) -> float:
    """|exact QDQ / unoptimized - 1|: what float summation order alone moves this graph's perplexity."""
    plain = perplexity(path, DATA / "test.txt", tokenizer, windows=WINDOWS, optimize=False)["ppl"]
    return abs(exact / plain - 1)


LOGIT_WINDOWS = 2  # windows of 512 for the logits check
DEFAULT_RECIPE = "mquant-w8a8"


@pytest.fixture(scope="module")
def compiled(smollm2_dir, tmp_path_factory):
    """recipe -> its compiled SmolLM2 folder, each compiled once for this module's tests."""
    folders = {}

    def get(recipe: str):
        if recipe not in folders:
            folders[recipe] = _compile(smollm2_dir, tmp_path_factory.mktemp(recipe) / "out", recipe)
        return folders[recipe]

    return get


def _logit_sqnr(path, tokenizer) -> tuple[float, float]:
    """(SQNR of the kernels' logits against exact QDQ's, SQNR of the unoptimized graph's against
    exact QDQ's) over LOGIT_WINDOWS windows: the second is what float order alone costs."""
    from edgeq.quantize.sqnr import sqnr_db
    from edgeq.runtime.ort_session import open_session, session_options
    from edgeq.textdata import feeds_for_windows, token_windows

    kernels = open_session(path)
    exact = open_session(path, options=session_options(exact_qdq=True))
    plain = open_session(path, options=session_options(optimize=False))
    ids = token_windows(DATA / "test.txt", tokenizer, seq_len=512, windows=LOGIT_WINDOWS)
    got = {name: [] for name in ("kernels", "exact", "plain")}
    for row in ids:
        feeds = feeds_for_windows(kernels.get_inputs(), row[None])
        for name, session in (("kernels", kernels), ("exact", exact), ("plain", plain)):
            got[name].append(session.run(["logits"], feeds)[0])
    k, e, p = (np.concatenate(got[n]) for n in ("kernels", "exact", "plain"))
    return sqnr_db(e, k), sqnr_db(e, p)


def _logits_within_rounding(path, tokenizer, recipe: str) -> None:
    kernels, plain = _logit_sqnr(path, tokenizer)
    print(f"{recipe}: logits SQNR kernels vs exact {kernels:.1f} dB, unoptimized vs exact {plain:.1f} dB")
    assert kernels > min(20.0, plain - 6.0), (recipe, kernels, plain, machine_info()["u8s8_kernel"])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES_8BIT)
def test_recipe_integer_kernels_match_exact_qdq(recipe, smollm2_dir, compiled):
    out = compiled(recipe)
    u8s8 = _saturation_free_in_onnxruntime(out)
    if recipe in ("w8a8", "w8a8-mse", "quarot-w8a8", "mquant-w8a8", "muxq-w8a8"):  # every linear W8A8
        assert u8s8["linears"] >= 211
    _logits_within_rounding(out / "model.onnx", smollm2_dir, recipe)


@pytest.mark.slow
def test_default_recipe_perplexity_with_kernels_equals_exact_qdq(smollm2_dir, compiled):
    out = compiled(DEFAULT_RECIPE)
    kernels, exact = _gap(out / "model.onnx", smollm2_dir)
    _within_rounding(out / "model.onnx", smollm2_dir, kernels, exact)


@pytest.mark.slow
def test_full_range_weights_fail_where_the_kernel_saturates(smollm2_dir, tmp_path):
    """The form every graph had before: the test above fails with it on AVX2, and the model says why."""
    out = _compile(smollm2_dir, tmp_path / "full", "mquant-w8a8", "--target", "ort-cpu-vnni")
    u8s8 = json.loads((out / "report.json").read_text())["u8s8"]
    assert u8s8["linears_at_risk"] > 100 and u8s8["max_pair_rate"] > 0  # predicted on any machine
    kernels, exact = _gap(out / "model.onnx", smollm2_dir)
    unsafe = [v for v in ort_fused_u8s8(out / "model.onnx").values() if not v["saturation_free"]]
    assert len(unsafe) == u8s8["linears_at_risk"]  # onnxruntime runs exactly the linears flagged
    if saturating_cpu():
        assert kernels / exact - 1 > SATURATED, (kernels, exact)
    else:
        _within_rounding(out / "model.onnx", smollm2_dir, kernels, exact)

    # one real linear: the machine's integer result equals the VPMADDUBSW model's (saturating
    # CPU) or the exact product (otherwise), on real activation codes of this graph
    model = onnx.load(str(out / "model.onnx"))
    sites = find_u8s8_sites(gs.import_onnx(model))
    risky = static_risk(sites)
    site = next(s for s in sites if s.node.name in risky and "down_proj" in s.node.name)
    codes = _activation_codes(model, site.activation.name, smollm2_dir)[:8]
    q_kn = site.weight_kn().astype(np.int8)
    predicted, saturated, _ = vpmaddubsw_matmul(codes, q_kn)
    assert saturated > 0
    exact_int = codes.astype(np.int64) @ q_kn.astype(np.int64)
    got = _machine_matmul_integer(codes, q_kn)
    np.testing.assert_array_equal(got, predicted if saturating_cpu() else exact_int)


def _activation_codes(model: onnx.ModelProto, name: str, tokenizer) -> np.ndarray:
    from edgeq.graph import ir
    from edgeq.textdata import feeds_for_windows, token_windows

    model.graph.output.extend([onnx.helper.make_tensor_value_info(name, onnx.TensorProto.UINT8, None)])
    session = ir.make_session(model)
    ids = token_windows(DATA / "test.txt", tokenizer, seq_len=64, windows=1)
    codes = session.run([name], feeds_for_windows(session.get_inputs(), ids))[0]
    return codes.reshape(-1, codes.shape[-1])


def _machine_matmul_integer(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from onnx import TensorProto, helper, numpy_helper

    from edgeq.graph import ir

    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, list(a.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)], [numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return ir.make_session(model, optimize=True).run(None, {"a": a})[0].astype(np.int64)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mquant-w8a8-vlm", "mquant-w4a8-vlm"])
def test_vlm_recipe_integer_kernels_match_exact_qdq(recipe, composed_vlm_dir, tmp_path):
    """The -vlm recipes on the composed vision-language model (SmolLM2 + visual tokens): onnxruntime
    fuses exactly the linears we guard, all pair-bounded, and the logits with its integer kernels
    are as close to the exact-QDQ logits as float summation order alone puts them (no text labels
    here, so the check is on the logits of two evaluation samples, not perplexity). Measured on
    AVX2: 27.6-28.8 dB either way, the rounding flips of the module docstring."""
    from edgeq.runtime.ort_session import open_session, session_options
    from edgeq.quantize.sqnr import sqnr_db
    from edgeq.textdata import load_npz_samples

    out = tmp_path / recipe
    assert main(["compile", str(composed_vlm_dir / "model.onnx"), "--recipe", recipe, "--calib",
                 str(composed_vlm_dir / "calib.npz"), "--calib-windows", "2", "-o", str(out)]) == 0
    u8s8 = _saturation_free_in_onnxruntime(out)
    if recipe == "mquant-w8a8-vlm":
        assert u8s8["linears"] >= 211
    kernels = open_session(out / "model.onnx")
    exact = open_session(out / "model.onnx", options=session_options(exact_qdq=True))
    plain = open_session(out / "model.onnx", options=session_options(optimize=False))
    for feeds in load_npz_samples(composed_vlm_dir / "eval.npz", kernels.get_inputs())[:2]:
        k, e, p = (s.run(None, feeds)[0] for s in (kernels, exact, plain))
        assert sqnr_db(e, k) > min(20.0, sqnr_db(e, p) - 6.0), (recipe, sqnr_db(e, k), sqnr_db(e, p),
                                                                machine_info()["u8s8_kernel"])
