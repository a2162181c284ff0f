"""Regroup `attnres.DepthAttention` site nodes into the two-phase form (function.py), by core/two_phase.py's policy.

It reads only site nodes, so both paths to ONNX use it. Sites of one chain (same root, eps and
axis -1) whose source lists share a prefix form a group: one Partial over the shared history,
appending to the previous Partial's (every source named once, so the file grows linearly with
depth), and one Merge per site over its extras. Groups of one, pairs over at most MAX_GROUP
sources (no gain in onnxruntime) and sites on another axis stay DepthAttention nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from ..core.two_phase import MAX_GROUP, site_groups
from .function import DELTA, DOMAIN, MERGE, OP_TYPE, PAIR, PARTIAL, merge_node, partial_node


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


class FreshNames:
    """Names for added nodes and values that no node, value, initializer or input of `graph` has yet."""

    def __init__(self, graph: onnx.GraphProto):
        self.taken = {o for n in graph.node for o in n.output} | {n.name for n in graph.node}
        self.taken |= {i.name for i in graph.initializer} | {v.name for v in graph.input}

    def fresh(self, name: str) -> str:
        candidate, i = name, 1
        while candidate in self.taken:
            candidate, i = f"{name}_{i}", i + 1
        self.taken.add(candidate)
        return candidate


def group_sites(graph: onnx.GraphProto) -> int:
    """Regroup the DepthAttention nodes of `graph` in place; returns the number of Merge nodes made."""
    chains: dict[tuple, list[int]] = {}
    for i, node in enumerate(graph.node):
        if node.domain == DOMAIN and node.op_type == OP_TYPE and len(node.input) >= 3:
            attrs = _attrs(node)
            if attrs.get("axis") == -1:
                chains.setdefault((node.input[0], attrs["eps"]), []).append(i)
    names = FreshNames(graph)
    produced = {o: i for i, n in enumerate(graph.node) for o in n.output}  # initializers and inputs: absent
    replace: dict[int, onnx.NodeProto] = {}
    before: dict[int, onnx.NodeProto] = {}
    merges = 0
    for (_, eps), members in chains.items():
        nodes = [graph.node[i] for i in members]
        terms = [list(n.input[:-1]) for n in nodes]
        stacked: tuple[list[str], list[str]] | None = None   # (history, [history_out, rms_out]) of the last Partial
        for start, end, length in site_groups(terms):
            if end - start < 2 or (end - start == 2 and length <= MAX_GROUP):
                continue
            if any(produced.get(n.input[-1], -1) > members[start] for n in nodes[start:end]):
                continue  # a query computed after the group's first site: no Partial can read it there
            history, first = terms[start][:length], nodes[start]
            carried = stacked is not None and history[:len(stacked[0])] == stacked[0]
            new = history[len(stacked[0]):] if carried else history
            base = f"{first.name or first.output[0]}/partial"
            outs = [names.fresh(f"{base}/{what}") for what in ("history", "rms", "lse", "acc", "columns")]
            before[members[start]] = partial_node(stacked[1] if carried else [], new,
                                                  [n.input[-1] for n in nodes[start:end]], outs, eps=eps,
                                                  name=names.fresh(base))
            stacked = (history, outs[:2])
            for index, node in enumerate(nodes[start:end]):
                attrs = _attrs(node)
                replace[members[start + index]] = merge_node(
                    outs[2], outs[3], outs[4], terms[start + index][length:], node.input[-1], node.output[0], index=index,
                    eps=eps, scale=attrs["scale"], name=node.name)
                merges += 1
    if not replace:
        return 0
    nodes = []
    for i, node in enumerate(graph.node):
        if i in before:
            nodes.append(before[i])
        nodes.append(replace.get(i, node))
    graph.ClearField("node")
    graph.node.extend(nodes)
    return merges


@dataclass
class Site:
    """One site of a graph in either form: its node, output, full source list S_k and attributes."""

    node: onnx.NodeProto
    sources: list[str]
    query: str
    eps: float
    scale: float
    axis: int
    base: str | None = None  # Delta AttnRes: the plain sum and the gate
    gate: str | None = None


def sites(graph: onnx.GraphProto) -> list[Site]:
    """The sites of `graph` in order (DepthAttention, Merge and pair nodes), a Merge's sources resolved
    through its Partial (and the Partials it carries from) to the history entries plus its extras.
    Assumes a well-formed graph (onnx_site_check.check_sites)."""
    history: dict[str, list[str]] = {}  # lse output of a Partial -> its history entries
    stacked: dict[str, list[str]] = {}  # history_out of a Partial -> its history entries
    out = []
    for node in graph.node:
        if node.domain != DOMAIN:
            continue
        attrs = _attrs(node)
        if node.op_type == PARTIAL:
            carried = stacked[node.input[0]] if attrs["carry"] else []
            entries = carried + list(node.input[2 * attrs["carry"]:len(node.input) - attrs["queries"]])
            stacked[node.output[0]] = history[node.output[2]] = entries
        elif node.op_type in (OP_TYPE, MERGE):
            sources = (history[node.input[0]] + list(node.input[3:-1])) if node.op_type == MERGE else list(node.input[:-1])
            out.append(Site(node, sources, node.input[-1], attrs["eps"], attrs["scale"], attrs["axis"]))
        elif node.op_type == DELTA:
            out.append(Site(node, list(node.input[:-3]), node.input[-3], attrs["eps"], attrs["scale"], attrs["axis"],
                            node.input[-2], node.input[-1]))
        elif node.op_type == PAIR:
            count = len(node.input) - 1 - attrs["affine"]
            out.append(Site(node, list(node.input[:count]), node.input[count], attrs["eps"], attrs["scale"], attrs["axis"]))
    return out
