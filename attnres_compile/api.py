"""The Python API: `inspect` (analysis only) and `rewrite` (analysis, fx rewrite, verification)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from . import hf_experts, progress, pytree_warning
from .config import AttnResConfig
from .errors import ConfigError, InputError, TraceError, first_line
from .kernels import prebuild
from .op import fused_kernels
from .passes import dynamic_dims, input_guards, verify
from .passes.chain_analysis import analyze
from .passes.fx_rewrite import apply_plan
from .passes.fx_mode import make_mode_switchable
from .passes.fx_site_norm import unfuse_norms
from .passes.fx_two_phase import one_pass
from .passes.fx_view import split_alpha, tensor_meta, view_from_fx
from .plan_checks import as_config, has_work, plan_notes, split_inputs
from .report import Report, build


@dataclass
class RewriteResult:
    """`graph_module`: the rewritten, trainable GraphModule; `report`; `modified`: False if nothing was done."""

    graph_module: fx.GraphModule
    report: Report
    modified: bool


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

    nn.Module: torch.export (eval-mode ops recorded as they are) with the input dims of
    `dynamic` (passes/dynamic_dims.py; default batch and sequence) or the explicit
    `dynamic_shapes`, retried with static shapes (and a note) when the dynamic export fails,
    falling back to torch.fx.symbolic_trace + ShapeProp. ExportedProgram: its `.module()`.
    GraphModule: a copy, shape-propagated from `example_inputs` if its nodes carry no shapes.
    Export-traced modules get working train()/eval() (passes/fx_mode.py); adds with
    `alpha != 1` are split into a scaling and a plain add (fx_view.split_alpha); two-phase
    sites (`two_phase`) become one depth_attention each again (fx_two_phase.one_pass), and so do
    fused site + norm pairs (`fuse_norms`; fx_site_norm.unfuse_norms). The export's input checks
    run compiled, not through sympy on every call (passes/input_guards.py).
    """
    traced = _trace(model, example_inputs, dynamic_shapes, dynamic)
    input_guards.install(traced.graph_module)  # torch.export's per-call sympy input checks, compiled once
    split_alpha(traced.graph_module)
    one_pass(traced.graph_module)  # a two-phase module's sites, as rewrite made them
    unfuse_norms(traced.graph_module)  # and a fused module's
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


def _analyze(traced: Traced, config: AttnResConfig):
    view = view_from_fx(traced.graph_module)
    return view, analyze(view, config)


def inspect(model: Any, example_inputs: Any = None, config: AttnResConfig | None = None, dynamic_shapes: Any = None,
            dynamic: str | None = None) -> Report:
    """Analyse `model` and report its residual chains, sites and skipped adds, without rewriting.

    `dynamic` / `dynamic_shapes`: which input dims the trace keeps symbolic (see `trace`).
    """
    config = as_config(config)
    with progress.stage("tracing"):
        traced = trace(model, example_inputs, dynamic_shapes, dynamic)
    return inspect_traced(traced, config)


def inspect_traced(traced: Traced, config: AttnResConfig | None = None) -> Report:
    """`inspect` of a model `trace` returned (the memory planner profiles the same trace)."""
    config = as_config(config)
    view, plan = _analyze(traced, config)
    return build(plan, view, config, traced.source, notes=traced.notes + plan_notes(plan), dynamic_dims=traced.dynamic)


def rewrite(model: Any, example_inputs: Any = None, config: AttnResConfig | None = None, verify_outputs: bool = True,
            dynamic_shapes: Any = None, dynamic: str | None = None, with_past: bool = False) -> RewriteResult:
    """Rewrite the residual chains of `model` to AttnRes; returns the GraphModule and the report.

    With example inputs and `verify_outputs`, the original and rewritten models are run on
    them and compared per output (the report's "verification", passes/verify.py): elementwise
    |diff| <= rtol * (max|ref| + |ref|), rtol 1e-5 in preserve mode at fp32 (scaled to the
    dtype), 1e-3 in paper mode (PreNorm models differ through the norms' eps only); fp16/bf16
    outputs are also judged against a float64 run of the original; function-changing rewrites
    are reported without a verdict. Each run gets a fresh copy of the inputs, `model` is left as
    it was (buffers, RNG state), and float inputs are also tried with zero rows (verify.py).

    `with_past`: `model` is an HF causal LM; what is traced and rewritten is its decoder with a
    KV cache (decoder.py: flat past in, `logits` and `present.*` out; batch, sequence and past
    length dynamic), which `generation.causal_lm` serves to HF `generate()`.
    """
    config = as_config(config)
    if with_past:
        model, example_inputs, dynamic_shapes = _with_past(model, example_inputs, dynamic_shapes, dynamic)
    with progress.stage("tracing"):
        traced = trace(model, example_inputs, dynamic_shapes, dynamic)
    gm = traced.graph_module
    view, plan = _analyze(traced, config)
    if not has_work(plan, config):
        report = build(plan, view, config, traced.source, notes=traced.notes + plan_notes(plan), dynamic_dims=traced.dynamic)
        return RewriteResult(gm, report, modified=False)
    sites = apply_plan(gm, plan, config)
    verification = None
    if verify_outputs and traced.args is not None:
        original = model.module() if isinstance(model, torch.export.ExportedProgram) else model
        changes = any(c.changes_function for c in plan.to_rewrite)
        # the rewritten run's kernels build in the background meanwhile (kernels/prebuild.py)
        workers = prebuild.start(prebuild.forward_specs(gm)) if fused_kernels() else []
        try:
            with progress.stage("verifying in torch"):
                verification, notes = verify.verify_module(original, gm, traced.args, traced.kwargs,
                                                           verify.tolerance(config.scale, changes))
        finally:
            prebuild.stop(workers)
        traced.notes += notes
        failed = [r for r in verification or [] if r.get("ok") is False]
        if failed and config.scale == "paper":
            traced.notes.append(verify.paper_scale_note(len(failed)))
    report = build(plan, view, config, traced.source, sites, verification, traced.notes, traced.dynamic)
    return RewriteResult(gm, report, modified=True)


def _with_past(model: Any, example_inputs: Any, dynamic_shapes: Any, dynamic: str | None):
    """The decoder-with-past wrapper of an HF causal LM, its example (a real cache) and its dims."""
    from . import decoder

    if not isinstance(model, nn.Module) or isinstance(model, fx.GraphModule):
        raise InputError(f"with_past=True needs the Hugging Face causal LM itself (an nn.Module), got {type(model).__name__}")
    if dynamic_shapes is not None or dynamic is not None:
        raise ConfigError("with_past=True sets the dynamic dims itself (batch, sequence, past length): drop dynamic=")
    return decoder.wrap(model, example_inputs)
