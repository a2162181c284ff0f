"""The two-phase depth-attention ops: a site's softmax over depth split at a shared history.

    depth_attention_partial(history, queries[B, D], eps, dim) -> (m, l, acc)
        per query q: m_q = max_j z_qj, l_q = sum_j exp(z_qj - m_q), acc_q = sum_j exp(z_qj - m_q) h_j,
        z_qj = w_q . RMSNorm(h_j); float32 state; m, l [B, rows..], acc [B, rows.., D]
    depth_attention_merge(m, l, acc, index, extra, query, eps, scale, dim)
        = depth_attention(history + extra, query, eps, scale, dim) up to float reassociation

Gradients through the reference are exact (m is a shift held constant); docs/design.md §6.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import depth_attention as op
from .depth_attention import _back, _check, _compute_dtype, _last

PARTIAL_NAME = "attnres::depth_attention_partial"
MERGE_NAME = "attnres::depth_attention_merge"

_LIB = torch.library.Library("attnres", "FRAGMENT")
_LIB.define("depth_attention_partial(Tensor[] history, Tensor queries, float eps, int dim) -> (Tensor, Tensor, Tensor)")
_LIB.define("depth_attention_merge(Tensor m, Tensor l, Tensor acc, int index, Tensor[] extra, Tensor query, "
            "float eps, float scale, int dim) -> Tensor")
_PARTIAL = torch.ops.attnres.depth_attention_partial.default
_MERGE = torch.ops.attnres.depth_attention_merge.default
depth_attention_partial = _PARTIAL
depth_attention_merge = _MERGE


def _check_queries(history: Sequence[torch.Tensor], queries: torch.Tensor, dim: int) -> None:
    if queries.dim() != 2 or queries.shape[0] == 0:
        raise ValueError(f"depth_attention_partial queries must have shape [B, D], got {tuple(queries.shape)}")
    _check(history, queries[0], dim)


def _logit(s: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w . RMSNorm(s) over the last axis: w [D] gives [rows..], w [D, B] gives [rows.., B]."""
    rinv = torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
    return torch.matmul(s, w) * (rinv if w.dim() == 2 else rinv.squeeze(-1))


def partial_reference(history: list[torch.Tensor], queries: torch.Tensor, eps: float, dim: int):
    """The eager partial, in differentiable torch ops (m held constant)."""
    _check_queries(history, queries, dim)
    ctype = _compute_dtype(history[0].dtype)
    srcs = [s.to(ctype) for s in _last(history, dim)]
    w = queries.to(ctype).t()
    z = torch.stack([_logit(s, w, eps) for s in srcs]).movedim(-1, 0)  # [B, J, rows..]
    m = z.amax(1).detach()
    e = torch.exp(z - m.unsqueeze(1))
    acc = e[:, 0].unsqueeze(-1) * srcs[0]
    for j in range(1, len(srcs)):
        acc = acc + e[:, j].unsqueeze(-1) * srcs[j]
    return m, e.sum(1), acc


def merge_reference(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, index: int, extra: list[torch.Tensor],
                    query: torch.Tensor, eps: float, scale: float, dim: int) -> torch.Tensor:
    """The eager merge, in differentiable torch ops (the running max held constant)."""
    _check(extra, query, dim)
    dtype = extra[0].dtype
    ctype = _compute_dtype(dtype)
    srcs = [s.to(ctype) for s in _last(extra, dim)]
    z = torch.stack([_logit(s, query.to(ctype), eps) for s in srcs])  # [E, rows..]
    mq, lq, aq = m[index].to(ctype), l[index].to(ctype), acc[index].to(ctype)
    top = torch.maximum(mq, z.amax(0)).detach()
    alpha, p = torch.exp(mq - top), torch.exp(z - top)
    num = aq * alpha.unsqueeze(-1)
    for i, s in enumerate(srcs):
        num = num + p[i].unsqueeze(-1) * s
    out = num * (scale / (alpha * lq + p.sum(0))).unsqueeze(-1)
    return _back(out, dim, dtype)


def _partial_any(history, queries, eps, dim):
    """The kernel of devices without a fused one, and the fallback of those with one."""
    with torch.no_grad():
        return partial_reference(history, queries, eps, dim)


def _merge_any(m, l, acc, index, extra, query, eps, scale, dim):
    with torch.no_grad():
        return merge_reference(m, l, acc, index, extra, query, eps, scale, dim)


def _partial(history, queries, eps, dim):
    """The CPU and CUDA kernel (arguments checked where the fused kernel refuses them)."""
    fused = op.fused_kernels()
    if fused:
        try:
            state = fused.partial(history, queries, eps, dim)
        except Exception:
            _check_queries(history, queries, dim)
            raise
        if state is not None:
            return state
    return _partial_any(history, queries, eps, dim)


def _merge(m, l, acc, index, extra, query, eps, scale, dim):
    fused = op.fused_kernels()
    if fused:
        try:
            out = fused.merge(m, l, acc, index, extra, query, eps, scale, dim)
        except Exception:
            _check(extra, query, dim)
            raise
        if out is not None:
            return out
    return _merge_any(m, l, acc, index, extra, query, eps, scale, dim)


def _partial_autograd(history, queries, eps, dim):
    """The Autograd kernel: the differentiable reference when a gradient is wanted, else the
    backend kernel (called directly in plain eager execution, as op._autograd does)."""
    if op.wants_grad(queries, *history):
        return partial_reference(history, queries, eps, dim)
    if op.plain_eager(history, queries):
        return _partial(history, queries, eps, dim)
    with torch._C._AutoDispatchBelowAutograd():
        return _PARTIAL(history, queries, eps, dim)


def _merge_autograd(m, l, acc, index, extra, query, eps, scale, dim):
    if op.wants_grad(l, acc, query, *extra):
        return merge_reference(m, l, acc, index, extra, query, eps, scale, dim)
    if op.plain_eager([m, l, acc, *extra], query):
        return _merge(m, l, acc, index, extra, query, eps, scale, dim)
    with torch._C._AutoDispatchBelowAutograd():
        return _MERGE(m, l, acc, index, extra, query, eps, scale, dim)


for _key in ("CPU", "CUDA"):
    _LIB.impl("depth_attention_partial", _partial, _key)
    _LIB.impl("depth_attention_merge", _merge, _key)
_LIB.impl("depth_attention_partial", _partial_any, "CompositeExplicitAutograd")  # any other device
_LIB.impl("depth_attention_merge", _merge_any, "CompositeExplicitAutograd")
_LIB.impl("depth_attention_partial", _partial_autograd, "Autograd")
_LIB.impl("depth_attention_merge", _merge_autograd, "Autograd")


@torch.library.register_fake(PARTIAL_NAME)
def _(history, queries, eps, dim):
    _check_queries(history, queries, dim)
    rows = [n for i, n in enumerate(history[0].shape) if i != dim % history[0].dim()]
    ctype = _compute_dtype(history[0].dtype)
    new = history[0].new_empty
    b = queries.shape[0]
    return new((b, *rows), dtype=ctype), new((b, *rows), dtype=ctype), new((b, *rows, queries.shape[1]), dtype=ctype)


@torch.library.register_fake(MERGE_NAME)
def _(m, l, acc, index, extra, query, eps, scale, dim):
    _check(extra, query, dim)
    return extra[0].new_empty(extra[0].shape)
