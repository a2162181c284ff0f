"""samples/train_tiny_lm.py at its --tiny size: all five runs, the conversion check, the artifacts."""

import json

import pytest

from attnres_compile.monitor import inspect_weights
from samples import train_tiny_lm


def test_tiny_training_run(tmp_path):
    results = train_tiny_lm.main(["--tiny", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["runs"].keys() == set(train_tiny_lm.RUNS)
    steps, convert_at = saved["config"]["steps"], saved["config"]["convert_at"]
    for name, run in saved["runs"].items():
        start = convert_at if name.endswith("-convert") else 0
        assert run["start_step"] == start
        assert len(run["train_loss"]) == steps - start
        assert run["val"][0][0] == start and run["val"][-1][0] == steps
        assert len(run["depth"]["sites"]) == 2 * saved["config"]["layers"]
    base = saved["runs"]["baseline"]
    for name in ("full-convert", "block-convert"):
        check = saved["runs"][name]["convert_check"]
        assert check["abs_diff"] < 1e-4
        assert check["baseline"] == dict(map(tuple, base["val"]))[convert_at]
    assert results["runs"]["full"]["final"] == saved["runs"]["full"]["final"]
    for name in ("full", "block", "full-convert", "block-convert"):
        assert (tmp_path / f"{name}.pt2").exists()
    stats = inspect_weights(tmp_path / "full.pt2")["stats"]  # on the validation batch stored in the program
    assert [s["sources"] for s in stats["sites"]] == [s["sources"] for s in saved["runs"]["full"]["depth"]["sites"]]
    assert all(sum(s["weights"]) == pytest.approx(1.0) for s in stats["sites"])


def test_plots_written(tmp_path):
    pytest.importorskip("matplotlib")
    train_tiny_lm.main(["--tiny", "--out", str(tmp_path), "--runs", "baseline,full", "--steps", "4"])
    for name in ("val_loss.png", "magnitude.png", "weights_full.png"):
        assert (tmp_path / name).stat().st_size > 0
