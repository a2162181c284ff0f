"""Quantized ONNX files: onnxruntime.quantization.quantize_dynamic on an exported decoder (MatMulInteger after
DynamicQuantizeLinear), rewritten and verified with the quantize steps fixed by the original's activations
(onnx/quantize_steps.py).

An exact rewrite changes the residual sums by float rounding only, but an activation that close to a
rounding boundary lands one int8 step away, and the logits move by percents: a plain comparison
fails an exact rewrite. With the steps fixed it passes, and real changes (a trained pseudo-query, a
norm weight off by 1e-3) still fail.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from attnres_compile.onnx import runtime as ort_backend
from attnres_compile.onnx.pipeline import rewrite_onnx
from attnres_compile.onnx import quantize_steps as onnx_quantize_steps
from attnres_compile.core import verify

LAYERS, HIDDEN = 8, 64      # 16 links: deep enough that Full's sums differ from the original's by rounding
SHAPES = {"input_ids": (2, 128), "attention_mask": (2, 128)}  # enough activations that some sit on a boundary
TOLERANCE = verify.tolerance("preserve", False)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(original, rewritten, report): a tiny HF Llama exported with torch.onnx, quantize_dynamic'd (int8 weights),
    and its rewrite (Full; verified in the tests, on chosen inputs)."""
    transformers = pytest.importorskip("transformers")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from samples.hf_models import CausalLMLogits

    folder = tmp_path_factory.mktemp("quantized")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      initializer_range=0.2)
    module = CausalLMLogits(transformers.LlamaForCausalLM(config).eval()).eval()
    ids = torch.randint(0, 128, (2, 8))
    names = ["input_ids", "attention_mask"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (ids, torch.ones_like(ids)), str(folder / "fp32.onnx"), dynamo=False, opset_version=17,
                          input_names=names, output_names=["logits"], dynamic_axes={n: {0: "batch", 1: "seq"} for n in names})
    quantize_dynamic(str(folder / "fp32.onnx"), str(folder / "int8.onnx"), weight_type=QuantType.QInt8)
    result = rewrite_onnx(folder / "int8.onnx", folder / "attnres.onnx", verify_outputs=False)
    return folder / "int8.onnx", folder / "attnres.onnx", result.report


def _plain(original, rewritten, seed: int) -> float:
    """The largest difference of the logits relative to their magnitude, both files run as they are."""
    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (original, rewritten)]
    feeds = ort_backend.feeds_at(sessions[0], onnx.load(str(original), load_external_data=False), SHAPES, seed)
    expected, actual = (s.run(None, feeds)[0] for s in sessions)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def _verdicts(original, rewritten, seed: int = 0) -> list[bool]:
    rows, _, notes = ort_backend.compare_files(original, rewritten, TOLERANCE, SHAPES, seed=seed)
    assert any("quantize step(s) fixed by the original's activations" in n for n in notes)
    return [r["ok"] for r in rows]


@pytest.mark.slow
def test_exact_rewrite_of_a_quantized_decoder_verifies(quantized):
    """On inputs where a plain comparison fails the exact rewrite (one-step flips: percents off, against 1e-5), the
    verification's comparison, with the steps fixed, passes."""
    original, rewritten, report = quantized
    ops = {n.op_type for n in onnx.load(str(original), load_external_data=False).graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops and report["summary"]["links"] == 2 * LAYERS
    assert len(onnx_quantize_steps.steps(onnx.load(str(original), load_external_data=False))) == 4 * LAYERS + 1
    plain = {}
    for seed in range(8):  # a few seeds in, one lands an activation on a rounding boundary
        plain[seed] = _plain(original, rewritten, seed)
        if plain[seed] > 100 * verify.PRESERVE_RTOL:
            break
    else:
        pytest.fail(f"no input where a plain comparison fails the rewrite: {plain}")
    assert _verdicts(original, rewritten, seed) == [True], (seed, plain)


def _changed(rewritten, path, edit) -> str:
    model = onnx.load(str(rewritten))
    weights = {i.name: i for i in model.graph.initializer}
    name, value = edit(weights)
    weights[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))
    onnx.save(model, str(path))
    return str(path)


@pytest.mark.slow
def test_real_changes_of_a_quantized_rewrite_still_fail(quantized, tmp_path):
    """A pseudo-query away from zero and a norm weight off by 1e-3 (relative) change what is quantized by more than
    the rounding margin: the comparison fails, as a plain one would."""
    original, rewritten, _ = quantized
    rng = np.random.default_rng(0)

    def query(weights):
        name = next(n for n in weights if n.startswith("attnres.chain0.site"))
        return name, 0.5 * rng.standard_normal(numpy_helper.to_array(weights[name]).shape)

    def norm(weights):
        name = next(n for n in weights if "layernorm" in n)  # one initializer for every norm: equal at init
        return name, numpy_helper.to_array(weights[name]) * (1 + 1e-3)

    for edit in (query, norm):
        changed = _changed(rewritten, tmp_path / f"{edit.__name__}.onnx", edit)
        assert _verdicts(original, changed) == [False], edit.__name__
