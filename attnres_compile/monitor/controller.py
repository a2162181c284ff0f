"""`CollapseController`: slow down (or freeze) a site's pseudo-query once its depth weights collapse.

It scales the step the optimizer takes on that one query (a pre-step hook keeps the query, a
post-step hook moves it to `old + factor * (new - old)`), which for SGD, Adam and AdamW is exactly
the step at `lr * factor`; `factor=0` freezes it. The parameter groups stay as built, so
schedulers (`query_warmup`) and optimizer checkpoints are unaffected.
"""

from __future__ import annotations

import logging

import torch

from .collapse import find_collapse
from .sums import site_of

log = logging.getLogger("attnres_compile.monitor")


class CollapseController:
    """Acts on `find_collapse(stats)` of each watched step (call `update(stats)`): each flagged site's
    query steps are scaled by `factor` from then on, once; `actions` lists and logs (WARNING) them."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module, factor: float = 0.1,
                 min_entropy: float = 0.1, dead_weight: float = 1e-3):
        if not 0.0 <= factor < 1.0:
            raise ValueError(f"factor scales a collapsed site's steps down: give 0 <= factor < 1 (0 freezes), not {factor}")
        self.queries = {site: p for name, p in module.named_parameters() if (site := site_of(name)) is not None}
        if not self.queries:
            raise ValueError("the module has no pseudo-query parameter named attnres.chain<i>.site<k> (is it rewritten?)")
        self.factor, self.min_entropy, self.dead_weight = factor, min_entropy, dead_weight
        self.scaled: dict[tuple[str, int], float] = {}
        self.actions: list[dict] = []
        self._before: dict[tuple[str, int], torch.Tensor] = {}
        optimizer.register_step_pre_hook(self._keep)
        optimizer.register_step_post_hook(self._scale)

    def update(self, stats: dict) -> list[dict]:
        """Act on the collapses in `stats` (a watched step's); returns the new actions."""
        new = []
        for flag in find_collapse(stats, self.min_entropy, self.dead_weight):
            if flag["kind"] == "site":
                sites, why = [flag["site"]], f"entropy {flag['entropy']:.3g} < {self.min_entropy}"
            else:
                sites, why = flag["sites"], f"source {flag['source']} dead (max weight {flag['max_weight']:.2g})"
            for k in sites:
                key = (flag["chain"], k)
                if key in self.scaled or key not in self.queries:
                    continue
                self.scaled[key] = self.factor
                what = "frozen" if self.factor == 0 else f"steps x{self.factor:g}"
                action = {"step": stats.get("step"), "chain": key[0], "site": k, "reason": why, "action": what}
                new.append(action)
                log.warning("step %s: %s site %d collapsed (%s): its pseudo-query is %s from now on",
                            action["step"], key[0], k, why, what)
        self.actions.extend(new)
        return new

    def _keep(self, optimizer, args, kwargs) -> None:
        self._before = {key: self.queries[key].detach().clone() for key in self.scaled}

    def _scale(self, optimizer, args, kwargs) -> None:
        with torch.no_grad():
            for key, old in self._before.items():
                p = self.queries[key]
                p.copy_(torch.lerp(old, p, self.scaled[key]))
        self._before = {}
