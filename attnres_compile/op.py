"""The depth-attention op, `torch.ops.attnres.depth_attention` (DESIGN.md §3).

    out = scale * sum_i softmax_i(w . RMSNorm(s_i)) * s_i      over the feature axis `dim`

A torch.library custom op: it stays one node through torch.export, has a fake kernel for
tracing and an analytic backward. The eager kernel never stacks the sources: per source it
reads the norm and the dot with `w` (two fused reductions), then accumulates `p_i * s_i` in
place, in float32 (float64 for float64 storage) whatever the storage dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

OP_NAME = "attnres::depth_attention"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(sources: Sequence[torch.Tensor], query: torch.Tensor, dim: int) -> int:
    if len(sources) == 0:
        raise ValueError("depth_attention needs at least one source")
    first = sources[0]
    for i, s in enumerate(sources):
        if s.shape != first.shape or s.dtype != first.dtype or s.device != first.device:
            raise ValueError(
                f"depth_attention sources must share shape, dtype and device: source 0 is "
                f"{tuple(first.shape)} {first.dtype} {first.device}, source {i} is {tuple(s.shape)} {s.dtype} {s.device}"
            )
    if not -first.dim() <= dim < first.dim():
        raise ValueError(f"depth_attention dim {dim} is out of range for rank-{first.dim()} sources")
    size = first.shape[dim]
    if query.dim() != 1 or query.shape[0] != size:
        raise ValueError(f"depth_attention query must have shape [{size}], got {tuple(query.shape)}")
    return size


def _logits(sources: Sequence[torch.Tensor], w: torch.Tensor, eps: float, ctype: torch.dtype):
    """Per source, with the feature axis last: logits z_i and inverse RMS r_i (shape [...])."""
    size = sources[0].shape[-1]
    zs, rinvs = [], []
    for s in sources:
        sc = s.to(ctype)
        rinv = torch.rsqrt(torch.linalg.vector_norm(sc, dim=-1).square_().div_(size).add_(eps))
        zs.append(torch.matmul(sc, w).mul_(rinv))
        rinvs.append(rinv)
    return torch.stack(zs), torch.stack(rinvs)


def _last(sources: Sequence[torch.Tensor], dim: int) -> list[torch.Tensor]:
    return [s if dim in (-1, s.dim() - 1) else s.movedim(dim, -1) for s in sources]


def _back(t: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    if dim not in (-1, t.dim() - 1):
        t = t.movedim(-1, dim)
    return t.to(dtype).contiguous()


@torch.library.custom_op(OP_NAME, mutates_args=())
def depth_attention(sources: list[torch.Tensor], query: torch.Tensor, eps: float, scale: float, dim: int) -> torch.Tensor:
    """scale * sum_i softmax_i(query . RMSNorm(sources[i])) * sources[i], reduced over axis `dim`."""
    _check(sources, query, dim)
    dtype = sources[0].dtype
    ctype = _compute_dtype(dtype)
    srcs = _last(sources, dim)
    if dtype != ctype:  # one widening copy per source, shared by the logits and the sum
        srcs = [s.to(ctype) for s in srcs]
    z, _ = _logits(srcs, query.to(ctype), eps, ctype)
    p = torch.softmax(z, dim=0).mul_(scale).unsqueeze(-1)
    acc = srcs[0].to(ctype) * p[0]
    for i in range(1, len(srcs)):
        acc.addcmul_(srcs[i], p[i])
    return _back(acc, dim, dtype)


@depth_attention.register_fake
def _(sources, query, eps, scale, dim):
    _check(sources, query, dim)
    return sources[0].new_empty(sources[0].shape)


def _setup_context(ctx, inputs, output):
    sources, query, eps, scale, dim = inputs
    ctx.save_for_backward(query, *sources)
    ctx.eps, ctx.scale, ctx.dim = eps, scale, dim


def _backward(ctx, grad):
    """Analytic gradient. With n_i = s_i r_i, z_i = w.n_i, u_i = g.s_i, dz_i = c p_i (u_i - sum_j p_j u_j):
    ds_i = c p_i g + dz_i r_i (w - z_i n_i / D),  dw = sum_rows sum_i dz_i n_i."""
    query, *sources = ctx.saved_tensors
    dim, scale = ctx.dim, ctx.scale
    dtype = sources[0].dtype
    ctype = _compute_dtype(dtype)
    w = query.to(ctype)
    srcs = [s.to(ctype) for s in _last(sources, dim)]
    g = _last([grad], dim)[0].to(ctype)
    size = srcs[0].shape[-1]
    z, rinv = _logits(srcs, w, ctx.eps, ctype)
    p = torch.softmax(z, dim=0)
    u = torch.stack([(g * s).sum(-1) for s in srcs])
    dz = p * (u - (p * u).sum(0, keepdim=True)) * scale
    a = dz * rinv                      # coefficient of w
    b = dz * z * rinv.square() / size  # coefficient of s_i
    grads, grad_w = [], torch.zeros_like(w)
    for i, s in enumerate(srcs):
        gs = g * (scale * p[i]).unsqueeze(-1)
        gs.add_(a[i].unsqueeze(-1) * w).sub_(s * b[i].unsqueeze(-1))
        grads.append(_back(gs, dim, dtype) if ctx.needs_input_grad[0] else None)
        grad_w += torch.einsum("...,...d->d", a[i], s)
    grad_q = grad_w.to(query.dtype) if ctx.needs_input_grad[1] else None
    return grads, grad_q, None, None, None


depth_attention.register_autograd(_backward, setup_context=_setup_context)


def depth_attention_stacked(sources: Sequence[torch.Tensor], query: torch.Tensor, eps: float, scale: float, dim: int = -1) -> torch.Tensor:
    """The unfused `torch.stack` formulation of the published pseudocode in float32, for tests
    (bench/kernel.py's `eager` backend is the same form run in the storage dtype, as a user would)."""
    v = torch.stack([s.movedim(dim, -1) for s in sources]).float()
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.einsum("d,s...d->s...", query.float(), k).softmax(0)
    out = scale * torch.einsum("s...,s...d->...d", p, v)
    return out.movedim(-1, dim).to(sources[0].dtype)
