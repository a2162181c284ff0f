"""Decoder-with-past: an HF causal LM as one flat function, the form every runtime can serve.

    (input_ids, attention_mask, position_ids, past_key_values.0.key, ...) -> {logits, present.0.key, ...}

AttnRes mixes over depth per token, so the KV cache is unchanged and the depth history is
rebuilt each forward from the current tokens. Every route (torch, ONNX, TVM) runs this one
signature, named as optimum's decoder-with-past files.
"""

from __future__ import annotations

import inspect as pyinspect
import json
from dataclasses import dataclass

import torch
from torch import nn

from ..core.errors import InputError, first_line

INPUTS = ("input_ids", "attention_mask", "position_ids")
PAST, PRESENT = "past_key_values.{}.{}", "present.{}.{}"
DIMS = {"batch": "batch_size", "seq": "sequence_length", "past": "past_sequence_length",
        "total": "past_sequence_length + sequence_length"}
GENERATION = "attnres.generation"  # ONNX metadata / .pt2 extra / TVM manifest key: generation_ids' result


@dataclass(frozen=True)
class Geometry:
    """What a cache layer holds: [batch, heads, length, head_dim] keys and values, per layer."""

    layers: int
    heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    dtype: torch.dtype

    def input_names(self) -> list[str]:
        return [*INPUTS, *(PAST.format(i, kv) for i in range(self.layers) for kv in ("key", "value"))]

    def output_names(self) -> list[str]:
        return ["logits", *(PRESENT.format(i, kv) for i in range(self.layers) for kv in ("key", "value"))]

    def empty_past(self, batch: int, device=None) -> list[torch.Tensor]:
        """The past of a prefill: every layer's keys and values with length 0."""
        return [torch.zeros(batch, self.heads[i], 0, self.head_dims[i], dtype=self.dtype, device=device)
                for i in range(self.layers) for _ in range(2)]


def flat_input_names(inputs: list[str], outputs: list[str]) -> list[str]:
    """`inputs` with a decoder-with-past program's pasts named as the ONNX route names them: traced, the
    wrapper's `*past` becomes placeholders `past_0`, `past_1`, ...; the program is recognised by its
    names (`input_ids`, `attention_mask`, `position_ids`, then one past per `present.*` output)."""
    layers = (len(outputs) - 1) // 2
    names = Geometry(layers, (0,) * layers, (0,) * layers, torch.float32)
    if list(outputs) == names.output_names() and list(inputs[:3]) == list(INPUTS) and len(inputs) == 3 + 2 * layers:
        return names.input_names()
    return list(inputs)


def generation_ids(model: nn.Module) -> dict:
    """{"eos_token_id": [ids], "pad_token_id": id or None}: what HF generate() stops a row at and pads
    finished rows with, from the model's generation_config (its config where it has none)."""
    source = getattr(model, "generation_config", None) or getattr(model, "config", None)
    return token_ids(vars(source) if source is not None else {}) or {"eos_token_id": [], "pad_token_id": None}


def token_ids(data) -> dict | None:
    """`data`'s eos_token_id (an id or a list of ids) and pad_token_id, as generation_ids gives them;
    `data` is a dict or its JSON text (ONNX metadata). None where it names neither or holds something
    else (a file's word is checked, not trusted)."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except (ValueError, RecursionError):
            return None
    if not isinstance(data, dict) or not ({"eos_token_id", "pad_token_id"} & set(data)):
        return None
    eos, pad = data.get("eos_token_id"), data.get("pad_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    ok = isinstance(eos, list) and all(type(i) is int and i >= 0 for i in eos)
    if not ok or not (pad is None or type(pad) is int and pad >= 0):
        return None
    return {"eos_token_id": eos, "pad_token_id": pad}


def _cache_param(model: nn.Module) -> str:
    """The forward's name for the cache: `cache` (transformers >= 5.2x) or `past_key_values`."""
    params = pyinspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise InputError(f"{type(model).__name__}.forward takes no cache (`cache` or `past_key_values`): with_past=True "
                     "needs a Hugging Face causal LM with a KV cache")


def _takes_positions(model: nn.Module) -> bool:
    return "position_ids" in pyinspect.signature(model.forward).parameters


def _layers_of(cache) -> list:
    """The per-layer key/value holders of a transformers DynamicCache; refuses any other cache."""
    from transformers import DynamicCache

    layers = getattr(cache, "layers", None)
    if not isinstance(cache, DynamicCache) or not layers or not all(
            isinstance(getattr(layer, "keys", None), torch.Tensor) and getattr(layer, "keys").dim() == 4
            and isinstance(getattr(layer, "values", None), torch.Tensor) for layer in layers):
        raise InputError(f"the model's cache is a {type(cache).__name__} that is not one key/value pair per layer "
                         "(a state-space or hybrid model?): with_past=True supports decoders whose cache is transformers' "
                         "DynamicCache of keys and values (Llama, GPT-2, Mistral, Qwen2, Mixtral, ...)")
    return layers


def probe(model: nn.Module, input_ids: torch.Tensor) -> tuple[Geometry, list[torch.Tensor]]:
    """The cache geometry of `model`, and the flat past (keys, values per layer) of `input_ids`."""
    _cache_param(model)
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True)
    except Exception as exc:  # noqa: BLE001 - the model's own failure, named in one line
        raise InputError(f"{type(model).__name__} does not run with use_cache=True ({first_line(exc)}); with_past=True needs "
                         "a Hugging Face causal LM with a KV cache") from None
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None:
        raise InputError(f"{type(model).__name__} returned no cache with use_cache=True: with_past=True needs a Hugging "
                         "Face causal LM with a KV cache")
    layers = _layers_of(cache)
    keys = [layer.keys for layer in layers]
    geometry = Geometry(len(layers), tuple(k.shape[1] for k in keys), tuple(k.shape[3] for k in keys), keys[0].dtype)
    return geometry, [t for layer in layers for t in (layer.keys, layer.values)]


def fresh_cache(flat: list[torch.Tensor] | tuple[torch.Tensor, ...]):
    """A DynamicCache holding `flat` (keys, values per layer) as they are, without copying them."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i in range(0, len(flat), 2):
        cache.update(flat[i][:, :, :0], flat[i + 1][:, :, :0], i // 2)
        layer = cache.layers[i // 2]
        layer.keys, layer.values = flat[i], flat[i + 1]
    return cache


def positions(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """Position ids of the last `length` tokens, as HF generate derives them (left padding counts from 0)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)[:, -length:]


class DecoderWithPast(nn.Module):
    """`model` (an HF causal LM) as a flat function of tensors: the past in, logits and the present out.
    Each call builds a plain DynamicCache (sliding windows applied by the mask), so past 0 is a prefill.
    """

    def __init__(self, model: nn.Module, geometry: Geometry):
        super().__init__()
        self.model = model
        self.geometry = geometry
        self._cache = _cache_param(model)
        self._positions = _takes_positions(model)

    @property
    def wraps(self) -> nn.Module:
        """The HF model inside (hf_experts switches its MoE experts to traceable ops while tracing)."""
        return self.model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        kwargs = {"position_ids": position_ids} if self._positions else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                         **{self._cache: fresh_cache(past)}, **kwargs)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        present = {PRESENT.format(i, kv): getattr(layer, kv + "s")
                   for i, layer in enumerate(cache.layers) for kv in ("key", "value")}
        return {"logits": out.logits, **present}


def relax_mask_length(gm) -> None:
    """Let the traced decoder take an attention mask of any length from 1, as its other inputs do.
    torch.export gives the mask's length (past + sequence) an enforced derived minimum of 4, which
    refused 1-3 token prompts; the graph computes any length, so it becomes the others' unenforced 2."""
    import sympy
    from torch.utils._sympy.value_ranges import ValueRanges

    ranges = getattr(gm, "range_constraints", None)
    mask = next((n for n in gm.graph.find_nodes(op="placeholder") if n.name == "attention_mask"), None)
    val = mask.meta.get("val") if mask is not None else None
    if not ranges or not isinstance(val, torch.Tensor) or val.dim() != 2 or not isinstance(val.shape[1], torch.SymInt):
        return
    symbol = val.shape[1].node.expr
    if isinstance(symbol, sympy.Symbol) and symbol in ranges and ranges[symbol].lower > 2:
        ranges[symbol] = ValueRanges(2, ranges[symbol].upper)


def wrap(model: nn.Module, example_inputs=None, past_length: int = 7, seq_length: int = 5):
    """(DecoderWithPast(model), example args, dynamic_shapes) for tracing `model` with a KV cache.
    The example past is the model's own cache of a real prefix: batch 2, past 7, 5 new tokens (none
    0 or 1, which torch.export would specialise).
    """
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    ids = example_inputs.get("input_ids") if isinstance(example_inputs, dict) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < past_length + seq_length:
        if vocab < 2:
            raise InputError(f"{type(model).__name__} has no config.vocab_size and the example inputs hold no input_ids "
                             f"of {past_length + seq_length}+ tokens: with_past=True needs a Hugging Face causal LM")
        ids = torch.randint(0, vocab, (2, past_length + seq_length), generator=torch.Generator().manual_seed(0))
    ids = ids[:2, :past_length + seq_length]
    if ids.shape[0] < 2:
        ids = ids.repeat(2, 1)
    geometry, past = probe(model, ids[:, :past_length])
    mask = torch.ones_like(ids)
    # contiguous: a slice's stride (the prompt's length) becomes a stride symbol of the exported program
    # that no range covers, and torch's decompositions (TVM's importer runs them) fail on it
    args = tuple(t.contiguous() for t in (ids[:, past_length:], mask, positions(mask, seq_length), *past))
    dyn = torch.export.Dim.DYNAMIC
    spec = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, {0: dyn, 1: dyn}, tuple({0: dyn, 2: dyn} for _ in past))
    wrapper = DecoderWithPast(model, geometry)
    wrapper.training = model.training  # the wrapper's own flag only: the model's mode is the user's
    return wrapper, args, spec
