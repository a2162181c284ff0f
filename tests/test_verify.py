"""Verdicts that can fail: relative to each output's magnitude, dtype-aware, exact on non-finite
values, honest about outputs too small to judge, and a report that stays strict JSON."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnres_compile as ac
from attnres_compile.api import trace
from attnres_compile.passes import verify
from samples import hf_models, hf_zoo, models

PRESERVE = verify.tolerance("preserve", False)
ROOT = Path(__file__).parents[1]


def _row(ref, got, tol=PRESERVE):
    (row,) = verify.compare(torch.as_tensor(ref, dtype=torch.float32), torch.as_tensor(got, dtype=torch.float32), tol)
    return row


def test_non_finite_values_compare_exactly():
    """NaN/inf positions must match; one inf in the reference must not make the tolerance infinite."""
    same_nan = _row([math.nan, 1.0, 2.0], [math.nan, 1.0, 2.0])
    assert same_nan["verdict"] == "pass" and same_nan["nonfinite"] == 1 and same_nan["max_abs"] == 0
    inf_ref = _row([math.inf, 1.0, 2.0], [0.0, 1e6, -1e6])
    assert inf_ref["verdict"] == "fail" and inf_ref["nonfinite_mismatch"] == 1 and math.isfinite(inf_ref["atol"])
    assert _row([math.inf, 1.0], [-math.inf, 1.0])["verdict"] == "fail"
    assert _row([math.nan, math.nan], [math.nan, math.nan])["verdict"] == "pass"  # all NaN in both


def test_tolerance_scales_with_the_output_and_reports_the_minimum():
    small = 2e-10 * torch.rand(64, generator=torch.Generator().manual_seed(0))
    assert _row(small, small * 1.01)["verdict"] == "fail"  # a 1% change of a tiny output is a change
    row = _row(small, small * (1 + 1e-7))
    assert row["verdict"] == "pass" and 0 < row["min_rtol"] <= 1e-7 and row["atol"] == pytest.approx(1e-5 * row["ref_max"])
    assert "passes from" in verify.describe(row)
    tiny = _row([1e-25, -3e-26], [1e-25, -3e-26])
    assert tiny["verdict"] == "too small" and "ok" not in tiny and "too small to tell" in verify.describe(tiny)
    assert _row([1e-25, 0.0], [1.0, 0.0])["verdict"] == "fail"  # too small still fails on a real difference
    f64 = verify.compare(small.double(), small.double() * (1 + 1e-7), PRESERVE)[0]
    assert f64["verdict"] == "fail" and f64["rtol"] < 1e-13  # float64 rounding is judged at float64's epsilon


def test_mobilenetv2_at_default_init_is_not_passed():
    """HF's default init gives outputs ~1e-26: a paper rewrite changing them by ~90% used to get ✓."""
    model, inputs = hf_zoo.mobilenetv2_default_init_factory()
    gm = trace(model, inputs).graph_module
    paper = ac.rewrite(gm, inputs, ac.AttnResConfig(scale="paper"))
    assert {row["verdict"] for row in paper.report["verification"]} == {"fail"}
    assert min(row["min_rtol"] for row in paper.report["verification"]) > 0.1  # outputs changed by ~99%
    preserve = ac.rewrite(gm, inputs).report
    assert {row["verdict"] for row in preserve["verification"]} == {"too small"}
    assert "too small to tell" in str(preserve) and "✓" not in str(preserve)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_rewrite_is_judged_against_float64(dtype):
    """fp16/bf16: the rewrite passes when it is no worse than the original's own rounding."""
    model, inputs = hf_models.llama_factory()
    model = model.to(dtype)
    result = ac.rewrite(model, inputs)
    (row,) = result.report["verification"]
    assert row["dtype"] == str(dtype).removeprefix("torch.") and row["verdict"] == "pass", row
    assert row["truth_err_rewritten"] <= verify.TRUTH_FACTOR * row["truth_err_original"]
    assert row["min_rtol"] > verify.PRESERVE_RTOL  # fp32's tolerance would have failed it


def test_report_json_is_strict_with_nan_outputs(tmp_path):
    """An ONNX model whose outputs hold NaN rows (NaN token embeddings): identical NaNs pass, and
    `--report` is valid JSON (no bare NaN)."""
    model, (tokens,) = models.gpt_factory()
    with torch.no_grad():
        model.tok.weight[::3] = math.nan
    path = tmp_path / "nan_gpt.onnx"
    torch.onnx.export(model, (tokens,), str(path), dynamo=False, opset_version=17, input_names=["idx"],
                      output_names=["logits"], dynamic_axes={"idx": {0: "batch", 1: "seq"}})
    report = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "attnres_compile.cli", "rewrite", str(path), "-o", str(tmp_path / "out.onnx"),
                           "--report", str(report)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in the report"))
    (row,) = data["verification"]
    assert row["verdict"] == "pass" and row["nonfinite"] > 0 and "nonfinite_mismatch" not in row
    assert "non-finite, identical" in proc.stdout
