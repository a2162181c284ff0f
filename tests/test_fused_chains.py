"""The fused kernels over long source lists (kernels/fused.py, CHAIN_ABOVE): the forward as a chain
of partial kernels, the backward as backward_chunk kernels, against the eager reference, and the
kernels they build, whose number no longer grows with the source count."""

import pytest
import torch

from attnres_compile.ops import depth_attention as op_module
from attnres_compile.kernels import cache as kernel_cache
from attnres_compile.kernels import fused

op = torch.ops.attnres.depth_attention.default
T = fused.CHAIN_ABOVE
CHUNK = kernel_cache.PARTIAL_CHUNK


@pytest.fixture(autouse=True)
def tvm_kernels():
    previous = op_module.set_kernel("tvm")
    yield
    op_module.set_kernel(previous)


def _case(count: int, shape: tuple, dtype: torch.dtype, seed: int = 0):
    """Sources of mixed magnitudes, a query and an output gradient, in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    sources = [(torch.randn(*shape, generator=g) * (0.5 + i % 4)).to(dtype) for i in range(count)]
    w = torch.randn(shape[-1], generator=g) / shape[-1] ** 0.5 * 4  # peaked softmax weights
    return sources, w, torch.randn(*shape, generator=g).to(dtype)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


# float32: sums of up to 61 terms (each within a few ulps) in another order than the reference's;
# bfloat16: the outputs' rounding to the storage dtype (both sides accumulate in float32)
TOL = {torch.float32: 64 * torch.finfo(torch.float32).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps}


@pytest.mark.parametrize("count,dtype,shape", [(T + 1, torch.float32, (3, 5, 48)), (40, torch.float32, (37, 48)),
                                               (61, torch.float32, (2, 9, 48)), (T + 3, torch.bfloat16, (21, 64))])
def test_chained_forward_and_backward_match_the_reference(count, dtype, shape):
    """T + 1 and T + 3 (chunks of 8, 8 and a ragged last one), 40 (whole chunks), 61 (ragged 5)."""
    assert count > T
    sources, w, grad = _case(count, shape, dtype, seed=count)
    scale = float(count)
    out = fused.forward(sources, w, 1e-6, scale, -1)
    ref = op_module.forward_reference(sources, w, 1e-6, scale, -1)
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous()
    assert _rel(out, ref) <= TOL[dtype]
    grads, grad_w = fused.backward(sources, w, grad, 1e-6, scale, -1)
    ref_grads, ref_w = op_module.backward_reference(sources, w, grad, 1e-6, scale, -1)
    assert [g.dtype for g in grads] == [dtype] * count and grad_w.dtype == w.dtype
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) <= TOL[dtype]
    assert _rel(grad_w, ref_w) <= TOL[torch.float32]  # accumulated in float32 either way


def test_chained_op_gradient_matches_float64():
    """Through the op and autograd: 27 sources (chunks 8, 8, 8, 3) against float64's gradient."""
    sources, w, grad = _case(27, (4, 6, 32), torch.float32, seed=3)
    leaves = [s.clone().requires_grad_() for s in sources]
    wq = w.clone().requires_grad_()
    op(leaves, wq, 1e-6, 27.0, -1).backward(grad)
    op_module.set_kernel("eager")
    ref_leaves = [s.double().requires_grad_() for s in sources]
    ref_w = w.double().requires_grad_()
    op(ref_leaves, ref_w, 1e-6, 27.0, -1).backward(grad.double())
    for got, ref in [(x.grad, r.grad) for x, r in zip(leaves, ref_leaves)] + [(wq.grad, ref_w.grad)]:
        assert _rel(got, ref) <= TOL[torch.float32]


def test_kernels_built_do_not_grow_with_the_source_count(one_thread):
    """Forward and backward at every count 20..61, with the preserve mode's scale (the count),
    build the partial chain's links, the merge of the last link and the backward's chunks (of 8
    and of each remainder): the kernels of 20..27 serve all the rest."""
    fused._KERNELS.clear()

    def kinds(counts) -> set:
        for count in counts:
            sources, w, grad = _case(count, (2, 3, 16), torch.float32)
            assert fused.forward(sources, w, 1e-6, float(count), -1) is not None
            assert fused.backward(sources, w, grad, 1e-6, float(count), -1) is not None
        return {k[:2] for k, fn in fused._KERNELS.items() if fn is not False}

    first = kinds(range(20, 28))
    assert kinds(range(28, 62)) == first
    rest = set(range(1, CHUNK))
    allowed = {("partial", CHUNK), *(("partial_link", n) for n in (*rest, CHUNK)),
               *(("merge_indexed", n) for n in (*rest, CHUNK)), *(("backward_chunk", n) for n in (*rest, CHUNK))}
    assert first <= allowed and len(first) <= 3 * CHUNK + 1


def test_chained_calls_fall_back_where_the_kernels_do_not_apply():
    """float64 storage and a feature axis other than the last get None (the op's eager reference)."""
    sources, w, grad = _case(T + 2, (3, 8), torch.float64)
    assert fused.forward(sources, w, 1e-6, 1.0, -1) is None
    assert fused.backward(sources, w, grad, 1e-6, 1.0, -1) is None
    sources, w, grad = _case(T + 2, (8, 3), torch.float32)
    assert fused.forward(sources, torch.randn(8), 1e-6, 1.0, 0) is None
    assert fused.backward(sources, torch.randn(8), grad, 1e-6, 1.0, 0) is None
    out = op(sources, torch.randn(8), 1e-6, 1.0, 0)  # the op still computes it
    assert out.shape == (8, 3) and torch.isfinite(out).all()
