"""Compile what you have (issue 63, item 4): `rewrite --no-rewrite` writes the original model through the
same trace, export, passes and verification as a rewrite, and `compile` builds a model without sites by the
same TVM pipeline; both say so (the report's header and JSON, the compile line and the manifest), so a
user compares a rewrite with its original built alike. Each through a forked `main` (forked_cli.py): exit
codes as docs/cli.md lists them, one line per failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).parent))

from forked_cli import run_cli  # noqa: E402
from hostile import tiny  # noqa: E402


def _ok(run) -> str:
    assert run.code == 0, (run.code, run.signal, run.stderr)
    return run.stdout


def _one_line(run, code: int, *texts: str) -> None:
    assert run.code == code, (run.code, run.signal, run.stderr)
    assert len(run.lines) == 1 and run.lines[0].startswith("attnres-compile: error: "), run.stderr
    assert all(t in run.lines[0] for t in texts), run.lines


def _attnres_nodes(path: Path) -> int:
    return sum(n.domain == "attnres" for n in onnx.load(str(path), load_external_data=False).graph.node)


def test_no_rewrite_writes_the_original_and_compile_builds_it(tmp_path):
    onnx.save(tiny(links=3), str(tmp_path / "t.onnx"))
    rewritten, original = tmp_path / "rewritten.onnx", tmp_path / "original.onnx"
    _ok(run_cli(["rewrite", tmp_path / "t.onnx", "-o", rewritten]))
    out = _ok(run_cli(["rewrite", tmp_path / "t.onnx", "-o", original, "--no-rewrite", "--report", tmp_path / "r.json"]))
    assert "variant=none (the original model, not rewritten)" in out and "sites" in out
    assert "verification (original vs written" in out and "✓ y" in out
    assert "note: not rewritten (--no-rewrite)" in out and "rewrite_chains" not in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rewritten"] is False and report["summary"]["sites_rewritten"] == 0
    assert _attnres_nodes(rewritten) == 3 and _attnres_nodes(original) == 0

    art = tmp_path / "art"
    out = _ok(run_cli(["compile", original, "-o", art]))
    assert f"compiled the original model (no depth-attention sites, not rewritten) for llvm into {art}" in out
    assert "verified against onnxruntime" in out
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["rewritten"] is False and "the original model" in manifest["note"] and manifest["sites"] == []
    assert manifest["kernels"] == []
    rewritten_art = tmp_path / "rewritten_art"
    _ok(run_cli(["compile", rewritten, "-o", rewritten_art]))
    assert json.loads((rewritten_art / "manifest.json").read_text())["rewritten"] is True

    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    for folder, name in ((art, "o.npz"), (rewritten_art, "r.npz")):
        _ok(run_cli(["run", folder, "--inputs", tmp_path / "in.npz", "-o", tmp_path / name]))
    import onnxruntime as ort

    expected = ort.InferenceSession(str(tmp_path / "t.onnx")).run(None, {"x": x})[0]
    for name in ("o.npz", "r.npz"):
        np.testing.assert_allclose(np.load(tmp_path / name)["y"], expected, rtol=1e-5, atol=1e-5)


def test_a_model_without_chains(tmp_path):
    """`rewrite` of a model with no residual chain stays exit 4 and names --no-rewrite; with it the model is
    written; `compile` builds it as it is (exit 6 before issue 63)."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["h"], ["y"])], "mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8])])
    mlp = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(mlp))
    _one_line(run_cli(["rewrite", mlp, "-o", tmp_path / "x.onnx"]), 4, "no residual chain to rewrite",
              "--no-rewrite writes the model as it is")
    assert not (tmp_path / "x.onnx").exists()
    _ok(run_cli(["rewrite", mlp, "-o", tmp_path / "x.onnx", "--no-rewrite"]))
    out = _ok(run_cli(["compile", mlp, "-o", tmp_path / "art"]))
    assert "compiled the original model" in out
    assert json.loads((tmp_path / "art" / "manifest.json").read_text())["rewritten"] is False
    _one_line(run_cli(["compile", tmp_path / "missing.onnx", "-o", tmp_path / "a2"]), 6, "no such file")


def test_no_rewrite_from_a_factory(tmp_path):
    """A factory's original through the fx trace and torch.export: a .pt2 without the op, verified against the
    model, and compiled as the original."""
    pt2 = tmp_path / "o.pt2"
    out = _ok(run_cli(["rewrite", "samples.models:gpt_factory", "-o", pt2, "--no-rewrite"],
                      cwd=Path(__file__).resolve().parents[1]))
    assert "variant=none" in out and "✓" in out and "✗" not in out
    from attnres_compile.pt2 import load

    program = load(pt2)
    assert not any("depth_attention" in str(n.target) for n in program.program.graph.nodes)
    out = _ok(run_cli(["compile", pt2, "-o", tmp_path / "art"]))
    assert "compiled the original model" in out and "verified against torch" in out
