"""The HTP deployment as a device runs it (issue 44): parts that fit a context budget, and one
copy of the weights.

- ``--max-context-mb``: every part of both graphs is prepared whole by Qualcomm's compiler, and
  ``edgeq eval ppl`` / ``edgeq generate --provider qnn-htp`` run the parts in sequence, scoring as
  the unsplit pair does on CPU;
- ``--share-weights``: the prefill and decode graphs go into one context binary (weights once);
  QNN cannot load it on x86-64, so running it here is a one-line refusal, not a crash;
- bad input (a budget one block does not fit, the options without ``--context-binary``) exits 2
  with one line and writes nothing.

Vendor-gated as tests/test_qnn_vendor.py is (x86-64 Linux, Python >= 3.11).
"""

from __future__ import annotations

import json
import platform
import sys

import onnx
import pytest

from edgeq.cli import main
from edgeq.targets.qnn_vendor import vendor_version

if platform.machine() != "x86_64" or sys.version_info < (3, 11) or not sys.platform.startswith("linux"):
    pytest.skip("onnxruntime-qnn emulates the HTP on x86-64 Linux, Python >= 3.11 only", allow_module_level=True)
if vendor_version() is None:
    pytest.fail("onnxruntime-qnn is not installed: `pip install -e .[qnn]` (make test installs it)", pytrace=False)

BUDGET_MB = "0.15"  # the tiny llama's pair (about 0.26 MB of weights) in two parts per graph


def _compile(tiny_past, out, *extra):
    return main(["compile", str(tiny_past / "model" / "model.onnx"), "--recipe", "mquant-w8a8", "--calib",
                 str(tiny_past / "calib.txt"), "--seq-len", "32", "--calib-windows", "2", "--no-cache",
                 "--static", "prefill=8,context=48", "--target", "qnn-htp", "-o", str(out), *extra])


def _ppl(folder, tiny_past, capsys, *extra) -> float:
    argv = ["eval", "ppl", str(folder), "--text", str(tiny_past / "calib.txt"), "--tokenizer", str(folder),
            "--seq-len", "17", "--windows", "1", "--through", "prefill", "--json", *extra]
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["ppl"]


def test_parts_are_prepared_whole_and_run_in_sequence_on_the_htp(tiny_past, tmp_path, capsys):
    out = tmp_path / "parts"
    assert _compile(tiny_past, out, "--context-binary", "--max-context-mb", BUDGET_MB) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    parts = report["static"]["parts"]
    manifest = json.dumps(json.loads((out / "manifest.json").read_text()))
    for role in ("prefill", "decode"):
        files = [p["file"] for p in parts[role]]
        assert len(files) >= 2 and all(p["weight_bytes"] <= float(BUDGET_MB) * 2**20 for p in parts[role])
        for file in files:
            ctx = f"qnn/{file[:-len('.onnx')]}_ctx.onnx"
            assert [n.op_type for n in onnx.load(out / ctx).graph.node] == ["EPContext"]
            assert ctx in manifest and report["qnn_context"]["graphs"][file]["load_seconds"] is not None
        assert not (out / "qnn" / f"{role}_ctx.onnx").exists()
    assert len(parts["prefill"]) == len(parts["decode"])
    # the target's output stages, in order, each with the files it added (the writer only runs them)
    stages = report["output_stages"]
    assert [s["name"] for s in stages] == ["qnn-parts", "qnn-context-binaries", "genai-qnn-pipeline"]
    assert set(stages[0]["files"]) == {p["file"] for role in ("prefill", "decode") for p in parts[role]}
    assert all(f.startswith("qnn/") for f in stages[1]["files"]) and len(stages[1]["files"]) >= 2 * len(parts["prefill"])
    assert stages[2]["files"] == {} and report["qnn_context"]["genai"]["written"] is False
    capsys.readouterr()
    cpu = _ppl(out, tiny_past, capsys)
    htp = _ppl(out, tiny_past, capsys, "--provider", "qnn-htp")
    assert abs(htp / cpu - 1) < 0.05, (htp, cpu)
    assert main(["generate", str(out), "--prompt", "a b", "--max-new-tokens", "3", "--provider", "qnn-htp"]) == 0


def test_shared_weights_are_one_binary_and_refused_to_run_here(tiny_past, tmp_path, capsys):
    out = tmp_path / "shared"
    assert _compile(tiny_past, out, "--context-binary", "--share-weights") == 0, capsys.readouterr().err
    binaries = sorted(p.name for p in (out / "qnn").glob("*.bin"))
    assert len(binaries) == 1, binaries
    report = json.loads((out / "report.json").read_text())["qnn_context"]
    assert report["weights_shared"] is True and report["loaded_back"] is False
    for role in ("prefill", "decode"):
        (node,) = onnx.load(out / "qnn" / f"{role}_ctx.onnx").graph.node
        cache = next(a.s.decode() for a in node.attribute if a.name == "ep_cache_context")
        assert cache == binaries[0]  # both graphs point at the one binary
    capsys.readouterr()
    code = main(["generate", str(out), "--prompt", "a b", "--max-new-tokens", "2", "--provider", "qnn-htp"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Shared weights buffer" in err, err


@pytest.mark.parametrize("extra, message", [
    (["--context-binary", "--max-context-mb", "0.05"], "block 0 holds"),
    # the embedding table at the 16 bits the HTP lowering stores it in: refused before any work
    (["--context-binary", "--max-context-mb", "0.001"], "as the target stores it (16-bit), more than one part may hold"),
    (["--max-context-mb", "64"], "--max-context-mb is a setting of --context-binary"),
    (["--share-weights"], "--share-weights is a setting of --context-binary"),
    (["--context-binary", "--max-context-mb", "0"], "positive"),
])
def test_bad_deployment_options_exit_2_and_write_nothing(tiny_past, tmp_path, capsys, extra, message):
    out = tmp_path / "o"
    code = _compile(tiny_past, out, *extra)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, (code, err)
    assert not out.exists()


def test_json_output_stays_clean_of_the_vendors_banner(tiny_past, tmp_path):
    """QNN's backend prints a banner on the process's stdout when it loads; ``--json`` must still be
    one JSON document on stdout, for edgeq's own HTP loop and for onnxruntime-genai's pipeline."""
    import subprocess

    out = tmp_path / "pair"
    assert _compile(tiny_past, out, "--context-binary") == 0
    for argv in ([str(out), "--provider", "qnn-htp"], [str(out / "qnn")]):
        done = subprocess.run([sys.executable, "-m", "edgeq", "generate", *argv, "--prompt", "w5 w17 w99",
                               "--max-new-tokens", "2", "--json"], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(json.loads(done.stdout)["tokens"]) == 2, done.stdout
