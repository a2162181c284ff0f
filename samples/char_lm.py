"""A character-level PreNorm GPT on Python's own docs (`pydoc_data.topics`): data, model, LR schedule,
optimizer, training step, evaluation and the AttnRes rewrite, shared by samples/train_tiny_lm.py and
samples/study.py so both train exactly the same way.
"""

from __future__ import annotations

import copy
import math
from functools import lru_cache

import torch
from torch import nn
from torch.nn import functional as F

from attnres_compile import AttnResConfig, rewrite
from attnres_compile.monitor import DepthMonitor, ResidualProbe
from samples.models import GPT

QUERY_PREFIX = "attnres."  # pseudo-query parameters are named attnres.chain<i>.site<k>


@lru_cache(maxsize=1)
def load_text(val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, tuple[str, ...]]:
    """Train ids, held-out ids (the last `val_fraction` of the text, topics in sorted order) and the vocabulary."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    vocab = tuple(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(len(ids) * (1 - val_fraction))
    return ids[:cut], ids[cut:], vocab


def windows(ids: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-character targets for windows of `seq` characters at `starts`."""
    chunk = ids[starts[:, None] + torch.arange(seq + 1)]
    return chunk[:, :-1], chunk[:, 1:]


def build_model(seed: int, vocab: int, layers: int, dim: int, heads: int, seq: int) -> GPT:
    """The baseline GPT with GPT-2 style init (N(0, 0.02) weights, zero biases), seeded."""
    torch.manual_seed(seed)
    model = GPT(vocab=vocab, dim=dim, layers=layers, heads=heads, max_len=seq)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    return model


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Multiplier of the peak LR: linear warmup, then cosine decay to a tenth at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * t))


def make_opt(model: nn.Module, lr: float, adam_state: dict | None = None, query_lr: float | None = None) -> torch.optim.Optimizer:
    """Adam (betas 0.9, 0.95); the pseudo-queries get `query_lr` when given. Each group's "peak" is its
    LR before the schedule. `adam_state` ({param name: state}) seeds the state of parameters of the same name."""
    named = list(model.named_parameters())
    queries = [p for n, p in named if n.startswith(QUERY_PREFIX)] if query_lr is not None else []
    rest = [p for p in model.parameters() if all(p is not q for q in queries)]
    groups = [{"params": rest, "peak": lr}] + ([{"params": queries, "peak": query_lr}] if queries else [])
    opt = torch.optim.Adam(groups, lr=lr, betas=(0.9, 0.95))
    for name, p in named:
        if adam_state and name in adam_state:
            opt.state[p] = copy.deepcopy(adam_state[name])
    return opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, factor: float) -> float:
    """One Adam step at `factor` x each group's peak LR, gradients clipped to norm 1; returns the loss."""
    for group in opt.param_groups:
        group["lr"] = group["peak"] * factor
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    opt.step()
    return loss.item()


def evaluate(model, batches, monitor: DepthMonitor | ResidualProbe | None = None) -> tuple[float, dict | None]:
    """Mean loss over `batches`; through `monitor` (which then holds the depth stats of these batches) if given."""
    call = model if monitor is None else monitor
    if monitor is not None:
        monitor.reset()
    with torch.no_grad():
        losses = [F.cross_entropy(call(x).flatten(0, 1), y.flatten()).item() for x, y in batches]
    return sum(losses) / len(losses), None if monitor is None else monitor.stats()


def attnres(model: nn.Module, example: torch.Tensor, variant: str, form: str, blocks: int) -> torch.fx.GraphModule:
    """`model` rewritten to AttnRes: variant "full", "block", "delta" or "delta-block" (Block and Delta-Block with
    `blocks` blocks); form "preserve" (exact at init: c_k = |S_k|, Delta's gates 0) or "paper" (the published start:
    c_k = 1, Delta's gates 1). A preserve rewrite must pass verification (paper changes the function: Full and Block
    through the LayerNorm eps when the stream is small, as it is at init; Delta through its gates)."""
    kind = variant.split("-")[0]
    delta = kind == "delta"
    config = AttnResConfig(variant=kind, num_blocks=blocks if variant.endswith("block") else None,
                           scale="preserve" if delta else form, init=form if delta and form == "paper" else "exact")
    result = rewrite(model.eval(), (example,), config)  # rewrite works on its own copy
    bad = [r for r in result.report["verification"] or [] if r.get("ok") is False]
    if bad and form == "preserve":
        raise AssertionError(f"{variant}/{form} rewrite failed verification: {bad}")
    return result.graph_module
