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
from attnres_compile.fx.trace import trace
from attnres_compile.fx.decoder import _cache_param
from attnres_compile.core.errors import ConfigError, VerificationError
from attnres_compile.core import verify
from samples import hf_models, hf_zoo, models

sys.path.insert(0, str(Path(__file__).parent))

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
    assert any("norms' eps" in n for n in paper.report["notes"])  # same note as the CLI prints
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


# ---------------------------------------------------------------------------------------------
# issue 39 (4, 8, 13, 14, 15) and issue 38 (2): verdicts that shapes, eps and state used to hide


class Chain(torch.nn.Module):
    """x + tanh(W x) three times; optionally train-mode BatchNorm and dropout first, or doubling its input in place."""

    def __init__(self, stateful: bool = False, mutates: bool = False, extra=None):
        super().__init__()
        self.fc = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(3))
        self.norm = torch.nn.Sequential(torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5)) if stateful else None
        self.mutates, self.extra = mutates, extra

    def forward(self, x):
        if self.mutates:
            x.mul_(2)
        if self.norm is not None:
            x = self.norm(x)
        for fc in self.fc:
            x = x + torch.tanh(fc(x))
        return self.extra(x) if self.extra else x


def _sneaky(eps: float) -> ac.AttnResConfig:
    """A config holding an eps the validation refuses (what --eps 1e-300 used to give: 0 in float32)."""
    config = ac.AttnResConfig()
    object.__setattr__(config, "eps", eps)
    return config


@pytest.mark.parametrize("eps", [1e-300, 1e-40, 1e308, math.inf, math.nan, 2.0])
def test_eps_outside_float32_normal_range_is_refused(eps, capsys, tmp_path):
    with pytest.raises(ConfigError, match=r"^eps=\S+ is out of range.*1.18e-38"):
        ac.AttnResConfig(eps=eps)
    from attnres_compile.cli import main

    assert main(["rewrite", "samples.models:gpt_factory", "-o", str(tmp_path / "o.pt2"), "--eps", repr(eps)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"attnres-compile: error: --eps {eps!r} is out of range") and "eps=" not in line
    assert not any(tmp_path.iterdir())


def test_zero_rows_catch_the_nan_the_example_inputs_hide(tmp_path):
    """eps 0 in float32: the keys' RMSNorm gives NaN on a zero row only; random inputs have none."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    (row,) = ac.rewrite(Chain().eval(), (x,), _sneaky(0.0)).report["verification"]
    assert row["verdict"] == "fail" and row["zero_rows"]["inputs"] == ["arg0"] and row["zero_rows"]["nonfinite_mismatch"]
    assert "with zero rows in arg0: non-finite values differ" in verify.describe(row)
    good = ac.rewrite(Chain().eval(), (x,)).report
    assert good["verification"][0]["zero_rows"]["verdict"] == "pass" and "also with zero rows in arg0" in str(good)

    import onnx
    from attnres_compile.onnx.pipeline import rewrite_onnx
    from hostile import tiny

    onnx.save(tiny(), tmp_path / "m.onnx")
    with pytest.raises(VerificationError, match=r"max abs 0.00e\+00 .* with zero rows in x: non-finite values differ.*; "
                                                 "nothing written"):
        rewrite_onnx(tmp_path / "m.onnx", tmp_path / "o.onnx", _sneaky(1e-300))
    assert not (tmp_path / "o.onnx").exists()


def test_rewrite_leaves_the_callers_model_and_rng_alone():
    """Train-mode BatchNorm statistics and the global RNG (dropout) are as they were before verification."""
    torch.manual_seed(0)
    model = Chain(stateful=True).train()
    x = torch.randn(4, 8)
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    result = ac.rewrite(model, (x,))
    assert all(torch.equal(buffers[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert result.report["verification"][0]["verdict"] == "pass"  # same RNG state for both runs: same dropout mask


def test_integer_outputs_are_compared_exactly(tmp_path):
    ints = torch.arange(6).reshape(2, 3)
    (same,) = verify.compare(ints, ints.clone(), PRESERVE)
    (off,) = verify.compare({"ids": ints}, {"ids": ints + (ints == 4)}, PRESERVE)
    assert same["verdict"] == "pass" and same["ok"] and "all equal" in verify.describe(same)
    assert off["verdict"] == "fail" and off["mismatch"] == 1 and "1 of 6 values differ" in verify.describe(off)
    assert verify.compare(ints > 2, ints > 3, PRESERVE)[0]["verdict"] == "fail"
    x = torch.randn(4, 8)
    rows = ac.rewrite(Chain(extra=lambda h: h.argmax(-1)).eval(), (x,)).report["verification"]  # integer-only
    assert [(r["output"], r["dtype"], r["verdict"]) for r in rows] == [("output", "int64", "pass")]


def _zero_batch_onnx(path: Path) -> Path:
    import onnx
    from hostile import tiny

    onnx.save(tiny(), path)
    return path


def test_empty_verification_is_not_a_pass(tmp_path, capsys):
    """--input-shape x:0x16: every output is empty; the verdict says nothing was compared."""
    from attnres_compile.cli import main

    model = _zero_batch_onnx(tmp_path / "m.onnx")
    assert main(["rewrite", str(model), "-o", str(tmp_path / "o.onnx"), "--input-shape", "x:0x16"]) == 0
    out = capsys.readouterr().out
    assert "✓" not in out and "∅ y" in out and "nothing was compared: every output is empty" in out
    (row,) = verify.compare(torch.zeros(0, 16), torch.zeros(0, 16), PRESERVE)
    assert row["verdict"] == "empty" and "ok" not in row
    report = ac.rewrite(Chain(extra=lambda h: h[:0]).eval(), (torch.randn(4, 8),)).report
    assert "nothing was compared: every output is empty" in str(report) and "✓" not in str(report)


def test_a_model_that_changes_its_input_is_verified_on_fresh_inputs():
    x = torch.randn(4, 8)
    before = x.clone()
    (row,) = ac.rewrite(Chain(mutates=True).eval(), (x,)).report["verification"]
    assert row["verdict"] == "pass", row
    assert torch.equal(x, before)  # the caller's inputs are left alone too


@pytest.fixture
def dynamic_cache():
    """transformers' DynamicCache as a pytree node (how torch.export takes it as an input), for this test only."""
    from transformers import DynamicCache
    from transformers.integrations.executorch import register_dynamic_cache_export_support
    from torch.fx import _pytree as fx_pytree
    from torch.utils import _pytree

    registered = DynamicCache in _pytree.SUPPORTED_NODES
    register_dynamic_cache_export_support()
    yield DynamicCache
    if not registered:
        _pytree._deregister_pytree_node(DynamicCache)
        fx_pytree.SUPPORTED_NODES.pop(DynamicCache, None)


def test_kv_cache_input_is_not_grown_by_the_original_before_the_rewrite_runs(dynamic_cache):
    """A decode step with a prefilled DynamicCache: the original appends to the cache in place; the rewrite
    used to get the grown cache ("shape[2] to be equal to 8, but got 9")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        out = model(torch.randint(0, 100, (1, 8)), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values  # `cache` from transformers 5.25 on
    inputs = {"input_ids": torch.randint(0, 100, (1, 1)), _cache_param(model): cache, "use_cache": True}
    rows = ac.rewrite(model, inputs).report["verification"]
    assert cache.get_seq_length() == 8
    assert rows[0]["output"] == "logits" and {r["verdict"] for r in rows} == {"pass"}, rows


def test_shape_propagation_runs_on_copies():
    """A GraphModule without shapes is run once to get them: not on the caller's inputs, not with its RNG."""
    gm = torch.fx.symbolic_trace(Chain(mutates=True).eval())
    x = torch.randn(4, 8)
    before, rng = x.clone(), torch.get_rng_state()
    assert ac.rewrite(gm, (x,)).report["verification"][0]["verdict"] == "pass"
    assert torch.equal(x, before) and torch.equal(rng, torch.get_rng_state())
