"""`convert(model, config)`: the user's model, converted, as a model of its own class.
For an HF causal LM: a deep copy whose backbone runs the rewritten decoder-with-past graph on its
own modules (outline.py, program.py) with zero pseudo-queries under `<backbone>.attnres` (the
function unchanged, checked on a few tokens). The head, loss, `generate()` and PEFT wrappers are
HF's own code on top.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..core import verify
from ..core.chain_analysis import analyze
from ..core.checks import as_config, has_work, split_inputs
from ..core.errors import InputError, TraceError, VerificationError
from ..fx.decoder import _cache_param, _takes_positions, probe
from ..fx.rewrite import RewriteSites
from ..fx.trace import trace
from ..fx.view import view_from_fx
from ..kernels import prebuild
from ..ops.depth_attention import kernels_expected
from . import classes
from . import outline as outlining
from . import program as prog
from . import trace as tracing
from .checkpoint import attach
from .replicate import layers_path
from .runtime import Module
from .state import Geometry, ModuleState, Program, State, dtype_name, holder, parameter_dtype

CHECK_TOKENS = (2, 12)  # the exactness check's batch and sequence length


def is_causal_lm(model: Any) -> bool:
    return (isinstance(model, nn.Module) and callable(getattr(model, "get_decoder", None))
            and callable(getattr(model, "generate", None)) and hasattr(model, "config"))


def convert(model: nn.Module, config=None, example_inputs: Any = None) -> nn.Module:
    """`model` converted to AttnRes (a deep copy; `model` is left as it was).

    `config`: an AttnResConfig (default Full, preserve scale). `example_inputs`: a dict with
    `input_ids` for the exactness check (default: random tokens)."""
    config = as_config(config)
    if isinstance(model, classes.Converted):
        raise InputError(f"{type(model).__name__} is converted already")
    if not is_causal_lm(model):
        return _convert_module(model, config, example_inputs)
    device = next(model.parameters()).device
    kernels = kernels_expected()  # TVM's runtime loads on the check's first call, while its kernels build
    workers = _early_workers(model.get_decoder()) if kernels and device.type == "cpu" else []
    try:
        state, gm = _state(model.get_decoder(), config, example_inputs)
        if kernels:  # built meanwhile
            workers = prebuild.start(prebuild.forward_specs(gm, device), workers)
        lm = copy.deepcopy(model)
        attach(lm, state, queries=True)
        _check(model, lm, config, example_inputs)
    finally:
        prebuild.stop(workers)
    return lm


def _early_workers(backbone: nn.Module) -> list:
    """Kernel builders that import TVM while `backbone` is traced (kernels/prebuild.early)."""
    from ..kernels import fused

    path, size = layers_path(backbone), getattr(backbone.config, "hidden_size", None)
    dtype = fused._DTYPES.get(parameter_dtype(backbone))
    if path is None or not isinstance(size, int) or dtype is None:
        return []
    return prebuild.early(len(backbone.get_submodule(path)), size, dtype)


def _ids(model_config, example_inputs) -> torch.Tensor:
    ids = example_inputs.get("input_ids") if isinstance(example_inputs, dict) else None
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        return ids
    vocab = int(getattr(model_config, "vocab_size", 0) or 2)
    return torch.randint(0, vocab, CHECK_TOKENS, generator=torch.Generator().manual_seed(0))


def _state(backbone: nn.Module, config, example_inputs) -> tuple[State, Any]:
    device = next(backbone.parameters()).device
    ids = _ids(backbone.config, example_inputs).to(device)
    was = backbone.training
    backbone.train(False)
    try:
        geometry, _ = probe(backbone, ids[:1, :2])
        with torch.no_grad():
            output = type(backbone(input_ids=ids[:1, :2], use_cache=False)).__name__
    finally:
        backbone.train(was)
    import transformers.modeling_outputs as outputs

    if not hasattr(outputs, output):
        raise InputError(f"{type(backbone).__name__} returns a {output}, not a transformers output class")
    state = State(config=config.to_dict() if hasattr(config, "to_dict") else dict(vars(config)), sites=[],
                  geometry=Geometry(geometry.layers, list(geometry.heads), list(geometry.head_dims)),
                  output=output, cache_param=_cache_param(backbone), layers=layers_path(backbone))
    dtype = parameter_dtype(backbone)
    data, sites, gm = tracing.rewrite(backbone, state, config, dtype, device, int(backbone.config.vocab_size),
                                      _takes_positions(backbone))
    state.sites = sites
    state.programs[dtype_name(dtype)] = Program(data)
    return state, gm


def _check(original: nn.Module, converted: nn.Module, config, example_inputs) -> None:
    """Original against converted logits on a few tokens (verify.compare, preserve tolerance), both in
    eval mode."""
    tol = verify.tolerance(config.scale, False)
    if tol is None or config.scale != "preserve":
        return
    ids = _ids(original.config, example_inputs).to(next(original.parameters()).device)
    modes = [(m, m.training) for m in (original, converted)]
    try:
        for m, _ in modes:
            m.train(False)
        with torch.no_grad():
            want = original(input_ids=ids, use_cache=False).logits
            got = converted(input_ids=ids, use_cache=False).logits
    finally:
        for m, mode in modes:
            m.train(mode)
    rows = verify.compare(want, got, tol)
    if not all(row.get("ok") for row in rows):
        raise VerificationError(f"the converted {type(original).__name__} differs from the original: "
                                f"{verify.describe(rows[0])}; report this with the model")


def layers_anywhere(module: nn.Module) -> str | None:
    """The longest ModuleList in `module`'s tree (its blocks), by path; None without one."""
    lists = [(len(m), -name.count("."), name) for name, m in module.named_modules()
             if isinstance(m, nn.ModuleList) and len(m)]
    return max(lists)[2] if lists else None


def _convert_module(model: nn.Module, config, example_inputs) -> nn.Module:
    """Any other nn.Module: traced on `example_inputs` (batch and sequence dims dynamic), rewritten,
    outlined onto a deep copy of itself, checked on the example; it keeps its dtype (a cast model
    is converted again: only a Hugging Face model can be traced from its config)."""
    if not isinstance(model, nn.Module) or example_inputs is None:
        raise InputError(f"convert takes a Hugging Face causal LM, or an nn.Module with example_inputs; got "
                         f"{type(model).__name__}{'' if example_inputs is not None else ' without example_inputs'}")
    converted = copy.deepcopy(model)
    traced = trace(converted, example_inputs)
    gm = traced.graph_module
    plan = analyze(view_from_fx(gm), config)
    if not has_work(plan, config):
        raise TraceError(f"{type(model).__name__} holds depth-attention sites already: convert the original model")
    sites_pass = RewriteSites(plan, config)
    sites_pass(gm)
    rewritten = sites_pass.sites
    layers = layers_anywhere(converted)
    graph, blocks, _ = outlining.outline(gm.graph, converted, "", layers)
    sizes = {n: p.shape[0] for n, p in gm.named_parameters() if n.startswith("attnres.")}
    sites = [[s.param.split(".")[1], s.site, sizes[s.param]] for s in rewritten]
    dtype = parameter_dtype(converted)
    data = prog.to_data(graph, blocks, {"dtype": dtype_name(dtype), "device": str(next(converted.parameters()).device),
                                        "layers": layers})
    spec = getattr(gm.graph._codegen, "pytree_info", None)
    if spec is None:
        raise InputError(f"{type(model).__name__} was traced with torch.fx.symbolic_trace: convert needs torch.export")
    classes.swap(converted, Module)
    if layers and blocks:
        for layer in converted.get_submodule(layers):
            classes.swap(layer, classes.Layer)
    converted.attnres = holder(sites, config.to_dict(), next(converted.parameters()).device)
    converted.__dict__["_attnres_state"] = ModuleState(config.to_dict(), sites, Program(data), spec.in_spec,
                                                       spec.out_spec, dtype_name(dtype))
    args, kwargs = split_inputs(example_inputs)
    modes = [(m, m.training) for m in (model, converted)]
    try:
        for m, _ in modes:
            m.train(False)
        with torch.no_grad():
            want = model(*verify.fresh(args), **verify.fresh(kwargs))
            got = converted(*verify.fresh(args), **verify.fresh(kwargs))
    finally:
        for m, mode in modes:
            m.train(mode)
    tol = verify.tolerance(config.scale, any(c.changes_function for c in plan.to_rewrite))
    rows = verify.compare(want, got, tol) if tol is not None and config.scale == "preserve" else []
    if not all(row.get("ok") for row in rows):
        raise VerificationError(f"the converted {type(model).__name__} differs from the original: "
                                f"{verify.describe(rows[0])}; report this with the model")
    return converted
