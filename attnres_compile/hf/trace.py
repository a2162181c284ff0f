"""Trace an HF backbone with a KV cache, rewrite it, and keep the result as program data (program.py).
What is traced is `WithPast(backbone)`, decoder.py's decoder-with-past without the head, with
dynamic batch, sequence and past: past 0 is a training forward or prefill, so one graph serves
`Trainer` and `generate()`. A backbone whose layers are alike is traced as three layers and the
graph grown to its depth (replicate.py): the trace's cost no longer grows with the depth.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.chain_analysis import analyze
from ..core.checks import has_work
from ..core.config import AttnResConfig
from ..core.errors import TraceError
from ..fx.decoder import INPUTS, fresh_cache, positions
from ..fx.rewrite import RewriteSites
from ..fx.trace import trace
from ..fx.view import view_from_fx
from ..utils import progress
from . import outline as outlining
from . import program as prog
from . import replicate
from .classes import base_class
from .state import Geometry, State, dtype_name

PAST, SEQ, BATCH = 7, 5, 2  # example sizes: none is 0 or 1, which torch.export would specialise


class WithPast(nn.Module):
    """`backbone` (an HF decoder: LlamaModel, GPT2Model, ...) as a flat function of tensors."""

    def __init__(self, backbone: nn.Module, cache_param: str, takes_positions: bool = True):
        super().__init__()
        self.model = backbone
        self._cache = cache_param
        self._positions = takes_positions

    @property
    def wraps(self) -> nn.Module:
        """The backbone (hf_experts switches its MoE experts to traceable ops while tracing)."""
        return self.model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        extra = {"position_ids": position_ids} if self._positions else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                         **{self._cache: fresh_cache(past)}, **extra)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return (out.last_hidden_state, *(getattr(layer, kv + "s") for layer in cache.layers for kv in ("key", "value")))


def example(geometry: Geometry, vocab: int, dtype: torch.dtype, device) -> tuple[tuple, tuple]:
    """(example args, dynamic_shapes) of WithPast: a past of zeros, random tokens, all ones mask."""
    ids = torch.randint(0, max(vocab, 2), (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones(BATCH, PAST + SEQ, dtype=torch.long, device=device)
    past = [torch.zeros(BATCH, geometry.heads[i], PAST, geometry.head_dims[i], dtype=dtype, device=device)
            for i in range(geometry.layers) for _ in range(2)]
    dyn = torch.export.Dim.DYNAMIC
    spec = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, {0: dyn, 1: dyn}, tuple({0: dyn, 2: dyn} for _ in past))
    return (ids, mask, positions(mask, SEQ).contiguous(), *past), spec


def rewrite(backbone: nn.Module, state: State, config: AttnResConfig, dtype: torch.dtype, device, vocab: int,
            takes_positions: bool = True):
    """(program data, sites, the rewritten GraphModule) of `backbone` (an unconverted module of the
    backbone's class, whose weights the graph never reads) traced in `dtype`."""
    traced, device = _trace(backbone, state, dtype, device, vocab, takes_positions)
    if traced.source != "torch.export":  # symbolic_trace's method calls have no data form (program.py)
        raise TraceError(f"{type(backbone).__name__} with its KV cache: {traced.notes[-1]}; convert needs torch.export "
                         "to trace it: report this with the model")
    gm = traced.graph_module
    plan = analyze(view_from_fx(gm), config)
    if not has_work(plan, config):  # it raises where there is no chain; False: rewritten already
        raise TraceError(f"{type(backbone).__name__} holds depth-attention sites already: convert the original model")
    sites_pass = RewriteSites(plan, config)
    sites_pass(gm)
    rewritten = sites_pass.sites
    sizes = {name: tuple(p.shape) for name, p in gm.named_parameters() if name.startswith("attnres.")}
    sites = [[s.param.split(".")[1], s.site, sizes[s.param][0]] for s in rewritten]
    graph, blocks, leaves = outlining.outline(gm.graph, backbone, "model", state.layers)
    attrs = {n.target: list(_attr_shape(backbone, sizes, n.target)) for n in graph.find_nodes(op="get_attr")}
    modules = {n.target: type(backbone.get_submodule(n.target)).__name__ for n in graph.find_nodes(op="call_module")}
    extra = {"dtype": dtype_name(dtype), "device": str(torch.device(device)), "layers": state.layers,
             "leaves": leaves, "attrs": attrs, "modules": modules}
    return prog.to_data(graph, blocks, extra), sites, gm


def _trace(backbone: nn.Module, state: State, dtype: torch.dtype, device, vocab: int, takes_positions: bool):
    """(the WithPast trace, the device it was traced on): of a meta-device `SHALLOW`-layer copy,
    grown to the backbone's depth, where replicate.py finds the layers alike; else of the backbone."""
    layers = backbone.get_submodule(state.layers) if state.layers else None
    geometry = state.geometry
    if (layers is not None and len(layers) > replicate.SHALLOW and len(set(geometry.heads)) == 1
            and len(set(geometry.head_dims)) == 1
            and getattr(backbone.config, "num_hidden_layers", None) == len(layers)):
        traced = _shallow(backbone, layers, state, dtype, vocab, takes_positions)
        if traced is not None and replicate.deepen(traced.graph_module, f"model.{state.layers}.", len(layers),
                                                   len(INPUTS), 1):  # WithPast's shared inputs; its hidden state
            return traced, "meta"
    args, spec = example(geometry, vocab, dtype, device)
    return trace(WithPast(backbone, state.cache_param, takes_positions), args, spec), device


def _shallow(backbone: nn.Module, layers: nn.ModuleList, state: State, dtype: torch.dtype, vocab: int,
             takes_positions: bool):
    """The WithPast trace of a meta-device SHALLOW-layer instance of the backbone's class, or None where
    its layers are not like the backbone's `layers` or it cannot be built or traced (the caller traces whole)."""
    try:
        with torch.device("meta"):  # no weights allocated: the trace reads shapes and dtypes only
            shallow = base_class(backbone)(replicate.shallow_config(backbone.config)).to(dtype).train(False)
        short_layers = shallow.get_submodule(state.layers)
        if len(short_layers) != replicate.SHALLOW or not replicate.same_layers(layers,
                                                                               short_layers[replicate.TEMPLATE]):
            return None
        short = Geometry(replicate.SHALLOW, state.geometry.heads[:replicate.SHALLOW],
                         state.geometry.head_dims[:replicate.SHALLOW])
        args, spec = example(short, vocab, dtype, "meta")
        return trace(WithPast(shallow, state.cache_param, takes_positions), args, spec)
    except Exception:  # noqa: BLE001 - a class built from more than its config, a trace that needs real weights:
        return None    # the whole model is traced, as without the shortcut


def _attr_shape(backbone: nn.Module, sizes: dict, target: str) -> tuple:
    if target in sizes:
        return sizes[target]
    owner, _, name = target.rpartition(".")
    return tuple(getattr(backbone.get_submodule(owner) if owner else backbone, name).shape)


def retrace(backbone: nn.Module, state: State, dtype: torch.dtype) -> dict:
    """Program data for a converted `backbone` in a dtype it has no program for: a fresh meta-device
    instance of its class in `dtype`, traced and rewritten with the same settings (the same sites)."""
    config = getattr(backbone, "config", None)
    name = base_class(backbone).__name__
    with progress.stage(f"tracing the converted {name} for {dtype_name(dtype)} (once per dtype)"):
        with torch.device("meta"):  # no weights allocated: the trace reads shapes and dtypes only
            fresh = base_class(backbone)(config).to(dtype).train(False)
        data, sites, _ = rewrite(fresh, state, AttnResConfig(**state.config), dtype, "meta",
                                 int(getattr(config, "vocab_size", 2)))
    if sites != state.sites:
        raise TraceError(f"traced in {dtype_name(dtype)}, {name} has {len(sites)} sites where "
                         f"the conversion has {len(state.sites)}: convert the model in {dtype_name(dtype)} instead")
    return data
