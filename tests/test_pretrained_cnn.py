"""A pretrained CNN shipped in a PyPI package: YOLOv8n (nudenet 3.4.2's 320n.onnx, symbolic image
size), inspected and rewritten (preserve, Block) through the CLI and verified in onnxruntime.

Install it with `pip install --no-deps nudenet==3.4.2` (only the ONNX file is used; its own
dependencies, opencv among them, are not needed).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _yolo() -> Path:
    spec = importlib.util.find_spec("nudenet")
    if spec is None:
        pytest.skip("nudenet is not installed: pip install --no-deps nudenet==3.4.2")
    return Path(spec.submodule_search_locations[0]) / "320n.onnx"


@pytest.mark.slow
def test_yolov8n_rewrite_block_verified_in_onnxruntime(tmp_path):
    """YOLOv8n's backbone C2f blocks repeat their bottleneck [3, 6, 6, 3] x 0.33 = [1, 2, 2, 1]
    times, each bottleneck a link x + cv2(cv1(x)) (the head's C2f blocks have no shortcut):
    6 links in 4 chains, of which the two 2-link chains (32 and 64 channels) are rewritten."""
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "attnres_compile.cli", "rewrite", str(_yolo()), "-o", str(tmp_path / "yolo.onnx"),
                           "--blocks", "2", "--input-shape", "images:1x3x320x320", "--report", str(report)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    assert [(c["links"], c["status"], c["feature_size"]) for c in data["chains"]] == [
        (1, "skipped", 16), (2, "rewritten", 32), (2, "rewritten", 64), (1, "skipped", 128)]
    assert all(c["feature_axis"] == 1 for c in data["chains"])
    (row,) = data["verification"]
    assert row["verdict"] == "pass" and row["ref_max"] > 1, row  # box coordinates in pixels
    assert "✓ output0" in proc.stdout and "verified at: images 1x3x320x320\n" in proc.stdout
