"""The Python API: `inspect` (analysis only) and `rewrite` (analysis, fx rewrite, verification)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from .config import AttnResConfig
from .errors import InputError, TraceError, first_line
from .passes import verify
from .passes.chain_analysis import analyze
from .passes.fx_rewrite import apply_plan
from .passes.fx_mode import make_mode_switchable
from .passes.fx_view import tensor_meta, view_from_fx
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


def trace(model: Any, example_inputs: Any = None, dynamic_shapes: Any = None) -> Traced:
    """A private GraphModule copy of `model` with shape metadata, and how it was obtained.

    nn.Module: torch.export (eval-mode ops recorded as they are), falling back to
    torch.fx.symbolic_trace + ShapeProp. ExportedProgram: its `.module()`. GraphModule: a copy,
    shape-propagated from `example_inputs` if its nodes carry no shapes. Export-traced modules
    get working train()/eval() (passes/fx_mode.py).
    """
    args, kwargs = split_inputs(example_inputs)
    if isinstance(model, torch.export.ExportedProgram):
        return Traced(make_mode_switchable(copy.deepcopy(model.module()), False), "ExportedProgram", args, kwargs, [])
    if isinstance(model, fx.GraphModule):
        gm = make_mode_switchable(copy.deepcopy(model), model.training)
        _ensure_shapes(gm, args, kwargs)
        return Traced(gm, "GraphModule", args, kwargs, [])
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be an nn.Module, fx.GraphModule or ExportedProgram, got {type(model).__name__}")
    if args is None:
        raise InputError("example_inputs are required to trace an nn.Module: pass a tuple of args or a dict of kwargs")
    notes = [] if not model.training else ["model traced in training mode: dropout is recorded as active; call model.eval() first for an exact rewrite"]
    model = copy.deepcopy(model)
    try:
        ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        return Traced(make_mode_switchable(ep.module(), model.training), "torch.export", args, kwargs, notes)
    except Exception as export_exc:  # noqa: BLE001 - any tracer failure falls back, then is reported
        try:
            gm = fx.symbolic_trace(model)
            _ensure_shapes(gm, args, kwargs)
        except Exception as fx_exc:  # noqa: BLE001
            raise TraceError(
                f"could not trace {type(model).__name__}: torch.export failed ({first_line(export_exc)}); "
                f"torch.fx.symbolic_trace failed ({first_line(fx_exc)}); make the model exportable "
                f"(use_cache=False, explicit attention_mask) or pass an fx.GraphModule"
            ) from None
        notes.append(f"torch.export failed ({first_line(export_exc, 160)}); used torch.fx.symbolic_trace")
        return Traced(gm, "symbolic_trace", args, kwargs, notes)


def _ensure_shapes(gm: fx.GraphModule, args: tuple | None, kwargs: dict) -> None:
    if all(tensor_meta(n)[0] is not None for n in gm.graph.nodes if n.op == "placeholder"):
        return
    if args is None or kwargs:
        raise InputError("the GraphModule carries no shape metadata: pass example_inputs as a tuple of positional args")
    try:
        ShapeProp(gm).propagate(*args)
    except Exception as exc:  # noqa: BLE001
        raise TraceError(f"shape propagation failed on the example inputs ({first_line(exc)})") from None


def _analyze(traced: Traced, config: AttnResConfig):
    view = view_from_fx(traced.graph_module)
    return view, analyze(view, config)


def inspect(model: Any, example_inputs: Any = None, config: AttnResConfig | None = None, dynamic_shapes: Any = None) -> Report:
    """Analyse `model` and report its residual chains, sites and skipped adds, without rewriting."""
    config = as_config(config)
    traced = trace(model, example_inputs, dynamic_shapes)
    view, plan = _analyze(traced, config)
    return build(plan, view, config, traced.source, notes=traced.notes + plan_notes(plan))


def rewrite(model: Any, example_inputs: Any = None, config: AttnResConfig | None = None, verify_outputs: bool = True,
            dynamic_shapes: Any = None) -> RewriteResult:
    """Rewrite the residual chains of `model` to AttnRes; returns the GraphModule and the report.

    With example inputs and `verify_outputs`, the original and rewritten models are run on
    them and compared per output (the report's "verification"): |diff| <= tol * (1 + max|ref|)
    with tol 1e-5 in preserve mode (fp32), 1e-3 in paper mode (PreNorm models differ through
    the norms' eps only); function-changing rewrites are reported without a verdict.
    """
    config = as_config(config)
    traced = trace(model, example_inputs, dynamic_shapes)
    gm = traced.graph_module
    view, plan = _analyze(traced, config)
    if not has_work(plan, config):
        return RewriteResult(gm, build(plan, view, config, traced.source, notes=traced.notes + plan_notes(plan)), modified=False)
    sites = apply_plan(gm, plan, config)
    verification = None
    if verify_outputs and traced.args is not None:
        original = model.module() if isinstance(model, torch.export.ExportedProgram) else model
        expected, actual = verify.run_both(original, gm, traced.args, traced.kwargs)
        changes = any(c.changes_function for c in plan.to_rewrite)
        verification = verify.compare(expected, actual, *verify.tolerance(config.scale, changes))
    report = build(plan, view, config, traced.source, sites, verification, traced.notes)
    return RewriteResult(gm, report, modified=True)
