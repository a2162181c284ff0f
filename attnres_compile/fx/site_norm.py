"""Site + norm fusion in a rewritten GraphModule (ops/site_norm.py; docs/design.md §6, *Site + norm pair*).

`fuse_norms(gm)` replaces a float32 site read by a norm over its last axis (`aten.layer_norm`,
`aten.rms_norm`, or HF's RMSNorm as torch.export writes it; directly, through same-dtype casts
or a feature-preserving reshape) by one `depth_attention_norm` node: the norm's readers get
`normed`, the site's others `mixed`. Run on a module that is run, not in `rewrite`;
`unfuse_norms` is the inverse, applied wherever a graph is read.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from ..ops.depth_attention import depth_attention as SITE
from ..ops.site_norm import depth_attention_norm as PAIR

aten = torch.ops.aten
_ASSERT = aten._assert_tensor_metadata.default
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.alias.default, aten.type_as.default)


@dataclass
class _Norm:
    """A norm reading a site: kind, eps, weight and bias (fx nodes or None), its last node (whose
    value is the normed tensor), and the nodes computing it that go (`steps`)."""

    kind: str
    eps: float
    weight: fx.Node | None
    bias: fx.Node | None
    last: fx.Node
    steps: list[fx.Node] = field(default_factory=list)
    view: fx.Node | None = None  # the reshape of the site the norm reads, if it reads one


def fuse_norms(gm: fx.GraphModule) -> PassResult:
    """Replace, in place, every site whose output a norm reads by one depth_attention_norm node."""
    graph = gm.graph
    fused = 0
    for site in list(graph.nodes):
        if _is_site(site):
            norm = _match(site)
            if norm is not None:
                fused += _replace(graph, site, norm)
    if fused:
        graph.lint()
        gm.recompile()
    return PassResult(gm, fused > 0)


def unfuse_norms(gm: fx.GraphModule) -> PassResult:
    """Undo `fuse_norms` in place: each pair back to depth_attention and the norm as one aten op
    (`layer_norm`, `rms_norm`); the same values."""
    graph = gm.graph
    pairs = [n for n in graph.nodes if n.op == "call_function" and n.target is PAIR]
    for pair in pairs:
        sources, query, eps, scale, dim, weight, bias, norm_eps, kind = pair.args
        with graph.inserting_before(pair):
            site = graph.call_function(SITE, (sources, query, eps, scale, dim))
            size = [_val(sources[0]).shape[-1]]
            norm = (graph.call_function(aten.layer_norm.default, (site, size, weight, bias, norm_eps)) if kind == "layer"
                    else graph.call_function(aten.rms_norm.default, (site, size, weight, norm_eps)))
        site.meta.update({k: v for k, v in pair.meta.items() if k != "val"})
        for user in list(pair.users):  # getitem 0 (mixed), 1 (normed)
            value = site if user.args[1] == 0 else norm
            value.meta.update(user.meta)
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        graph.erase_node(pair)
    if pairs:
        graph.lint()
        gm.recompile()
    return PassResult(gm, bool(pairs))


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _is_site(node: fx.Node) -> bool:
    """A one-pass site over the last axis of float32 sources, as `rewrite` makes it."""
    if node.op != "call_function" or node.target is not SITE or node.kwargs or len(node.args) != 5:
        return False
    val = _val(node)
    return val is not None and val.dtype == torch.float32 and node.args[4] in (-1, val.dim() - 1)


def _call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _readers(node: fx.Node) -> list[fx.Node]:
    """The readers of `node` but its metadata checks."""
    return [u for u in node.users if u.target is not _ASSERT]


def _cast_of(node: fx.Node, src: fx.Node) -> bool:
    """Whether `node` is a copy of `src`'s value: a same-dtype, same-shape cast, clone or alias."""
    if not _call(node, *_CASTS) or node.args[0] is not src:
        return False
    a, b = _val(node), _val(src)
    return a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape


def _through_casts(node: fx.Node) -> fx.Node:
    """`node`, or the end of a run of same-dtype casts read only by each other."""
    while len(_readers(node)) == 1 and _cast_of(_readers(node)[0], node):
        node = _readers(node)[0]
    return node


def _last_axis(dims, rank: int) -> bool:
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, rank - 1)


def _vector(node, size: int) -> bool:
    """A float32 [D] tensor (a norm's weight or bias)."""
    val = _val(node)
    return val is not None and val.dtype == torch.float32 and tuple(val.shape) == (size,)


def _match(site: fx.Node) -> _Norm | None:
    """The norm that reads `site` (or a same-dtype cast of it, or a row view), if exactly one does."""
    values = [site] + [u for u in _readers(site) if _cast_of(u, site) or _row_view(u, site)]
    size = _val(site).shape[-1]
    found = []
    for x in values:
        for user in _readers(x):
            norm = _aten_norm(user, x, size, _val(x).dim()) or _hf_rms(user, x, values, size, _val(x).dim())
            if norm is None:
                continue
            alone = x is not site and not (set(_readers(x)) - set(norm.steps))
            if _row_view(x, site):
                if not alone:
                    continue  # a view others read too: the pair's normed output has no place to get it
                norm.view = x
            norm.steps += [x] if alone else []
            found.append(norm)
    return found[0] if len(found) == 1 else None


def _row_view(node: fx.Node, site: fx.Node) -> bool:
    """A reshape of the site's value that keeps its feature size last (rows map to rows)."""
    if not _call(node, aten.view.default, aten.reshape.default, aten._unsafe_view.default) or node.args[0] is not site:
        return False
    a, b = _val(node), _val(site)
    return a is not None and a.dim() >= 2 and a.dtype == b.dtype and a.shape[-1] == b.shape[-1]


def _aten_norm(node: fx.Node, x: fx.Node, size: int, rank: int) -> _Norm | None:
    """aten.layer_norm / aten.rms_norm over the last axis of x."""
    if _call(node, aten.layer_norm.default) and node.args[0] is x and not node.kwargs:
        shape, weight, bias, eps = _given(node.args[1:5], [None, None, None, 1e-5])
        kind = "layer"
    elif _call(node, aten.rms_norm.default) and node.args[0] is x and not node.kwargs:
        shape, weight, eps = _given(node.args[1:4], [None, None, None])
        bias, kind = None, "rms"
        eps = torch.finfo(torch.float32).eps if eps is None else eps
    else:
        return None
    if list(shape) != [size] or any(p is not None and not _vector(p, size) for p in (weight, bias)):
        return None
    if bias is not None and weight is None:  # a form no nn module writes; the pair's ONNX node has no slot for it
        return None
    last = _through_casts(node)
    return _Norm(kind, float(eps), weight, bias, last, _walk(node, last))


def _given(args: tuple, defaults: list) -> list:
    """A schema's arguments from the positional ones given, the rest at their defaults."""
    return list(args) + defaults[len(args):]


def _hf_rms(square: fx.Node, x: fx.Node, values: list[fx.Node], size: int, rank: int) -> _Norm | None:
    """x * rsqrt(mean(x^2, [-1], keepdim) + eps) [cast] [* weight], x read by the square and the product."""
    if not (_call(square, aten.pow.Tensor_Scalar) and square.args[0] is x and square.args[1] == 2
            or _call(square, aten.mul.Tensor) and square.args[0] is x and square.args[1] is x):
        return None
    chain = [square]
    for target, test in ((aten.mean.dim, lambda n: _last_axis(n.args[1], rank) and (n.args[2:3] == (True,)
                                                                                    or n.kwargs.get("keepdim"))),
                         (aten.add.Tensor, lambda n: isinstance(n.args[1], float)),
                         (aten.rsqrt.default, lambda n: True)):
        readers = _readers(chain[-1])
        if len(readers) != 1 or not _call(readers[0], target) or readers[0].args[0] is not chain[-1] or not test(readers[0]):
            return None
        chain.append(readers[0])
    eps = float(chain[2].args[1])
    readers = _readers(chain[-1])
    if len(readers) != 1 or not _call(readers[0], aten.mul.Tensor) or set(readers[0].args) != {x, chain[-1]}:
        return None
    scaled = _through_casts(readers[0])
    chain += [n for n in _walk(readers[0], scaled)]
    weight, last = None, scaled
    after = _readers(scaled)
    if len(after) == 1 and _call(after[0], aten.mul.Tensor) and len(after[0].args) == 2:
        other = next((a for a in after[0].args if a is not scaled), None)
        if other is not None and _vector(other, size) and _val(after[0]) is not None and _val(after[0]).dtype == torch.float32:
            weight, last = other, _through_casts(after[0])
            chain += [n for n in _walk(after[0], last)]
    if any(len(_readers(n)) != 1 for n in chain[:-1] if n is not last):
        return None
    return _Norm("rms", eps, weight, None, last, chain)


def _walk(first: fx.Node, last: fx.Node) -> list[fx.Node]:
    """first and the casts after it up to last (inclusive)."""
    nodes = [first]
    while nodes[-1] is not last:
        nodes.append(_readers(nodes[-1])[0])
    return nodes


def _replace(graph: fx.Graph, site: fx.Node, norm: _Norm) -> int:
    """Put the pair in place of `site` and `norm`; 0 where no place has the weight, the bias and
    every other reader of the site after it."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    gone = set(norm.steps) | {norm.last}
    others = [u for u in _readers(site) if u not in gone]
    params = [p for p in (norm.weight, norm.bias) if p is not None]
    if all(position[u] > position[norm.last] for u in others):
        anchor = norm.last  # insert before it: every parameter (and a view's sizes) is computed by then
    elif norm.view is None and all(p.op in ("placeholder", "get_attr") or position[p] < position[site] for p in params):
        anchor = site.next
    else:
        return 0
    with graph.inserting_before(anchor):
        weight, bias = (graph.get_attr(p.target) if p is not None and p.op == "get_attr" and position[p] > position[anchor]
                        else p for p in (norm.weight, norm.bias))
        sources, query, eps, scale, dim = site.args
        pair = graph.call_function(PAIR, (sources, query, eps, scale, dim, weight, bias, norm.eps, norm.kind))
        mixed = graph.call_function(operator.getitem, (pair, 0))
        normed = graph.call_function(operator.getitem, (pair, 1))
        out = normed if norm.view is None else graph.call_function(norm.view.target, (normed, *norm.view.args[1:]))
    pair.meta.update({k: v for k, v in site.meta.items() if k not in ("val", "tensor_meta")})
    pair.meta["val"] = (_val(site), _val(site) if norm.view is not None else _val(norm.last))
    mixed.meta.update(site.meta)
    normed.meta.update(site.meta if norm.view is not None else norm.last.meta)
    out.meta.update(norm.last.meta)
    norm.last.replace_all_uses_with(out)
    for node in sorted(gone, key=position.get, reverse=True):  # readers first: each step is read by the next only
        for check in [u for u in node.users if u.target is _ASSERT]:
            graph.erase_node(check)
        graph.erase_node(node)
    for check in [u for u in site.users if u.target is _ASSERT]:
        graph.erase_node(check)
    site.replace_all_uses_with(mixed)
    graph.erase_node(site)
    return 1
