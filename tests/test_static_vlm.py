"""``edgeq compile --static`` of a vision-language model and ``edgeq eval vqa`` on it, on the tiny random
VLM (``tiny_vlm_dir``: 32x32 images, 4 visual tokens, ``with-past/``):

- the fp32 static deployment (visual span at prefill rows [0, V), AIFS order, causal mask on
  positions) gives the dynamic with-past graph's logits at every answer step and its greedy answers,
  also when the prompt's text spills out of the prefill window into decode steps;
- MSQ's two scales land where they belong: in the static prefill graph every two-scale site's
  per-row gain is s_t/s_v on rows [0, V) and 1 on the text rows, in decode.onnx 1;
- refusals (one line, exit 2, nothing written): a prefill shorter than the visual span and a text
  token, calibration images of another size, questions whose images are of another size;
- the qnn-htp deployment is clean for the target (all three graphs), QNN prepares the three context
  binaries, and a question answered through them on the emulated HTP is answered as on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgeq.cli import main
from edgeq.evaluate.generate import greedy_decode
from edgeq.evaluate.vqa import evaluate_vqa, prompt_embeds, static_greedy, visual_tokens
from edgeq.files.vqa_questions import load_questions, write_questions
from edgeq.files.vlm_folder import EMBED_TABLE_FILE, QUESTIONS_FILE, VISION_FILE
from edgeq.graph.facts import VISUAL_SPAN_INPUTS
from edgeq.generation.vlm_pair import open_static_vlm
from edgeq.runtime.ort_session import open_session

CONTEXT = 40


def _compile(tiny_vlm_dir: Path, out: Path, recipe: str = "fp32", prefill: int = 16, *extra: str) -> int:
    past = tiny_vlm_dir / "with-past"
    calib = ["--calib", str(past / "calib.npz")] if recipe != "fp32" else []
    return main(["compile", str(past / "model.onnx"), "--recipe", recipe, *calib,
                 "--static", f"prefill={prefill},context={CONTEXT}", *extra, "-o", str(out)])


@pytest.fixture(scope="module")
def fp32_static(tiny_vlm_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("static-vlm") / "fp32"
    assert _compile(tiny_vlm_dir, out) == 0
    return out


@pytest.fixture(scope="module")
def msq_static(tiny_vlm_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("static-vlm") / "msq"
    assert _compile(tiny_vlm_dir, out, "mquant-w8a8-vlm") == 0
    return out


def test_fp32_deployment_holds_three_static_graphs_and_says_where_the_span_is(fp32_static):
    report = json.loads((fp32_static / "report.json").read_text())
    vlm = report["static"]["vlm"]
    assert vlm["visual_rows"] == [0, 4] and vlm["image_size"] == 32
    for name in ("prefill.onnx", "decode.onnx", VISION_FILE, EMBED_TABLE_FILE, QUESTIONS_FILE, "weights.data"):
        assert (fp32_static / name).is_file(), name
    shapes = {}
    for name in ("prefill.onnx", "decode.onnx", VISION_FILE):
        model = onnx.load(fp32_static / name, load_external_data=False)
        shapes[name] = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        keys = {p.key for p in model.metadata_props}
        assert VISUAL_SPAN_INPUTS.key not in keys, name  # it would name inputs the static graphs lack
    assert shapes[VISION_FILE] == {"pixels": [1, 32, 32, 3]}
    assert shapes["prefill.onnx"]["inputs_embeds"] == [1, 16, 64]
    assert shapes["decode.onnx"]["inputs_embeds"] == [1, 1, 64]
    assert not {"visual_start", "visual_len"} & set(shapes["prefill.onnx"])  # the span is fixed, not an input
    # the fixed layout's rewrites are named stages of the route, each graph's recorded
    stages = [(r["name"], r["graph"]) for r in report["route_stages"]]
    assert stages == [("vlm-order-invariant-mask", "with-past"), ("vlm-fixed-visual-slice", "prefill.onnx"),
                      ("vlm-fixed-visual-slice", "decode.onnx"), ("vlm-static-vision", "vision.onnx")], stages


@pytest.mark.parametrize("prefill", [16, 8])  # 8: the question's text continues through decode.onnx
def test_fp32_static_equals_the_dynamic_graph(tiny_vlm_dir, tmp_path, prefill):
    out = tmp_path / "fp32"
    assert _compile(tiny_vlm_dir, out, "fp32", prefill) == 0
    q = load_questions(tiny_vlm_dir / QUESTIONS_FILE)
    table = np.load(tiny_vlm_dir / EMBED_TABLE_FILE)
    dynamic = open_session(tiny_vlm_dir / "with-past" / "model.onnx", optimize=False)
    vision, decoder = open_static_vlm(out, table)
    tokens = visual_tokens(open_session(tiny_vlm_dir / VISION_FILE), q.pixels)
    np.testing.assert_allclose(visual_tokens(vision, q.pixels), tokens, rtol=0, atol=1e-5)
    steps = int(q.answer_len.max())
    for i in range(len(q)):
        start, length = q.visual_span(i)
        embeds = prompt_embeds(q.prompt(i), tokens[q.question_image[i]], table, start)
        feeds = {"inputs_embeds": embeds, "visual_start": np.array([start]), "visual_len": np.array([length])}
        want = greedy_decode(dynamic, feeds, steps, table)
        got = static_greedy(decoder, q.prompt(i), start, tokens[q.question_image[i]], steps)
        np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-4)
        assert got.tokens.tolist() == want.tokens.tolist()


def test_eval_vqa_on_the_static_deployment_answers_as_the_export(tiny_vlm_dir, fp32_static, capsys):
    assert main(["eval", "vqa", str(fp32_static), "--json"]) == 0
    static = json.loads(capsys.readouterr().out)
    export = evaluate_vqa(tiny_vlm_dir)
    for key in ("accuracy", "samples", "answers", "correct", "gold", "question_rows"):
        assert static[key] == export[key], key
    assert static["form"] == "static"


def test_msq_scales_land_on_the_visual_and_text_rows(msq_static):
    """Integer lowering: a site quantizes x * g with the text scale; g = s_t / s_v on visual rows
    makes their effective scale s_v. The static graphs hold g as a constant per row."""
    report = json.loads((msq_static / "report.json").read_text())
    msq = next(p for p in report["passes"] if p["name"] == "msq")
    assert msq["summary"]["two_scale_sites"] > 0
    ranges = {k: v for k, v in msq["summary"]["modality_ranges"].items() if not v.get("shared")}
    for role, visual_rows in (("prefill", 4), ("decode", 0)):
        model = onnx.load(msq_static / f"{role}.onnx")
        consts = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
        gains = {}
        for node in model.graph.node:
            if node.op_type == "Mul" and "ModalityRescale" in node.name:
                site = node.input[0] if node.input[0] in ranges else None
                gains[site or node.name] = consts[node.input[1]].reshape(-1)
        assert len(gains) == len(ranges), (role, sorted(gains))
        for site, gain in gains.items():
            width = 16 if role == "prefill" else 1
            assert gain.shape == (width,), (site, gain.shape)
            assert np.all(gain[visual_rows:] == 1.0), site  # text rows: the text scale itself
            if visual_rows:
                assert np.all(gain[:visual_rows] == gain[0]) and gain[0] != 1.0, site
    sv = json.loads((msq_static / "report.json").read_text())["static"]["vlm"]["msq_visual_rows"]
    assert sv == {"prefill.onnx": [0, 4], "decode.onnx": []}


def test_msq_gain_is_the_ratio_of_the_two_scales(msq_static):
    from edgeq.quantize.quant import QuantSpec, scale_zero_point

    report = json.loads((msq_static / "report.json").read_text())
    ranges = next(p for p in report["passes"] if p["name"] == "msq")["summary"]["modality_ranges"]
    model = onnx.load(msq_static / "prefill.onnx")
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    spec = QuantSpec(dtype="uint8", symmetric=True)
    checked = 0
    for node in model.graph.node:
        if node.op_type == "Mul" and "ModalityRescale" in node.name and node.input[0] in ranges:
            r = ranges[node.input[0]]
            s_v, _ = scale_zero_point(np.array(r["visual"][0]), np.array(r["visual"][1]), spec)
            s_t, _ = scale_zero_point(np.array(r["text"][0]), np.array(r["text"][1]), spec)
            np.testing.assert_allclose(consts[node.input[1]].reshape(-1)[0], s_t / s_v, rtol=1e-5)
            checked += 1
    assert checked > 0


def _one_line_exit_2(capsys, code: int, out: Path, *words: str) -> None:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err
    assert not out.exists()


def test_a_prefill_shorter_than_the_visual_span_is_refused(tiny_vlm_dir, tmp_path, capsys):
    out = tmp_path / "short"
    _one_line_exit_2(capsys, _compile(tiny_vlm_dir, out, "fp32", 4), out, "prefill=4", "visual span")


def test_calibration_images_of_another_size_are_refused(tiny_vlm_dir, tmp_path, capsys):
    calib = dict(np.load(tiny_vlm_dir / "with-past" / "calib.npz"))
    calib["visual_len"] = calib["visual_len"] * 4  # what 64x64 images would give
    np.savez(tmp_path / "calib64.npz", **calib)
    out = tmp_path / "other-size"
    code = main(["compile", str(tiny_vlm_dir / "with-past" / "model.onnx"), "--recipe", "mquant-w8a8-vlm",
                 "--calib", str(tmp_path / "calib64.npz"), "--static", f"prefill=24,context={CONTEXT}", "-o", str(out)])
    _one_line_exit_2(capsys, code, out, "another size")


def test_questions_with_images_of_another_size_are_refused(fp32_static, tmp_path, capsys):
    q = load_questions(fp32_static / QUESTIONS_FILE)
    big = np.repeat(np.repeat(q.pixels, 2, axis=1), 2, axis=2)
    path = write_questions(tmp_path / "q64.npz", big, q.image_index, q.question_image,
                           [q.prompt(i) for i in range(len(q))], [q.gold(i) for i in range(len(q))], q.end_id,
                           q.question, q.answer, q.qtype, q.question_index)
    assert main(["eval", "vqa", str(fp32_static), "--questions", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "64x64" in err and "32x32" in err, err


def test_msq_custom_lowering_is_refused(tiny_vlm_dir, tmp_path, capsys):
    recipe = (Path(__file__).resolve().parent.parent / "edgeq" / "recipes" / "mquant-w8a8-vlm.toml").read_text()
    (tmp_path / "custom.toml").write_text(recipe.replace('lowering = "integer"', 'lowering = "custom"'))
    out = tmp_path / "custom"
    code = _compile(tiny_vlm_dir, out, str(tmp_path / "custom.toml"))
    _one_line_exit_2(capsys, code, out, "custom")


def test_qnn_htp_deployment_is_clean_for_the_target(tiny_vlm_dir, tmp_path):
    out = tmp_path / "qnn"
    assert _compile(tiny_vlm_dir, out, "mquant-w8a8-vlm", 16, "--target", "qnn-htp") == 0
    checks = json.loads((out / "report.json").read_text())["target"]["check"]
    assert set(checks) == {"prefill.onnx", "decode.onnx", VISION_FILE}
    assert all(c["clean"] for c in checks.values()), checks


def test_context_binaries_run_on_the_emulated_htp(tiny_vlm_dir, tmp_path, capsys):
    """The three graphs prepared by QNN (--context-binary) and one question answered through them
    on the emulated HTP, as on CPU (about 11 s alone: the emulator is slow)."""
    from edgeq.targets.qnn_vendor import vendor_version

    if vendor_version() is None:
        pytest.skip("onnxruntime-qnn is not installed")
    out = tmp_path / "ctx"
    assert _compile(tiny_vlm_dir, out, "mquant-w8a8-vlm", 16, "--target", "qnn-htp", "--context-binary") == 0
    for name in ("prefill", "decode", "vision"):
        assert (out / "qnn" / f"{name}_ctx.onnx").is_file(), name
    capsys.readouterr()
    assert main(["eval", "vqa", str(out), "--provider", "qnn-htp", "--samples", "1", "--json"]) == 0
    htp = json.loads(capsys.readouterr().out)
    cpu = evaluate_vqa(out, samples=1)
    assert htp["provider"] == "qnn-htp" and htp["samples"] == 1
    assert htp["answers"] == cpu["answers"]


def test_w4a16_vlm_recipe_compiles_static_for_the_htp(tiny_vlm_dir, tmp_path, capsys):
    """mquant-w4a16-vlm (GPTQ int4 in whole blocks of 64, head int8, 16-bit activations, MSQ): the
    static deployment is clean for qnn-htp on all three graphs, its weights are int4 blocks that
    divide K (or int4 per channel), and it answers on CPU."""
    out = tmp_path / "w4a16"
    assert _compile(tiny_vlm_dir, out, "mquant-w4a16-vlm", 16, "--target", "qnn-htp") == 0
    report = json.loads((out / "report.json").read_text())
    checks = report["target"]["check"]
    assert set(checks) == {"prefill.onnx", "decode.onnx", VISION_FILE}
    assert all(c["clean"] for c in checks.values()), checks
    passes = {p["name"]: p for p in report["passes"]}
    assert passes["gptq"]["modified"] and passes["msq"]["modified"], passes.keys()
    assert report["static"]["vlm"]["passes_realized_by_layout"] == ["aifs"]
    model = onnx.load(out / "prefill.onnx", load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    blocks = []
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            dtype = inits[node.input[0]].data_type
            block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
            if dtype == onnx.TensorProto.INT4:
                k = inits[node.input[0]].dims[0]
                assert block == 0 or k % block == 0, (node.name, k, block)
                blocks.append(block)
            if dtype == onnx.TensorProto.INT16:
                pytest.fail(f"{node.name}: an int16 weight")
    assert 64 in blocks, blocks  # int4 weights in blocks of 64 along K
    acts = {inits[n.input[2]].data_type for n in model.graph.node
            if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in inits}
    assert onnx.TensorProto.INT16 in acts, acts
    capsys.readouterr()
    assert main(["eval", "vqa", str(out), "--samples", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 2


def test_msq_without_aifs_keeps_the_image_at_its_prompt_rows(tiny_vlm_dir, msq_static, tmp_path):
    """A recipe with msq but no aifs: the prefill keeps the prompt's order, MSQ's visual scale on the
    image's rows [m, m + V) (m: where every question puts the image); the same scales as with aifs,
    so the same answers and logits up to float summation order."""
    recipe = (Path(__file__).resolve().parent.parent / "edgeq" / "recipes" / "mquant-w8a8-vlm.toml").read_text()
    no_aifs = recipe.replace('[[pass]]\nname = "aifs"', '[[pass]]\nname = "aifs-removed"')
    no_aifs = no_aifs[:no_aifs.index('[[pass]]\nname = "aifs-removed"')] + no_aifs[no_aifs.index('[[pass]]\nname = "msq"'):]
    (tmp_path / "msq.toml").write_text(no_aifs)
    out = tmp_path / "msq-in-order"
    assert _compile(tiny_vlm_dir, out, str(tmp_path / "msq.toml")) == 0
    q = load_questions(tiny_vlm_dir / QUESTIONS_FILE)
    m = q.visual_span(0)[0]
    vlm = json.loads((out / "report.json").read_text())["static"]["vlm"]
    assert vlm["order"] == "original" and vlm["visual_rows"] == [m, m + 4] and vlm["passes_realized_by_layout"] == []
    assert vlm["msq_visual_rows"]["prefill.onnx"] == [m, m + 4]
    model = onnx.load(out / "prefill.onnx")
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    gains = [consts[n.input[1]].reshape(-1) for n in model.graph.node
             if n.op_type == "Mul" and "ModalityRescale" in n.name and n.input[1] in consts]
    assert gains
    for gain in gains:
        assert np.all(gain[m:m + 4] == gain[m]) and gain[m] != 1.0
        assert np.all(np.delete(gain, np.arange(m, m + 4)) == 1.0)
    table = np.load(tiny_vlm_dir / EMBED_TABLE_FILE)
    vision, in_order = open_static_vlm(out, table)
    _, aifs = open_static_vlm(msq_static, table)
    tokens = visual_tokens(vision, q.pixels)
    for i in range(min(len(q), 4)):
        start = q.visual_span(i)[0]
        a = static_greedy(in_order, q.prompt(i), start, tokens[q.question_image[i]], 2)
        b = static_greedy(aifs, q.prompt(i), start, tokens[q.question_image[i]], 2, force_tokens=a.tokens)
        np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=2e-2 * np.abs(b.logits).max())
    with pytest.raises(Exception, match="keeps the image at prompt rows"):
        static_greedy(in_order, q.prompt(0), m + 1, tokens[q.question_image[0]], 1)


def test_answer_logits_of_the_fp32_deployment_are_the_exports(tiny_vlm_dir, fp32_static):
    """``answer_logits`` (what KL and top-1 against fp32 are computed on): per question, the
    distributions predicting each gold answer token and the end token, the gold tokens fed back;
    the fp32 static deployment gives the export's."""
    from edgeq.evaluate.vqa import answer_logits

    export, static = answer_logits(tiny_vlm_dir, samples=3), answer_logits(fp32_static, samples=3)
    q = load_questions(tiny_vlm_dir / QUESTIONS_FILE)
    rows = export["question_rows"]
    assert static["question_rows"] == rows and export["counts"] == [int(q.answer_len[i]) for i in rows]
    assert export["logits"].shape == (sum(export["counts"]), len(np.load(tiny_vlm_dir / EMBED_TABLE_FILE)))
    np.testing.assert_array_equal(export["gold"], np.concatenate([q.gold(i) for i in rows]))
    np.testing.assert_allclose(static["logits"], export["logits"], rtol=0, atol=1e-4)
