"""Apply a `Plan` to an ONNX model: one `attnres.DepthAttention` node per site (function.py).

The site node takes over the value name of the site's sum, so every reader reads it without
rewiring; residual Adds and skip-path ops left unread are removed. Pseudo-queries are zero float32
initializers `attnres.chain<i>.site<k>` (k from 1), as the fx rewrite names them. Delta keeps the
residual Adds under fresh names (`attnres/chain<i>/plain<k>`), with gates `attnres.chain<i>.gate<k>`.
"""

from __future__ import annotations

from collections import Counter

import networkx as nx
import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..core.config import AttnResConfig
from ..core.plan import Chain, Plan, RewrittenSite
from .function import delta_node, site_node
from .two_phase import FreshNames
from .view import STANDARD_DOMAINS, subgraph_reads

PREFIX = "attnres"


def rewrite_sites(model: onnx.ModelProto, plan: Plan, config: AttnResConfig, view: nx.DiGraph) -> list[RewrittenSite]:
    """Rewrite `model` in place for every chain of `plan` marked for rewriting; returns the sites. Their
    final form (grouped, with functions) is the later passes' (passes.py)."""
    graph = model.graph
    rewriter = _Rewriter(graph, view, config)
    sites: list[RewrittenSite] = []
    for chain in plan.to_rewrite:
        sites += rewriter.chain(chain)
    nodes = []
    for node in graph.node:
        out = node.output[0] if node.output else None
        if out in rewriter.removed:
            nodes += rewriter.inserts.get(out, [])
        else:
            nodes.append(node)
            nodes += rewriter.after.get(out, [])
    dead_from = {i for node in graph.node if node.output and node.output[0] in rewriter.removed for i in node.input}
    nodes = _without_dead(nodes, dead_from, {o.name for o in graph.output})
    graph.ClearField("node")
    graph.node.extend(nodes)
    _prune_value_info(graph)
    return sites


class _Rewriter:
    """Builds the site nodes of each chain; records which Adds they replace."""

    def __init__(self, graph: onnx.GraphProto, view: nx.DiGraph, config: AttnResConfig):
        self.graph, self.view, self.config = graph, view, config
        self.names = FreshNames(graph)
        self.fresh = self.names.fresh
        self.removed: set[str] = set()               # output names of the residual Adds
        self.inserts: dict[str, list[onnx.NodeProto]] = {}  # site value -> nodes replacing its Add
        self.after: dict[str, list[onnx.NodeProto]] = {}  # Delta: value -> nodes placed after its producer
        self.producer = {o: n for n in graph.node for o in n.output}
        self.next_chain = 0

    def chain(self, chain: Chain) -> list[RewrittenSite]:
        while any(t.startswith(f"{PREFIX}.chain{self.next_chain}.") for t in self.names.taken):
            self.next_chain += 1
        tag = f"chain{self.next_chain}"
        self.next_chain += 1
        terms = chain.site_terms(self.config.block_size_for(len(chain.sources) - 1))
        cache: dict[tuple, str] = {}
        out = []
        delta = self.config.delta
        for k, (link, groups) in enumerate(zip(chain.links, terms), start=1):
            plain = self.fresh(f"{PREFIX}/{tag}/plain{k}") if delta else None
            nodes = self.after.setdefault(plain, []) if delta else self.inserts.setdefault(link.result, [])
            site = _Site(self, chain, tag, link.result, link.branches[0], nodes, cache)
            inputs = [site.term(group) for group in groups]
            scale = 1.0 if delta else float(len(inputs)) if self.config.scale == "preserve" else 1.0
            query = self.fresh(f"{PREFIX}.{tag}.site{k}")
            self.graph.initializer.append(numpy_helper.from_array(np.zeros(chain.feature_size, np.float32), query))
            name = self.fresh(f"{PREFIX}/{tag}/site{k}")
            gate = None
            if delta:
                gate = self.fresh(f"{PREFIX}.{tag}.gate{k}")
                self.graph.initializer.append(numpy_helper.from_array(np.full(1, self.config.gate_init, np.float32), gate))
                nodes.append(delta_node(inputs, query, plain, gate, link.result, eps=self.config.eps, scale=scale,
                                        axis=chain.feature_axis, rank=len(link.shape), name=name))
                nxt = chain.links[k] if k < len(chain.links) else None
                self._read_delta(link.result, plain, chain.skip_paths[k] if nxt else [], nxt.adds if nxt else [], tag)
            else:
                nodes.append(site_node(inputs, query, link.result, eps=self.config.eps, scale=scale,
                                       axis=chain.feature_axis, rank=len(link.shape), name=name))
                self.removed.update(link.adds)
            out.append(RewrittenSite(chain.index, k, name, query, len(inputs), scale, gate))
        return out

    def _read_delta(self, value: str, plain: str, path: list[str], skip_adds: list[str], tag: str) -> None:
        """Delta: `value`'s producer writes `plain` instead (the Delta node takes `value` over); the
        skip path to the next link (`path`, read at its end by one of `skip_adds`) goes on from the plain
        names, and each op on it with other readers is copied over the Delta side (the copy takes its
        value name over, the op writes a fresh one)."""
        readers = [self.producer[a] for a in skip_adds]
        self._rename(value, plain)
        hops = [*path, None]
        for i, hop in enumerate(hops):
            on_path = readers if hop is None else [self.producer[hop]]
            for node in on_path:  # the path reads the plain value
                node.input[:] = [plain if x == value else x for x in node.input]
            if hop is None or not self._read_off_path(hops[i:], skip_adds):
                return
            op = self.producer[hop]
            fresh = self.fresh(f"{PREFIX}/{tag}/plain/{hop}")
            copy = onnx.NodeProto()
            copy.CopyFrom(op)
            copy.input[:] = [value if x == plain else x for x in op.input]  # over the Delta side
            copy.name = self.fresh(f"{PREFIX}/{tag}/delta/{op.name or hop}")
            self._rename(hop, fresh)
            self.after.setdefault(fresh, []).append(copy)  # reads `value` (the Delta side), writes `hop`
            value, plain = hop, fresh

    def _read_off_path(self, hops: list, skip_adds: list[str]) -> bool:
        """Whether an op of `hops` (the rest of a skip path, None at its end) has a reader off the path."""
        for hop, nxt in zip(hops, hops[1:]):
            keep = set(skip_adds) if nxt is None else {nxt}
            if any(u not in keep for u in self.view.nodes[hop]["users"]):
                return True
        return False

    def _rename(self, value: str, new: str) -> None:
        """`value`'s producer writes `new` instead."""
        node = self.producer.pop(value)
        node.output[:] = [new if o == value else o for o in node.output]
        self.producer[new] = node


class _Site:
    """The entries of S_k for one site: sources in the site's layout and (partial) block sums."""

    def __init__(self, rw: _Rewriter, chain: Chain, tag: str, value: str, ref: str, nodes: list, cache: dict):
        self.rw, self.sources, self.tag, self.ref, self.nodes, self.cache = rw, chain.sources, tag, ref, nodes, cache
        self.shape = rw.view.nodes[value]["shape"]

    def term(self, group: tuple[int, ...]) -> str:
        key = (group, self.shape)
        if key not in self.cache:
            last = self.in_layout(self.sources[group[-1]])
            if len(group) == 1:
                self.cache[key] = last
            else:
                name = self.rw.fresh(f"{PREFIX}/{self.tag}/sum{group[0]}-{group[-1]}")
                self.nodes.append(helper.make_node("Add", [self.term(group[:-1]), last], [name], name=name))
                self.cache[key] = name
        return self.cache[key]

    def in_layout(self, source: str) -> str:
        """`source` reshaped to the site's layout when the two differ ([B*T, D] vs [B, T, D])."""
        if self.rw.view.nodes[source]["shape"] == self.shape:
            return source
        key = (source, self.shape)
        if key not in self.cache:
            shape_key = ("shape", self.ref)
            if shape_key not in self.cache:
                shape = self.rw.fresh(f"{PREFIX}/{self.tag}/shape_of/{self.ref}")
                self.nodes.append(helper.make_node("Shape", [self.ref], [shape], name=shape))
                self.cache[shape_key] = shape
            name = self.rw.fresh(f"{PREFIX}/{self.tag}/layout/{source}")
            self.nodes.append(helper.make_node("Reshape", [source, self.cache[shape_key]], [name], name=name))
            self.cache[key] = name
        return self.cache[key]


def _without_dead(nodes: list[onnx.NodeProto], candidates: set[str], outputs: set[str]) -> list[onnx.NodeProto]:
    """Drop standard ops among `candidates`' producers (transitively) whose outputs nobody reads."""
    uses = Counter(i for n in nodes for i in [*n.input, *subgraph_reads(n)] if i) + Counter(outputs)
    kept = []
    for node in reversed(nodes):
        outs = [o for o in node.output if o]
        dead = (node.domain in STANDARD_DOMAINS and any(o in candidates for o in outs)
                and not any(uses[o] for o in outs) and not subgraph_reads(node))
        if dead:
            for i in node.input:
                uses[i] -= 1
                candidates.add(i)
        else:
            kept.append(node)
    return kept[::-1]


def _prune_value_info(graph: onnx.GraphProto) -> None:
    produced = {o for n in graph.node for o in n.output}
    keep = [vi for vi in graph.value_info if vi.name in produced]
    graph.ClearField("value_info")
    graph.value_info.extend(keep)
