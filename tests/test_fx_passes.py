"""Before -> Expected for each fx pass (issue 61): a tiny graph before, the pass applied, the expected graph
written by hand as a module that calls the attnres ops explicitly, traced the same way (torch.export, or
torch.fx.symbolic_trace, fx/trace.py's fallback), compared structurally (`structure`), then the numbers.

Passes: fx/view.py `split_alpha`, fx/rewrite.py `RewriteSites` (Full, Block, a parallel link, a skip
that changes layout), fx/two_phase.py `two_phase` / `one_pass`, fx/site_norm.py `fuse_norms` /
`unfuse_norms`.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from attnres_compile.core.chain_analysis import analyze
from attnres_compile.core.config import AttnResConfig
from attnres_compile.fx.rewrite import RewriteSites
from attnres_compile.fx.site_norm import fuse_norms, unfuse_norms
from attnres_compile.fx.two_phase import one_pass, two_phase
from attnres_compile.fx.view import split_alpha, view_from_fx
from attnres_compile.ops import depth_attention as op_module

SITE = torch.ops.attnres.depth_attention.default
PARTIAL = torch.ops.attnres.depth_attention_partial.default
MERGE = torch.ops.attnres.depth_attention_merge.default
PAIR = torch.ops.attnres.depth_attention_norm.default
EPS = 1e-6
D = 4


@pytest.fixture(autouse=True)
def eager_ops():
    """The ops' eager reference: no kernel build, and the pair computes the unfused ops themselves."""
    previous = op_module.set_kernel("eager")
    yield
    op_module.set_kernel(previous)


# ---- the structural comparison ------------------------------------------------------------------------


def _target(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', None) or ''}.{target.__name__}"


def _args(node: fx.Node) -> tuple:
    """An op overload's positional arguments without the trailing ones at their schema default
    (torch.export leaves those out: `layer_norm(x, [4], w, b)` is `layer_norm(x, [4], w, b, 1e-05)`)."""
    args = list(node.args)
    if isinstance(node.target, torch._ops.OpOverload):
        schema = node.target._schema.arguments
        while args and schema[len(args) - 1].has_default_value() and args[-1] == schema[len(args) - 1].default_value:
            args.pop()
    return tuple(args)


def structure(gm: fx.GraphModule) -> list[tuple]:
    """`gm`'s graph as a canonical list, whatever its node names and order: each node reachable from the
    output in post-order (operands first, in argument order), then the nodes nothing reads, in graph
    order. A node is (op, target, args, kwargs) with every operand replaced by its position in the list;
    inputs are ("input", their position), attributes ("attr", their qualified name), so two reads of one
    parameter are the same operand; an op's trailing arguments at their default are left out."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index: dict[fx.Node, int] = {}
    out: list[tuple] = []

    def operand(node: fx.Node):
        if node.op == "placeholder":
            return ("input", placeholders.index(node))
        if node.op == "get_attr":
            return ("attr", node.target)
        return ("%", index[node])

    def visit(node: fx.Node) -> None:
        if node in index or node.op in ("placeholder", "get_attr"):
            return
        for arg in node.all_input_nodes:
            visit(arg)
        index[node] = len(out)
        args = fx.node.map_arg(_args(node), operand)
        kwargs = fx.node.map_arg(node.kwargs, operand)
        out.append((node.op, _target(node), args, kwargs))

    visit(next(n for n in gm.graph.nodes if n.op == "output"))
    for node in gm.graph.nodes:
        visit(node)  # what the output does not read: dead adds a pass left behind show here
    return out


def assert_same_graph(got: fx.GraphModule, expected: fx.GraphModule) -> None:
    """The same structure, and the same parameters and buffers (names, values): the queries a pass adds included."""
    got_s, expected_s = structure(got), structure(expected)
    assert got_s == expected_s, "\n".join(["got:", *map(str, got_s), "expected:", *map(str, expected_s)])
    got_state, expected_state = got.state_dict(), expected.state_dict()
    assert sorted(got_state) == sorted(expected_state)
    for name, value in got_state.items():
        torch.testing.assert_close(value, expected_state[name], rtol=0, atol=0, msg=name)


def exported(module: nn.Module, *args) -> fx.GraphModule:
    """`module` traced as fx/trace.py traces it first: torch.export, as a GraphModule (static shapes)."""
    return torch.export.export(module, args).module(check_guards=False)


def symbolic(module: nn.Module, *args) -> fx.GraphModule:
    """`module` traced as fx/trace.py's fallback does: torch.fx.symbolic_trace, shapes by ShapeProp."""
    gm = fx.symbolic_trace(module)
    ShapeProp(gm).propagate(*args)
    return gm


def rewrite_sites(gm: fx.GraphModule, config: AttnResConfig):
    """RewriteSites with the plan chain analysis makes of `gm`'s view."""
    return RewriteSites(analyze(view_from_fx(gm), config), config)(gm)


def queries(module: nn.Module, *counts: int, random: bool = False) -> nn.Module:
    """`module` given an `attnres` holder with chain<i>.site<k> parameters of size D, as RewriteSites names
    them: zeros (what the rewrite makes), or random (for the passes that run after it)."""
    module.attnres = nn.Module()
    g = torch.Generator().manual_seed(0)
    for i, count in enumerate(counts):
        module.attnres.register_module(f"chain{i}", nn.ParameterDict({
            f"site{k}": nn.Parameter(torch.randn(D, generator=g) if random else torch.zeros(D))
            for k in range(1, count + 1)}))
    return module


def q(module: nn.Module, chain: int, site: int) -> nn.Parameter:
    return getattr(module.attnres, f"chain{chain}")[f"site{site}"]


def assert_same_numbers(got: nn.Module, expected: nn.Module, *args, **tol) -> None:
    torch.testing.assert_close(got(*args), expected(*args), **tol)


X = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1))


class Layers(nn.Module):
    """n linear D -> D layers, the branches of the tiny models."""

    def __init__(self, n: int):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.f = nn.ModuleList(nn.Linear(D, D) for _ in range(n))


# ---- split_alpha --------------------------------------------------------------------------------------


class AddAlpha(Layers):
    def __init__(self):
        super().__init__(1)

    def forward(self, x):
        return torch.add(x, self.f[0](x), alpha=0.5)


class AddScaled(nn.Module):
    def __init__(self, before: AddAlpha):
        super().__init__()
        self.f = before.f

    def forward(self, x):
        return torch.add(x, torch.mul(self.f[0](x), 0.5))


@pytest.mark.parametrize("trace", [exported, symbolic])
def test_split_alpha_makes_the_scaled_branch_a_node(trace):
    """add(x, f(x), alpha=0.5) -> add(x, mul(f(x), 0.5)): aten.mul under torch.export, torch.mul under
    symbolic_trace; a graph with no alpha is left as it is."""
    before = AddAlpha()
    gm = trace(before, X)
    result = split_alpha(gm)
    assert result.modified and result.graph_module is gm
    assert_same_graph(gm, trace(AddScaled(before), X))
    assert_same_numbers(gm, before, X)
    assert_same_numbers(trace(AddScaled(before), X), before, X)
    again = structure(gm)
    assert not split_alpha(gm).modified and structure(gm) == again


# ---- RewriteSites -------------------------------------------------------------------------------------


class Two(Layers):
    """h1 = x + f0(x); h2 = h1 + f1(h1)."""

    def __init__(self):
        super().__init__(2)

    def forward(self, x):
        h = x + self.f[0](x)
        return h + self.f[1](h)


class TwoFull(nn.Module):
    """Two's sites as Full AttnRes: each h_k one depth_attention over x and the branches so far."""

    def __init__(self, before: Two):
        super().__init__()
        self.f = before.f
        queries(self, 2)

    def forward(self, x):
        b0 = self.f[0](x)
        h = SITE([x, b0], q(self, 0, 1), EPS, 2.0, -1)
        b1 = self.f[1](h)
        return SITE([x, b0, b1], q(self, 0, 2), EPS, 3.0, -1)


class TwoCloned(Two):
    """Two with a copy on the second link's skip (value-preserving: the chain goes through it)."""

    def forward(self, x):
        h = x + self.f[0](x)
        return h.clone() + self.f[1](h)


@pytest.mark.parametrize("model", [Two, TwoCloned])
def test_rewrite_sites_full(model):
    """Each h_k one depth_attention over x and the branches so far, its query at attnres.chain0.site<k>;
    the residual adds go, and with them the ops on the skip path they leave unread (the clone)."""
    before = model()
    gm = exported(before, X)
    result = rewrite_sites(gm, AttnResConfig())
    assert result.modified
    expected = exported(TwoFull(before), X)
    assert_same_graph(gm, expected)
    assert_same_numbers(gm, before, X)
    assert_same_numbers(expected, before, X)


class Three(Layers):
    def __init__(self):
        super().__init__(3)

    def forward(self, x):
        for f in self.f:
            x = x + f(x)
        return x


class ThreeBlock(nn.Module):
    """Three's sites as Block AttnRes with blocks of 2 branches: the block (b0, b1) is summed once, and
    both later sites read that sum."""

    def __init__(self, before: Three):
        super().__init__()
        self.f = before.f
        queries(self, 3)

    def forward(self, x):
        b0 = self.f[0](x)
        h = SITE([x, b0], q(self, 0, 1), EPS, 2.0, -1)
        b1 = self.f[1](h)
        block = b0 + b1
        h = SITE([x, block], q(self, 0, 2), EPS, 2.0, -1)
        b2 = self.f[2](h)
        return SITE([x, block, b2], q(self, 0, 3), EPS, 3.0, -1)


def test_rewrite_sites_block():
    before = Three()
    gm = exported(before, X)
    assert rewrite_sites(gm, AttnResConfig(variant="block", block_size=2)).modified
    expected = exported(ThreeBlock(before), X)
    assert_same_graph(gm, expected)
    assert_same_numbers(gm, before, X)
    assert_same_numbers(expected, before, X)


class Parallel(Layers):
    """A parallel block (GPT-J: h = x + attn(x) + mlp(x)), then a plain one."""

    def __init__(self):
        super().__init__(3)

    def forward(self, x):
        h = x + self.f[0](x) + self.f[1](x)
        return h + self.f[2](h)


class ParallelFull(nn.Module):
    """The parallel link is one site over both of its branches."""

    def __init__(self, before: Parallel):
        super().__init__()
        self.f = before.f
        queries(self, 2)

    def forward(self, x):
        a, m = self.f[0](x), self.f[1](x)
        h = SITE([x, a, m], q(self, 0, 1), EPS, 3.0, -1)
        b = self.f[2](h)
        return SITE([x, a, m, b], q(self, 0, 2), EPS, 4.0, -1)


def test_rewrite_sites_parallel_link():
    before = Parallel()
    gm = exported(before, X)
    assert rewrite_sites(gm, AttnResConfig()).modified
    expected = exported(ParallelFull(before), X)
    assert_same_graph(gm, expected)
    assert_same_numbers(gm, before, X)


class Flattened(Layers):
    """The stream viewed as [B*T, D] between the two links (HF OPT)."""

    def __init__(self):
        super().__init__(2)

    def forward(self, x):
        h = x + self.f[0](x)
        v = h.view(-1, D)
        return v + self.f[1](v)


class FlattenedFull(nn.Module):
    """The second site's earlier sources brought to its layout with aten.reshape_as its branch (an op
    the converted model's graph data can name, where a method call is not)."""

    def __init__(self, before: Flattened):
        super().__init__()
        self.f = before.f
        queries(self, 2)

    def forward(self, x):
        b0 = self.f[0](x)
        h = SITE([x, b0], q(self, 0, 1), EPS, 2.0, -1)
        b1 = self.f[1](h.view(-1, D))
        reshape_as = torch.ops.aten.reshape_as.default
        return SITE([reshape_as(x, b1), reshape_as(b0, b1), b1], q(self, 0, 2), EPS, 3.0, -1)


def test_rewrite_sites_skip_that_changes_layout():
    before = Flattened()
    gm = symbolic(before, X)
    assert rewrite_sites(gm, AttnResConfig()).modified
    expected = symbolic(FlattenedFull(before), X)
    assert_same_graph(gm, expected)
    assert_same_numbers(gm, before, X)
    assert_same_numbers(expected, before, X)


def test_rewrite_sites_leaves_a_short_chain():
    """A chain below min_chain is not rewritten: the graph is unchanged and the pass says so."""
    gm = exported(Two(), X)
    unchanged = structure(gm)
    result = rewrite_sites(gm, AttnResConfig(min_chain=3))
    assert not result.modified and structure(gm) == unchanged


# ---- two_phase / one_pass -----------------------------------------------------------------------------


class Sites(Layers):
    """Two sites of one chain as RewriteSites writes them, over 6 and 7 sources: they share the history
    x, b0..b3 (5 sources), the first has b4 of its own, the second b4 and b5."""

    def __init__(self):
        super().__init__(6)
        queries(self, 2, random=True)

    def forward(self, x):
        s = [x] + [f(x) for f in self.f]
        return SITE(s[:6], q(self, 0, 1), EPS, 6.0, -1), SITE(s, q(self, 0, 2), EPS, 7.0, -1)


class SitesTwoPhase(nn.Module):
    """One partial over the shared history for both queries, then a merge per site over its own sources."""

    def __init__(self, before: Sites):
        super().__init__()
        self.f, self.attnres = before.f, before.attnres

    def forward(self, x):
        s = [x] + [f(x) for f in self.f]
        q1, q2 = q(self, 0, 1), q(self, 0, 2)
        state = PARTIAL(s[:5], torch.stack([q1, q2]), EPS, -1)
        m, l, acc = state[0], state[1], state[2]
        return (MERGE(m, l, acc, 0, s[5:6], q1, EPS, 6.0, -1),
                MERGE(m, l, acc, 1, s[5:7], q2, EPS, 7.0, -1))


def test_two_phase():
    """Under symbolic_trace (the pass reads the site calls only; torch.stack as it writes it)."""
    before = Sites()
    gm = symbolic(before, X)
    result = two_phase(gm, min_history=5)
    assert result.modified
    expected = symbolic(SitesTwoPhase(before), X)
    assert_same_graph(gm, expected)
    assert_same_numbers(gm, before, X, rtol=1e-5, atol=1e-6)
    assert_same_numbers(expected, before, X, rtol=1e-5, atol=1e-6)


def test_two_phase_keeps_a_short_history():
    """5 shared sources are below the default MIN_HISTORY: one pass per site stays."""
    gm = symbolic(Sites(), X)
    unchanged = structure(gm)
    assert not two_phase(gm).modified and structure(gm) == unchanged


def test_one_pass_undoes_two_phase():
    before = Sites()
    gm = symbolic(SitesTwoPhase(before), X)
    assert one_pass(gm).modified
    assert_same_graph(gm, symbolic(before, X))
    assert_same_numbers(gm, before, X)
    assert not one_pass(gm).modified


# ---- fuse_norms / unfuse_norms ------------------------------------------------------------------------


class HFRMSNorm(nn.Module):
    """HF Llama's RMSNorm, as torch.export writes it: pow, mean, add eps, rsqrt, mul, mul by the weight."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))
        self.eps = 1e-5

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


NORMS = {"layer": lambda: nn.LayerNorm(D), "rms": lambda: nn.RMSNorm(D, eps=1e-5), "hf_rms": HFRMSNorm}


class PreNorm(Layers):
    """Two sites of a PreNorm model: the next branch reads the first through a norm, the second site is
    read by that norm's output (the final norm) and by the output itself."""

    def __init__(self, norm: str):
        super().__init__(2)
        self.norm, self.final = NORMS[norm](), NORMS[norm]()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for module in (self.norm, self.final):
                module.weight.uniform_(0.5, 1.5, generator=g)
                if getattr(module, "bias", None) is not None:
                    module.bias.uniform_(-0.5, 0.5, generator=g)
        queries(self, 2, random=True)

    def forward(self, x):
        b0 = self.f[0](x)
        h = SITE([x, b0], q(self, 0, 1), EPS, 2.0, -1)
        b1 = self.f[1](self.norm(h))
        h = SITE([x, b0, b1], q(self, 0, 2), EPS, 3.0, -1)
        return self.final(h), h


class PreNormFused(nn.Module):
    """Each site and the norm reading it as one depth_attention_norm: the first's mixed output unread,
    the second's read by the output."""

    def __init__(self, before: PreNorm, kind: str):
        super().__init__()
        self.f, self.norm, self.final, self.attnres = before.f, before.norm, before.final, before.attnres
        self.kind = kind

    def params(self, norm: nn.Module) -> tuple:
        return norm.weight, getattr(norm, "bias", None), norm.eps

    def forward(self, x):
        b0 = self.f[0](x)
        _, normed = PAIR([x, b0], q(self, 0, 1), EPS, 2.0, -1, *self.params(self.norm), self.kind)
        b1 = self.f[1](normed)
        h, normed = PAIR([x, b0, b1], q(self, 0, 2), EPS, 3.0, -1, *self.params(self.final), self.kind)
        return normed, h


class PreNormUnfused(nn.Module):
    """unfuse_norms' form of PreNormFused: each pair as depth_attention and one aten norm op."""

    def __init__(self, before: PreNorm, kind: str):
        super().__init__()
        self.f, self.norm, self.final, self.attnres = before.f, before.norm, before.final, before.attnres
        self.kind = kind

    def norm_op(self, x, norm):
        if self.kind == "layer":
            return torch.ops.aten.layer_norm.default(x, [D], norm.weight, norm.bias, norm.eps)
        return torch.ops.aten.rms_norm.default(x, [D], norm.weight, norm.eps)

    def forward(self, x):
        b0 = self.f[0](x)
        h = SITE([x, b0], q(self, 0, 1), EPS, 2.0, -1)
        b1 = self.f[1](self.norm_op(h, self.norm))
        h = SITE([x, b0, b1], q(self, 0, 2), EPS, 3.0, -1)
        return self.norm_op(h, self.final), h


@pytest.mark.parametrize("norm", NORMS)
def test_fuse_norms(norm):
    """nn.LayerNorm, nn.RMSNorm and HF's RMSNorm (its six ops) each fused with the site they read."""
    before = PreNorm(norm)
    gm = exported(before, X)
    assert fuse_norms(gm).modified
    kind = "layer" if norm == "layer" else "rms"
    expected = exported(PreNormFused(before, kind), X)
    assert_same_graph(gm, expected)
    assert_same_numbers(gm, before, X, rtol=1e-5, atol=1e-6)
    assert_same_numbers(expected, before, X, rtol=1e-5, atol=1e-6)


def test_fuse_norms_leaves_a_site_two_norms_read():
    """A site read by two norms has no one pair: nothing changes."""

    class TwoNorms(Layers):
        def __init__(self):
            super().__init__(1)
            self.a, self.b = nn.LayerNorm(D), nn.LayerNorm(D)
            queries(self, 1, random=True)

        def forward(self, x):
            h = SITE([x, self.f[0](x)], q(self, 0, 1), EPS, 2.0, -1)
            return self.a(h), self.b(h)

    gm = exported(TwoNorms(), X)
    unchanged = structure(gm)
    assert not fuse_norms(gm).modified and structure(gm) == unchanged


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_unfuse_norms(kind):
    before = PreNorm("layer" if kind == "layer" else "rms")
    gm = exported(PreNormFused(before, kind), X)
    assert unfuse_norms(gm).modified
    expected = exported(PreNormUnfused(before, kind), X)
    assert_same_graph(gm, expected)
    assert_same_numbers(gm, before, X, rtol=1e-5, atol=1e-6)
    assert_same_numbers(expected, before, X, rtol=1e-5, atol=1e-6)
    assert not unfuse_norms(gm).modified
