"""A tiny HF Llama exported as an optimum-style decoder-with-past ONNX file (test fixture).

Inputs `input_ids`, `attention_mask`, `position_ids`, `past_key_values.{i}.key/value`; outputs
`logits`, `present.{i}.key/value`; dims named as optimum names them (`batch_size`,
`sequence_length`, `past_sequence_length`, `past_sequence_length + sequence_length`).
"""

from __future__ import annotations

import inspect
import re
import warnings

import onnx
import torch

LAYERS, HEADS, HEAD_DIM, VOCAB = 2, 2, 16, 100
BATCH, SEQ, PAST = 2, 3, 4
OPTIMUM_DIMS = {"batch_size", "sequence_length", "past_sequence_length", "past_sequence_length + sequence_length"}


class FlatDecoder(torch.nn.Module):
    """forward(input_ids, attention_mask, position_ids, *past) -> (logits, *present): a DynamicCache
    built from flat past tensors, so the exporter sees plain tensors in and out."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        # transformers 5.2x renamed past_key_values (deprecated) to cache
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(len(past) // 2):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         **{self.cache_argument: cache}, use_cache=True)
        present = [t for layer in out.past_key_values.layers[:LAYERS] for t in (layer.keys, layer.values)]
        return (out.logits, *present)


def names() -> tuple[list[str], list[str]]:
    """(input names, output names) as optimum writes them."""
    past = [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def decoder() -> tuple[FlatDecoder, tuple]:
    """The wrapped tiny Llama (hidden 32, 2 layers, 2 heads, vocab 100) and example inputs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=LAYERS * HEAD_DIM, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
                         max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    past = [torch.randn(BATCH, HEADS, PAST, HEAD_DIM) for _ in range(2 * LAYERS)]
    inputs = (torch.randint(0, VOCAB, (BATCH, SEQ)), torch.ones(BATCH, PAST + SEQ, dtype=torch.int64),
              torch.arange(PAST, PAST + SEQ).expand(BATCH, SEQ), *past)
    return FlatDecoder(model).eval(), inputs


def export_dynamo(path) -> onnx.ModelProto:
    """torch.onnx.export(dynamo=True) with every batch, sequence and past dim Dim.DYNAMIC; the
    exporter's own names (`s10`, `s53`, ...), inputs and outputs renamed to optimum's. Returns the model."""
    module, inputs = decoder()
    dyn = torch.export.Dim.DYNAMIC
    spec = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, {0: dyn, 1: dyn}, tuple({0: dyn, 2: dyn} for _ in inputs[3:]))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's and transformers' deprecation notes
        program = torch.onnx.export(module, inputs, dynamo=True, dynamic_shapes=spec, verbose=False)
    model = program.model_proto
    _rename_values(model, *names())
    onnx.save(model, str(path))
    return model


def optimum_dims(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the dynamo export with its dims renamed as optimum names them."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    ids, mask = graph.input[0].type.tensor_type.shape.dim, graph.input[1].type.tensor_type.shape.dim
    rename = {ids[0].dim_param: "batch_size", ids[1].dim_param: "sequence_length",
              mask[0].dim_param: "batch_size", mask[1].dim_param: "past_sequence_length + sequence_length"}
    for past in graph.input[3:]:
        rename[past.type.tensor_type.shape.dim[2].dim_param] = "past_sequence_length"
    for value in [*graph.input, *graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.dim_param = _rename_dim(dim.dim_param, rename)
    del graph.value_info[:]
    return model


def export_torchscript(path) -> None:
    """torch.onnx.export(dynamo=False) with `dynamic_axes` named as optimum names them."""
    module, inputs = decoder()
    inputs_names, output_names = names()
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
            "attention_mask": {0: "batch_size", 1: "past_sequence_length + sequence_length"},
            "position_ids": {0: "batch_size", 1: "sequence_length"},
            "logits": {0: "batch_size", 1: "sequence_length"}}
    axes.update({n: {0: "batch_size", 2: "past_sequence_length"} for n in inputs_names[3:]})
    axes.update({n: {0: "batch_size", 2: "past_sequence_length + sequence_length"} for n in output_names[1:]})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings: the cache's Python branches are traced at these sizes
        torch.onnx.export(module, inputs, str(path), dynamo=False, input_names=inputs_names,
                          output_names=output_names, dynamic_axes=axes, opset_version=17)


def _rename_values(model: onnx.ModelProto, inputs: list[str], outputs: list[str]) -> None:
    graph = model.graph
    rename = {v.name: n for v, n in zip([*graph.input, *graph.output], [*inputs, *outputs])}
    for value in [*graph.input, *graph.output]:
        value.name = rename[value.name]
    for node in graph.node:
        node.input[:] = [rename.get(n, n) for n in node.input]
        node.output[:] = [rename.get(n, n) for n in node.output]


def _rename_dim(text: str, rename: dict[str, str]) -> str:
    return re.sub(r"\bs\d+\b", lambda m: rename.get(m[0], m[0]), text)
