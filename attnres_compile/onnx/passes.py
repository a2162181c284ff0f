"""The ONNX passes, each a named step on a model in place that returns what it did (`PassResult`), and
`run`, which applies a list of them and counts, as onnxscript's rewriter pipelines read."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import onnx

from ..core.config import AttnResConfig
from ..core.plan import Plan, RewrittenSite
from . import site_norm
from .function import attach_functions, default_opset
from .rewrite import rewrite_sites
from .two_phase import group_sites
from .unfuse_skip_norm import Unfused, unfuse


@dataclass
class PassResult:
    """`model`, changed in place; `count`: what the pass made or replaced (nodes, sites, pairs)."""

    model: onnx.ModelProto
    count: int

    @property
    def modified(self) -> bool:
        return self.count > 0


class UnfuseSkipNorms:
    """onnxruntime's Skip*LayerNormalization back into Add + norm, so their sums are residual adds
    (unfuse_skip_norm.py); `unfused` keeps the counts per op and what was kept, for the report."""

    name = "unfuse_skip_norms"

    def __init__(self):
        self.unfused = Unfused()

    def __call__(self, model: onnx.ModelProto) -> PassResult:
        self.unfused = unfuse(model, default_opset(model))
        return PassResult(model, sum(self.unfused.counts.values()))


class RewriteSites:
    """One `attnres.DepthAttention` node per site of every chain of `plan` marked for rewriting
    (rewrite.py); `sites` holds what it rewrote, for the report."""

    name = "rewrite_sites"

    def __init__(self, plan: Plan, config: AttnResConfig, view: nx.DiGraph):
        self.plan, self.config, self.view = plan, config, view
        self.sites: list[RewrittenSite] = []

    def __call__(self, model: onnx.ModelProto) -> PassResult:
        self.sites = rewrite_sites(model, self.plan, self.config, self.view)
        return PassResult(model, len(self.sites))


class FuseNorms:
    """Each site a norm reads, and that norm, as one `attnres.DepthAttentionNorm` node (site_norm.py);
    `view` tells which values are float32."""

    name = "fuse_norms"

    def __init__(self, view: nx.DiGraph):
        self.view = view

    def __call__(self, model: onnx.ModelProto) -> PassResult:
        float32 = lambda name: name in self.view and self.view.nodes[name]["dtype"] == "float"  # noqa: E731
        return PassResult(model, site_norm.fuse_norms(model.graph, float32))


class GroupSites:
    """Sites sharing a history as one Partial and a Merge per site (two_phase.py); counts the Merges."""

    name = "group_sites"

    def __call__(self, model: onnx.ModelProto) -> PassResult:
        return PassResult(model, group_sites(model.graph))


class AttachFunctions:
    """Every attnres node given its model-local function (function.py); counts the sites."""

    name = "attach_functions"

    def __call__(self, model: onnx.ModelProto) -> PassResult:
        return PassResult(model, attach_functions(model))


# every path to an AttnRes ONNX model ends with these: the rewrite and the PyTorch export alike
FINALIZE = (GroupSites, AttachFunctions)


def run(model: onnx.ModelProto, passes) -> dict[str, int]:
    """Apply `passes` to `model` in order, in place; {pass name: count}."""
    return {p.name: p(model).count for p in passes}
