"""Tracing: a private GraphModule of a model (torch.export, falling back to torch.fx), normalised
for the analysis by the passes of `PREPARE`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from ..core import verify
from ..core.checks import split_inputs
from ..core.errors import ConfigError, InputError, TraceError, first_line
from ..utils import pytree_warning
from . import dynamic_dims, hf_experts, input_guards
from .mode import make_mode_switchable
from .site_norm import unfuse_norms
from .two_phase import one_pass
from .view import split_alpha, tensor_meta

# what every traced graph goes through before it is read: torch.export's input checks compiled once,
# `h + k * f` split into a scaling and a plain add, a two-phase or fused module's sites back to one op each
PREPARE = (input_guards.install, split_alpha, one_pass, unfuse_norms)


@dataclass
class Traced:
    graph_module: fx.GraphModule
    source: str
    args: tuple | None
    kwargs: dict
    notes: list[str]

    @property
    def dynamic(self) -> dict[str, list[int]]:
        """{input: symbolic axes} of the traced module ({} when every shape is static)."""
        return dynamic_dims.traced_dims(self.graph_module)


def trace(model: Any, example_inputs: Any = None, dynamic_shapes: Any = None, dynamic: str | None = None) -> Traced:
    """A private GraphModule copy of `model` with shape metadata, and how it was obtained.
    nn.Module: torch.export with `dynamic` dims (or `dynamic_shapes`), retried static with a note,
    else symbolic_trace + ShapeProp. ExportedProgram: its `.module()`. GraphModule: a copy,
    shape-propagated if needed. Then the `PREPARE` passes run.
    """
    traced = _trace(model, example_inputs, dynamic_shapes, dynamic)
    for prepare in PREPARE:
        prepare(traced.graph_module)
    return traced


def _trace(model: Any, example_inputs: Any, dynamic_shapes: Any, dynamic: str | None) -> Traced:
    args, kwargs = split_inputs(example_inputs)
    if isinstance(model, torch.export.ExportedProgram):
        return Traced(make_mode_switchable(pytree_warning.deepcopy(model.module(check_guards=False)), False), "ExportedProgram", args, kwargs, [])
    if isinstance(model, fx.GraphModule):
        gm = make_mode_switchable(pytree_warning.deepcopy(model), model.training)
        _ensure_shapes(gm, args, kwargs)
        return Traced(gm, "GraphModule", args, kwargs, [])
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be an nn.Module, fx.GraphModule or ExportedProgram, got {type(model).__name__}")
    if args is None:
        raise InputError("example_inputs are required to trace an nn.Module: pass a tuple of args or a dict of kwargs")
    notes = [] if not model.training else ["model traced in training mode: dropout is recorded as active; call model.eval() first for an exact rewrite"]
    try:
        model = pytree_warning.deepcopy(model)
    except Exception as exc:  # noqa: BLE001 - a module holding a lock, a generator, an open file...
        raise InputError(f"{type(model).__name__} cannot be copied (copy.deepcopy: {first_line(exc)}); the rewrite "
                         "works on a copy to leave the model passed in unchanged: make it deep-copyable") from None
    dims = dynamic_dims.parse(dynamic)
    what = "dynamic_shapes" if dynamic_shapes is not None else f"dynamic {dims.text}"
    dims_asked = dynamic_shapes is None
    if dims_asked:
        dynamic_shapes = dynamic_dims.export_spec(dims, model, args, kwargs)
        notes += dynamic_dims.size_one_note(dims, model, args, kwargs)
    try:
        with hf_experts.export_friendly(model) as note:
            ep = dynamic_dims.export_program(model, args, kwargs, dynamic_shapes, what, notes)
        notes += [note] if note else []
        gm = ep.module(check_guards=False)
        if dims_asked:
            notes += dynamic_dims.specialised_note(dims, model, args, kwargs, gm)
        return Traced(make_mode_switchable(gm, model.training), "torch.export", args, kwargs, notes)
    except Exception as export_exc:  # noqa: BLE001 - any tracer failure falls back, then is reported
        try:
            gm = fx.symbolic_trace(model)
            _ensure_shapes(gm, args, kwargs)
        except Exception as fx_exc:  # noqa: BLE001
            raise TraceError(
                f"could not trace {type(model).__name__}: torch.export failed ({first_line(export_exc)}); "
                f"torch.fx.symbolic_trace failed ({first_line(fx_exc)}); make the model exportable "
                f"(use_cache=False, explicit attention_mask) or pass an fx.GraphModule{_cache_hint(export_exc)}"
            ) from None
        notes.append(f"torch.export failed ({first_line(export_exc, 160)}); used torch.fx.symbolic_trace")
        return Traced(gm, "symbolic_trace", args, kwargs, notes)


def _cache_hint(exc: BaseException) -> str:
    """A model that returns or takes a KV cache object: how to rewrite it for generation."""
    return "; to generate with a KV cache, rewrite with with_past=True" if "Cache" in str(exc) else ""


def _ensure_shapes(gm: fx.GraphModule, args: tuple | None, kwargs: dict) -> None:
    if all(tensor_meta(n)[0] is not None or ("val" in n.meta and not isinstance(n.meta["val"], torch.Tensor))
           for n in gm.graph.nodes if n.op == "placeholder"):
        return  # every tensor input has a shape (non-tensor inputs such as use_cache=False have none)
    if args is None or kwargs:
        raise InputError("the GraphModule carries no shape metadata: pass example_inputs as a tuple of positional args")
    try:
        with verify.kept():  # a dropout draws from the caller's RNG; the inputs are copies (a run may change them)
            ShapeProp(gm).propagate(*verify.fresh(args))
    except Exception as exc:  # noqa: BLE001
        raise TraceError(f"shape propagation failed on the example inputs ({first_line(exc)})") from None


def decoder_with_past(model: Any, example_inputs: Any, dynamic_shapes: Any, dynamic: str | None):
    """The decoder-with-past wrapper of an HF causal LM, its example (a real cache) and its dims."""
    from . import decoder

    if not isinstance(model, nn.Module) or isinstance(model, fx.GraphModule):
        raise InputError(f"with_past=True needs the Hugging Face causal LM itself (an nn.Module), got {type(model).__name__}")
    if dynamic_shapes is not None or dynamic is not None:
        raise ConfigError("with_past=True sets the dynamic dims itself (batch, sequence, past length): drop dynamic=")
    return decoder.wrap(model, example_inputs)
