"""Delta AttnRes' op, `torch.ops.attnres.depth_attention_delta` (docs/design.md, Delta):

    out = base + gate * scale * sum_i softmax_i(w . RMSNorm(s_i)) * s_i      over the feature axis `dim`

`base` is the site's plain sum, `gate` its float32 [1] gate (0 at conversion: out is `base`,
bitwise, and the query's gradient is zero, so the gates train first). A separate op, so no pass
reading `depth_attention`'s arguments drops the delta part unnoticed. Two-phase form:
`depth_attention_merge_delta(..., base, gate, ...) = base + gate * depth_attention_merge(...)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import depth_attention as op
from .depth_attention import _PLAIN, _back, _check, _compute_dtype, _last, _logits, _modes

OP_NAME = "attnres::depth_attention_delta"
BACKWARD_NAME = "attnres::depth_attention_delta_backward"
MERGE_NAME = "attnres::depth_attention_merge_delta"

_LIB = torch.library.Library("attnres", "FRAGMENT")
_LIB.define("depth_attention_delta(Tensor[] sources, Tensor query, Tensor base, Tensor gate, float eps, float scale, "
            "int dim) -> Tensor")
_LIB.define("depth_attention_delta_backward(Tensor[] sources, Tensor query, Tensor gate, Tensor grad, float eps, "
            "float scale, int dim) -> (Tensor[], Tensor, Tensor)")
_LIB.define("depth_attention_merge_delta(Tensor m, Tensor l, Tensor acc, int index, Tensor[] extra, Tensor query, "
            "Tensor base, Tensor gate, float eps, float scale, int dim) -> Tensor")
_OP = torch.ops.attnres.depth_attention_delta.default
_MERGE = torch.ops.attnres.depth_attention_merge_delta.default
depth_attention_merge_delta = _MERGE
_BACKWARD = torch.ops.attnres.depth_attention_delta_backward.default
depth_attention_delta = _OP  # depth_attention_delta(sources, query, base, gate, eps, scale, dim)


def _check_delta(sources: Sequence[torch.Tensor], query: torch.Tensor, base: torch.Tensor, gate: torch.Tensor,
                 dim: int) -> None:
    _check(sources, query, dim)
    first = sources[0]
    if base.shape != first.shape or base.dtype != first.dtype or base.device != first.device:
        raise ValueError(f"depth_attention_delta base must match the sources: they are {tuple(first.shape)} "
                         f"{first.dtype} {first.device}, base is {tuple(base.shape)} {base.dtype} {base.device}")
    if gate.numel() != 1:
        raise ValueError(f"depth_attention_delta gate must hold one value, got shape {tuple(gate.shape)}")


def forward_reference(sources: list[torch.Tensor], query: torch.Tensor, base: torch.Tensor, gate: torch.Tensor,
                      eps: float, scale: float, dim: int) -> torch.Tensor:
    """The eager forward: base + gate * scale * sum_i softmax_i(query . RMSNorm(sources[i])) * sources[i],
    in float32 (float64 for float64 storage); the gate is folded into the weights, so gate 0 adds
    exact zeros to base."""
    _check_delta(sources, query, base, gate, dim)
    dtype = sources[0].dtype
    ctype = _compute_dtype(dtype)
    srcs = [s.to(ctype) for s in _last(sources, dim)]
    z, _ = _logits(srcs, query.to(ctype), eps, ctype)
    p = torch.softmax(z, dim=0).mul_(gate.to(ctype).reshape(()) * scale).unsqueeze(-1)
    acc = _last([base], dim)[0].to(ctype, copy=True)
    for s, ps in zip(srcs, p):
        acc.addcmul_(s, ps)
    return _back(acc, dim, dtype)


def backward_reference(sources: list[torch.Tensor], query: torch.Tensor, gate: torch.Tensor, grad: torch.Tensor,
                       eps: float, scale: float, dim: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(source gradients, query gradient, gate gradient); base's gradient is `grad`."""
    ctype = _compute_dtype(sources[0].dtype)
    g = grad.to(ctype)
    grads, grad_query = op.backward_reference(sources, query, g * gate.to(ctype).reshape(()), eps, scale, dim)
    p = op.depth_weights(sources, query, eps, dim)
    gl = _last([g], dim)[0]
    ubar = sum(pk * (gl * s.to(ctype)).sum(-1) for pk, s in zip(p, _last(sources, dim)))
    grad_gate = (ubar.sum() * scale).to(gate.dtype).reshape(gate.shape)
    return grads, grad_query, grad_gate


def _forward(sources, query, base, gate, eps, scale, dim):
    """The CPU and CUDA kernel: fused where it applies, else the reference; observers see the call."""
    fused = op.fused_kernels()
    out = None
    if fused:
        try:
            out = fused.forward_delta(sources, query, base, gate, eps, scale, dim)
        except Exception:
            _check_delta(sources, query, base, gate, dim)
            raise
    if out is None:
        out = forward_reference(sources, query, base, gate, eps, scale, dim)
    if op._observers:
        for observer in op._observers:
            observer(sources, query, eps, dim, out)
    return out


def _backward(sources, query, gate, grad, eps, scale, dim):
    fused = op.fused_kernels()
    if fused:
        result = fused.backward_delta(sources, query, gate, grad, eps, scale, dim)
        if result is not None:
            return result
    return backward_reference(sources, query, gate, grad, eps, scale, dim)


class _DeltaAttention(torch.autograd.Function):
    """The op under autograd; `direct` (depth_attention.plain_eager at the call): the backend kernels are called
    without a second trip through the dispatcher."""

    @staticmethod
    def forward(ctx, direct, query, base, gate, eps, scale, dim, *sources):
        sources = list(sources)
        if direct:
            out = _forward(sources, query, base, gate, eps, scale, dim)
        else:
            with torch._C._AutoDispatchBelowAutograd():
                out = _OP(sources, query, base, gate, eps, scale, dim)
        ctx.save_for_backward(query, gate, *sources)
        ctx.args = (direct, eps, scale, dim)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, gate, *sources = ctx.saved_tensors
        direct, *args = ctx.args
        if direct and not torch.is_grad_enabled() and type(grad) in _PLAIN and not _modes():
            grads, grad_query, grad_gate = _backward(sources, query, gate, grad, *args)
        else:
            grads, grad_query, grad_gate = _BACKWARD(sources, query, gate, grad, *args)
        need = ctx.needs_input_grad
        return (None, grad_query if need[1] else None, grad if need[2] else None, grad_gate if need[3] else None,
                None, None, None, *grads)


_apply = super(torch.autograd.Function, _DeltaAttention).apply  # without Function.apply's Python wrapper


def _autograd(sources, query, base, gate, eps, scale, dim):
    """The Autograd kernel: the autograd.Function only when a gradient is wanted, else the backend kernel."""
    direct = op.plain_eager(sources, query) and type(base) in _PLAIN and type(gate) in _PLAIN
    if direct and not torch.is_grad_enabled():
        return _forward(sources, query, base, gate, eps, scale, dim)
    if op.wants_grad(query, base, gate, *sources):
        return (_apply if direct else _DeltaAttention.apply)(direct, query, base, gate, eps, scale, dim, *sources)
    if direct:
        return _forward(sources, query, base, gate, eps, scale, dim)
    with torch._C._AutoDispatchBelowAutograd():
        return _OP(sources, query, base, gate, eps, scale, dim)


# ---- the two-phase merge (inference; differentiable through the reference) -------------------------

def merge_reference(m, l, acc, index, extra, query, base, gate, eps, scale, dim):
    """The eager merge in differentiable torch ops: base + gate * two_phase.merge_reference(...)."""
    from .two_phase import merge_reference as plain

    ctype = _compute_dtype(base.dtype)
    mix = plain(m, l, acc, index, extra, query, eps, scale, dim).to(ctype)
    return (base.to(ctype) + gate.to(ctype).reshape(()) * mix).to(base.dtype)


def _merge_any(m, l, acc, index, extra, query, base, gate, eps, scale, dim):
    with torch.no_grad():
        return merge_reference(m, l, acc, index, extra, query, base, gate, eps, scale, dim)


def _merge(m, l, acc, index, extra, query, base, gate, eps, scale, dim):
    fused = op.fused_kernels()
    if fused:
        out = fused.merge_delta(m, l, acc, index, extra, query, base, gate, eps, scale, dim)
        if out is not None:
            return out
    return _merge_any(m, l, acc, index, extra, query, base, gate, eps, scale, dim)


def _merge_autograd(m, l, acc, index, extra, query, base, gate, eps, scale, dim):
    if op.wants_grad(l, acc, query, base, gate, *extra):
        return merge_reference(m, l, acc, index, extra, query, base, gate, eps, scale, dim)
    if op.plain_eager([m, l, acc, base, *extra], query) and type(gate) in _PLAIN:
        return _merge(m, l, acc, index, extra, query, base, gate, eps, scale, dim)
    with torch._C._AutoDispatchBelowAutograd():
        return _MERGE(m, l, acc, index, extra, query, base, gate, eps, scale, dim)


class _DeltaOverload(type(_OP)):
    """The OpOverload plus depth_attention.py's eager shortcut (`_SiteOverload`): a plain eager inference call
    (a decode step's sites) goes straight to `_forward`, skipping the dispatcher's round trip."""

    def __call__(self, /, *args, **kwargs):
        if not kwargs and len(args) == 7 and _shortcut(*args):
            return _forward(*args)
        return self._op(*args, **kwargs)


def _shortcut(sources, query, base, gate, eps, scale, dim) -> bool:
    """depth_attention._shortcut's test with the plain sum and the gate too."""
    if type(base) not in _PLAIN or type(gate) not in _PLAIN or not op._shortcut(sources, query, eps, scale, dim):
        return False
    return not torch.is_grad_enabled() or not (base.requires_grad or gate.requires_grad)


_OP.__class__ = _DeltaOverload
direct_forward = _forward  # the backend kernel by name (fx/lean.py, as depth_attention.direct_forward)

for _key in ("CPU", "CUDA"):
    _LIB.impl("depth_attention_delta", _forward, _key)
    _LIB.impl("depth_attention_delta_backward", _backward, _key)
_LIB.impl("depth_attention_delta", forward_reference, "CompositeExplicitAutograd")
_LIB.impl("depth_attention_delta_backward", backward_reference, "CompositeExplicitAutograd")
_LIB.impl("depth_attention_delta", _autograd, "Autograd")
for _key in ("CPU", "CUDA"):
    _LIB.impl("depth_attention_merge_delta", _merge, _key)
_LIB.impl("depth_attention_merge_delta", _merge_any, "CompositeExplicitAutograd")
_LIB.impl("depth_attention_merge_delta", _merge_autograd, "Autograd")


@torch.library.register_fake(MERGE_NAME)
def _(m, l, acc, index, extra, query, base, gate, eps, scale, dim):
    _check(extra, query, dim)
    return base.new_empty(base.shape)


@torch.library.register_fake(OP_NAME)
def _(sources, query, base, gate, eps, scale, dim):
    _check_delta(sources, query, base, gate, dim)
    return base.new_empty(base.shape)


@torch.library.register_fake(BACKWARD_NAME)
def _(sources, query, gate, grad, eps, scale, dim):
    return [s.new_empty(s.shape) for s in sources], query.new_empty(query.shape), gate.new_empty(gate.shape)
