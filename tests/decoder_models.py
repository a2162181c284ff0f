"""A tiny HF Llama with the decoder-with-past signature, its AttnRes rewrite as .onnx and .pt2.

Inputs `input_ids`, `attention_mask`, `position_ids` and per layer `past_key_values.{i}.key` /
`.value`; outputs `logits` and `present.{i}.key` / `.value` (optimum's names). Batch, sequence
and past length are dynamic; past length 0 is a prefill.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch

import attnres_compile as ac

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 2, 16, 100


class FlatDecoder(torch.nn.Module):
    """`model(input_ids, attention_mask, position_ids, *pasts)` -> (logits, *presents), flat."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(len(past) // 2):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        layers = out.past_key_values.layers
        return (out.logits, *[t for layer in layers for t in (layer.keys, layer.values)])


def decoder():
    """The eval-mode flat decoder and example inputs (batch 2, seq 5, past 7)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=2, num_key_value_heads=KV_HEADS)
    return FlatDecoder(LlamaForCausalLM(config).eval()).eval(), inputs(2, 5, 7)


def inputs(batch: int, seq: int, past: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random ids, a full mask, positions past..past+seq-1 and random pasts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    pasts = [torch.randn(batch, KV_HEADS, past, HEAD_DIM, generator=g) for _ in range(2 * LAYERS)]
    return (ids, mask, pos, *pasts)


def input_names() -> list[str]:
    return ["input_ids", "attention_mask", "position_ids",
            *[f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]]


def output_names() -> list[str]:
    return ["logits", *[f"present.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]]


def dynamic_shapes(flat: bool = False):
    """Batch, sequence and past length dynamic (one symbol each, as optimum names them; the mask's
    length, their sum, its own); `flat` for the rewritten GraphModule's flat inputs."""
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence_length")
    past = torch.export.Dim("past_sequence_length", min=0)
    pasts = tuple({0: batch, 2: past} for _ in range(2 * LAYERS))
    tokens = {0: batch, 1: seq}
    return (tokens, {0: batch, 1: torch.export.Dim.DYNAMIC}, tokens) + (pasts if flat else (pasts,))


def rewritten() -> tuple[torch.nn.Module, tuple]:
    """The Block (N=2) rewrite of the decoder, verified, and its example inputs."""
    model, args = decoder()
    result = ac.rewrite(model, args, ac.AttnResConfig(variant="block", num_blocks=2), dynamic_shapes=dynamic_shapes())
    return result.graph_module, args


def write_pt2(path: Path) -> Path:
    from attnres_compile import pt2

    gm, args = rewritten()
    program = torch.export.export(gm, args, dynamic_shapes=dynamic_shapes(flat=True), strict=False)
    pt2.save(program, path)
    return path


def write_onnx(path: Path) -> Path:
    """The rewrite exported to ONNX, inputs and outputs named as optimum names them."""
    from attnres_compile.passes.onnx_export import export

    gm, args = rewritten()
    model = export(gm, args, None, dynamic_shapes(flat=True))
    _rename(model.graph, [i.name for i in model.graph.input], input_names())
    _rename(model.graph, [o.name for o in model.graph.output], output_names())
    onnx.save(model, str(path))
    return path


def _rename(graph: onnx.GraphProto, old: list[str], new: list[str]) -> None:
    mapping = dict(zip(old, new))
    for value in [*graph.input, *graph.output, *graph.value_info]:
        value.name = mapping.get(value.name, value.name)
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
