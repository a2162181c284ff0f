"""Two-phase sites in a rewritten GraphModule, for eager inference (ops/two_phase.py).

Sites of one chain that share a history (onnx_grouping.site_groups) become one
`depth_attention_partial` over that history for all their queries, before the group's first
site, and a `depth_attention_merge` (Delta: `depth_attention_merge_delta`) per site over its
own newest sources, where that moves fewer bytes and the history is at least MIN_HISTORY.
Applied to a module that is run (`two_phase(gm)`), not in `rewrite`, whose canonical form the
monitor reads; `one_pass` is the inverse for exporters and re-analysis (docs/design.md §6).
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from ..core.two_phase import site_groups, two_phase_wins
from ..ops.delta import depth_attention_delta as DELTA
from ..ops.delta import depth_attention_merge_delta as MERGE_DELTA
from ..ops.depth_attention import depth_attention as SITE
from ..ops.two_phase import depth_attention_merge as MERGE
from ..ops.two_phase import depth_attention_partial as PARTIAL


def _site_args(node: fx.Node):
    """(sources, query, eps, scale, dim, (base, gate) or ()) of a one-pass site node (Delta's too), else None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is SITE and len(node.args) == 5:
        return (*node.args, ())
    if node.target is DELTA and len(node.args) == 7:
        sources, query, base, gate, eps, scale, dim = node.args
        return sources, query, eps, scale, dim, (base, gate)
    return None


def two_phase(gm: fx.GraphModule, min_history: int | None = None) -> PassResult:
    """Rewrite `gm`'s groups of sites over a shared history to partial + merges, in place."""
    graph = gm.graph
    chains: dict[tuple, list[fx.Node]] = {}
    for node in graph.nodes:
        site = _site_args(node)
        if site is not None:
            sources, _, eps, _, dim, delta = site
            chains.setdefault((sources[0], eps, dim, bool(delta)), []).append(node)
    position = {node: i for i, node in enumerate(graph.nodes)}
    merges = 0
    for members in chains.values():
        terms = [list(node.args[0]) for node in members]
        for start, end, length in site_groups(terms):
            group = members[start:end]
            extras = [len(t) - length for t in terms[start:end]]
            if end - start < 2 or not two_phase_wins(length, extras, _itemsize(group[0]), min_history):
                continue
            queries = [node.args[1] for node in group]  # the query is the second argument of both site ops
            if any(q.op not in ("get_attr", "placeholder") and position[q] > position[group[0]] for q in queries):
                continue  # a query computed after the group's first site: no partial can read it there
            merges += _rewrite_group(graph, group, terms[start][:length])
    if merges:
        graph.lint()
        gm.recompile()
    return PassResult(gm, merges > 0)


def _itemsize(site: fx.Node) -> int:
    val = site.meta.get("val")
    return val.element_size() if isinstance(val, torch.Tensor) else 4


def _rewrite_group(graph: fx.Graph, group: list[fx.Node], history: list[fx.Node]) -> int:
    first = group[0]
    _, _, eps, _, dim, _ = _site_args(first)
    with graph.inserting_before(first):
        queries = [graph.get_attr(q.target) if q.op == "get_attr" else q for q in (node.args[1] for node in group)]
        stacked = graph.call_function(torch.stack, (queries,))
        partial = graph.call_function(PARTIAL, (history, stacked, eps, dim))
        state = [graph.call_function(operator.getitem, (partial, i)) for i in range(3)]
    for index, node in enumerate(group):
        sources, query, eps, scale, dim, delta = _site_args(node)
        with graph.inserting_before(node):
            merge = graph.call_function(MERGE_DELTA if delta else MERGE,
                                        (*state, index, sources[len(history):], query, *delta, eps, scale, dim))
        merge.meta.update(node.meta)
        node.replace_all_uses_with(merge)
        graph.erase_node(node)
    return len(group)


def one_pass(gm: fx.GraphModule) -> PassResult:
    """Undo `two_phase` in place: every merge back to one `depth_attention` over its partial's
    history and its own extras (the same op calls `rewrite` made), the partials, their state and
    their stacked queries removed."""
    graph = gm.graph
    partials = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (MERGE, MERGE_DELTA):
            continue
        if node.target is MERGE:
            state, *_, extra, query, eps, scale, dim = node.args
            delta = ()
        else:
            state, *_, extra, query, base, gate, eps, scale, dim = node.args
            delta = (base, gate)
        partial = state.args[0]
        with graph.inserting_before(node):
            if delta:
                site = graph.call_function(DELTA, ([*partial.args[0], *extra], query, *delta, eps, scale, dim))
            else:
                site = graph.call_function(SITE, ([*partial.args[0], *extra], query, eps, scale, dim))
        site.meta.update(node.meta)
        node.replace_all_uses_with(site)
        graph.erase_node(node)
        if partial not in partials:
            partials.append(partial)
    for partial in partials:
        for user in list(partial.users):
            if not user.users:
                graph.erase_node(user)
        stacked = partial.args[1]
        if not partial.users:
            graph.erase_node(partial)
        if isinstance(stacked, fx.Node) and stacked.op == "call_function" and not stacked.users:
            queries = stacked.args[0]
            graph.erase_node(stacked)
            for q in queries:
                if isinstance(q, fx.Node) and q.op == "get_attr" and not q.users:
                    graph.erase_node(q)
    if partials:
        graph.lint()
        gm.recompile()
    return PassResult(gm, bool(partials))
