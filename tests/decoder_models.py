"""A tiny HF Llama's decoder with past (decoder.py's signature), rewritten (Block N=2), as .onnx and .pt2.

Batch, sequence and past length are dynamic; a past of length 0 is a prefill. The ONNX file
takes and returns optimum's names; the .pt2 keeps the rewritten module's placeholder names
(`past_0`...), so its runs are fed by position (`by_position`). The wrapper fills a plain
DynamicCache with `update`: the program of `decoder.DecoderWithPast` (its cache aliases the
past) exports to neither format yet ("'NoneType' object has no attribute 'size'" in torch.onnx,
"a guard reading ._base" in the .pt2 check).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

import attnres_compile as ac
from attnres_compile import decoder

VOCAB, LAYERS, KV_HEADS, HEAD_DIM = 100, 2, 2, 16
NAMES = decoder.Geometry(LAYERS, (KV_HEADS,) * LAYERS, (HEAD_DIM,) * LAYERS, torch.float32)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=2, num_key_value_heads=KV_HEADS)
    return LlamaForCausalLM(config).eval()


class FlatDecoder(torch.nn.Module):
    """`model(input_ids, attention_mask, position_ids, *past)` -> {logits, present.{i}.key|value}."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(0, len(past), 2):
            cache.update(past[i], past[i + 1], i // 2)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        layers = out.past_key_values.layers
        return {"logits": out.logits, **{decoder.PRESENT.format(i, kv): getattr(layer, kv + "s")
                                         for i, layer in enumerate(layers) for kv in ("key", "value")}}


def rewritten() -> tuple[torch.fx.GraphModule, tuple]:
    """The verified Block (N=2) rewrite of the decoder with past (batch 2, sequence 5, past 7), and its inputs."""
    model = FlatDecoder(llama()).eval()
    args = tuple(torch.from_numpy(a) for a in feeds(2, 5, 7).values())
    any_ = torch.export.Dim.DYNAMIC
    spec = ({0: any_, 1: any_},) * 3 + (tuple({0: any_, 2: any_} for _ in range(2 * LAYERS)),)
    result = ac.rewrite(model, args, ac.AttnResConfig(variant="block", num_blocks=2), dynamic_shapes=spec)
    return result.graph_module, args


def dynamic_shapes():
    """One symbol for the batch and one for the past length; the sequence and the mask's length (their
    sum) each their own (the rewritten module guards the sequence against one value, 12, which a
    named Dim refuses)."""
    batch, past, any_ = torch.export.Dim("batch"), torch.export.Dim("past_sequence_length", min=0), torch.export.Dim.DYNAMIC
    tokens = {0: batch, 1: any_}
    return (tokens, tokens, tokens, *({0: batch, 2: past} for _ in range(2 * LAYERS)))


def write_pt2(path: Path) -> Path:
    from attnres_compile import pt2

    gm, args = rewritten()
    pt2.save(torch.export.export(gm, args, dynamic_shapes=dynamic_shapes(), strict=False), path)
    return path


def write_onnx(path: Path) -> Path:
    """The rewrite exported to ONNX, its inputs renamed as optimum names them (outputs already are)."""
    from attnres_compile.passes.onnx_export import export

    gm, args = rewritten()
    model = export(gm, args, None, dynamic_shapes())
    renamed = dict(zip([i.name for i in model.graph.input], NAMES.input_names()))
    for value in model.graph.input:
        value.name = renamed[value.name]
    for node in model.graph.node:
        node.input[:] = [renamed.get(n, n) for n in node.input]
    onnx.save(model, str(path))
    return path


def feeds(batch: int, seq: int, past: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random ids and pasts, a full mask, positions past..past+seq-1, by decoder.py's names."""
    rng = np.random.default_rng(seed)
    values = [rng.integers(0, VOCAB, (batch, seq)), np.ones((batch, past + seq), np.int64),
              np.broadcast_to(np.arange(past, past + seq), (batch, seq)).copy(),
              *(rng.standard_normal((batch, KV_HEADS, past, HEAD_DIM), dtype=np.float32) for _ in range(2 * LAYERS))]
    return dict(zip(NAMES.input_names(), values))


def empty_past(batch: int = 1) -> dict[str, np.ndarray]:
    return {name: t.numpy() for name, t in zip(NAMES.input_names()[3:], NAMES.empty_past(batch))}


def by_position(run, input_names: list[str], output_names: list[str]):
    """A step over decoder.py's names for a callable whose inputs and outputs are in that order under other names."""
    def step(named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = run({theirs: named[ours] for theirs, ours in zip(input_names, NAMES.input_names())})
        return dict(zip(NAMES.output_names(), out.values()))
    return step
