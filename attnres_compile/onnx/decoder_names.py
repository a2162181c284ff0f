"""Name an exported decoder-with-past ONNX graph as optimum does (`past_key_values.0.key`,
`present.0.key`, `batch_size`, `sequence_length`, `past_sequence_length`), which onnxruntime-genai
and our verification expect, instead of torch.onnx's placeholder and symbol names.
"""

from __future__ import annotations

import re

import onnx

from ..fx.decoder import DIMS
from . import io as onnx_io


def name(model: onnx.ModelProto, input_names: list[str], output_names: list[str]) -> None:
    """Rename `model`'s graph inputs and outputs in order, and its symbolic dims by role, in place."""
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if len(inputs) != len(input_names) or len(graph.output) != len(output_names):
        raise ValueError(f"{len(inputs)} inputs and {len(graph.output)} outputs, expected {len(input_names)} and "
                         f"{len(output_names)}")
    renames = {v.name: new for v, new in zip([*inputs, *graph.output], [*input_names, *output_names])}
    symbols = _symbols(inputs)
    for node in _nodes(graph):
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]
    for value in [*inputs, *graph.output, *graph.value_info]:
        value.name = renames.get(value.name, value.name)
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.dim_param = _rename_expression(dim.dim_param, symbols)
    for value in graph.output:  # present.*: [batch, heads, past + seq, head_dim]; logits: [batch, seq, vocab]
        dims = value.type.tensor_type.shape.dim
        if value.name.startswith("present.") and len(dims) == 4 and dims[2].HasField("dim_param"):
            dims[2].dim_param = DIMS["total"]


def _symbols(inputs) -> dict[str, str]:
    """torch's symbol -> optimum's dim name, read off the inputs whose role fixes it."""
    roles = {("input_ids", 0): "batch", ("input_ids", 1): "seq", ("attention_mask", 0): "batch",
             ("attention_mask", 1): "total", ("position_ids", 0): "batch", ("position_ids", 1): "seq"}
    order = ["input_ids", "attention_mask", "position_ids"]
    symbols = {}
    for index, value in enumerate(inputs):
        dims = value.type.tensor_type.shape.dim
        for axis, dim in enumerate(dims):
            role = roles.get((order[index], axis)) if index < len(order) else ("past" if axis == 2 else
                                                                                 "batch" if axis == 0 else None)
            if role and dim.HasField("dim_param") and re.fullmatch(r"\w+", dim.dim_param):
                symbols.setdefault(dim.dim_param, DIMS[role])
    return symbols


def _rename_expression(text: str, symbols: dict[str, str]) -> str:
    renamed = re.sub(r"\b\w+\b", lambda m: symbols.get(m.group(0), m.group(0)), text)
    terms = sorted(t.strip() for t in renamed.split("+"))
    return DIMS["total"] if terms == sorted([DIMS["past"], DIMS["seq"]]) else renamed


def _nodes(graph: onnx.GraphProto):
    """Every node of `graph` and of its subgraphs (If/Loop bodies read outer names too)."""
    stack = [graph]
    while stack:
        graph = stack.pop()
        yield from graph.node
        stack.extend(onnx_io.subgraphs(graph.node))
