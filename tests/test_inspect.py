"""edgeq inspect: structure summary, and ranges with outlier channels under --calib."""

import json

import numpy as np
from toy import toy_model_dir, write_text

from edgeq.cli import main


def test_inspect_structure_and_ranges(tmp_path, capsys):
    model = toy_model_dir(tmp_path / "toy")
    calib = write_text(tmp_path / "calib.txt", 300)
    assert main(["inspect", str(model)]) == 0
    text = capsys.readouterr().out
    assert "linears: 2" in text and "fc1 16x16" in text

    assert main(["inspect", str(model), "--calib", str(calib), "--seq-len", "16", "--calib-windows", "2",
                 "--outlier-threshold", "1.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["linear"]: r for r in report["activations"]}
    assert set(rows) == {"fc1", "lm_head"}
    # fc1 reads embedding rows: its absmax is the largest |embed| value over the tokens seen
    assert 1.5 < rows["fc1"]["absmax"] < 6.0
    assert all(0 <= c < 16 for c in rows["fc1"]["outlier_channels"])
    assert rows["fc1"]["outlier_channels"] == sorted(set(rows["fc1"]["outlier_channels"]))
    assert np.isfinite(rows["lm_head"]["absmax"])
