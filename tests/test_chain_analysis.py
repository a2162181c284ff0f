"""Chain analysis on hand-built neutral views: the ground truth is known exactly."""

import pytest
import torch
from torch import nn

import attnres_compile as ac
from attnres_compile.core.config import AttnResConfig
from attnres_compile.onnx.pipeline import inspect_onnx
from attnres_compile.core import chain_analysis
from attnres_compile.onnx import export as onnx_export, io as onnx_io
from attnres_compile.core.chain_analysis import analyze
from attnres_compile.core.graph_view import Kind, ViewNode, build_view

D = (2, 8, 16)


class ViewBuilder:
    """Tiny DSL: each call appends a node and returns its name."""

    def __init__(self):
        self.nodes = []

    def add_node(self, kind, target, inputs=(), shape=D, **kw):
        name = f"n{len(self.nodes)}"
        self.nodes.append(ViewNode(name, kind, target, list(inputs), shape, "float32", **kw))
        return name

    def inp(self, shape=D):
        return self.add_node(Kind.INPUT, "input", shape=shape)

    def const(self, shape=D):
        return self.add_node(Kind.CONST, "param", shape=shape)

    def op(self, *inputs, target="f", shape=D, learned=True):
        """An op; `learned` (the default) stands for a sublayer's matmul or weighted op."""
        return self.add_node(Kind.OP, target, inputs, shape, learned=learned)

    def add(self, a, b, **kw):
        return self.add_node(Kind.ADD, "add", [x for x in (a, b) if x is not None], **kw)

    def cast(self, a, **kw):
        return self.add_node(Kind.PASSTHROUGH, "to", [a], **kw)

    def analyze(self, **cfg):
        return analyze(build_view(self.nodes), AttnResConfig(**cfg))


def test_prenorm_chain_both_operand_orders():
    b = ViewBuilder()
    h = b.inp()
    sources = [h]
    for i in range(4):
        f = b.op(b.op(h, target="norm"))
        sources.append(f)
        h = b.add(h, f) if i % 2 else b.add(f, h)
    plan = b.analyze()
    assert len(plan.chains) == 1 and plan.chains[0].rewrite
    assert plan.chains[0].sources == sources and len(plan.chains[0].sites) == 4
    assert not plan.skipped_adds


def test_parallel_link_is_one_link_with_two_branches():
    b = ViewBuilder()
    h = b.inp()
    for _ in range(2):
        n = b.op(h, target="norm")
        h = b.add(b.add(h, b.op(n)), b.op(n))
    chain = b.analyze().chains[0]
    assert [len(link.branches) for link in chain.links] == [2, 2]
    assert [len(link.adds) for link in chain.links] == [2, 2]


def test_skip_path_casts_are_looked_through():
    b = ViewBuilder()
    h = b.inp()
    for _ in range(3):
        f = b.op(h)
        h = b.add(b.cast(b.cast(h)), f)
    assert len(b.analyze().chains[0].links) == 3


def test_activation_sum_is_not_a_link():
    """GELU-tanh's x + 0.044715 * x**3 inside an MLP: the skip reaches the branch through
    parameter-free ops only. A weighted branch (layer scale gamma * f(x)) still is a link."""
    b = ViewBuilder()
    h = b.inp()
    for _ in range(2):
        a = b.op(h, target="linear")
        cube = b.op(b.op(a, target="pow", learned=False), target="mul", learned=False)
        inner = b.add(a, cube)
        f = b.op(b.op(inner, target="tanh", learned=False), target="linear")
        h = b.add(h, f)
    gamma = b.const(shape=(16,))
    h = b.add(h, b.add_node(Kind.OP, "mul", [gamma, b.op(h, target="tanh", learned=False)]))
    plan = b.analyze(min_chain=1)
    assert [len(c.links) for c in plan.chains] == [3]
    assert [s.reason for s in plan.skipped_adds] == [chain_analysis.NOT_LEARNED] * 2


def test_sum_is_flattened_through_value_preserving_ops():
    """Falcon's `h + dropout(mlp += attn)` (p = 0) is one link with two branches; a dropout that
    is active in training keeps its sum whole."""
    b = ViewBuilder()
    h = b.inp()
    for mode_dependent in (False, True):
        n = b.op(h, target="norm")
        h = b.add(h, b.cast(b.add(b.op(n), b.op(n)), mode_dependent=mode_dependent))
    chain = b.analyze().chains[0]
    assert [len(link.branches) for link in chain.links] == [2, 1]
    assert [len(link.adds) for link in chain.links] == [2, 1]


def test_non_residual_adds_and_their_reasons():
    b = ViewBuilder()
    x = b.inp()
    tok, pos = b.op(x, target="embed"), b.op(b.const(), target="embed")
    b.add(tok, b.op(x, target="other"))           # no common skip
    b.add(tok, pos)                               # pos depends only on constants
    b.add(tok, None, scalar=True)                 # eps
    b.add(tok, b.op(tok, shape=(2, 8, 1)))        # broadcast
    b.add(tok, b.op(tok), blocker="not a plain sum (alpha != 1)")
    b.add(tok, tok)                               # x + x
    plan = b.analyze()
    reasons = [s.reason for s in plan.skipped_adds]
    assert reasons == [
        "no operand that every other operand depends on (e.g. tok + pos, a mask, a projection shortcut)",
        "an operand is a constant (bias, parameter or positional table)",
        "adds a scalar constant (eps, offset)",
        "skip shape [2, 8, 16] and branch shape [2, 8, 1] differ",
        "not a plain sum (alpha != 1)",
        "two operands are the same value (x + x is a scaling, not a residual)",
    ]
    assert plan.chains == []


def test_postnorm_stream_is_split_and_reported():
    b = ViewBuilder()
    h = b.inp()
    for _ in range(3):
        h = b.op(b.add(h, b.op(h)), target="layer_norm")
    plan = b.analyze()
    assert len(plan.chains) == 3 and not plan.to_rewrite
    assert all("layer_norm" in c.reason and "allow_nonlinear" in c.reason for c in plan.chains)
    opt = b.analyze(allow_nonlinear=True)
    assert len(opt.chains) == 1 and opt.chains[0].rewrite and opt.chains[0].changes_function
    assert opt.chains[0].through == ["layer_norm"]


def test_pure_segments_of_a_mixed_stream_are_rewritten_exactly():
    b = ViewBuilder()
    h = b.inp()
    for i in range(5):
        h = b.add(h, b.op(h))
        if i == 1:
            h = b.op(h, target="relu")
    plan = b.analyze()
    assert [len(c.links) for c in plan.chains] == [2, 3]
    assert all(c.rewrite and not c.changes_function for c in plan.chains)


def test_fork_splits_the_chain():
    b = ViewBuilder()
    h = b.inp()
    h = b.add(h, b.op(h))
    h = b.add(h, b.op(h))
    left = b.add(h, b.op(h))
    b.add(left, b.op(left))
    right = b.add(h, b.op(h))
    b.add(right, b.op(right))
    plan = b.analyze()
    assert sorted(len(c.links) for c in plan.chains) == [2, 2, 2]


def test_short_chain_and_min_chain():
    b = ViewBuilder()
    h = b.inp()
    b.add(h, b.op(h))
    plan = b.analyze()
    assert not plan.chains[0].rewrite and "min_chain=2" in plan.chains[0].reason
    assert b.analyze(min_chain=1).chains[0].rewrite


def test_site_terms_full_and_block():
    b = ViewBuilder()
    h = b.inp()
    for _ in range(5):
        h = b.add(h, b.op(h))
    chain = b.analyze().chains[0]
    assert chain.site_terms(1)[-1] == [(0,), (1,), (2,), (3,), (4,), (5,)]
    assert chain.site_terms(2) == [
        [(0,), (1,)], [(0,), (1, 2)], [(0,), (1, 2), (3,)], [(0,), (1, 2), (3, 4)], [(0,), (1, 2), (3, 4), (5,)],
    ]


class ExplicitAdds(nn.Module):
    """A residual stream next to bias, position, mask and eps adds written out by hand."""

    def __init__(self, d=16, t=6):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(d))
        self.pos = nn.Parameter(torch.randn(t, d))
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        self.mlp = nn.ModuleList(nn.Linear(d, d) for _ in range(3))

    def forward(self, x, mask):
        h = x + self.pos
        for fc in self.mlp:
            scores = self.q(h) @ self.k(h).transpose(-1, -2) + mask
            mixed = scores.softmax(-1) @ h + self.bias
            var = mixed.pow(2).mean(-1, keepdim=True)
            h = h + (fc(mixed * torch.rsqrt(var + 1e-5)) + self.bias)
            h = fc(h) + h
        return h


def test_explicit_non_residual_adds_survive_rewrite():
    model = ExplicitAdds().eval()
    inputs = (torch.randn(2, 6, 16), torch.zeros(2, 6, 6).masked_fill(torch.rand(2, 6, 6) > 0.7, -1e4))
    result = ac.rewrite(model, inputs)
    reasons = {a["node"]: a["reason"] for a in result.report["skipped_adds"]}
    assert sum("is a constant" in r for r in reasons.values()) == 7  # pos, 2 bias adds per layer
    assert sum("depends on" in r for r in reasons.values()) == 3  # scores + mask
    assert sum("scalar" in r for r in reasons.values()) == 3      # var + eps
    assert [c["links"] for c in result.report["chains"]] == [6]
    assert all(row["ok"] for row in result.report["verification"])


class GatedConditioning(nn.Module):
    """FiLM / adaLN-style gating, y + W(c) * sigmoid(mean(y)): the branch's only learned op, W(c),
    is beside the skip's path, not on it."""

    def __init__(self, d=16, layers=3):
        super().__init__()
        self.cond = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, y, c):
        for w in self.cond:
            y = y + w(c) * torch.sigmoid(y.mean(-1, keepdim=True))
        return y


def test_gated_conditioning_branch_is_learned(tmp_path):
    """A branch is learned when its cone after the skip holds a learned op: the three gated links
    form one chain, in the fx analysis and in the ONNX one (a single rule), and rewrite exactly."""
    torch.manual_seed(0)
    model, inputs = GatedConditioning().eval(), (torch.randn(2, 6, 16), torch.randn(2, 6, 16))
    result = ac.rewrite(model, inputs)
    assert [c["links"] for c in result.report["chains"]] == [3]
    assert all(row["ok"] for row in result.report["verification"])
    path = tmp_path / "gated.onnx"
    onnx_io.write(onnx_export.export(model, inputs), path)
    assert [c["links"] for c in inspect_onnx(path)["chains"]] == [3]
