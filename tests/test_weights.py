"""Weight-quantized ONNX files (issue 63, item 3): `rewrite --weights int8|int4` (onnx/weights.py).

A tiny PreNorm GPT (samples/models.py) exported with input_ids -> logits: every constant-weight MatMul
becomes MatMulNBits, the sites stay the rewrite's, the file runs in onnxruntime, and the verification states
its bounds and its numbers (perplexity, next-token agreement, greedy tokens). A deliberately broken scale
fails the verification (exit 7, nothing written); the CLI's misuses are one line each (docs/cli.md).
SmolLM2 through the factory route: tests/test_smollm2.py (-m llm); genai folders: tests/test_onnx_fused_norms.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from forked_cli import run_cli  # noqa: E402

import attnres_compile as ac  # noqa: E402
from attnres_compile.api import rewrite_onnx  # noqa: E402
from samples import models  # noqa: E402

ROWS = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1)).numpy()


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> Path:
    """The sample GPT (4 blocks, width 64, vocab 96) as ONNX: input_ids [b, s] -> logits [b, s, 96]."""
    model, (ids,) = models.gpt_factory(layers=4)
    folder = tmp_path_factory.mktemp("weights")
    path = folder / "gpt.onnx"
    torch.onnx.export(model, (ids,), str(path), dynamo=False, opset_version=17, input_names=["input_ids"],
                      output_names=["logits"], dynamic_axes={"input_ids": {0: "b", 1: "s"}, "logits": {0: "b", 1: "s"}})
    np.save(folder / "rows.npy", ROWS)
    return path


def _ops(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def test_int8_and_int4_files_verify_and_run(lm, tmp_path):
    config = ac.AttnResConfig(variant="block", num_blocks=2)
    fp32 = rewrite_onnx(lm, tmp_path / "fp32.onnx", config).report
    reports = {w: rewrite_onnx(lm, tmp_path / f"{w}.onnx", config, weights=w, eval_ids=ROWS).report
               for w in ("int8", "int4")}
    before = _ops(tmp_path / "fp32.onnx")
    for w, report in reports.items():
        info = report["weights"]
        ops = _ops(tmp_path / f"{w}.onnx")
        assert ops.get("MatMulNBits") == info["quantized"] == 17 and info["bits"] == {"int8": 8, "int4": 4}[w]
        assert info["kept"] == before["MatMul"] - 17  # q @ k^T, p @ v: activations on both sides
        assert info["accuracy_level"] == 4 and info["minimum"] == (w == "int4")
        assert info["head_bits"] == (8 if w == "int4" else None)  # the LM head at 8 bits in an int4 file
        if w == "int4":  # 16 bodies, each with its offset and block sums (one per distinct input: all 16 here)
            assert info["with_minimum"] == 16 and ops["MatMul"] == info["kept"] + 16 + 16
        assert {k: v for k, v in ops.items() if k.startswith(("DepthAttention", "Gather", "LayerNorm"))} == \
               {k: v for k, v in before.items() if k.startswith(("DepthAttention", "Gather", "LayerNorm"))}
        assert report["summary"]["sites_rewritten"] == fp32["summary"]["sites_rewritten"] == 8
        assert all(r["ok"] for r in report["verification"])  # the float32 rewrite first, exact as ever
        check = info["verification"]
        assert check["ok"] and check["rows_evaluated"] == [4, 32] and check["positions"] == 4 * 31
        perplexity, agreement, greedy = check["checks"]
        assert perplexity["ok"] and agreement["ok"] and greedy["ok"] is None
        assert perplexity["bound"] == ("<= +2%" if w == "int8" else "<= +5%") and abs(perplexity["change"]) < 0.02
        assert agreement["value"] >= 0.9
        text = str(report)
        assert "verified against the float32 model on 4 row(s) x 32 tokens" in text and "✓ perplexity" in text
        assert info["bytes_after"] < info["bytes_before"] * 0.45
    import onnxruntime as ort

    logits = {w: ort.InferenceSession(str(tmp_path / f"{w}.onnx")).run(None, {"input_ids": ROWS})[0]
              for w in ("fp32", "int8", "int4")}
    assert (logits["int8"].argmax(-1) == logits["fp32"].argmax(-1)).mean() > 0.95
    assert np.abs(logits["int8"] - logits["fp32"]).max() < 0.1 * np.abs(logits["fp32"]).max()


def _break_a_scale():
    """In the forked CLI: the quantizer's first MatMulNBits scales multiplied by 8 (a broken scale)."""
    from onnx import numpy_helper

    from attnres_compile.onnx import weights

    real = weights.quantize

    def broken(model, bits, *args, **kwargs):
        out, info = real(model, bits, *args, **kwargs)
        name = next(n.input[2] for n in out.graph.node if n.op_type == "MatMulNBits")
        for t in out.graph.initializer:
            if t.name == name:
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 8, name))
        return out, info
    weights.quantize = broken


def test_a_broken_scale_fails_verification_and_writes_nothing(lm, tmp_path):
    out = tmp_path / "q.onnx"
    run = run_cli(["rewrite", lm, "-o", out, "--weights", "int8", "--eval-ids", lm.parent / "rows.npy"],
                  setup=_break_a_scale)
    assert run.code == 7, (run.code, run.stderr)
    assert len(run.lines) == 1 and "the int8 weights are out of bounds" in run.lines[0], run.stderr
    assert "nothing written" in run.lines[0] and not out.exists() and not list(tmp_path.iterdir())
    good = run_cli(["rewrite", lm, "-o", out, "--weights", "int8", "--eval-ids", lm.parent / "rows.npy",
                    "--report", tmp_path / "r.json"])
    assert good.code == 0, good.stderr
    assert "✓ next-token agreement with float32" in good.stdout and "(bound >= 90%)" in good.stdout
    assert json.loads((tmp_path / "r.json").read_text())["weights"]["verification"]["ok"] is True


def test_an_already_rewritten_file_and_the_original_are_quantized(lm, tmp_path):
    """`--weights` on a rewritten file quantizes it, sites as they are; with --no-rewrite, the original."""
    rewritten = tmp_path / "r.onnx"
    rewrite_onnx(lm, rewritten, verify_outputs=False)
    again = rewrite_onnx(rewritten, tmp_path / "r4.onnx", weights="int4", eval_ids=ROWS).report
    assert any(n.startswith("already rewritten: 8 depth_attention sites kept") for n in again["notes"])
    assert _ops(tmp_path / "r4.onnx").get("DepthAttention", 0) + _ops(tmp_path / "r4.onnx").get("DepthAttentionMerge", 0) \
        == _ops(rewritten).get("DepthAttention", 0) + _ops(rewritten).get("DepthAttentionMerge", 0) > 0
    original = rewrite_onnx(lm, tmp_path / "o8.onnx", rewrite_chains=False, weights="int8", eval_ids=ROWS).report
    assert original["rewritten"] is False and original["weights"]["verification"]["ok"]
    assert not any(n.domain == "attnres" for n in onnx.load(str(tmp_path / "o8.onnx")).graph.node)


def test_cli_misuses_are_one_line(lm, tmp_path):
    rows = lm.parent / "rows.npy"
    cases = [
        (["rewrite", "samples.models:gpt_factory", "-o", tmp_path / "q.pt2", "--weights", "int8"], 2,
         "--weights writes an .onnx file"),
        (["rewrite", lm, "-o", tmp_path / "q.onnx", "--eval-ids", rows], 2, "give --weights int8 or int4"),
        (["rewrite", lm, "-o", tmp_path / "q.onnx", "--weights", "int4"], 2, "pass --eval-ids FILE.npy, or --no-verify"),
        (["rewrite", lm, "-o", tmp_path / "q.onnx", "--weights", "int4", "--eval-ids", tmp_path / "none.npy"], 6,
         "no such file"),
    ]
    for argv, code, text in cases:
        run = run_cli(argv, cwd=Path(__file__).resolve().parents[1])
        assert run.code == code and len(run.lines) == 1 and text in run.lines[0], (argv, run.code, run.stderr)
    assert not list(tmp_path.iterdir())
