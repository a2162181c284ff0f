"""`DepthMonitor`: per-site depth-attention statistics collected while the model trains, no second forward.

On a watched step an observer on the op (`op.observe`) accumulates, from every forward call,
per-source weight sums and maxima, entropy and output squares (and a Delta site's gate); other
steps cost an empty-list test. Sites are named from their query parameter, so wrapped, FSDP2 and
DTensor modules are watched alike; under torch.distributed the sums are all_reduced over `group`.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import fx

from ..ops.delta import depth_attention_merge_delta
from ..ops.depth_attention import depth_weights, observe
from ..ops.site_norm import depth_attention_norm as _PAIR
from ..ops.two_phase import depth_attention_merge
from .logs import CsvLog, log_stats
from .sums import SiteSums, gate_of, site_of, stats_of

_MERGES = (depth_attention_merge, depth_attention_merge_delta)

_in_backward = torch._C._current_autograd_node  # the autograd node running now, None outside a backward


class DepthMonitor:
    """Watches the depth-attention sites of a rewritten `module` on chosen steps.

        monitor = DepthMonitor(gm, every=5, csv="weights.csv")
        for step, (x, y) in enumerate(batches):
            with monitor.watch(step):          # watched when step % every == 0; else costs nothing
                loss = loss_fn(gm(x), y)
            loss.backward(); opt.step(); opt.zero_grad()

    After a watched step `stats()` (and `history[-1]`) holds its statistics, reduced over `group`
    under torch.distributed, and rank 0 writes them to `csv` (a new path, `overwrite=True`, or a
    `CsvLog`) and `tensorboard`. `watch()` without a step watches whatever runs inside it;
    `monitor(*args)` runs the module watched, adding to the sums until `reset()`.
    """

    def __init__(self, module: torch.nn.Module, every: int = 1, group: Any = None,
                 csv: str | Path | CsvLog | None = None, tensorboard: Any = None, prefix: str = "attnres",
                 overwrite: bool = False):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r}: give a whole number of steps, 1 or more (watch every step: 1)")
        graphs = [m.graph for m in module.modules() if isinstance(getattr(m, "graph", None), fx.Graph)]
        if any(n.op == "call_function" and n.target in _MERGES for g in graphs for n in g.nodes):
            raise ValueError("the module is in the two-phase form (attnres_compile.two_phase), whose merged sites "
                             "are not watched: monitor the one-pass module, or undo the pass with "
                             "attnres_compile.fx.two_phase.one_pass(gm)")
        if any(n.op == "call_function" and n.target is _PAIR for g in graphs for n in g.nodes):
            raise ValueError("the module's sites are fused with their norms (attnres_compile.fuse_norms), which are "
                             "not watched: monitor the module rewrite returned, or undo the pass with "
                             "attnres_compile.fx.site_norm.unfuse_norms(gm)")
        self.module, self.every, self.group, self.prefix = module, every, group, prefix
        self._queries: dict[int, tuple[tuple[str, int], str, torch.Tensor]] = {}
        self._gates = {gate_of(n): p for n, p in module.named_parameters() if gate_of(n) is not None}
        self._storages: dict[int, tuple[tuple[str, int], str, torch.Tensor]] = {}
        self._scan()
        if not self._queries:
            raise ValueError("no site to monitor: the module has no pseudo-query parameter named "
                             "attnres.chain<i>.site<k> (is it rewritten?)")
        self.csv = csv if isinstance(csv, CsvLog) or csv is None else CsvLog(csv, overwrite=overwrite)
        self.tensorboard = tensorboard
        self.history: list[dict] = []
        self.reset()

    def _scan(self) -> None:
        """Map the module's pseudo-queries to their sites, by object and by storage (each entry keeps
        the tensor, so a stale entry is recognised). By storage: FSDP2 registers its unsharded
        parameters only during forward (in new storage each time) and hands the blocks aliases of
        them, and a DTensor query reaches the op as its local tensor; a missed call scans again."""
        self._storages = {}
        for name, p in self.module.named_parameters():
            site = site_of(name)
            if site is not None:
                self._queries[id(p)] = (site, name, p)
                local = p.to_local() if hasattr(p, "to_local") else p
                if local.numel() and local.data_ptr():  # FSDP2 frees the unsharded storage between steps
                    self._storages[local.data_ptr()] = (site, name, local)

    def reset(self) -> None:
        """Forget the sums (a watched step starts with this)."""
        self._sums: dict[tuple[str, int], SiteSums] = {}
        self._step = None

    def _site(self, query: torch.Tensor) -> tuple[tuple[str, int], str] | None:
        entry = self._queries.get(id(query))
        if entry is not None and entry[2] is query:
            return entry[:2]
        for scanned in (False, True):
            if scanned:
                self._scan()
            entry = self._storages.get(query.data_ptr())
            if entry is not None and entry[2].data_ptr() == query.data_ptr():
                return entry[:2]
        return None

    def _observe(self, sources, query, eps, dim, out) -> None:
        if _in_backward() is not None:  # a site recomputed in the backward (activation checkpointing)
            return
        site = self._site(query)
        if site is None:  # another module's site
            return
        key, name = site
        with torch.no_grad():
            sums = self._sums.get(key) or self._sums.setdefault(key, SiteSums(name))
            sums.add_weights(depth_weights(sources, query, eps, dim))
            sums.add_value(out)

    def watching(self, step: int | None) -> bool:
        """Whether `watch(step)` watches: every `every`-th step, and always without a step."""
        return step is None or step % self.every == 0

    @contextlib.contextmanager
    def watch(self, step: int | None = None) -> Iterator[bool]:
        """Collect over the block when `watching(step)` (it yields whether it does); on leaving it,
        reduce over the group, keep the stats (`stats()`, `history` for a step) and write them out."""
        if not self.watching(step):
            yield False
            return
        self.reset()
        self._step = step
        with observe(self._observe):
            yield True
        reduce_sums(self._sums, self.group)
        if step is None:
            return
        stats = self.stats()
        self.history.append(stats)
        if _writes(self.group):
            if self.csv is not None:
                self.csv.write(stats)
            log_stats(self.tensorboard, stats, step, self.prefix)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's output, its sites watched (adding to the sums; no reduction)."""
        with observe(self._observe):
            return self.module(*args, **kwargs)

    def stats(self) -> dict:
        """{"step", "sites": [{"chain", "site", "name", "rows", "rms", "sources", "weights",
        "weights_max", "entropy", "max_entropy"[, "gate"]}]}: what the sums hold now (SiteSums.summary),
        and a Delta site's gate now."""
        stats = stats_of(self._sums, step=self._step)
        for site in stats["sites"]:
            gate = self._gates.get((site["chain"], site["site"]))
            if gate is not None:
                local = gate.to_local() if hasattr(gate, "to_local") else gate
                site["gate"] = float(local.detach().float().sum()) if local.numel() else None
        return stats


def _distributed(group: Any) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _writes(group: Any) -> bool:
    """Whether this process writes the logs: always alone, rank 0 of `group` under torch.distributed."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0


def reduce_sums(sums: dict[tuple[str, int], SiteSums], group: Any = None) -> None:
    """All-reduce every site's sums (SUM) and maxima (MAX) over `group`, in place, when
    torch.distributed is initialised with more than one process; a collective: every process of
    the group calls it, having watched the same sites (checked first, one small all_reduce)."""
    if not _distributed(group):
        return
    import torch.distributed as dist

    keys = sorted(sums)
    layout = zlib.crc32(repr([(k, len(sums[k].weight_sum)) for k in keys]).encode())
    backend = dist.get_backend(group)
    device = torch.device("cpu") if backend == "gloo" else (sums[keys[0]].sq.device if keys else torch.device("cuda"))
    check = torch.tensor([layout, -layout], dtype=torch.int64, device=device)
    dist.all_reduce(check, dist.ReduceOp.MAX, group=group)
    if check.tolist() != [layout, -layout]:
        raise RuntimeError("the processes watched different depth-attention sites on this step: give DepthMonitor "
                           "the data-parallel group (group=...) of processes that run the same sites")
    if not keys:
        return
    packed = [sums[k].packed() for k in keys]
    total = torch.cat([p[0] for p in packed]).to(device)
    peak = torch.cat([p[1] for p in packed]).to(device)
    dist.all_reduce(total, dist.ReduceOp.SUM, group=group)
    dist.all_reduce(peak, dist.ReduceOp.MAX, group=group)
    at = top = 0
    for k, (s, m) in zip(keys, packed):
        sums[k].unpack(total[at:at + len(s)], peak[top:top + len(m)])
        at, top = at + len(s), top + len(m)
