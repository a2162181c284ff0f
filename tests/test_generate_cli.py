"""`rewrite FACTORY --with-past` (.onnx as optimum names it, .pt2) and `generate` on each runtime.

The same prompt through onnxruntime, torch (.pt2) and a factory rewritten in memory must give
the original HF model's greedy tokens; the ONNX file's inputs, outputs and dims carry
optimum's decoder-with-past names, and mistakes get one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
import torch

from forked_cli import run_cli
from samples.hf_decoders import llama_factory

ROOT = Path(__file__).resolve().parents[1]
FACTORY = "samples.hf_decoders:llama_factory"
PROMPT = "5,17,42,8;9,3,71,60"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("with-past")
    for name in ("m.onnx", "m.pt2"):
        run = run_cli(["rewrite", FACTORY, "-o", folder / name, "--with-past", "--blocks", "2"], cwd=ROOT, timeout=300)
        assert run.code == 0, run.stderr
        assert "✓ logits" in run.stdout and "✗" not in run.stdout
    return folder


def _expected(new: int) -> list[list[int]]:
    model, _ = llama_factory()
    prompt = torch.tensor([[int(t) for t in row.split(",")] for row in PROMPT.split(";")])
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False).tolist()


def test_onnx_with_past_is_named_as_optimum_names_it(files):
    path = files / "m.onnx"
    onnx.checker.check_model(str(path))
    graph = onnx.load(str(path), load_external_data=False).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*graph.input, *graph.output]}
    assert list(dims) == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key", "past_key_values.0.value",
                          "past_key_values.1.key", "past_key_values.1.value", "logits", "present.0.key",
                          "present.0.value", "present.1.key", "present.1.value"]
    assert dims["input_ids"] == dims["position_ids"] == ["batch_size", "sequence_length"]
    assert dims["attention_mask"] == ["batch_size", "past_sequence_length + sequence_length"]
    assert dims["past_key_values.1.value"] == ["batch_size", 1, "past_sequence_length", 16]
    assert dims["present.0.key"] == ["batch_size", 1, "past_sequence_length + sequence_length", 16]
    assert dims["logits"] == ["batch_size", "sequence_length", 100]


@pytest.mark.parametrize("model", ["m.onnx", "m.pt2", FACTORY])
def test_generate_gives_the_original_tokens_on_every_runtime(files, model):
    target = model if ":" in model else files / model
    run = run_cli(["generate", target, "--prompt-ids", PROMPT, "--max-new-tokens", "24", "--json"], cwd=ROOT, timeout=300)
    assert run.code == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["tokens"] == _expected(24)
    assert data["new_tokens"] == 24 and data["decode_tokens_per_s"] > 0


@pytest.mark.parametrize("argv, message", [
    (["generate", "{onnx}", "--prompt-ids", "1,2;3"], "every row needs the same number"),
    (["generate", "{onnx}", "--prompt-ids", "a,b"], "expected comma-separated token ids"),
    (["generate", "{onnx}", "--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["generate", "{plain}", "--prompt-ids", "1,2"], "takes no past_key_values"),
    (["rewrite", "{onnx}", "-o", "{out}", "--with-past"], "--with-past applies to package.module:factory"),
    (["rewrite", FACTORY, "-o", "{out}", "--with-past", "--dynamic", "batch"], "drop --dynamic"),
])
def test_mistakes_get_one_line(files, tmp_path, argv, message):
    plain = tmp_path / "plain.onnx"
    if "{plain}" in argv:  # a model with no past inputs
        torch.onnx.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),), str(plain), dynamo=False, input_names=["input_ids"])
    values = {"onnx": files / "m.onnx", "plain": plain, "out": tmp_path / "out.onnx"}
    run = run_cli([a.format(**values) for a in argv], cwd=ROOT, timeout=120)
    assert run.code != 0 and len(run.lines) == 1 and run.lines[0].startswith("attnres-compile: error: "), run.stderr
    assert message in run.lines[0]
