"""The stream of an original (not rewritten) model, site by site: what it has instead of depth weights.
`ResidualProbe` runs the traced graph through an `fx.Interpreter` and records the RMS of each
residual sum h_k that `trace_sites` names (numbered as `rewrite` numbers sites); the graph is
left as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx._pytree import tree_flatten_spec

from ..core.config import AttnResConfig
from .sums import SiteSums, stats_of
from .watch import DepthMonitor


class ResidualProbe(fx.Interpreter):
    """Runs `gm` (without changing it) and adds, per site {node name: (chain, k)}, the RMS of that
    node's value. Call it like the module; `stats()` reads out, `reset()` forgets."""

    def __init__(self, gm: fx.GraphModule, sites: dict[str, tuple[str, int]]):
        super().__init__(gm)
        if not sites:
            raise ValueError("no site to probe: give the residual sums trace_sites names")
        self.sites = sites
        self.reset()

    def reset(self) -> None:
        self._sums = {key: SiteSums(name) for name, key in self.sites.items()}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            if not kwargs:
                return self.run(*args)
            spec = getattr(self.module, "_in_spec", None)
            if spec is None:
                raise ValueError("keyword inputs need a torch.export module (with an input spec); pass positional args")
            out = self.run(*tree_flatten_spec((args, kwargs), spec), enable_io_processing=False)
            return self.module.graph.process_outputs(out)

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        key = self.sites.get(n.name)
        if key is not None:
            self._sums[key].add_value(result)
        return result

    def stats(self) -> dict:
        """{"step": None, "sites": [{"chain", "site", "name", "rows": 0, "rms"}]} (SiteSums.summary)."""
        return stats_of(self._sums, step=None)


def trace_sites(model: Any, example_inputs: Any, config: AttnResConfig | None = None) -> tuple[fx.GraphModule, dict[str, tuple[str, int]]]:
    """A traced copy of an original `model` (its current weights) and its sites {node name: (chain, k)},
    numbered as `rewrite` numbers them.
    """
    from ..core.chain_analysis import analyze
    from ..fx.trace import trace
    from ..fx.view import view_from_fx

    traced = trace(model, example_inputs)
    plan = analyze(view_from_fx(traced.graph_module), config or AttnResConfig())
    sites = {link.result: (f"chain{i}", k) for i, chain in enumerate(plan.to_rewrite)
             for k, link in enumerate(chain.links, start=1)}
    if not sites:
        raise ValueError("the model has no residual chain to monitor")
    return traced.graph_module, sites


def record(module: torch.nn.Module, batches, sites: dict[str, tuple[str, int]] | None = None) -> dict:
    """The stats of running every batch (a tuple of positional args, or one tensor) under no_grad:
    a rewritten module's through `DepthMonitor`, an original's (give `sites` from `trace_sites`)
    through `ResidualProbe`."""
    monitor = DepthMonitor(module) if sites is None else ResidualProbe(module, sites)
    with torch.no_grad():
        for batch in batches:
            monitor(*(batch if isinstance(batch, (tuple, list)) else (batch,)))
    return monitor.stats()
