"""The recommended fine-tuning recipe for a converted model's pseudo-queries (see the package docstring)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..core.verify import is_attnres_param

QUERY_LR_SCALE = 0.01  # the queries' learning rate relative to the model's, Adam-family optimizers (docs/finetune.md)
SGD_QUERY_LR_SCALE = 1e-3  # the same for SGD, which steps by the gradient (the queries' is ~150x larger per element)
WARMUP_STEPS = 20  # steps over which the queries' rate ramps from 0 to its value


def is_query(name: str) -> bool:
    """Whether parameter `name` (as `named_parameters` gives it) is an AttnRes pseudo-query."""
    return is_attnres_param(name)


def param_groups(model: nn.Module, lr: float, weight_decay: float = 0.0, query_lr: float | None = None,
                 query_lr_scale: float = QUERY_LR_SCALE) -> list[dict]:
    """Two optimizer parameter groups, each with a "name": the model's weights at `lr` and
    `weight_decay`, and the pseudo-queries at `query_lr` (default `lr * query_lr_scale`) without weight
    decay. Rates, decay and scale must be finite and >= 0 (ValueError)."""
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("query_lr", query_lr),
                        ("query_lr_scale", query_lr_scale)):
        if value is None and name == "query_lr":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value!r}: give a finite number, 0 or more")
    weights, queries = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (queries if is_query(name) else weights).append(p)
    if not queries:
        raise ValueError("the model has no AttnRes pseudo-queries (parameters named attnres.*): is it rewritten?")
    return [{"params": weights, "lr": lr, "weight_decay": weight_decay, "name": "weights"},
            {"params": queries, "lr": lr * query_lr_scale if query_lr is None else query_lr, "weight_decay": 0.0,
             "name": "attnres_queries"}]


def query_warmup(optimizer: torch.optim.Optimizer, steps: int = WARMUP_STEPS) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler ramping the "attnres_queries" group's rate linearly from 0 (first step) to its
    value after `steps` steps; every other group keeps its rate. Call `.step()` after each
    optimizer step (compose with your own schedule through `ChainedScheduler` if you have one)."""
    names = [g.get("name") for g in optimizer.param_groups]
    if "attnres_queries" not in names:
        raise ValueError("the optimizer has no 'attnres_queries' group: build it from param_groups(model, lr)")
    ramp = (lambda step: min(1.0, step / steps)) if steps > 0 else (lambda step: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [ramp if n == "attnres_queries" else (lambda step: 1.0)
                                                         for n in names])
