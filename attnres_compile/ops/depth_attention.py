"""The depth-attention op, `torch.ops.attnres.depth_attention` (docs/design.md §6).

    out = scale * sum_i softmax_i(w . RMSNorm(s_i)) * s_i      over the feature axis `dim`

ATTNRES_KERNEL (or `set_kernel`) picks "auto" (fused TVM kernels where they apply, else the eager
reference), "tvm" (no fallback) or "eager". Accumulation is float32 (float64 for float64); mixed
source dtypes are promoted as `+` would. The backward is its own op so graphs keep it whole.
`observe(fn)` hands every forward call's sources, query and output to `fn` (monitor/watch.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence

import torch

from ..core.errors import ConfigError

OP_NAME = "attnres::depth_attention"
BACKWARD_NAME = "attnres::depth_attention_backward"
KERNELS = ("auto", "tvm", "eager")

_LIB = torch.library.Library("attnres", "DEF")
_LIB.define("depth_attention(Tensor[] sources, Tensor query, float eps, float scale, int dim) -> Tensor")
_LIB.define("depth_attention_backward(Tensor[] sources, Tensor query, Tensor grad, float eps, float scale, "
            "int dim) -> (Tensor[], Tensor)")
_OP = torch.ops.attnres.depth_attention.default
_BACKWARD = torch.ops.attnres.depth_attention_backward.default
depth_attention = _OP  # depth_attention(sources, query, eps, scale, dim)
depth_attention_backward = _BACKWARD


def is_attnres_op(target) -> bool:
    """Whether `target` (an fx node's, or a dispatched op) is one of the attnres ops: the site op, its
    backward, or the two-phase pair (ops/two_phase.py)."""
    return getattr(target, "namespace", None) == "attnres"

_mode = os.environ.get("ATTNRES_KERNEL") or "auto"  # unset or empty: auto
_fused = None  # kernels/fused.py for modes auto/tvm once resolved; False: the eager reference only


def set_kernel(mode: str) -> str:
    """Choose the implementation ("auto", "tvm" or "eager") for later calls; returns the previous."""
    global _mode, _fused
    if mode not in KERNELS:
        raise ConfigError(unknown_kernel(repr(mode)))
    previous, _mode, _fused = _mode, mode, None
    return previous


def unknown_kernel(what: str) -> str:
    """The message for a kernel choice `what` that is not one of KERNELS."""
    return f"{what} is not a depth-attention kernel: use one of {', '.join(KERNELS)}"


def _resolve():
    """kernels/fused.py, imported on the first call that may use it; False in mode eager or, in mode
    auto, without a usable TVM."""
    global _fused
    if _mode not in KERNELS:
        raise ConfigError(unknown_kernel(f"ATTNRES_KERNEL={_mode!r}"))
    if _mode == "eager":
        _fused = False
        return _fused
    from ..kernels import fused

    if not fused.available():
        if _mode == "tvm":
            raise RuntimeError("ATTNRES_KERNEL=tvm but TVM cannot be imported: install apache-tvm, "
                               "or use ATTNRES_KERNEL=auto or eager")
        _fused = False
        return _fused
    _fused = fused
    return _fused


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def common_dtype(sources: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype `+` gives the sum of `sources` (torch.promote_types over them)."""
    dtype = sources[0].dtype
    for s in sources:
        if s.dtype is not dtype:
            dtype = torch.promote_types(dtype, s.dtype)
    return dtype


def promoted(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """`sources` in their common dtype, as `+` computes with them (under autocast a residual stream
    holds a float32 root and bfloat16 branches); the list itself where they share one. The casts
    are differentiable: each source's gradient comes back in its own dtype."""
    dtype = common_dtype(sources) if sources else None
    return sources if all(s.dtype is dtype for s in sources) else [s.to(dtype) for s in sources]


def _check(sources: Sequence[torch.Tensor], query: torch.Tensor, dim: int) -> int:
    if len(sources) == 0:
        raise ValueError("depth_attention needs at least one source")
    first = sources[0]
    for i, s in enumerate(sources):
        if s.shape != first.shape or s.device != first.device or not s.is_floating_point():
            raise ValueError(
                f"depth_attention sources must be floating tensors of one shape and device: source 0 is "
                f"{tuple(first.shape)} {first.dtype} {first.device}, source {i} is {tuple(s.shape)} {s.dtype} {s.device}"
            )
    if not -first.dim() <= dim < first.dim():
        raise ValueError(f"depth_attention dim {dim} is out of range for rank-{first.dim()} sources")
    size = first.shape[dim]
    if query.dim() != 1 or query.shape[0] != size:
        raise ValueError(f"depth_attention query must have shape [{size}], got {tuple(query.shape)}")
    return size


# ---- the eager reference -----------------------------------------------------------------------

def _logits(sources: Sequence[torch.Tensor], w: torch.Tensor, eps: float, ctype: torch.dtype):
    """Per source, with the feature axis last: logits z_i and inverse RMS r_i (shape [len(sources), ...]).
    Two reductions per source (its norm, its dot with `w`), the rest on the stacked [S, ...] rows."""
    size = sources[0].shape[-1]
    srcs = [s.to(ctype) for s in sources]
    rinv = torch.stack([torch.linalg.vector_norm(s, dim=-1) for s in srcs]).square_().div_(size).add_(eps).rsqrt_()
    return torch.stack([torch.matmul(s, w) for s in srcs]).mul_(rinv), rinv


def _last(sources: Sequence[torch.Tensor], dim: int) -> list[torch.Tensor]:
    return [s if dim in (-1, s.dim() - 1) else s.movedim(dim, -1) for s in sources]


def _back(t: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    if dim not in (-1, t.dim() - 1):
        t = t.movedim(-1, dim)
    return t.to(dtype).contiguous()


def forward_reference(sources: list[torch.Tensor], query: torch.Tensor, eps: float, scale: float,
                      dim: int) -> torch.Tensor:
    """The eager forward: scale * sum_i softmax_i(query . RMSNorm(sources[i])) * sources[i]."""
    _check(sources, query, dim)
    sources = promoted(sources)
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


def backward_reference(sources: list[torch.Tensor], query: torch.Tensor, grad: torch.Tensor, eps: float,
                       scale: float, dim: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The analytic gradient. With n_i = s_i r_i, z_i = w.n_i, u_i = g.s_i, dz_i = c p_i (u_i - sum_j p_j u_j):
    ds_i = c p_i g + dz_i r_i (w - z_i n_i / D),  dw = sum_rows sum_i dz_i n_i."""
    dtype = sources[0].dtype
    ctype = _compute_dtype(dtype)
    w = query.to(ctype)
    srcs = [s.to(ctype) for s in _last(sources, dim)]
    g = _last([grad], dim)[0].to(ctype)
    size = srcs[0].shape[-1]
    z, rinv = _logits(srcs, w, eps, ctype)
    p = torch.softmax(z, dim=0)
    u = torch.stack([(g * s).sum(-1) for s in srcs])
    dz = p * (u - (p * u).sum(0, keepdim=True)) * scale
    a = dz * rinv                      # coefficient of w
    b = dz * z * rinv.square() / size  # coefficient of s_i
    grads, grad_w = [], torch.zeros_like(w)
    for i, s in enumerate(srcs):
        gs = g * (scale * p[i]).unsqueeze(-1)
        gs.add_(a[i].unsqueeze(-1) * w).sub_(s * b[i].unsqueeze(-1))
        grads.append(_back(gs, dim, dtype))
        grad_w += torch.einsum("...,...d->d", a[i], s)
    return grads, grad_w.to(query.dtype)


# ---- kernels -----------------------------------------------------------------------------------

def fused_kernels():
    """kernels/fused.py where this call may use the fused kernels (modes auto and tvm), else False."""
    return _fused if _fused is not None else _resolve()


def kernels_expected() -> bool:
    """Whether calls may use the fused kernels (mode auto or tvm, TVM installed), answered without
    loading TVM's runtime as fused_kernels() does (~0.7 s): for work started before the first call,
    such as building the kernels, so that the runtime loads while they build."""
    if _fused is not None:
        return _fused is not False
    from ..kernels.cache import installed

    return _mode in ("auto", "tvm") and installed()


def _forward(sources, query, eps, scale, dim):
    """The CPU and CUDA kernel: every real forward call (plain or under autograd, fused or eager,
    compiled or not, through the dispatcher or `_SiteOverload`) reaches it once, so it is where
    observers see the calls."""
    fused = _fused if _fused is not None else _resolve()  # fused_kernels(), inline: the decode hot path
    sources = promoted(sources)
    out = None
    if fused:
        try:
            out = fused.forward(sources, query, eps, scale, dim)
        except Exception:
            _check(sources, query, dim)  # bad arguments get the reference's message
            raise
    if out is None:
        out = forward_reference(sources, query, eps, scale, dim)
    if _observers:
        for observer in _observers:
            observer(sources, query, eps, dim, out)
    return out


_observers: list[Callable] = []  # called as observer(sources, query, eps, dim, out) after each forward call


@contextlib.contextmanager
def observe(observer: Callable) -> Iterator[None]:
    """Call `observer(sources, query, eps, dim, out)` after every CPU/CUDA forward call of the op
    while the block runs (monitor/watch.py collects the depth weights this way, without a second forward);
    outside such a block the op pays one empty-list test per call."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def depth_weights(sources: Sequence[torch.Tensor], query: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
    """The softmax weights of one call as the reference computes them, shape [len(sources), *rows]
    (rows: the sources' shape without `dim`), in float32 (float64 for float64 sources)."""
    ctype = _compute_dtype(sources[0].dtype)
    z, _ = _logits(_last(sources, dim), query.to(ctype), eps, ctype)
    return torch.softmax(z, dim=0)


def _backward(sources, query, grad, eps, scale, dim):
    fused = fused_kernels()
    if fused:
        result = fused.backward(sources, query, grad, eps, scale, dim)
        if result is not None:
            return result
    return backward_reference(sources, query, grad, eps, scale, dim)


class _DepthAttention(torch.autograd.Function):
    """The op under autograd. `direct` (plain_eager at the call): forward and backward call the
    backend kernels themselves, without a second round trip through the dispatcher."""

    @staticmethod
    def forward(ctx, direct, query, eps, scale, dim, *sources):
        sources = list(sources)
        if direct:
            out = _forward(sources, query, eps, scale, dim)
        else:
            with torch._C._AutoDispatchBelowAutograd():
                out = _OP(sources, query, eps, scale, dim)
        ctx.save_for_backward(query, *sources)
        ctx.args = (direct, eps, scale, dim)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, *sources = ctx.saved_tensors
        direct, *args = ctx.args
        if direct and not torch.is_grad_enabled() and type(grad) in _PLAIN and not _modes():
            grads, grad_query = _backward(sources, query, grad, *args)
        else:  # also with create_graph, where the backward op is what autograd must see
            grads, grad_query = _BACKWARD(sources, query, grad, *args)
        return None, grad_query if ctx.needs_input_grad[1] else None, None, None, None, *grads


_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))  # a Parameter dispatches as a plain tensor (a site's query is one)
_modes = torch._C._len_torch_dispatch_stack
_functorch = torch._C._are_functorch_transforms_active
_apply = super(torch.autograd.Function, _DepthAttention).apply  # without Function.apply's Python wrapper


def wants_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd must record this call: grad mode on and an input that requires a gradient."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def plain_eager(sources, query) -> bool:
    """Plain eager execution: no dispatch mode or functorch transform, plain CPU/CUDA tensors (or
    parameters). There an Autograd kernel may call the backend kernel itself, skipping a dispatcher
    round trip."""
    return (bool(sources) and not _modes() and not _functorch() and type(query) in _PLAIN
            and (sources[0].is_cpu or sources[0].is_cuda) and _PLAIN.issuperset(map(type, sources)))


def _autograd(sources, query, eps, scale, dim):
    """The Autograd kernel: the autograd.Function only when a gradient is wanted, else the backend
    kernel (directly in plain eager execution)."""
    sources = promoted(sources)  # differentiable casts, recorded before the op
    direct = plain_eager(sources, query)
    if direct and not torch.is_grad_enabled():  # inference (a decode step): straight to the kernel
        return _forward(sources, query, eps, scale, dim)
    if wants_grad(query, *sources):
        return (_apply if direct else _DepthAttention.apply)(direct, query, eps, scale, dim, *sources)
    if direct:
        return _forward(sources, query, eps, scale, dim)
    with torch._C._AutoDispatchBelowAutograd():
        return _OP(sources, query, eps, scale, dim)


def unwatched() -> bool:
    """Whether nothing would see a call of the op made now besides its backend kernel: no dispatch
    or torch-function mode, functorch transform, profiler, jit trace or forward-mode AD. With grad
    mode off too, a call on plain CPU/CUDA tensors goes straight to `_forward` (`_shortcut`), and a
    graph that checks this once per call may call `direct_forward` at its sites (fx/lean.py)."""
    return not (_modes() or _functorch() or _function_modes() or _profiling() or _tracing() is not None
                or _forward_ad._current_level >= 0)


def _shortcut(sources, query, eps, scale, dim) -> bool:
    """Whether an eager call may go straight to the backend kernel: where the dispatcher would reach
    it anyway (plain_eager, and no gradient wanted), with the schema's own argument types, and
    nothing that watches the dispatcher (`unwatched`). One pass over the sources: this runs on
    every site of every decode step."""
    if (type(sources) is not list or not sources or type(query) not in _PLAIN or type(eps) is not float
            or type(scale) is not float or type(dim) is not int or not unwatched()):
        return False
    grad = torch.is_grad_enabled()
    if grad and query.requires_grad:
        return False
    for s in sources:
        if type(s) not in _PLAIN or grad and s.requires_grad:
            return False
    return sources[0].is_cpu or sources[0].is_cuda


_function_modes = torch._C._is_torch_function_mode_enabled
_profiling = torch.autograd._profiler_enabled
_tracing = torch._C._get_tracing_state
_forward_ad = torch.autograd.forward_ad


class _SiteOverload(type(_OP)):
    """`torch.ops.attnres.depth_attention.default`'s class: the OpOverload, plus one eager shortcut.
    A plain eager inference call (`_shortcut`, e.g. a decode step's sites) goes straight to
    `_forward`, skipping the dispatcher's round trip; every other call takes the dispatcher."""

    def __call__(self, /, *args, **kwargs):
        if not kwargs and len(args) == 5 and _shortcut(*args):
            return _forward(*args)
        return self._op(*args, **kwargs)


_OP.__class__ = _SiteOverload
direct_forward = _forward  # the backend kernel by name, for graphs whose caller checked what `_shortcut` checks per call

for _key in ("CPU", "CUDA"):
    _LIB.impl("depth_attention", _forward, _key)
    _LIB.impl("depth_attention_backward", _backward, _key)
_LIB.impl("depth_attention", forward_reference, "CompositeExplicitAutograd")  # any other device
_LIB.impl("depth_attention_backward", backward_reference, "CompositeExplicitAutograd")
_LIB.impl("depth_attention", _autograd, "Autograd")


@torch.library.register_fake(OP_NAME)
def _(sources, query, eps, scale, dim):
    _check(sources, query, dim)
    return sources[0].new_empty(sources[0].shape, dtype=common_dtype(sources))


@torch.library.register_fake(BACKWARD_NAME)
def _(sources, query, grad, eps, scale, dim):
    return [s.new_empty(s.shape) for s in sources], query.new_empty(query.shape)


def depth_attention_stacked(sources: Sequence[torch.Tensor], query: torch.Tensor, eps: float, scale: float, dim: int = -1) -> torch.Tensor:
    """The unfused `torch.stack` formulation of the published pseudocode in float32, for tests
    (bench/kernel.py's `eager` backend is the same form run in the storage dtype, as a user would)."""
    v = torch.stack([s.movedim(dim, -1) for s in sources]).float()
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.einsum("d,s...d->s...", query.float(), k).softmax(0)
    out = scale * torch.einsum("s...,s...d->...d", p, v)
    return out.movedim(-1, dim).to(sources[0].dtype)
