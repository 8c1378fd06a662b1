"""onnxruntime-genai running a static pair's QNN context binaries (``edgeq.genai.qnn_config``, issue 44 item 3).

``write_genai_qnn_config`` makes ``OUT/qnn`` a genai ``decoder-pipeline`` folder (position processor
and KV writer on the CPU, the EPContext models on the QNN plugin EP). Checked on the tiny pair:
genai's own config parser takes it; the same pipeline with the CPU pair's graphs as its model stages
gives the CPU pair's logits and tokens (a prompt over several padded windows); on the emulated HTP
genai gives the tokens edgeq's own HTP loop gives, and the CPU pair's on a one-window prompt.
"""

from __future__ import annotations

import json
import platform
import sys

import numpy as np
import pytest

from edgeq.cli import main
from edgeq.targets.qnn_vendor import vendor_version

if platform.machine() != "x86_64" or sys.version_info < (3, 11) or not sys.platform.startswith("linux"):
    pytest.skip("onnxruntime-qnn emulates the HTP on x86-64 Linux, Python >= 3.11 only", allow_module_level=True)
if vendor_version() is None:
    pytest.fail("onnxruntime-qnn is not installed: `pip install -e .[qnn]` (make test installs it)", pytrace=False)
og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'edgeq[genai]')")

PROMPT_LONG = [5, 17, 99, 3, 42, 7, 8, 9, 10, 11, 12]  # 11 tokens: two windows of 8, five pads
PROMPT_SHORT = [6, 18, 100, 4, 43, 8, 9]  # one window, one pad


@pytest.fixture(scope="module")
def pair(tiny_past, tmp_path_factory):
    out = tmp_path_factory.mktemp("qnn-genai") / "out"
    assert main(["compile", str(tiny_past / "model" / "model.onnx"), "--recipe", "mquant-w8a8", "--calib",
                 str(tiny_past / "calib.txt"), "--seq-len", "32", "--calib-windows", "2", "--no-cache", "--static",
                 "prefill=8,context=48", "--target", "qnn-htp", "--context-binary", "-o", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    record = report["qnn_context"]["genai"]
    assert record.pop("written") is True
    # the pipeline is the output stage after the context binaries, its record listing what it wrote
    stages = {s["name"]: s for s in report["output_stages"]}
    assert list(stages) == ["qnn-context-binaries", "genai-qnn-pipeline"]
    assert set(stages["genai-qnn-pipeline"]["files"]) == set(record["files"])
    manifest = json.dumps(json.loads((out / "manifest.json").read_text()))
    assert all(f in manifest for f in record["files"])  # written before the manifest, listed by it
    return out, record


def _greedy(decoder, ids, n=8) -> list[int]:
    logits, tokens = decoder.prefill(np.asarray(ids, np.int64)), []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = decoder.step(tokens[-1])
    return tokens


def test_config_layout_and_genai_parses_it(pair):
    out, record = pair
    qnn = out / "qnn"
    config = json.loads((qnn / "genai_config.json").read_text())
    model = config["model"]
    assert model["type"] == "decoder-pipeline" and model["context_length"] == 48
    decoder = model["decoder"]
    assert decoder["sliding_window"] == {"window_size": 8, "pad_value": 0, "alignment": "right",
                                         "slide_key_value_cache": False, "slide_inputs": True}
    stages = decoder["pipeline"][0]
    assert list(stages) == ["position-processor", "prefill-htp", "decode-htp", "kv-writer"] == record["stages"]
    for role in ("prefill", "decode"):
        stage = stages[f"{role}-htp"]
        assert stage["filename"] == f"{role}_ctx.onnx" and (qnn / stage["filename"]).is_file()
        assert (stage["run_on_prompt"], stage["run_on_token_gen"]) == (role == "prefill", role == "decode")
        qnn_options = stage["session_options"]["provider_options"][0]["qnn"]
        assert qnn_options["backend_type"] == "htp" and "enable_htp_shared_memory_allocator" not in qnn_options
    assert config["search"]["max_length"] == 48 and config["search"]["past_present_share_buffer"] is True
    for name in record["files"]:
        assert (out / name).is_file(), name
    og.Config(str(qnn))  # genai's own parser takes every key


def test_pipeline_with_the_cpu_graphs_is_the_cpu_pair(pair, tmp_path):
    """The pipeline's wiring on its own: the CPU pair's graphs as its model stages, genai's loop."""
    from edgeq.genai.qnn_config import write_cpu_check_folder
    from edgeq.generation.decoders import open_decoder

    out, _ = pair
    cpu = write_cpu_check_folder(out, tmp_path / "cpu")
    reference = open_decoder(out)
    genai = open_decoder(cpu)
    assert genai.mode == "genai"
    assert _greedy(genai, PROMPT_LONG) == _greedy(reference, PROMPT_LONG)
    reference.reset()
    genai.reset()
    ids = np.array(PROMPT_LONG, np.int64)
    np.testing.assert_allclose(genai.prefill_all(ids), reference.prefill_all(ids), atol=1e-4)


def test_genai_runs_the_context_binaries_on_the_htp(pair):
    from edgeq.generation.decoders import open_decoder

    out, _ = pair
    genai = open_decoder(out / "qnn")
    htp = open_decoder(out, provider="qnn-htp")
    for prompt in (PROMPT_LONG, PROMPT_SHORT):
        genai.reset()
        htp.reset()
        assert _greedy(genai, prompt) == _greedy(htp, prompt)  # the same HTP arithmetic, genai's loop
    cpu = open_decoder(out)
    genai.reset()
    assert _greedy(genai, PROMPT_SHORT) == _greedy(cpu, PROMPT_SHORT)


def test_generate_cli_routes_the_qnn_folder(pair, capsys):
    out, _ = pair
    prompt = " ".join(f"w{i - 1}" for i in PROMPT_SHORT)
    results = []
    for folder in (out, out / "qnn"):
        assert main(["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "8", "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert results[1]["mode"] == "genai"
    assert results[1]["tokens"] == results[0]["tokens"]
