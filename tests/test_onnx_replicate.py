"""A decoder's ONNX export grown from three layers (onnx/replicate.py, hf/export.py).

Before -> Expected: the export of a view of a deep model's first three layers, grown to its depth,
is the export of the whole model: the same ops, the same initializers, the same outputs in
onnxruntime. A model whose layers differ is not grown (hf/export.py then exports it whole and
says why). GPT-2 in CI, Llama and Mistral with -m heavy
(benchmarks/runs/heavy-tests/onnx_replicate.txt, ci_time_moves.txt). The trained-checkpoint route through it (planted
queries, generated tokens) is tests/test_ship.py.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir
import onnxruntime as ort
import pytest
import torch
import transformers as tf

from attnres_compile.fx.decoder import wrap
from attnres_compile.hf import replicate
from attnres_compile.onnx.export import NotGrown, export
from attnres_compile.onnx.replicate import SCOPES, deepen

DEPTH = 4


def _llama(**extra):
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH,
                                              num_attention_heads=4, num_key_value_heads=2, **extra)).eval()


def _mistral():
    """Sliding-window attention: torch.export writes the past length + sequence length sum in a
    different operand order in different layers (onnx/replicate.COMMUTATIVE)."""
    return tf.MistralForCausalLM(tf.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                                                  num_hidden_layers=DEPTH, num_attention_heads=4,
                                                  num_key_value_heads=2, sliding_window=8)).eval()


def _gpt2(**extra):
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=96, n_embd=64, n_layer=DEPTH, n_head=4, n_positions=64,
                                            **extra)).eval()


def _ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter((n.domain, n.op_type) for n in model.graph.node)


def _run(model: onnx.ModelProto, args) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})


# Llama and Mistral under -m heavy (CI time): in CI, GPT-2 here and test_ship.py's trained Llama take the grown route
@pytest.mark.parametrize("make", [pytest.param(_llama, marks=pytest.mark.heavy, id="llama"),
                                  pytest.param(_gpt2, id="gpt2"),
                                  pytest.param(_mistral, marks=pytest.mark.heavy, id="mistral")])
def test_a_grown_export_is_the_whole_export(make):
    torch.manual_seed(0)
    model = make()
    view, prefix = replicate.shallow_view(model)
    assert len(view.get_decoder().get_submodule(replicate.layers_path(model.get_decoder()))) == replicate.SHALLOW
    whole, args, spec = wrap(model)
    small, small_args, small_spec = wrap(view)
    tensors = {**dict(whole.named_parameters(remove_duplicate=False)), **dict(whole.named_buffers())}
    grown = export(small, small_args, None, small_spec,
                   grow=lambda graph: deepen(graph, "model." + prefix, DEPTH, 3, 1, tensors.__getitem__))
    expected = export(whole, args, None, spec)
    assert _ops(grown) == _ops(expected)
    assert {i.name for i in grown.graph.initializer if "layers" in i.name or ".h." in i.name} == {
        i.name for i in expected.graph.initializer if "layers" in i.name or ".h." in i.name}
    assert len(grown.graph.input) == len(expected.graph.input) == 3 + 2 * DEPTH
    for got, want in zip(_run(grown, args), _run(expected, args), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_a_shifted_layer_that_differs_is_not_grown():
    """A constant of the third layer changed (as GPT-2's 1/(layer+1) scaling would): deepen refuses,
    the graph is left as exported, and `export` says so (NotGrown: the caller exports whole)."""
    torch.manual_seed(0)
    model = _llama()
    view, prefix = replicate.shallow_view(model)
    small, small_args, small_spec = wrap(view)
    whole = wrap(model)[0]
    tensors = {**dict(whole.named_parameters(remove_duplicate=False)), **dict(whole.named_buffers())}
    seen = {}

    def plant_then_grow(graph):
        third = f"model.{prefix}2."
        node = next(n for n in graph if n.op_type == "Constant" and third in n.metadata_props.get(SCOPES, "")
                    and n.attributes["value"].value.numpy().dtype == np.float32)
        tensor = node.attributes["value"].value.numpy() + 1
        node.attributes["value"] = onnx_ir.AttrTensor("value", onnx_ir.tensor(tensor))
        seen["nodes"] = len(graph)
        grown = deepen(graph, "model." + prefix, DEPTH, 3, 1, tensors.__getitem__)
        seen["after"] = len(graph)
        return grown

    with pytest.raises(NotGrown):
        export(small, small_args, None, small_spec, grow=plant_then_grow)
    assert seen["after"] == seen["nodes"]


def test_layers_set_apart_have_no_shallow_view():
    """Qwen2 with sliding-window layers from layer 3 on (its config's layer types differ), GPT-2
    scaling attention by 1/(layer+1): exported whole, and the reason is the report's note."""
    config = tf.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=DEPTH,
                            num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                            max_window_layers=3)
    assert len(set(config.layer_types)) == 2
    assert "per-layer settings that differ" in replicate.shallow_view(tf.Qwen2ForCausalLM(config).eval())
    assert isinstance(replicate.shallow_view(_llama()), tuple)
    gpt2 = _gpt2(scale_attn_by_inverse_layer_idx=True)  # its attention modules differ by layer
    assert "not all alike" in replicate.shallow_view(gpt2)


def test_a_failed_three_layer_export_falls_back_to_the_whole_model(tmp_path, monkeypatch):
    """The three-layer export raising (an exporter that cannot take the view) costs time, never the
    file: export_onnx exports the whole model, verifies it, and its report says why."""
    import attnres_compile as ac
    from attnres_compile.core.errors import TraceError
    from attnres_compile.onnx import export as onnx_export

    real = onnx_export.export

    def refuse_the_view(*args, grow=None, **kwargs):
        if grow is not None:
            raise TraceError("torch.onnx cannot export the model (planted)")
        return real(*args, **kwargs)

    monkeypatch.setattr(onnx_export, "export", refuse_the_view)
    torch.manual_seed(0)
    result = ac.export_onnx(_gpt2(), None, tmp_path / "m.onnx", ac.AttnResConfig(variant="block", num_blocks=2),
                            with_past=True)
    notes = result.report.data["notes"]
    assert "exported whole, not grown from three layers: its first layers did not export (TraceError: torch.onnx cannot " \
           "export the model (planted))" in notes, notes
    assert (tmp_path / "m.onnx").is_file() and all(row.get("ok") for row in result.report.data["verification"])
