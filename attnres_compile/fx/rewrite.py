"""Apply a `Plan` to a torch.fx GraphModule: one depth_attention node per site.

Site k gets `depth_attention(S_k, w_k, eps, c_k, axis)` right after its original sum, whose
uses read it instead; the now unused residual adds are erased. Block sums are plain shared adds;
pseudo-queries are zero parameters `attnres.chain<i>.site<k>` (k from 1). Delta AttnRes keeps the
residual adds: site k is `depth_attention_delta(S_k, w_k, h_k, g_k, eps, 1, axis)` with gate
`attnres.chain<i>.gate<k>` (float32 [1]); the next link's skip keeps reading h_k
(Chain.skip_paths), every other reader reads the Delta output.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..core.config import AttnResConfig
from ..core.plan import Chain, Plan, RewrittenSite
from ..ops import delta, depth_attention
from .view import InputDims, tensor_meta

HOLDER = "attnres"
_ASSERT = torch.ops.aten._assert_tensor_metadata.default


class RewriteSites(PassBase):
    """The pass that applies `plan` to a GraphModule, in place: one depth_attention node (Delta:
    depth_attention_delta) per site of every chain marked for rewriting. `sites` holds what it
    rewrote, for the report."""

    name = "rewrite_sites"

    def __init__(self, plan: Plan, config: AttnResConfig):
        super().__init__()
        self.plan, self.config = plan, config
        self.sites: list[RewrittenSite] = []

    def call(self, gm: fx.GraphModule) -> PassResult:
        if not hasattr(gm, HOLDER):
            gm.add_submodule(HOLDER, nn.Module())
        holder = gm.get_submodule(HOLDER)
        by_name = {n.name: n for n in gm.graph.nodes}
        replaced: dict[fx.Node, fx.Node] = {}
        dims = InputDims(gm)
        for chain in self.plan.to_rewrite:
            name = _free_name(holder)
            params = nn.ParameterDict()
            holder.register_module(name, params)
            self.sites += _rewrite_chain(gm, chain, name, params, by_name, replaced, self.config, dims)
        for old, new in replaced.items():
            old.replace_all_uses_with(new)
        if not self.config.delta:  # Delta keeps the stream's sums
            links = [link for c in self.plan.to_rewrite for link in c.links]
            _erase_dead(gm.graph, [by_name[a] for link in links for a in link.adds + link.inner])
        gm.graph.lint()
        gm.recompile()
        return PassResult(gm, bool(self.sites))


def _free_name(holder: nn.Module) -> str:
    i = 0
    while hasattr(holder, f"chain{i}"):
        i += 1
    return f"chain{i}"


def _rewrite_chain(gm, chain: Chain, name, params, by_name, replaced, config, dims) -> list[RewrittenSite]:
    graph = gm.graph
    sources = [by_name[s] for s in chain.sources]
    terms = chain.site_terms(config.block_size_for(len(sources) - 1))
    cache: dict[tuple, fx.Node] = {}
    out = []
    for k, (link, groups) in enumerate(zip(chain.links, terms), start=1):
        site = by_name[link.result]
        ref = by_name[link.branches[0]]  # has the site's shape and layout
        val = site.meta.get("val")
        device = val.device if isinstance(val, torch.Tensor) else None
        params[f"site{k}"] = nn.Parameter(torch.zeros(chain.feature_size, dtype=torch.float32, device=device))
        layout = (site, ref, tensor_meta(site, dims)[0], dims)
        with graph.inserting_before(site.next):
            inputs = [_term(graph, group, sources, layout, cache) for group in groups]
            scale = 1.0 if config.delta else float(len(inputs)) if config.scale == "preserve" else 1.0
            query = graph.get_attr(f"{HOLDER}.{name}.site{k}")
            _copy_scope(site, query)
            if config.delta:
                params[f"gate{k}"] = nn.Parameter(torch.full((1,), config.gate_init, dtype=torch.float32, device=device))
                gate = graph.get_attr(f"{HOLDER}.{name}.gate{k}")
                _copy_scope(site, gate)
                node = graph.call_function(delta.depth_attention_delta,
                                           (inputs, query, site, gate, float(config.eps), scale, chain.feature_axis))
            else:
                node = graph.call_function(
                    depth_attention.depth_attention,
                    (inputs, query, float(config.eps), scale, chain.feature_axis),
                )
        _copy_meta(site, node)
        node.meta["attnres"] = {"chain": name, "site": k}
        if config.delta:
            nxt = chain.links[k] if k < len(chain.links) else None
            _read_delta(graph, site, node, [by_name[p] for p in chain.skip_paths[k]] if nxt else [],
                        {by_name[a] for a in nxt.adds} if nxt else set())
        else:
            replaced[site] = node
        out.append(RewrittenSite(chain.index, k, node.name, f"{HOLDER}.{name}.site{k}", len(inputs), scale,
                                 f"{HOLDER}.{name}.gate{k}" if config.delta else None))
    return out


def _read_delta(graph: fx.Graph, site: fx.Node, delta: fx.Node, path: list[fx.Node], skip_readers: set[fx.Node]) -> None:
    """Point the readers of `site` (h_k) at its Delta output `delta`, except the next link's skip:
    along `path` (h_k's ops up to that skip, read by the next link's adds `skip_readers`) each op
    keeps reading the plain value, and its other readers read a copy of the op over the Delta side's
    value (made only as far along the path as some op has such readers), or, where the op is a cast
    to the dtype it reads (Llama's `to(float32)`, which returns its input), that value itself.
    torch.export's metadata checks stay on the plain value (both sides have the same metadata)."""
    hops = [*path, None]  # None: the end of the path, read by the next link's adds
    plain, mixed = site, delta
    for i, hop in enumerate(hops):
        keep = (skip_readers if hop is None else {hop}) | {u for u in plain.users if u.target is _ASSERT}
        for user in [u for u in plain.users if u not in keep and u is not delta]:
            user.replace_input_with(plain, mixed)
        if hop is None or not _read_off_path(hops, i, skip_readers):
            return
        if not _returns_its_input(hop, plain):
            with graph.inserting_after(hop):
                mixed = graph.node_copy(hop, lambda n: mixed if n is plain else n)
        plain = hop


def _returns_its_input(node: fx.Node, src: fx.Node) -> bool:
    """Whether `node` is `aten.to.dtype(src, its own dtype)` without copy=True or a memory format: it
    returns `src` itself."""
    if node.target is not torch.ops.aten.to.dtype or node.args[0] is not src:
        return False
    if node.kwargs.get("copy") or node.kwargs.get("memory_format") is not None or any(node.args[3:5]):
        return False
    a, b = node.meta.get("val"), src.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype


def _read_off_path(hops: list, i: int, skip_readers: set[fx.Node]) -> bool:
    """Whether op `hops[i]` or a later one of the skip path has a reader off the path (a metadata
    check aside)."""
    for j in range(i, len(hops) - 1):
        keep = skip_readers if hops[j + 1] is None else {hops[j + 1]}
        if any(u not in keep and u.target is not _ASSERT for u in hops[j].users):
            return True
    return False


def _term(graph: fx.Graph, group: tuple[int, ...], sources, layout, cache) -> fx.Node:
    """The node for one entry of S_k: a source, or the (partial) block sum over `group`.

    `layout` is (site, a node with the site's shape, the site's shape, the graph's InputDims).
    """
    key = (group, layout[2])
    if key in cache:
        return cache[key]
    last = _in_layout(graph, sources[group[-1]], layout, cache)
    if len(group) == 1:
        node = last
    else:
        node = graph.call_function(torch.ops.aten.add.Tensor, (_term(graph, group[:-1], sources, layout, cache), last))
        _copy_meta(layout[0], node)
        node.meta["attnres"] = {"role": "block_sum"}
    cache[key] = node
    return node


def _in_layout(graph: fx.Graph, src: fx.Node, layout, cache) -> fx.Node:
    """`src` brought to the site's layout ([B*T, D] vs [B, T, D]) when the two differ."""
    site, ref, shape, dims = layout
    key = (src, shape)
    if key in cache:
        return cache[key]
    if tensor_meta(src, dims)[0] == shape:
        cache[key] = src
    else:
        cache[key] = graph.call_function(torch.ops.aten.reshape_as.default, (src, ref))  # data-encodable (hf/program.py)
        _copy_meta(site, cache[key])
    return cache[key]


def _copy_meta(src: fx.Node, dst: fx.Node) -> None:
    for key in ("val", "tensor_meta"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]
    _copy_scope(src, dst)


def _copy_scope(src: fx.Node, dst: fx.Node) -> None:
    """Give `dst` the module scope of the site it belongs to, so module-aware tools (torch.export's
    unflatten, the pipelining outliner, profilers) place the inserted node inside that block."""
    for key in ("nn_module_stack", "stack_trace"):
        if key in src.meta:
            dst.meta[key] = dict(src.meta[key]) if isinstance(src.meta[key], dict) else src.meta[key]


def _erase_dead(graph: fx.Graph, adds: list[fx.Node]) -> None:
    """Erase the now-unused residual adds (and the ops between them), then the pure ops they leave
    without users, in one reverse pass.
    """
    doomed, candidates = set(adds), set(adds)
    for node in reversed(list(graph.nodes)):
        if node not in candidates or node.users:
            continue
        if node not in doomed and (node.op not in ("call_function", "call_method") or node.is_impure()):
            continue
        candidates.update(node.all_input_nodes)
        graph.erase_node(node)
