"""Chain analysis on the neutral view: residual links, chains, sources and sites (docs/design.md §2).
Runs once per model; every rewriter applies the resulting `Plan`. Every add ends up in a link or
in `Plan.skipped_adds` with its reason. About linear in graph size.
"""

from __future__ import annotations

import networkx as nx

from .config import AttnResConfig
from .graph_view import Kind, dynamic_inputs, format_shape
from .plan import Chain, Link, Plan, SkippedAdd

MAX_HOPS = 16           # ops walked back from a skip to the previous link's result
MAX_NONLINEAR_HOPS = 4  # of which non-linear (post-norm LayerNorm, ReLU, ...)

NOT_A_SKIP = "no operand that every other operand depends on (e.g. tok + pos, a mask, a projection shortcut)"
ALREADY_DELTA = "the plain sum of a Delta AttnRes site (already rewritten)"
NOT_LEARNED = "no learned op on the branch (an activation's own sum, e.g. GELU-tanh's x + 0.044715*x**3)"


def analyze(g: nx.DiGraph, config: AttnResConfig) -> Plan:
    """Find residual links and chains in the view `g`; decide which chains `config` rewrites."""
    nodes = g.nodes
    adds = sorted((n for n in g if nodes[n]["kind"] == Kind.ADD), key=lambda n: nodes[n]["order"])
    inner = {n for n in adds if _is_inner(g, n)}
    skipped: list[SkippedAdd] = []
    links: dict[str, Link] = {}
    bases = _delta_bases(g)
    for root in adds:
        if root in bases:
            skipped.append(SkippedAdd(root, nodes[root]["target"], ALREADY_DELTA))
        elif root not in inner:
            _match_sum(g, root, inner, links, skipped)
    chains = _chains(g, links, config)
    existing = [n for n in g if nodes[n]["kind"] == Kind.DEPTH_ATTENTION]
    return Plan(chains, skipped, existing, len(adds))


def _delta_bases(g: nx.DiGraph) -> set[str]:
    """The plain sums that Delta AttnRes sites already in the graph read (their `base`, the input
    before the gate): a rewritten Delta model keeps its residual adds, which are no links again."""
    nodes = g.nodes
    return {nodes[n]["inputs"][-2] for n in g if nodes[n]["kind"] == Kind.DEPTH_ATTENTION
            and "delta" in str(nodes[n]["target"]).lower() and len(nodes[n]["inputs"]) >= 4}


def _is_plain_tensor_add(g: nx.DiGraph, n: str) -> bool:
    """A plain add of two data-dependent tensors (a bias or eps add is never part of a sum tree)."""
    d = g.nodes[n]
    return (d["kind"] == Kind.ADD and d["blocker"] is None and not d["scalar"]
            and not any(g.nodes[i]["const"] for i in d["inputs"]))


def _sole_user(g: nx.DiGraph, n: str) -> str | None:
    """The only consumer of `n`, looking through single-use value-preserving ops (a cast, a p=0
    dropout: Falcon's `dropout_add(mlp += attn, h)`), or None."""
    users = g.nodes[n]["users"]
    while len(users) == 1 and _is_transparent(g, users[0]):
        users = g.nodes[users[0]]["users"]
    return users[0] if len(users) == 1 else None


def _is_transparent(g: nx.DiGraph, n: str) -> bool:
    d = g.nodes[n]
    return d["kind"] == Kind.PASSTHROUGH and not d["mode_dependent"]


def _is_inner(g: nx.DiGraph, n: str) -> bool:
    """An add whose only use is another plain add of the same shape: part of an n-ary sum."""
    user = _sole_user(g, n)
    return (
        _is_plain_tensor_add(g, n)
        and user is not None
        and _is_plain_tensor_add(g, user)
        and g.nodes[user]["shape"] == g.nodes[n]["shape"]
    )


def _inner_source(g: nx.DiGraph, i: str, inner: set[str]) -> tuple[str | None, list[str]]:
    """The inner add that operand `i` passes on unchanged (`i` itself, or through transparent ops
    that are returned with it), or (None, [])."""
    hops = []
    while i not in inner and _is_transparent(g, i) and len(g.nodes[i]["users"]) == 1:
        hops.append(i)
        i = g.nodes[i]["inputs"][0]
    return (i, hops) if i in inner else (None, [])


def _flatten(g: nx.DiGraph, root: str, inner: set[str]) -> tuple[list[str], list[str], list[str]]:
    """The add nodes of the sum tree under `root`, its terms in operand order, and the
    transparent ops between its adds."""
    tree, terms, between, stack = [], [], [], [root]
    while stack:
        n = stack.pop()
        tree.append(n)
        for i in reversed(g.nodes[n]["inputs"]):
            source, hops = _inner_source(g, i, inner)
            if source is not None:
                stack.append(source)
                between += hops
            else:
                terms.append(i)
    return tree, list(reversed(terms)), between


def _match_sum(g: nx.DiGraph, root: str, inner: set[str], links: dict[str, Link], skipped: list[SkippedAdd]) -> None:
    """The link of the sum tree under `root` into `links`; where its terms form none as a whole, `root`
    over its own operands and each add under it as a sum of its own (an FPN's `(x + se(x)) +
    upsample(y)` holds the residual `x + se(x)`); what forms no link into `skipped`."""
    tree, terms, between = _flatten(g, root, inner)
    found = _match_link(g, root, tree, terms)
    if isinstance(found, Link):
        found.inner = between
        links[root] = found
        return
    if len(tree) == 1:
        skipped.append(SkippedAdd(root, g.nodes[root]["target"], found))
        return
    parts = [a for a in tree if a != root]
    tree, terms, _ = _flatten(g, root, inner - set(parts))
    found = _match_link(g, root, tree, terms)
    if isinstance(found, Link):
        links[root] = found
    else:
        skipped.append(SkippedAdd(root, g.nodes[root]["target"], found))
    for part in dict.fromkeys(_inner_source(g, i, inner)[0] for i in g.nodes[root]["inputs"]):
        if part is not None:
            _match_sum(g, part, inner, links, skipped)


def _match_link(g: nx.DiGraph, root: str, tree: list[str], terms: list[str]) -> Link | str:
    """The link formed by the sum `terms`, or the reason it is not a residual link."""
    nodes = g.nodes
    if nodes[root]["blocker"]:
        return nodes[root]["blocker"]
    if nodes[root]["scalar"]:
        return "adds a scalar constant (eps, offset)"
    if len(terms) < 2:
        return "adds a single tensor operand"
    if any(nodes[t]["const"] for t in terms):
        return "an operand is a constant (bias, parameter or positional table)"
    paths = {t: _value_path(g, t) for t in terms}
    if len({p[-1] for p in paths.values()}) < len(terms):
        return "two operands are the same value (x + x is a scaling, not a residual)"
    skip = min(terms, key=lambda t: nodes[paths[t][-1]]["order"])
    branches = [t for t in terms if t != skip]
    if not all(_depends_on(g, b, paths[skip]) for b in branches):
        return NOT_A_SKIP
    if not all(_learned_branch(g, paths[skip], b) for b in branches):
        return NOT_LEARNED
    shape = nodes[skip]["shape"]
    if shape is None or any(nodes[t]["shape"] is None for t in terms):
        return "shapes unknown (the graph carries no shape metadata)"
    for b in branches:
        if nodes[b]["shape"] != shape:
            return f"skip shape {format_shape(shape)} and branch shape {format_shape(nodes[b]['shape'])} differ"
    branches.sort(key=lambda t: nodes[t]["order"])
    return Link(result=root, skip=skip, branches=branches, adds=sorted(tree, key=lambda a: nodes[a]["order"]), shape=shape)


def _value_path(g: nx.DiGraph, node: str) -> list[str]:
    """`node`, then back through value-preserving ops (casts, dropout, views) to the value's origin."""
    path = [node]
    while g.nodes[path[-1]]["kind"] in (Kind.PASSTHROUGH, Kind.LAYOUT):
        inputs = dynamic_inputs(g, path[-1])
        if len(inputs) != 1:
            break
        path.append(inputs[0])
    return path


def _depends_on(g: nx.DiGraph, node: str, skip_path: list[str]) -> bool:
    """Whether `node` reads the skip value (any node of `skip_path`) through an op that is not an add
    (a value reached only as an addend, like an attention mask, is no skip). Depth-attention nodes are
    barriers, so a rewritten graph's sums never form links again.
    """
    nodes = g.nodes
    targets = set(skip_path)
    low = nodes[skip_path[-1]]["order"]
    seen, stack = {node}, [node]
    while stack:
        n = stack.pop()
        if nodes[n]["kind"] == Kind.DEPTH_ATTENTION:
            continue
        for i in nodes[n]["inputs"]:
            if i in targets and nodes[n]["kind"] != Kind.ADD:
                return True
            if i not in seen and nodes[i]["order"] > low:
                seen.add(i)
                stack.append(i)
    return False


def _learned_branch(g: nx.DiGraph, skip_path: list[str], branch: str) -> bool:
    """Whether the cone of `branch` after the skip holds a learned op, on a path from the skip or in
    another operand's cone (FiLM / adaLN gating). The skip's own cone is never searched (GELU-tanh's
    internal sum is no link); depth-attention nodes are barriers as in `_depends_on`.
    """
    nodes = g.nodes
    low = nodes[skip_path[-1]]["order"]
    seen, stack = {branch}, [branch]
    while stack:
        n = stack.pop()
        if nodes[n]["learned"] and n not in skip_path:
            return True
        if nodes[n]["kind"] == Kind.DEPTH_ATTENTION:
            continue
        for i in nodes[n]["inputs"]:
            if i not in seen and nodes[i]["order"] > low:
                seen.add(i)
                stack.append(i)
    return False


def _predecessor(g: nx.DiGraph, link: Link, by_result: dict[str, Link]) -> tuple[str, list[str], list[str]] | None:
    """Walk back from `link.skip` to the result of an earlier link.

    Returns (that link's result, ops walked, the non-linear ones among them), or None.
    """
    nodes = g.nodes
    cur, path, nonlinear = link.skip, [], []
    for _ in range(MAX_HOPS):
        if cur in by_result:
            return cur, path, nonlinear
        inputs = dynamic_inputs(g, cur)
        if len(inputs) != 1:
            return None
        kind = nodes[cur]["kind"]
        if kind in (Kind.OP, Kind.ADD):  # an op, or a bias add: shape-preserving ones join non-linearly
            same_shape = nodes[cur]["shape"] is not None and nodes[cur]["shape"] == nodes[inputs[0]]["shape"]
            if not same_shape or len(nonlinear) == MAX_NONLINEAR_HOPS:
                return None
            nonlinear.append(cur)
        elif kind not in (Kind.PASSTHROUGH, Kind.LAYOUT):
            return None
        path.append(cur)
        cur = inputs[0]
    return None


def _feature_axis(shape: tuple, config: AttnResConfig) -> int | None:
    rank = len(shape)
    axis = config.feature_axis if config.feature_axis is not None else (1 if rank == 4 else -1)
    if not -rank <= axis < rank:
        return None
    axis %= rank
    return -1 if axis == rank - 1 else axis


def _chains(g: nx.DiGraph, links: dict[str, Link], config: AttnResConfig) -> list[Chain]:
    nodes = g.nodes
    ordered = sorted(links.values(), key=lambda l: nodes[l.result]["order"])
    preds: dict[str, tuple[str, list[str], list[str]]] = {}
    for link in ordered:
        found = _predecessor(g, link, links)
        if found is None:
            continue
        prev, path, _ = found
        axes = {_feature_axis(links[prev].shape, config), _feature_axis(link.shape, config)}
        if any(nodes[p]["kind"] == Kind.LAYOUT for p in path) and axes != {-1}:
            continue  # a reshape is only layout-only for last-axis streams
        preds[link.result] = found
    successors = _successors(preds)
    forks = {prev for prev, succ in successors.items() if len(succ) > 1}
    chains: list[Chain] = []
    for link in ordered:
        found = preds.get(link.result)
        if found is not None and found[0] not in forks:
            continue  # not the start of a stream
        stream, joins, paths = [link], [], [[]]
        while stream[-1].result in successors and stream[-1].result not in forks:
            nxt = links[successors[stream[-1].result][0]]
            joins.append([nodes[n]["target"] for n in preds[nxt.result][2]])
            paths.append(list(reversed(preds[nxt.result][1])))
            stream.append(nxt)
        chains += _segments(g, stream, joins, config, len(chains), paths)
    return chains


def _successors(preds: dict[str, tuple[str, list[str], list[str]]]) -> dict[str, list[str]]:
    """Each link result's continuations: of the links that walk back to it, those through the
    fewest non-linear ops. A chain nested in a branch reaches the outer site through the
    branch's own norm and projection on top of the outer join, so it does not fork the outer
    stream. Dropped candidates are removed from `preds` and start streams of their own."""
    by_prev: dict[str, list[str]] = {}
    for result, (prev, _, _) in preds.items():
        by_prev.setdefault(prev, []).append(result)
    for prev, results in by_prev.items():
        fewest = min(len(preds[r][2]) for r in results)
        for result in [r for r in results if len(preds[r][2]) > fewest]:
            del preds[result]
            results.remove(result)
    return by_prev


def _segments(g: nx.DiGraph, stream: list[Link], joins: list[list[str]], config: AttnResConfig, start: int,
              paths: list[list[str]]) -> list[Chain]:
    """Cut a stream into chains: at non-linear joins unless `config.allow_nonlinear`. `paths`: per
    link, the ops from the previous link's result to its skip (Chain.skip_paths)."""
    through = sorted({t for j in joins for t in j})
    if config.allow_nonlinear or not through:
        parts = [list(zip(stream, paths))]
    else:
        parts, cur = [], [(stream[0], [])]
        for link, join, path in zip(stream[1:], joins, paths[1:]):
            if join:
                parts.append(cur)
                cur = []
            cur.append((link, path if cur else []))
        parts.append(cur)
    chains = []
    for part in parts:
        chain = Chain(start + len(chains), [link for link, _ in part], -1, None, skip_paths=[p for _, p in part])
        chains.append(_decide(g, chain, config, through))
    return chains


def _decide(g: nx.DiGraph, chain: Chain, config: AttnResConfig, through: list[str]) -> Chain:
    """Fill in the feature axis and whether (and why not) the chain is rewritten."""
    shape = chain.links[0].shape
    axis = _feature_axis(shape, config)
    if axis is None:
        chain.reason = f"feature_axis {config.feature_axis} is out of range for a rank-{len(shape)} stream"
        return chain
    chain.feature_axis = axis
    sizes = {link.shape[axis] for link in chain.links}
    chain.feature_size = next(iter(sizes)) if len(sizes) == 1 else None
    nonlinear = config.allow_nonlinear and bool(through)
    if len(chain.links) < config.min_chain:
        chain.reason = f"chain of {len(chain.links)} link(s) is shorter than min_chain={config.min_chain}"
        if through and not config.allow_nonlinear:
            chain.reason += (
                f"; the stream continues through non-linear {', '.join(through)} (post-norm or"
                " post-activation): pass allow_nonlinear=True to rewrite it (changes the function)"
            )
    elif chain.feature_size is None:
        chain.reason = f"feature axis {axis} differs between links ({format_shape(tuple(sorted(map(str, sizes))))})"
    elif not isinstance(chain.feature_size, int):
        chain.reason = f"feature axis {axis} is dynamic ({format_shape((chain.feature_size,))}); export with a static feature size"
    elif config.delta and nonlinear:
        chain.reason = (f"variant 'delta' keeps the plain sum and adds to what reads it, but this stream passes "
                        f"through non-linear {', '.join(through)} between links, so no link reads a plain sum "
                        "(a gate on a chain that is not a pure sum): use variant full or block with allow_nonlinear")
    else:
        chain.rewrite = True
        chain.changes_function = nonlinear or (config.delta and config.gate_init != 0.0)
        chain.through = through if nonlinear else []
    return chain
