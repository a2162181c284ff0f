"""Activation checkpointing of called blocks, with a policy for the depth-attention sites.

`SitePolicy`, a selective-checkpointing policy, saves the sites' outputs (`save_sites=True`) or
lets them be recomputed, and counts both. `checkpoint_blocks` applies torch's composable
`checkpoint` to each block of a `called_blocks` module (composes with `fully_shard`).
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..ops.depth_attention import is_attnres_op
from .blocks import block_names


class SitePolicy:
    """Selective checkpointing policy: attnres ops saved (`save_sites`) or recomputed; every other
    op recomputed. `saved` counts the site calls whose outputs forward saved, `recomputed` the site
    calls backward ran again (torch's recompute mode does not consult the policy, so a dispatch
    mode beneath it counts the calls it lets through)."""

    def __init__(self, save_sites: bool = True):
        self.save_sites = save_sites
        self.saved = 0
        self.recomputed = 0

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if not is_attnres_op(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        self.saved += self.save_sites and not ctx.is_recompute
        return CheckpointPolicy.MUST_SAVE if self.save_sites else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn(self):
        """The (forward, recompute) contexts `checkpoint(..., context_fn=...)` asks for."""
        forward, recompute = create_selective_checkpoint_contexts(self)
        return forward, _counted(recompute, self)


@contextmanager
def _counted(recompute, policy: SitePolicy):
    """`recompute` with the site calls it computes again (not those served from its cache) counted."""
    with _SiteCounter(policy), recompute:
        yield


class _SiteCounter(TorchDispatchMode):
    """Counts attnres op calls into `policy.recomputed`; entered outside the recompute mode, it sees
    only the calls that mode passes on."""

    def __init__(self, policy: SitePolicy):
        super().__init__()
        self.policy = policy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.policy.recomputed += is_attnres_op(func)
        return func(*args, **(kwargs or {}))


def checkpoint_blocks(module: nn.Module, policy: SitePolicy | None = None) -> list[str]:
    """Checkpoint each block of `module` (a `called_blocks` result) under `policy` (None: plain
    checkpointing, everything recomputed); returns the blocks' names."""
    names = block_names(module)
    for name in names:
        checkpoint(module.get_submodule(name), context_fn=policy.context_fn if policy else None)
    return names
