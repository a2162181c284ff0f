"""Depth-attention observability: what each AttnRes site attends to, and how large the stream gets.

`DepthMonitor` runs a GraphModule through an `fx.Interpreter` that, at every depth_attention
node, recomputes the softmax weights from the node's own arguments, so the graph is left as it
is. It also records the RMS of each site's value: the depth_attention output of a rewritten
model, or the residual sum `h_k` of an original model (`trace_sites` finds those). Results
are a JSON-able dict (`stats()`), which `find_collapse`, `log_stats` and `plots` consume.

Checkpoint format for `inspect_weights`: a `.pt2` torch.export program of the rewritten model
(what `attnres-compile rewrite -o model.pt2` and `samples/train_tiny_lm.py` write); its stored
example inputs are what the weights are measured on unless other inputs are given.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.fx._pytree import tree_flatten_spec

from . import op_site_norm as _pair  # noqa: F401  (registers torch.ops.attnres.depth_attention_norm)
from . import op_two_phase as _ops  # noqa: F401  (registers torch.ops.attnres, the two-phase pair too)
from .config import AttnResConfig
from .errors import InputError, first_line

DEPTH_ATTENTION = torch.ops.attnres.depth_attention.default
MERGE = torch.ops.attnres.depth_attention_merge.default
PAIR = torch.ops.attnres.depth_attention_norm.default
_QUERY_NAME = re.compile(r"(chain\d+)\.site(\d+)$")


def depth_weights(sources: list[torch.Tensor], query: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
    """The softmax weights of one depth_attention call, float32, shape [len(sources), *rows]."""
    srcs = [s.detach().movedim(dim, -1).float() for s in sources]
    logits = torch.stack([(s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)) @ query.detach().float() for s in srcs])
    return torch.softmax(logits, dim=0)


def site_key(node: fx.Node) -> tuple[str, int]:
    """(chain, site) of a depth_attention node: from its meta, else from its query's name (after save/load)."""
    meta = node.meta.get("attnres") or {}
    if "chain" in meta:
        return meta["chain"], int(meta["site"])
    match = _QUERY_NAME.search(str(node.args[1].target))
    if match is None:
        raise ValueError(f"depth_attention node {node.name} has no attnres meta and its query {node.args[1]} is not named chain<i>.site<k>")
    return match.group(1), int(match.group(2))


class _Acc:
    """Running sums for one site: weight sums and maxima over rows, entropy sum, sum of squares."""

    def __init__(self, node: str):
        self.node, self.rows, self.sq, self.numel = node, 0, 0.0, 0
        self.weight_sum = self.weight_max = None
        self.entropy_sum = 0.0

    def add_weights(self, p: torch.Tensor) -> None:
        flat = p.reshape(p.shape[0], -1).double()
        total, peak = flat.sum(1), flat.amax(1)
        self.weight_sum = total if self.weight_sum is None else self.weight_sum + total
        self.weight_max = peak if self.weight_max is None else torch.maximum(self.weight_max, peak)
        self.entropy_sum += float(-(flat * flat.clamp_min(1e-30).log()).sum())
        self.rows += flat.shape[1]

    def add_value(self, value: torch.Tensor) -> None:
        self.sq += float(value.detach().double().square().sum())
        self.numel += value.numel()

    def summary(self) -> dict:
        out = {"node": self.node, "rms": math.sqrt(self.sq / self.numel) if self.numel else None}
        if self.weight_sum is not None:
            out.update(sources=len(self.weight_sum), weights=(self.weight_sum / self.rows).tolist(),
                       weights_max=self.weight_max.tolist(), entropy=self.entropy_sum / self.rows,
                       max_entropy=math.log(len(self.weight_sum)))
        return out


class DepthMonitor(fx.Interpreter):
    """Runs `gm` (without changing it) and accumulates, per site, depth-attention weights and stream RMS.

    `sites` maps node names to (chain, k) for a model that was not rewritten (see `trace_sites`);
    by default every depth_attention node is a site. Call it like the module; `stats()` reads out.
    """

    def __init__(self, gm: fx.GraphModule, sites: dict[str, tuple[str, int]] | None = None):
        super().__init__(gm)
        if any(n.op == "call_function" and n.target is MERGE for n in gm.graph.nodes):
            raise ValueError("the module is in the two-phase form (attnres_compile.two_phase), whose merged sites "
                             "are not watched: monitor the one-pass module, or undo the pass with "
                             "attnres_compile.passes.fx_two_phase.one_pass(gm)")
        if any(n.op == "call_function" and n.target is PAIR for n in gm.graph.nodes):
            raise ValueError("the module's sites are fused with their norms (attnres_compile.fuse_norms), which are "
                             "not watched: monitor the module rewrite returned, or undo the pass with "
                             "attnres_compile.passes.fx_site_norm.unfuse_norms(gm)")
        self.sites = sites
        if sites is None:
            self.sites = {n.name: site_key(n) for n in gm.graph.nodes if n.op == "call_function" and n.target is DEPTH_ATTENTION}
        if not self.sites:
            raise ValueError("no site to monitor: the module has no depth_attention node and no sites were given")
        self.reset()

    def reset(self) -> None:
        self._acc = {key: _Acc(name) for name, key in self.sites.items()}
        self.batches = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            self.batches += 1
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
            acc = self._acc[key]
            acc.add_value(result)
            if n.target is DEPTH_ATTENTION:
                sources, query, eps, _scale, dim = self.fetch_args_kwargs_from_env(n)[0]
                acc.add_weights(depth_weights(sources, query, eps, dim))
        return result

    def stats(self) -> dict:
        """{"batches", "sites": [{"chain", "site", "node", "rms"[, "sources", "weights", "weights_max", "entropy", "max_entropy"]}]}.

        weights: mean over tokens of each source's softmax weight (sums to 1); weights_max: its
        maximum over tokens; entropy: mean over tokens of the weights' entropy (nats).
        """
        order = sorted(self._acc, key=lambda ck: (int(ck[0].removeprefix("chain")), ck[1]))
        sites = [{"chain": c, "site": k, **self._acc[(c, k)].summary()} for c, k in order]
        return {"batches": self.batches, "sites": sites}


def record(module: fx.GraphModule, batches, sites: dict[str, tuple[str, int]] | None = None) -> dict:
    """`DepthMonitor(module, sites).stats()` after running every batch (a tuple of positional args, or one tensor)."""
    monitor = DepthMonitor(module, sites)
    for batch in batches:
        monitor(*(batch if isinstance(batch, (tuple, list)) else (batch,)))
    return monitor.stats()


def trace_sites(model: Any, example_inputs: Any, config: AttnResConfig | None = None) -> tuple[fx.GraphModule, dict[str, tuple[str, int]]]:
    """A traced copy of an original `model` and its sites {node name: (chain, k)}, numbered as `rewrite` numbers them.

    The copy holds the model's weights as they are now; trace again after training.
    """
    from .api import trace
    from .passes.chain_analysis import analyze
    from .passes.fx_view import view_from_fx

    traced = trace(model, example_inputs)
    plan = analyze(view_from_fx(traced.graph_module), config or AttnResConfig())
    sites = {link.result: (f"chain{i}", k) for i, chain in enumerate(plan.to_rewrite)
             for k, link in enumerate(chain.links, start=1)}
    if not sites:
        raise ValueError("the model has no residual chain to monitor")
    return traced.graph_module, sites


def find_collapse(stats: dict, min_entropy: float = 0.1, dead_weight: float = 1e-3) -> list[dict]:
    """Collapsed sites (mean token entropy below `min_entropy` nats, i.e. about one source read)
    and dead sources (weight below `dead_weight` at every token of every site that reads them)."""
    flags, peak = [], {}
    for s in stats["sites"]:
        if "weights" not in s:
            continue
        if s["entropy"] < min_entropy:
            flags.append({"kind": "site", "chain": s["chain"], "site": s["site"], "entropy": s["entropy"]})
        for j, w in enumerate(s["weights_max"]):
            seen = peak.setdefault((s["chain"], j), [0.0, []])
            seen[0] = max(seen[0], w)
            seen[1].append(s["site"])
    for (chain, j), (w, sites) in sorted(peak.items()):
        if w < dead_weight:
            flags.append({"kind": "source", "chain": chain, "source": j, "max_weight": w, "sites": sites})
    return flags


def tensorboard_writer(logdir: str | Path):
    """A `SummaryWriter` for `logdir`, or None when tensorboard is not installed (it is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(logdir))


def log_stats(writer, stats: dict, step: int, prefix: str = "attnres") -> None:
    """To TensorBoard: per-site entropy and RMS as scalars, each chain's site x source weights as a
    grey-level image (white = 1); a no-op when `writer` is None."""
    if writer is None:
        return
    from .plots import weight_matrix

    for s in stats["sites"]:
        tag = f"{prefix}/{s['chain']}/site{s['site']:02d}"
        writer.add_scalar(f"{tag}/rms", s["rms"], step)
        if "weights" in s:
            writer.add_scalar(f"{tag}/entropy", s["entropy"], step)
    for chain in sorted({s["chain"] for s in stats["sites"] if "weights" in s}):
        image = torch.tensor(weight_matrix(stats, chain)).nan_to_num(0.0)
        writer.add_image(f"{prefix}/{chain}/weights", image[None], step, dataformats="CHW")
    writer.flush()


def load_checkpoint(path: str | Path) -> tuple[fx.GraphModule, tuple, dict]:
    """The rewritten GraphModule of a `.pt2` torch.export program and the example (args, kwargs) stored
    with it, read without running anything stored in the archive (pt2.load)."""
    from .pt2 import load

    ep = load(path).program
    args, kwargs = ep.example_inputs if ep.example_inputs is not None else (None, None)
    return ep.module(), args, kwargs or {}


def inspect_weights(checkpoint: str | Path, out: str | Path | None = None, inputs: tuple | None = None,
                    min_entropy: float = 0.1, dead_weight: float = 1e-3) -> dict:
    """Depth-attention stats of a saved rewritten model (`.pt2`), measured on `inputs` (positional
    args) or the program's stored example inputs; writes the heatmap PNG to `out` when given.

    Returns {"checkpoint", "stats", "collapse"[, "heatmap"]}.
    """
    gm, args, kwargs = load_checkpoint(checkpoint)
    if inputs is not None:
        args, kwargs = tuple(inputs), {}
    if args is None:
        raise InputError(f"{checkpoint} stores no example inputs to measure the weights on: pass inputs, or write "
                         "it with `attnres-compile rewrite -o X.pt2`")
    if not any(n.op == "call_function" and n.target is DEPTH_ATTENTION for n in gm.graph.nodes):
        raise InputError(f"{checkpoint} holds no depth-attention site: rewrite the model first "
                         "(`attnres-compile rewrite -o X.pt2`)")
    monitor = DepthMonitor(gm)
    try:
        monitor(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a damaged archive whose program fails on its own inputs
        raise InputError(f"the program in {checkpoint} fails on its example inputs ({first_line(exc)})") from None
    stats = monitor.stats()
    result = {"checkpoint": str(checkpoint), "stats": stats, "collapse": find_collapse(stats, min_entropy, dead_weight)}
    if out is not None:
        from .plots import plot_heatmap

        result["heatmap"] = str(plot_heatmap(stats, out, title=Path(checkpoint).name))
    return result


def format_stats(stats: dict, collapse: list[dict] | None = None) -> str:
    """A printed table: one row per site, its entropy against log|S| and its largest mean weights."""
    lines = [f"{'chain':<8}{'site':>5}{'|S|':>5}{'entropy':>9}{'log|S|':>8}{'rms':>9}  top sources (mean weight)"]
    for s in stats["sites"]:
        if "weights" not in s:
            lines.append(f"{s['chain']:<8}{s['site']:>5}{'':>5}{'':>9}{'':>8}{s['rms']:>9.4f}")
            continue
        top = sorted(enumerate(s["weights"]), key=lambda t: -t[1])[:3]
        tops = ", ".join(f"src{j}:{w:.2f}" for j, w in top)
        lines.append(f"{s['chain']:<8}{s['site']:>5}{s['sources']:>5}{s['entropy']:>9.3f}{s['max_entropy']:>8.3f}{s['rms']:>9.4f}  {tops}")
    for f in collapse or []:
        where = f"site {f['site']} (entropy {f['entropy']:.3f})" if f["kind"] == "site" else f"source {f['source']} (max weight {f['max_weight']:.2e})"
        lines.append(f"collapse: {f['chain']} {where}")
    return "\n".join(lines)
