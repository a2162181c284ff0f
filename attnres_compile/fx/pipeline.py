"""The fx rewrite as a list of passes: trace, analyse, rewrite the sites, verify, report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..core import verify
from ..core.chain_analysis import analyze
from ..core.checks import as_config, has_work, plan_notes
from ..core.config import AttnResConfig
from ..core.report import Report, build
from ..kernels import prebuild
from ..ops.depth_attention import kernels_expected
from ..utils import progress
from .rewrite import RewriteSites
from .decoder import relax_mask_length
from .trace import Traced, decoder_with_past, trace
from .view import view_from_fx


@dataclass
class RewriteResult:
    """`graph_module`: the rewritten, trainable GraphModule; `report`; `modified`: False if nothing was done."""

    graph_module: fx.GraphModule
    report: Report
    modified: bool


def inspect(model: Any, example_inputs: Any = None, config: AttnResConfig | None = None, dynamic_shapes: Any = None,
            dynamic: str | None = None) -> Report:
    """Analyse `model` and report its residual chains, sites and skipped adds, without rewriting.

    `dynamic` / `dynamic_shapes`: which input dims the trace keeps symbolic (fx/trace.py).
    """
    config = as_config(config)
    with progress.stage("tracing"):
        traced = trace(model, example_inputs, dynamic_shapes, dynamic)
    return inspect_traced(traced, config)


def inspect_traced(traced: Traced, config: AttnResConfig | None = None) -> Report:
    """`inspect` of a model `trace` returned (the memory planner profiles the same trace)."""
    config = as_config(config)
    view = view_from_fx(traced.graph_module)
    plan = analyze(view, config)
    return build(plan, view, config, traced.source, notes=traced.notes + plan_notes(plan), dynamic_dims=traced.dynamic)


def rewrite(model: Any, example_inputs: Any = None, config: AttnResConfig | None = None, verify_outputs: bool = True,
            dynamic_shapes: Any = None, dynamic: str | None = None, with_past: bool = False,
            rewrite_chains: bool = True) -> RewriteResult:
    """Rewrite the residual chains of `model` to AttnRes; returns the GraphModule and the report.

    With example inputs and `verify_outputs`, both models run on fresh copies of them and are
    compared per output (core/verify.py; function-changing rewrites get no verdict); `model` is
    left as it was. `with_past`: `model` is an HF causal LM and its decoder with a KV cache is
    rewritten (fx/decoder.py). `rewrite_chains=False`: no site, the same trace, verification and
    report, for a like-with-like baseline.
    """
    config = as_config(config)
    if with_past:
        model, example_inputs, dynamic_shapes = decoder_with_past(model, example_inputs, dynamic_shapes, dynamic)
    with progress.stage("tracing"):
        traced = trace(model, example_inputs, dynamic_shapes, dynamic)
    gm = traced.graph_module
    if with_past:
        relax_mask_length(gm)  # a prompt of 1 to 3 tokens (fx/decoder.py)
    view = view_from_fx(gm)
    plan = analyze(view, config)
    if not rewrite_chains:
        verification = _verify(model, traced, config, plan, check=False) if verify_outputs and traced.args is not None else None
        report = build(plan, view, config, traced.source, [], verification, traced.notes + [NOT_REWRITTEN],
                       traced.dynamic, extra={"rewritten": False})
        return RewriteResult(gm, report, modified=False)
    if not has_work(plan, config):
        report = build(plan, view, config, traced.source, notes=traced.notes + plan_notes(plan), dynamic_dims=traced.dynamic)
        return RewriteResult(gm, report, modified=False)
    sites = RewriteSites(plan, config)
    sites(gm)
    verification = _verify(model, traced, config, plan) if verify_outputs and traced.args is not None else None
    report = build(plan, view, config, traced.source, sites.sites, verification, traced.notes, traced.dynamic,
                   passes={RewriteSites.name: len(sites.sites)})
    return RewriteResult(gm, report, modified=True)



NOT_REWRITTEN = ("not rewritten (rewrite_chains=False): the original model, traced, written and verified by the "
                 "same machinery as a rewrite, to compare like with like")


def _verify(model: Any, traced: Traced, config: AttnResConfig, plan, check: bool = True) -> list[dict] | None:
    """The original against the rewritten module (`check=False`: the traced one) on the example inputs;
    notes join `traced.notes`."""
    gm = traced.graph_module
    original = model.module() if isinstance(model, torch.export.ExportedProgram) else model
    changes = check and any(c.changes_function for c in plan.to_rewrite)
    scale = config.scale if check else "preserve"  # nothing rewritten: the trace must be exact
    # the rewritten run's kernels build in the background meanwhile (kernels/prebuild.py)
    workers = prebuild.start(prebuild.forward_specs(gm)) if kernels_expected() else []
    try:
        with progress.stage("verifying in torch"):
            verification, notes = verify.verify_module(original, gm, traced.args, traced.kwargs,
                                                       verify.tolerance(scale, changes))
    finally:
        prebuild.stop(workers)
    traced.notes += notes
    failed = [r for r in verification or [] if r.get("ok") is False]
    if failed and scale == "paper":
        traced.notes.append(verify.paper_scale_note(len(failed)))
    return verification
