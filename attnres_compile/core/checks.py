"""Checks shared by every front door (fx API, ONNX API, CLI) before and after analysis."""

from __future__ import annotations

from typing import Any

import torch

from .config import AttnResConfig
from .errors import ConfigError, DynamicFeatureAxisError, InputError, NoResidualChainError
from .graph_view import format_shape
from .plan import Plan


def as_config(config: AttnResConfig | None) -> AttnResConfig:
    if config is None:
        return AttnResConfig()
    if not isinstance(config, AttnResConfig):
        raise ConfigError(f"config must be an AttnResConfig, got {type(config).__name__}")
    return config


def split_inputs(example_inputs: Any) -> tuple[tuple | None, dict]:
    """(args, kwargs) from a tensor, a tuple/list of args or a dict of kwargs; (None, {}) for None."""
    if example_inputs is None:
        return None, {}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputError(f"example_inputs must be a tensor, a tuple of args or a dict of kwargs, got {type(example_inputs).__name__}")


def has_work(plan: Plan, config: AttnResConfig) -> bool:
    """True if `plan` rewrites something; False if the graph is already rewritten and nothing is left.

    Raises for a chain with a dynamic feature axis and for a graph without any residual chain.
    """
    dynamic = [c for c in plan.chains if isinstance(c.feature_size, str) and len(c.links) >= config.min_chain]
    if dynamic:
        raise DynamicFeatureAxisError(
            f"chain {dynamic[0].index} (root {dynamic[0].root}) has a dynamic feature axis "
            f"({format_shape((dynamic[0].feature_size,))[1:-1]}): "
            "export with a static feature size or set feature_axis"
        )
    if plan.to_rewrite:
        return True
    if plan.existing_sites:
        return False
    links = sum(len(c.links) for c in plan.chains)
    reasons = sorted({c.reason for c in plan.chains if c.reason})
    why = f"; chains skipped: {reasons[0]}" if reasons else ""
    raise NoResidualChainError(
        f"no residual chain to rewrite: {plan.adds_total} adds, {links} residual links, "
        f"{len(plan.chains)} chains (min_chain={config.min_chain}){why}; run inspect for the full report "
        "(rewrite_chains=False writes the model as it is, to compare with)"
    )


def plan_notes(plan: Plan) -> list[str]:
    """The report note for a graph that is already rewritten."""
    if plan.existing_sites and not plan.to_rewrite:
        return [f"already rewritten: {len(plan.existing_sites)} depth_attention sites found and no residual chain left: the sites are kept as they are, nothing more to rewrite"]
    return []
