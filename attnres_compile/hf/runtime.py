"""The forwards of a converted model: the backbone's (and a plain module's) runs its rewritten graph.
A backbone's forward takes HF's arguments, flattens the cache into the graph's past inputs, runs
the program of its parameter dtype and rebuilds the cache from the presents. A dtype without a
program gets one traced (`trace.retrace`), so a model cast after conversion computes what
converting it in that dtype gives.
"""

from __future__ import annotations

import torch
from torch.fx._pytree import tree_flatten_spec
from torch.utils import _pytree as pytree

from ..core.errors import InputError
from ..fx.decoder import _layers_of
from ..generation.serve import _holding
from .state import Program, State, dtype_name, parameter_dtype
from .trace import retrace

_UNSUPPORTED = ("inputs_embeds", "token_type_ids", "head_mask", "encoder_hidden_states", "cross_attn_head_mask")


class Backbone:
    """The converted backbone's forward: HF's arguments in, its own output class out."""

    @property
    def attnres_state(self) -> State:
        return self.__dict__["_attnres_state"]

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                past_key_values=None, **kwargs):
        """HF's backbone arguments (`input_ids` only, a 2-d mask, a DynamicCache as `cache` or
        `past_key_values`) in; the backbone's output class (last hidden state, the grown cache) out."""
        state = self.attnres_state
        for name in _UNSUPPORTED:
            if kwargs.get(name) is not None:
                raise InputError(f"a converted model takes input_ids, not {name}")
        for name in ("output_attentions", "output_hidden_states"):
            if kwargs.get(name):
                raise InputError(f"a converted model does not return per-layer tensors: drop {name}=True")
        if input_ids is None:
            raise InputError("a converted model needs input_ids")
        cache = cache if cache is not None else past_key_values
        batch, length = input_ids.shape
        device = input_ids.device
        dtype = parameter_dtype(self)
        program = state.programs.get(dtype_name(dtype))
        if program is None:
            program = state.programs[dtype_name(dtype)] = Program(retrace(self, state, dtype))
        compiled = program.compiled(device)
        past_length = cache.get_seq_length() if cache is not None else 0
        if past_length:
            past = [t for layer in _layers_of(cache) for t in (layer.keys, layer.values)]
        else:
            past = state.geometry.empty_past(batch, dtype, device)
        if attention_mask is None:
            attention_mask = torch.ones(batch, past_length + length, dtype=torch.long, device=device)
        elif attention_mask.dim() != 2:
            raise InputError("a converted model takes a 2-d attention_mask [batch, past + sequence]")
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + length, device=device).unsqueeze(0)
        position_ids = position_ids.expand(batch, length)
        out = compiled.top(self, compiled.blocks, input_ids, attention_mask, position_ids, *past)
        if use_cache is None:
            use_cache = getattr(getattr(self, "config", None), "use_cache", True)
        import transformers.modeling_outputs as outputs

        result = getattr(outputs, state.output)
        new_cache = _holding(cache, list(out[1:])) if use_cache else None
        key = "cache" if "cache" in result.__dataclass_fields__ else "past_key_values"
        return result(last_hidden_state=out[0], **{key: new_cache})


class Module:
    """A converted plain nn.Module's forward: called as its example was (the same arguments by
    position and name), returning what the original returned."""

    def forward(self, *args, **kwargs):
        state = self.__dict__["_attnres_state"]
        if dtype_name(parameter_dtype(self)) != state.dtype:
            raise InputError(f"{type(self).__name__} was converted in {state.dtype}: convert it in "
                             f"{dtype_name(parameter_dtype(self))} instead (only Hugging Face models are traced again)")
        try:
            flat = tree_flatten_spec((args, kwargs), state.in_spec)
        except Exception as exc:  # noqa: BLE001 - pytree's own words
            raise InputError(f"call {type(self).__name__} as its example inputs were given ({exc})") from None
        device = next((a.device for a in flat if isinstance(a, torch.Tensor)), torch.device("cpu"))
        compiled = state.program.compiled(device)
        return pytree.tree_unflatten(list(compiled.top(self, compiled.blocks, *flat)), state.out_spec)
