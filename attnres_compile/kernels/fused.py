"""The depth-attention op's fused TVM kernels, called on torch tensors (DLPack, zero-copy).

`forward`, `backward`, `partial`, `merge` return None where the kernels do not apply (other
dtypes than float32/float16/bfloat16, feature axis not last, rank-1 sources, devices other than
CPU/CUDA, no usable TVM in mode "auto"); the op then runs its eager reference. Calls over more
than CHAIN_ABOVE sources run as chains of at most PARTIAL_CHUNK. TVM_NUM_THREADS defaults to the
CPU count, TVM_BIND_THREADS and TVM_THREAD_POOL_SPIN_COUNT to 0 (docs/design.md §6 says why).
"""

from __future__ import annotations

import os
import threading

import torch

from . import cache as kernel_cache

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_KERNELS: dict[tuple, object] = {}  # (kind, count, dtype, device, rank, size, dim, eps, scale, threads) -> fn | False
_local = threading.local()
_ffi = None  # tvm_ffi with TVM's runtime loaded; False if TVM is not usable
_forked = False  # in a child forked after TVM's pool started: its workers are gone
BYTES_PER_THREAD = 2**20  # a CPU call's data per TVM thread, at least (see _threads)
CHAIN_ABOVE = 16  # sources above which forward and backward are chains of PARTIAL_CHUNK-source kernels


def _after_fork() -> None:
    """A forked child inherits TVM's thread pool without its threads: a parallel kernel would wait
    for them forever. With one thread TVM runs the kernels inline (it reads TVM_NUM_THREADS per
    launch), and the pool is never reconfigured."""
    global _forked
    os.environ["TVM_NUM_THREADS"] = "1"
    _forked = True


def available() -> bool:
    """Whether TVM is installed and its runtime loads (checked once per process)."""
    global _ffi
    if _ffi is None:
        os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))
        os.environ.setdefault("TVM_BIND_THREADS", "0")
        os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
        try:
            _ffi = kernel_cache.runtime() if kernel_cache.installed() else False
        except (ImportError, OSError):
            _ffi = False
        if _ffi:
            os.register_at_fork(after_in_child=_after_fork)
    return _ffi is not False


def _cuda_ready(device: torch.device) -> bool:
    import tvm

    return bool(tvm.cuda(device.index or 0).exist)


def _kernel(key: tuple, norm: str = ""):
    """The compiled kernel for a call's key, or False where the fused kernels do not apply; `norm`:
    the fused site + norm pair's cache.Spec.norm."""
    kind, count, dtype, device, rank, size, dim, eps, scale, threads = key
    if (dtype not in _DTYPES or device.type not in ("cpu", "cuda") or rank < 2 or dim not in (-1, rank - 1)
            or not available() or (device.type == "cuda" and not _cuda_ready(device))):
        return False
    threads = threads if device.type == "cpu" else 1
    spec = kernel_cache.Spec(kind, count, rank, size, _DTYPES[dtype], float(eps), float(scale), device.type, threads,
                             norm)
    return kernel_cache.get(spec)


def _lookup(key: tuple):
    fn = _KERNELS.get(key)
    if fn is None:
        fn = _KERNELS[key] = _kernel(key)
    return fn


def _threads(tensors: int, like: torch.Tensor) -> int:
    """TVM threads for a CPU call moving `tensors` tensors the size of `like`: torch's count, but at
    least BYTES_PER_THREAD per thread (waking a sleeping worker costs more than a small call saves)."""
    size = tensors * like.numel() * like.element_size()
    return 1 if size < 2 * BYTES_PER_THREAD else min(torch.get_num_threads(), size // BYTES_PER_THREAD)


def _run(fn, like: torch.Tensor, args: list, threads: int) -> None:
    """Call the kernel on torch tensors on `like`'s device; a strided or wrongly typed argument
    (which the kernel's argument checks reject before running) is retried as a contiguous float
    copy. Never on the common path: that is the kernel call alone."""
    if like.is_cpu:
        if threads > 1 and _local.__dict__.get("threads") != threads and not _forked:
            _ffi.get_global_func("runtime.config_threadpool")(1, threads)
            _local.threads = threads
        try:
            fn(*args)
        except (ValueError, TypeError):
            fn(*_dense(args))
        return
    import tvm_ffi

    with tvm_ffi.use_torch_stream():
        fn(*_dense(args))


def _dense(args: list) -> list:
    return [t if not isinstance(t, torch.Tensor) else t.contiguous() if t.dim() > 1 or t.dtype == torch.float32
            else t.float().contiguous() for t in args]


def forward(sources: list[torch.Tensor], query: torch.Tensor, eps: float, scale: float, dim: int):
    """The fused forward's output, or None if it does not apply."""
    s0 = sources[0]
    if len(sources) > CHAIN_ABOVE:
        return _forward_chain(sources, query, eps, scale, dim)
    threads = _threads(len(sources) + 1, s0)  # a one-thread call gets the kernel without a parallel loop
    fn = _lookup(("forward", len(sources), s0.dtype, s0.device, s0.dim(), s0.size(-1), dim, eps, scale, threads))
    if fn is False:
        return None
    out = torch.empty_like(s0) if s0.is_contiguous() else torch.empty_like(s0, memory_format=torch.contiguous_format)
    _run(fn, s0, [*sources, query, out], threads)
    return out


def backward(sources: list[torch.Tensor], query: torch.Tensor, grad: torch.Tensor, eps: float, scale: float,
             dim: int):
    """(source gradients, query gradient) from the fused backward, or None if it does not apply."""
    if len(sources) > CHAIN_ABOVE:
        return _backward_chunks(sources, query, grad, eps, scale, dim)
    s0 = sources[0]
    threads = _threads(2 * len(sources) + 1, s0)  # the CPU kernel keeps a partial query gradient per thread
    fn = _lookup(("backward", len(sources), s0.dtype, s0.device, s0.dim(), s0.shape[-1], dim, eps, scale, threads))
    if fn is False:
        return None
    grads = [torch.empty_like(s0, memory_format=torch.contiguous_format) for _ in sources]
    grad_query = query.new_empty(query.shape, dtype=torch.float32)
    _run(fn, s0, [*sources, query, grad.to(s0.dtype).contiguous(), *grads, grad_query], threads)
    return grads, grad_query.to(query.dtype)


def _forward_chain(sources: list[torch.Tensor], query: torch.Tensor, eps: float, scale: float, dim: int,
                   delta: tuple = ()):
    """`forward` over a long source list: the partial chain over the sources before the last link
    (kernel_cache.partial_links), then the indexed merge of the rest into that state, out = scale * acc / l
    (`delta` (base, gate): Delta AttnRes' merge, out = base + gate * that)."""
    s0, split = sources[0], kernel_cache.partial_links([0], len(sources))[-2]
    threads = _threads(len(sources) - split + 2 + bool(delta), s0)
    kind = "merge_indexed_delta" if delta else "merge_indexed"
    fn = _lookup((kind, len(sources) - split, s0.dtype, s0.device, s0.dim(), s0.shape[-1], dim, eps, 1.0, threads))
    state = None if fn is False else partial(sources[:split], query[None], eps, dim)
    if state is None:
        return None
    out = torch.empty_like(s0, memory_format=torch.contiguous_format)
    _run(fn, s0, [*state, *sources[split:], query, *delta, 0, float(scale), out], threads)
    return out


# ---- Delta AttnRes (ops/delta.py): out = base + gate * site ----------------------------------------

def _gate(gate: torch.Tensor) -> torch.Tensor:
    """The gate as the kernels take it: float32 [1] (itself where it is one already: the rewrite's)."""
    if gate.dtype == torch.float32 and gate.shape == (1,):
        return gate
    return gate.reshape(1) if gate.dtype == torch.float32 else gate.float().reshape(1)


def forward_delta(sources: list[torch.Tensor], query: torch.Tensor, base: torch.Tensor, gate: torch.Tensor,
                  eps: float, scale: float, dim: int):
    """Delta AttnRes' fused forward, base + gate * (the site's output), or None if it does not apply
    (also for a base of another dtype or layout than the sources')."""
    s0 = sources[0]
    if base.dtype != s0.dtype or base.shape != s0.shape:
        return None
    if len(sources) > CHAIN_ABOVE:
        return _forward_chain(sources, query, eps, scale, dim, (base, _gate(gate)))
    threads = _threads(len(sources) + 2, s0)
    fn = _lookup(("forward_delta", len(sources), s0.dtype, s0.device, s0.dim(), s0.size(-1), dim, eps, scale, threads))
    if fn is False:
        return None
    out = torch.empty_like(s0, memory_format=torch.contiguous_format)
    _run(fn, s0, [*sources, query, base, _gate(gate), out], threads)
    return out


def merge_delta(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, index: int, extra: list[torch.Tensor],
                query: torch.Tensor, base: torch.Tensor, gate: torch.Tensor, eps: float, scale: float, dim: int):
    """Delta AttnRes' phase 2: base + gate * (query `index`'s phase-1 state merged with `extra`), by the
    indexed merge kernel (index and scale its arguments), or None if it does not apply."""
    s0 = extra[0]
    if acc.dtype != torch.float32 or acc.shape[1:] != s0.shape or base.dtype != s0.dtype or base.shape != s0.shape:
        return None
    threads = _threads(len(extra) + 3, s0)
    fn = _lookup(("merge_indexed_delta", len(extra), s0.dtype, s0.device, s0.dim(), s0.shape[-1], dim, eps,
                  float(m.shape[0]), threads))
    if fn is False:
        return None
    out = torch.empty_like(s0, memory_format=torch.contiguous_format)
    _run(fn, s0, [m, l, acc, *extra, query, base, _gate(gate), int(index), float(scale), out], threads)
    return out


def backward_delta(sources: list[torch.Tensor], query: torch.Tensor, gate: torch.Tensor, grad: torch.Tensor,
                   eps: float, scale: float, dim: int):
    """(source gradients, query gradient, gate gradient) of Delta AttnRes from the fused kernels, or
    None if they do not apply. The base's gradient is `grad` itself. The gate's is scale times the
    sum over rows of ubar = sum_k p_k (grad . s_k), which the kernel stores per row."""
    s0 = sources[0]
    if len(sources) > CHAIN_ABOVE:
        result = _backward_chunks(sources, query, grad, eps, scale, dim, _gate(gate))
        return None if result is None else (*result[:2], result[2].to(gate.dtype).reshape(gate.shape))
    threads = _threads(2 * len(sources) + 1, s0)
    fn = _lookup(("backward_delta", len(sources), s0.dtype, s0.device, s0.dim(), s0.shape[-1], dim, eps, scale, threads))
    if fn is False:
        return None
    grads = [torch.empty_like(s0, memory_format=torch.contiguous_format) for _ in sources]
    grad_query = query.new_empty(query.shape, dtype=torch.float32)
    ubar = s0.new_empty((1, *s0.shape[:-1]), dtype=torch.float32)  # a leading 1: its sum over rows is [1]
    _run(fn, s0, [*sources, query, _gate(gate), grad.to(s0.dtype).contiguous(), *grads, grad_query, ubar], threads)
    grad_gate = ubar.sum(tuple(range(1, ubar.dim())))  # float32 pairwise sums
    if scale != 1.0:
        grad_gate.mul_(scale)
    if grad_gate.shape != gate.shape or grad_gate.dtype != gate.dtype:
        grad_gate = grad_gate.to(gate.dtype).reshape(gate.shape)
    return grads, grad_query.to(query.dtype), grad_gate


def _backward_chunks(sources: list[torch.Tensor], query: torch.Tensor, grad: torch.Tensor, eps: float,
                     scale: float, dim: int, gate: torch.Tensor | None = None):
    """`backward` over a long source list: the softmax state from the partial chain, ubar = g.acc / l
    per row, then a backward_chunk kernel per PARTIAL_CHUNK sources, their query gradients summed.
    Kernels are built for scale 1 and given l / scale, so one kernel serves every scale. With `gate`
    (Delta, float32 [1]) the gate's gradient scale * sum(ubar) is returned third."""
    s0, count = sources[0], len(sources)
    bounds = [*range(0, count, kernel_cache.PARTIAL_CHUNK), count]
    chunks = list(zip(bounds, bounds[1:]))
    threads = _threads(2 * kernel_cache.PARTIAL_CHUNK + 1, s0)
    kind = "backward_chunk" if gate is None else "backward_chunk_delta"
    fns = [_lookup((kind, end - start, s0.dtype, s0.device, s0.dim(), s0.shape[-1], dim, eps, 1.0,
                    threads)) for start, end in chunks]
    state = None if any(fn is False for fn in fns) else partial(sources, query[None], eps, dim)
    if state is None:
        return None
    m, l, acc = (t[0] for t in state)
    g = grad.to(s0.dtype).contiguous()
    ubar = (torch.linalg.vecdot(acc, g) if g.dtype == acc.dtype else acc.mul_(g).sum(-1)).div_(l)
    l = l.div(scale)
    grads = [torch.empty_like(s0, memory_format=torch.contiguous_format) for _ in sources]
    shares = query.new_empty((len(chunks), query.shape[0]), dtype=torch.float32)
    gated = [] if gate is None else [gate]
    for fn, (start, end), dw in zip(fns, chunks, shares):
        _run(fn, s0, [*sources[start:end], query, *gated, g, m, l, ubar, *grads[start:end], dw], threads)
    if gate is None:
        return grads, shares.sum(0).to(query.dtype)
    return grads, shares.sum(0).to(query.dtype), ubar.sum(dtype=torch.float64).mul_(scale).float().reshape(())


def partial(history: list[torch.Tensor], queries: torch.Tensor, eps: float, dim: int):
    """(m, l, acc) from the fused phase-1 kernels for the queries [B, D], or None if they do not apply:
    a chain of partials over at most PARTIAL_CHUNK sources (kernel_cache.partial_links), as in the
    TVM lowering, so a few small kernels serve every history length."""
    s0, count = history[0], queries.shape[0]
    bounds = kernel_cache.partial_links([0], len(history))
    links = list(zip(bounds, bounds[1:]))
    threads = _threads(bounds[1] + count, s0)  # a link writes a float32 state per query
    fns = [_lookup(("partial_link" if start else "partial", end - start, s0.dtype, s0.device, s0.dim(),
                    s0.shape[-1], dim, eps, float(count), threads)) for start, end in links]
    if any(fn is False for fn in fns):
        return None
    rows, w, state = s0.shape[:-1], queries.float().contiguous(), []
    for fn, (start, end) in zip(fns, links):
        m, l = (s0.new_empty((count, *rows), dtype=torch.float32) for _ in range(2))
        acc = s0.new_empty((count, *s0.shape), dtype=torch.float32)
        _run(fn, s0, [*history[start:end], w, *state, m, l, acc], threads)
        state = [m, l, acc]
    return tuple(state)


def merge(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, index: int, extra: list[torch.Tensor],
          query: torch.Tensor, eps: float, scale: float, dim: int):
    """Query `index`'s phase-1 state merged with `extra` by the fused phase-2 kernel, or None if it
    does not apply (also for a state that is not the partial kernel's float32)."""
    s0 = extra[0]
    if acc.dtype != torch.float32 or acc.shape[1:] != s0.shape:
        return None
    threads = _threads(len(extra) + 2, s0)
    fn = _lookup(("merge", len(extra), s0.dtype, s0.device, s0.dim(), s0.shape[-1], dim, eps, scale, threads))
    if fn is False:
        return None
    out = torch.empty_like(s0, memory_format=torch.contiguous_format)
    _run(fn, s0, [m[index], l[index], acc[index], *extra, query, out], threads)
    return out


# ---- the fused site + norm pair (ops/site_norm.py) ---------------------------------------------------

def _pair_kernel(kind: str, sources: list[torch.Tensor], dim: int, eps: float, scale: float, threads: int, norm: str):
    """The pair's compiled kernel, or False: float32 storage on the CPU only (the norm's arithmetic is
    the model's float32 one; the CUDA schedules build and compile but have not run on a GPU yet) and
    at most CHAIN_ABOVE sources (a longer list runs the reference)."""
    s0 = sources[0]
    if s0.dtype != torch.float32 or not s0.is_cpu or len(sources) > CHAIN_ABOVE:
        return False
    key = (kind, len(sources), s0.dtype, s0.device, s0.dim(), s0.shape[-1], dim, eps, scale, threads, norm)
    fn = _KERNELS.get(key)
    if fn is None:
        fn = _KERNELS[key] = _kernel(key[:10], norm)
    return fn


def _f32(t: torch.Tensor | None) -> list[torch.Tensor]:
    return [] if t is None else [t if t.dtype == torch.float32 else t.float()]


def forward_norm(sources: list[torch.Tensor], query: torch.Tensor, weight, bias, eps: float, scale: float, dim: int,
                 norm_eps: float, kind: str):
    """(mixed, normed) from the fused pair's kernel, or None if it does not apply."""
    s0 = sources[0]
    threads = _threads(len(sources) + 2, s0)
    norm = kernel_cache.norm_spec(kind, norm_eps, weight is not None, bias is not None)
    fn = _pair_kernel("forward_norm", sources, dim, eps, scale, threads, norm)
    if fn is False:
        return None
    mixed, normed = (torch.empty_like(s0, memory_format=torch.contiguous_format) for _ in range(2))
    _run(fn, s0, [*sources, query, *_f32(weight), *_f32(bias), mixed, normed], threads)
    return mixed, normed


def backward_norm(sources: list[torch.Tensor], query: torch.Tensor, weight, bias, grad_mixed, grad_normed,
                  eps: float, scale: float, dim: int, norm_eps: float, kind: str):
    """(source gradients, query gradient, [weight gradient][, bias gradient]) from the fused pair's
    backward, or None if it does not apply. The bias gradient, sum_rows grad_normed, is summed here
    (tensorir.depth_attention_norm_backward_func: one row reduction per kernel)."""
    s0 = sources[0]
    threads = _threads(2 * len(sources) + 3, s0)
    norm = kernel_cache.norm_spec(kind, norm_eps, weight is not None, bias is not None, grad_mixed is not None)
    fn = _pair_kernel("backward_norm", sources, dim, eps, scale, threads, norm)
    if fn is False:
        return None
    grads = [torch.empty_like(s0, memory_format=torch.contiguous_format) for _ in sources]
    grad_query = query.new_empty(query.shape, dtype=torch.float32)
    params = [query.new_empty(weight.shape, dtype=torch.float32)] if weight is not None else []
    gn = grad_normed.to(s0.dtype).contiguous()
    gm = [] if grad_mixed is None else [grad_mixed.to(s0.dtype).contiguous()]
    _run(fn, s0, [*sources, query, *_f32(weight), *_f32(bias), *gm, gn, *grads, grad_query, *params], threads)
    if bias is not None:
        params.append(gn.sum(tuple(range(gn.dim() - 1)), dtype=torch.float32))
    params = [p.to(t.dtype) for p, t in zip(params, [t for t in (weight, bias) if t is not None])]
    return grads, grad_query.to(query.dtype), params
