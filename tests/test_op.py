"""The depth_attention custom op: reference numerics, gradients, dtypes, export."""

import pytest
import torch

from attnres_compile.op import depth_attention_stacked

op = torch.ops.attnres.depth_attention.default


def _float64_reference(sources, w, eps, scale, dim):
    v = torch.stack([s.double().movedim(dim, -1) for s in sources])
    k = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.einsum("d,s...d->s...", w.double(), k).softmax(0)
    return (scale * torch.einsum("s...,s...d->...d", p, v)).movedim(-1, dim)


@pytest.mark.parametrize("shape,dim", [((2, 5, 16), -1), ((7, 33), -1), ((2, 6, 3, 3), 1)])
@pytest.mark.parametrize("num", [1, 3, 9])
def test_matches_float64_reference(shape, dim, num):
    g = torch.Generator().manual_seed(num)
    sources = [torch.randn(*shape, generator=g) * (i + 1) for i in range(num)]
    w = torch.randn(shape[dim], generator=g)
    out = op(sources, w, 1e-6, 2.5, dim)
    ref = _float64_reference(sources, w, 1e-6, 2.5, dim)
    assert out.shape == sources[0].shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(depth_attention_stacked(sources, w, 1e-6, 2.5, dim).double(), ref, atol=1e-5, rtol=1e-5)


def test_zero_query_gives_scaled_mean_and_preserve_gives_sum():
    sources = [torch.randn(4, 8) for _ in range(5)]
    out = op(sources, torch.zeros(8), 1e-6, 5.0, -1)
    torch.testing.assert_close(out, sum(sources), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_storage_accumulates_in_float32(dtype):
    g = torch.Generator().manual_seed(0)
    sources = [(torch.randn(64, 96, generator=g) * 100).to(dtype) for _ in range(17)]
    w = torch.randn(96, generator=g)
    out = op(sources, w, 1e-6, 17.0, -1)
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    ref = _float64_reference(sources, w, 1e-6, 17.0, -1)
    # the only rounding left is the final cast to the storage dtype
    torch.testing.assert_close(out.double(), ref, atol=0, rtol=2 * torch.finfo(dtype).eps)


def test_all_zero_source_is_legal():
    sources = [torch.zeros(3, 8), torch.randn(3, 8)]
    out = op(sources, torch.randn(8), 1e-6, 1.0, -1)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dim,shape", [(-1, (2, 3, 6)), (1, (2, 4, 3, 3))])
def test_gradcheck(dim, shape):
    g = torch.Generator().manual_seed(1)
    sources = [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    w = torch.randn(shape[dim], generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: op(list(a[:-1]), a[-1], 1e-6, 3.0, dim), (*sources, w))


def test_opcheck():
    sources = [torch.randn(3, 5, requires_grad=True) for _ in range(3)]
    torch.library.opcheck(op, (sources, torch.randn(5, requires_grad=True), 1e-6, 3.0, -1))


def test_stays_one_node_through_export():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(8))

        def forward(self, a, b):
            return op([a, b, a * b], self.w, 1e-6, 3.0, -1)

    ep = torch.export.export(M(), (torch.randn(2, 8), torch.randn(2, 8)))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(op) == 1


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="share shape"):
        op([torch.randn(2, 4), torch.randn(2, 5)], torch.zeros(4), 1e-6, 2.0, -1)
    with pytest.raises(ValueError, match="query must have shape"):
        op([torch.randn(2, 4)], torch.zeros(3), 1e-6, 1.0, -1)


def test_zero_query_paper_scale_is_the_mean():
    """At w = 0 every site weighs its sources uniformly: with c = 1 the output is their mean."""
    sources = [torch.randn(5, 8) for _ in range(6)]
    out = op(sources, torch.zeros(8), 1e-6, 1.0, -1)
    torch.testing.assert_close(out, sum(sources) / 6, atol=1e-6, rtol=1e-6)
