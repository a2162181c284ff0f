"""benchmarks/tvm_zoo.py's runner: each (model, route) in its own child under a time limit, rows merged into --out."""

import json

from benchmarks import tvm_zoo


def test_a_route_past_its_time_limit_is_one_row_and_the_run_goes_on(tmp_path):
    """Two routes killed at --timeout (exit 17) are two failed rows; --out keeps the rows of other models,
    writes the readable table beside them, and --resume then has nothing left to run."""
    out = tmp_path / "zoo.json"
    kept = {"model": "gpt2", "route": "onnx", "group": "suite", "status": "ok", "rel_err": 1e-7, "build_s": 1.0}
    out.write_text(json.dumps([kept]))
    assert tvm_zoo.main(["ppocr_cls", "ddddocr_det", "--routes", "onnx", "--timeout", "1", "--out", str(out)]) == 1
    rows = {(r["model"], r["route"]): r for r in json.loads(out.read_text())}
    assert rows.keys() == {("gpt2", "onnx"), ("ppocr_cls", "onnx"), ("ddddocr_det", "onnx")}
    for name in ("ppocr_cls", "ddddocr_det"):
        row = rows[name, "onnx"]
        assert (row["status"], row["exit"], row["group"]) == ("failed", 17, "pretrained"), row
        assert "did not finish within 1 s while ppocr_cls onnx".replace("ppocr_cls", name) in row["error"]
    table = out.with_suffix(".txt").read_text()
    assert "3 rows, 1 ok, 0 mismatch, 2 failed, 0 no chain, 0 refused" in table
    assert tvm_zoo.main(["ppocr_cls", "--routes", "onnx", "--out", str(out), "--resume"]) == 0
    assert len(json.loads(out.read_text())) == 3
