"""The fused site + norm pair, `torch.ops.attnres.depth_attention_norm` (docs/design.md §6).

    mixed, normed = depth_attention_norm(sources, query, eps, scale, dim, norm_weight, norm_bias,
                                         norm_eps, norm_kind)

`mixed` is `depth_attention(...)`, `normed` its LayerNorm ("layer") or RMSNorm ("rms", no bias)
over the feature axis. In mode eager both equal the unfused ops bit for bit; the fused kernel
differs by float32 rounding. The backward saves nothing beyond the site's inputs.
"""

from __future__ import annotations

import torch

from . import depth_attention as op
from .depth_attention import _check, _compute_dtype

NAME = "attnres::depth_attention_norm"
BACKWARD_NAME = "attnres::depth_attention_norm_backward"
KINDS = ("layer", "rms")

_LIB = torch.library.Library("attnres", "FRAGMENT")
_LIB.define("depth_attention_norm(Tensor[] sources, Tensor query, float eps, float scale, int dim, Tensor? norm_weight, "
            "Tensor? norm_bias, float norm_eps, str norm_kind) -> (Tensor, Tensor)")
_LIB.define("depth_attention_norm_backward(Tensor[] sources, Tensor query, Tensor? norm_weight, Tensor? norm_bias, "
            "Tensor? grad_mixed, Tensor grad_normed, float eps, float scale, int dim, float norm_eps, str norm_kind) "
            "-> (Tensor[], Tensor, Tensor[])")
_OP = torch.ops.attnres.depth_attention_norm.default
_BACKWARD = torch.ops.attnres.depth_attention_norm_backward.default
depth_attention_norm = _OP


def check(sources, query, dim, weight, bias, kind) -> int:
    """The feature size, after ops/depth_attention.py's checks and the norm's: over the last axis, a known kind, an
    RMSNorm without bias, weight and bias of shape [D]."""
    if sources and dim not in (-1, sources[0].dim() - 1):
        raise ValueError(f"depth_attention_norm normalises the last axis: dim must be -1, got {dim}")
    size = _check(sources, query, dim)
    if kind not in KINDS:
        raise ValueError(f"depth_attention_norm norm_kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "rms" and bias is not None:
        raise ValueError("depth_attention_norm: an RMSNorm has no bias")
    for name, t in (("norm_weight", weight), ("norm_bias", bias)):
        if t is not None and tuple(t.shape) != (size,):
            raise ValueError(f"depth_attention_norm {name} must have shape [{size}], got {tuple(t.shape)}")
    return size


def norm_reference(h: torch.Tensor, weight, bias, norm_eps: float, kind: str) -> torch.Tensor:
    """The unfused norm of the site's output `h` over its last axis, as the models write it."""
    if kind == "layer":
        return torch.nn.functional.layer_norm(h, h.shape[-1:], weight, bias, norm_eps)
    x = h.to(_compute_dtype(h.dtype))
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps)).to(h.dtype)
    return normed if weight is None else weight * normed


def forward_reference(sources, query, eps, scale, dim, weight, bias, norm_eps, kind):
    """The eager forward: the unfused pair, (mixed, norm(mixed))."""
    check(sources, query, dim, weight, bias, kind)
    mixed = op.forward_reference(sources, query, eps, scale, dim)
    return mixed, norm_reference(mixed, weight, bias, norm_eps, kind)


def backward_reference(sources, query, weight, bias, grad_mixed, grad_normed, eps, scale, dim, norm_eps, kind):
    """The analytic gradient. With n = (h - mean) r (RMSNorm: mean 0, h r), g = grad_normed * weight:
    dh = grad_mixed + r (g - mean(g) - n mean(g n)) (RMSNorm: without mean(g)), then the site's
    backward (op.backward_reference) for dh; d weight = sum_rows grad_normed n, d bias = sum_rows grad_normed."""
    ctype = _compute_dtype(sources[0].dtype)
    h = op.forward_reference(sources, query, eps, scale, dim).to(ctype)
    centred = h - h.mean(-1, keepdim=True) if kind == "layer" else h
    r = torch.rsqrt(centred.square().mean(-1, keepdim=True) + norm_eps)
    n = centred * r
    gn = grad_normed.to(ctype)
    g = gn if weight is None else gn * weight.to(ctype)
    dh = g - (g * n).mean(-1, keepdim=True) * n
    if kind == "layer":
        dh = dh - g.mean(-1, keepdim=True)
    dh = dh * r
    if grad_mixed is not None:
        dh = dh + grad_mixed.to(ctype)
    grads, grad_query = op.backward_reference(sources, query, dh, eps, scale, dim)
    rows = tuple(range(h.dim() - 1))
    params = [] if weight is None else [(gn * n).sum(rows).to(weight.dtype)]
    return grads, grad_query, params + ([] if bias is None else [gn.sum(rows).to(bias.dtype)])


def _forward(sources, query, eps, scale, dim, weight, bias, norm_eps, kind):
    """The CPU and CUDA kernel."""
    fused = op.fused_kernels()
    if fused and kind in KINDS and (kind == "layer" or bias is None):
        try:
            pair = fused.forward_norm(sources, query, weight, bias, eps, scale, dim, norm_eps, kind)
        except Exception:
            check(sources, query, dim, weight, bias, kind)  # bad arguments get the reference's message
            raise
        if pair is not None:
            return pair
    return forward_reference(sources, query, eps, scale, dim, weight, bias, norm_eps, kind)


def _backward(sources, query, weight, bias, grad_mixed, grad_normed, eps, scale, dim, norm_eps, kind):
    fused = op.fused_kernels()
    if fused:
        result = fused.backward_norm(sources, query, weight, bias, grad_mixed, grad_normed, eps, scale, dim,
                                     norm_eps, kind)
        if result is not None:
            return result
    return backward_reference(sources, query, weight, bias, grad_mixed, grad_normed, eps, scale, dim, norm_eps, kind)


class _SiteNorm(torch.autograd.Function):
    """The pair under autograd; `direct` as in op._DepthAttention (plain eager: the kernels are called
    without a second trip through the dispatcher). Saves the site's inputs only."""

    @staticmethod
    def forward(ctx, direct, query, weight, bias, eps, scale, dim, norm_eps, kind, *sources):
        args = (list(sources), query, eps, scale, dim, weight, bias, norm_eps, kind)
        if direct:
            mixed, normed = _forward(*args)
        else:
            with torch._C._AutoDispatchBelowAutograd():
                mixed, normed = _OP(*args)
        ctx.save_for_backward(query, weight, bias, *sources)
        ctx.args = (direct, eps, scale, dim, norm_eps, kind)
        ctx.set_materialize_grads(False)  # an unread `mixed` gets no zero gradient to read
        return mixed, normed

    @staticmethod
    def backward(ctx, grad_mixed, grad_normed):
        query, weight, bias, *sources = ctx.saved_tensors
        direct, eps, scale, dim, norm_eps, kind = ctx.args
        if grad_normed is None:
            grad_normed = torch.zeros_like(sources[0])
        args = (sources, query, weight, bias, grad_mixed, grad_normed, eps, scale, dim, norm_eps, kind)
        if direct and not torch.is_grad_enabled() and not op._modes():
            grads, grad_query, params = _backward(*args)
        else:  # also with create_graph, where the backward op is what autograd must see
            grads, grad_query, params = _BACKWARD(*args)
        params = iter(params)
        grad_weight = next(params) if weight is not None else None
        grad_bias = next(params) if bias is not None else None
        return (None, grad_query if ctx.needs_input_grad[1] else None, grad_weight, grad_bias,
                None, None, None, None, None, *grads)


_apply = super(torch.autograd.Function, _SiteNorm).apply  # without Function.apply's Python wrapper (ops/depth_attention.py)


def _autograd(sources, query, eps, scale, dim, weight, bias, norm_eps, kind):
    """The Autograd kernel: the autograd.Function when a gradient is wanted, else the backend kernel."""
    params = [t for t in (weight, bias) if t is not None]
    direct = op.plain_eager(sources, query) and all(type(t) in op._PLAIN for t in params)
    args = (sources, query, eps, scale, dim, weight, bias, norm_eps, kind)
    if direct and not torch.is_grad_enabled():  # inference (a decode step): straight to the kernel
        return _forward(*args)
    if op.wants_grad(query, *sources, *params):
        return (_apply if direct else _SiteNorm.apply)(direct, query, weight, bias, eps, scale, dim, norm_eps, kind,
                                                       *sources)
    if direct:
        return _forward(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return _OP(*args)


def _forward_any(*args):
    with torch.no_grad():
        return forward_reference(*args)


for _key in ("CPU", "CUDA"):
    _LIB.impl("depth_attention_norm", _forward, _key)
    _LIB.impl("depth_attention_norm_backward", _backward, _key)
_LIB.impl("depth_attention_norm", _forward_any, "CompositeExplicitAutograd")  # any other device
_LIB.impl("depth_attention_norm_backward", backward_reference, "CompositeExplicitAutograd")
_LIB.impl("depth_attention_norm", _autograd, "Autograd")


@torch.library.register_fake(NAME)
def _(sources, query, eps, scale, dim, weight, bias, norm_eps, kind):
    check(sources, query, dim, weight, bias, kind)
    return sources[0].new_empty(sources[0].shape), sources[0].new_empty(sources[0].shape)


@torch.library.register_fake(BACKWARD_NAME)
def _(sources, query, weight, bias, grad_mixed, grad_normed, eps, scale, dim, norm_eps, kind):
    params = [t.new_empty(t.shape) for t in (weight, bias) if t is not None]
    return [s.new_empty(s.shape) for s in sources], query.new_empty(query.shape), params
