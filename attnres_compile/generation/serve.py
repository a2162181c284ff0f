"""Serve a rewritten decoder-with-past to HF `generate()`, and as a step for generate_loop.

`causal_lm(model, graph_module)` returns an instance of the model's own class whose forward runs
the rewritten graph, so HF's generate() machinery works as on the original. Its weights are the
graph's own tensors (assigned, not copied), so fine-tuning the graph changes what it generates.
Steps run on fx/lean.py's copy of the graph where the inputs fit it.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import torch
from torch import fx, nn

from ..core.errors import InputError
from ..fx import decoder
from ..fx import lean as fx_lean


def causal_lm(model: nn.Module, graph_module: fx.GraphModule) -> nn.Module:
    """An HF causal LM of `model`'s class that generates with `graph_module` (a `rewrite(..., with_past=True)`)."""
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        raise InputError(f"{type(model).__name__} is not a Hugging Face generation model (no generate()/config)")
    geometry = _geometry(model)
    with torch.device("meta"):
        shell = type(model)(model.config)
    state = {k[len("model."):]: v for k, v in graph_module.state_dict(keep_vars=True).items() if k.startswith("model.")}
    shell.load_state_dict(state, assign=True, strict=False)
    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    for name, tensor in [*shell.named_parameters(remove_duplicate=False), *shell.named_buffers(remove_duplicate=False)]:
        if tensor.is_meta:  # tied or non-persistent (rotary tables): never read, the graph has its own
            _assign(shell, name, own[name])
    shell.generation_config = model.generation_config
    shell.train(graph_module.training)
    shell.attnres_graph = graph_module  # a submodule: .to(), .train() and parameters() reach it
    shell.forward = types.MethodType(_make_forward(geometry), shell)
    return shell


def _geometry(model: nn.Module) -> decoder.Geometry:
    return decoder.probe(model, torch.zeros(1, 2, dtype=torch.long))[0]  # token 0: in every vocabulary


def _assign(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    if leaf in target._parameters:
        target._parameters[leaf] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)
    else:
        target._buffers[leaf] = tensor


def _make_forward(geometry: decoder.Geometry):
    presents = geometry.output_names()[1:]

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        """The rewritten decoder on HF's arguments: the cache's keys/values in, a new cache out."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if inputs_embeds is not None or input_ids is None:
            raise InputError("the rewritten decoder takes input_ids, not inputs_embeds")
        cache = kwargs.pop("past_key_values", cache)
        batch, length = input_ids.shape
        past_length = cache.get_seq_length() if cache is not None else 0
        if past_length:
            past = [t for layer in decoder._layers_of(cache) for t in (layer.keys, layer.values)]
        else:
            past = geometry.empty_past(batch, input_ids.device)
        if attention_mask is None:
            attention_mask = torch.ones(batch, past_length + length, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = decoder.positions(attention_mask, length)
        args = (input_ids, attention_mask, position_ids, *past)
        prefill = length > 1 and isinstance(logits_to_keep, int) and logits_to_keep == 1  # generate()'s first call
        out = fx_lean.call(_lean_of(self, prefill), self.attnres_graph, args)
        logits = out["logits"]
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        present = [out[name] for name in presents]
        return CausalLMOutputWithPast(logits=logits, cache=_holding(cache, present) if use_cache is not False else None)

    return forward


def _lean_of(lm: nn.Module, last_position: bool) -> fx_lean.Lean | None:
    """`lm.attnres_graph` as fx/lean.py's copy (same values, less per-call overhead), computing the
    last position's logits only where `last_position` (`_last_position`); rebuilt when the graph
    module is recompiled; None where that does not apply."""
    graph_module = lm.attnres_graph
    cached = lm.__dict__.get("_attnres_lean")
    if cached is None or cached[0] is not graph_module._code:
        cached = lm.__dict__["_attnres_lean"] = (graph_module._code, {})
    if last_position not in cached[1]:
        lean = fx_lean.lean_copy(graph_module, _last_position if last_position else None)
        cached[1][last_position] = lean if lean is not None or not last_position else _lean_of(lm, False)
    return cached[1][last_position]


def _last_position(graph: fx.Graph) -> bool:
    """Edit `graph` (a copy) to apply its LM head to the last position alone, as HF's forward does for
    generate() (logits_to_keep=1). False when `logits` is not one linear of the hidden states."""
    spec = getattr(graph._codegen, "pytree_info", None)
    spec = spec.out_spec if spec is not None else None
    outputs = graph.output_node().args[0]
    if spec is None or "logits" not in (spec.context or ()) or not isinstance(outputs, (tuple, list)):
        return False
    head = outputs[spec.context.index("logits")]
    if (not isinstance(head, fx.Node) or head.target is not torch.ops.aten.linear.default
            or len(head.users) != 1):
        return False
    with graph.inserting_before(head):
        last = graph.call_function(torch.ops.aten.slice.Tensor, (head.args[0], 1, -1, sys.maxsize))
    head.args = (last, *head.args[1:])
    return True


def _holding(cache, present: list[torch.Tensor]):
    """A DynamicCache holding `present`: `cache` itself updated in place when it is a plain DynamicCache
    of filled layers (as HF's forward grows it), else a new one."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = cache.layers if type(cache) is DynamicCache else ()
    if 2 * len(layers) != len(present) or not all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers):
        return decoder.fresh_cache(present)
    for i, layer in enumerate(layers):
        layer.keys, layer.values = present[2 * i], present[2 * i + 1]
    return cache


def torch_step(graph_module: fx.GraphModule, names: list[str]):
    """A generate_loop step over the rewritten graph module (numpy in, numpy out, no autograd), run
    on its fx/lean.py copy where the inputs fit it."""
    lean = fx_lean.lean_copy(graph_module)

    def step(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names)
        with torch.no_grad():
            out = fx_lean.call(lean, graph_module, args)
        return {k: v.numpy() for k, v in out.items()}

    return step
