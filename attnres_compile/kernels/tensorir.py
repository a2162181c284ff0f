"""TensorIR for the depth-attention kernel family: the fused forward, the two-phase pair and the backward.

Functions are generated per source count and rank; each source is its own [rows.., D] buffer
with symbolic row dims. Stages write fresh intermediates (SSA style) so the schedules
(schedule.py) can merge them under one row loop, keyed on block names: stats_* (row
reductions), softmax* (per-row scalars), dw (the query gradient), sum_<block> (a long phase 1's
running sums), the rest elementwise. Arithmetic is float32; the softmax is exact, not online.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import tvm
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

F32 = "float32"
BLOCK_MAJOR = 16  # phase-1 partials over this many blocks or more sum block by block (_block_major_sums)
DTYPES = ("float32", "float16", "bfloat16")


def _f32(buf, *idx):
    x = buf[idx]
    if buf.dtype == "bfloat16":
        # exact widening spelled out: TVM's BF16ComputeLegalize skips casts inside T.Bind values
        # (the stats reduction), which then read the raw bits as an integer
        return T.reinterpret(F32, T.shift_left(T.cast(T.reinterpret("uint16", x), "uint32"), T.uint32(16)))
    return x if buf.dtype == F32 else T.cast(x, F32)


def _alloc(name: str, *shape):
    return IRBuilder.name(name, T.sblock_alloc_buffer(shape, F32, layout=None))


def _param(name: str, shape, dtype: str):
    """A tensor argument, aligned to its element only: the op passes torch views as they are, and
    TVM's default (64-byte alignment assumed, never checked) faults on a view at an odd offset."""
    align = tvm.DataType(dtype).bits // 8
    return IRBuilder.name(name, T.match_buffer(T.arg(name, T.handle()), shape, dtype, align=align, layout=None))


def _rows(rank: int) -> tuple:
    """The symbolic leading (row) dims of rank-`rank` sources: the kernels take the tensors as
    they are ([B, T, D] or [rows, D]: no reshape per call), the schedules fuse these axes."""
    if rank < 2:
        raise ValueError(f"sources must have rank >= 2 (rows and features), got rank {rank}")
    return tuple(tirx.Var(f"n{i}", "int32") for i in range(rank - 1))


@contextmanager
def _row_block(rows: tuple, name: str):
    """A per-row scalar stage; yields the row indices."""
    with T.grid(*rows) as rs, T.sblock(name):
        rs = [rs] if isinstance(rs, tirx.Var) else list(rs)  # T.grid of one extent yields the var
        yield tuple(T.axis.spatial(n, r) for n, r in zip(rows, rs))


def _elementwise(rows: tuple, size: int, name: str, body: Callable):
    """A [rows.., d] stage storing body(vr, vd) -> (buffer, indices, float32 value)."""
    with T.grid(*rows, size) as (*rs, d), T.sblock(name):
        vr, vd = tuple(T.axis.spatial(n, r) for n, r in zip(rows, rs)), T.axis.spatial(size, d)
        buf, idx, val = body(vr, vd)
        T.buffer_store(buf, val if buf.dtype == F32 else T.cast(val, buf.dtype), idx)


def _stats(name: str, rows: tuple, src, others: Sequence[Callable]) -> list:
    """stats_<name>[_<g>] stages: sum(src^2), then sum(src * other(vr, vd)) for each other term.
    Returns the [rows] buffers in that order. The sums go two per reduction block (TVM registers
    a sum reducer for one or two buffers, not more); the schedules load src[row, d] once for all."""
    def x(vr, vd):
        return _f32(src, *vr, vd)

    terms = [lambda vr, vd: x(vr, vd) * x(vr, vd)] + [lambda vr, vd, o=o: x(vr, vd) * o(vr, vd) for o in others]
    return _row_sums(name, rows, src.shape[-1], terms, ["ss"] + [f"dot{q}" for q in range(len(others))])


def _rinv(ss, vr: tuple, size: int, eps: float):
    """1/rms of one source in a row stage: 1 / sqrt(mean(s^2) + eps)."""
    return T.Bind(T.rsqrt(ss[vr] * T.float32(1.0 / size) + T.float32(eps)))


def _logit(ss, dot, vr: tuple, size: int, eps: float):
    """(z, 1/rms) of one source in a row stage: z = w.s / sqrt(mean(s^2) + eps)."""
    rinv = _rinv(ss, vr, size, eps)
    return T.Bind(dot[vr] * rinv), rinv


def _softmax(logits: list, start=None):
    """In a row stage: max m, weights e_k = exp(z_k - m) and denominator l over `logits`; with a
    `start` state (m0, l0) also its rescale a0 = exp(m0 - m), counted in l. Returns (m, e, l, a0)."""
    m = logits[0] if start is None else start[0]
    for z in logits if start is not None else logits[1:]:
        m = T.max(m, z)
    m = T.Bind(m)
    e = [T.Bind(T.exp(z - m)) for z in logits]
    a0 = None if start is None else T.Bind(T.exp(start[0] - m))
    total = e[0] if start is None else start[1] * a0
    for x in e if start is not None else e[1:]:
        total = total + x
    return m, e, T.Bind(total), a0


def _weighted(terms: list):
    """sum_k coef_k * x_k for [(coef, x)], as one expression."""
    val = terms[0][0] * terms[0][1]
    for c, x in terms[1:]:
        val = val + c * x
    return val


def _check(count: int, what: str, size: int, dtype: str):
    if count < 1:
        raise ValueError(f"need at least one {what}, got {count}")
    if size < 1:
        raise ValueError(f"feature_size must be positive, got {size}")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported storage dtype {dtype!r}; expected one of {DTYPES}")


def _site(rows: tuple, size: int, srcs: list, w, out, eps: float, scale, start=None, norm=None, mixed=None,
          delta=None):
    """Stages of one site: stats per source, softmax, out = scale * (a0 acc0 + sum e_k s_k) / l
    (`scale` a number or a float32 argument); with `delta` (base, gate), out = base + gate * that.
    `start` (m0, l0, acc0) is a phase-1 state to merge with, or None; `norm` (kind, gamma, beta, eps)
    a LayerNorm or RMSNorm applied before storing; `mixed` a buffer that also keeps the sum."""
    stats = [_stats(f"{k}", rows, s, [lambda vr, vd: w[vd]]) for k, s in enumerate(srcs)]
    K = len(srcs)
    e_buf, coef = _alloc("e", *rows, K + 1), _alloc("coef", *rows)
    with _row_block(rows, "softmax") as vr:
        z = [_logit(ss, dot, vr, size, eps)[0] for ss, dot in stats]
        _, e, total, a0 = _softmax(z, None if start is None else (start[0](vr), start[1](vr)))
        for k, x in enumerate(e + ([a0] if a0 is not None else [])):
            T.buffer_store(e_buf, x, [*vr, k])
        c = T.float32(scale) if isinstance(scale, (int, float)) else scale
        T.buffer_store(coef, (c if delta is None else c * delta[1][0]) / total, list(vr))

    h = out if norm is None else mixed if mixed is not None else _alloc("h", *rows, size)

    def body(vr, vd):
        terms = [(e_buf[(*vr, k)], _f32(s, *vr, vd)) for k, s in enumerate(srcs)]
        if start is not None:
            terms.append((e_buf[(*vr, K)], start[2](vr, vd)))
        value = _weighted(terms) * coef[vr]
        return h, [*vr, vd], value if delta is None else _f32(delta[0], *vr, vd) + value

    _elementwise(rows, size, "out", body)
    if norm is not None:
        kind, *affine = norm
        (_layer_norm if kind == "layer" else _rms_norm)(rows, size, h, out, *affine)


def _affine(value, gamma, beta, vd):
    """value * gamma + beta, either of them None: a norm without weight or bias."""
    value = value if gamma is None else value * _f32(gamma, vd)
    return value if beta is None else value + _f32(beta, vd)


def _layer_norm(rows: tuple, size: int, h, out, gamma, beta, eps: float):
    """out = (h - mean) / sqrt(var + eps) * gamma + beta per row, mean and var from one pass as TVM's
    layer_norm computes them, var clamped at 0; gamma or beta None: no such parameter."""
    ss, total = _stats("h", rows, h, [lambda vr, vd: T.float32(1)])
    mean, rstd = _alloc("mean", *rows), _alloc("rstd", *rows)
    with _row_block(rows, "softmax_norm") as vr:
        mu = T.Bind(total[vr] * T.float32(1.0 / size))
        T.buffer_store(mean, mu, list(vr))
        var = T.max(ss[vr] * T.float32(1.0 / size) - mu * mu, T.float32(0))
        T.buffer_store(rstd, T.rsqrt(var + T.float32(eps)), list(vr))
    _elementwise(rows, size, "normed", lambda vr, vd: (
        out, [*vr, vd], _affine((_f32(h, *vr, vd) - mean[vr]) * rstd[vr], gamma, beta, vd)))


def _rms_norm(rows: tuple, size: int, h, out, gamma, beta, eps: float):
    """out = h / sqrt(mean(h^2) + eps) * gamma over the features of each row (beta is None;
    gamma None: no weight): the decomposed RMSNorm of HF Llama and its kin, in its order of operations."""
    (ss,) = _stats("h", rows, h, [])
    rstd = _alloc("rstd", *rows)
    with _row_block(rows, "softmax_norm") as vr:
        T.buffer_store(rstd, _rinv(ss, vr, size, eps), list(vr))
    _elementwise(rows, size, "normed", lambda vr, vd: (out, [*vr, vd], _affine(_f32(h, *vr, vd) * rstd[vr], gamma, None, vd)))


NORMS = ("layer", "rms")


def _delta_params(rows: tuple, size: int, dtype: str) -> tuple:
    """Delta AttnRes' (base, gate) parameters, after `w`: the plain sum [rows.., D] in the sources'
    dtype and the site's gate, float32 [1]."""
    return _param("base", (*rows, size), dtype), _param("gate", (1,), F32)


def _norm_params(size: int, norm_eps: float | None, norm: str):
    """The fused norm's (kind, gamma, beta, eps), its parameters after `w` (gamma and, for a
    LayerNorm, beta), or None without one."""
    if norm_eps is None:
        return None
    if norm not in NORMS:
        raise ValueError(f"unknown fused norm {norm!r}; expected one of {NORMS}")
    gamma = _param("gamma", (size,), F32)  # parameters in this order
    return norm, gamma, _param("beta", (size,), F32) if norm == "layer" else None, norm_eps


def depth_attention_func(
    num_sources: int,
    feature_size: int,
    dtype: str = "float32",
    eps: float = 1e-6,
    scale: float | None = None,
    rank: int = 2,
    norm_eps: float | None = None,
    norm: str = "layer",
    delta: bool = False,
) -> tirx.PrimFunc:
    """Fused `depth_attention(s0, ..., s{S-1}, w, out)` over [rows.., D] sources of rank `rank`
    (symbolic rows), float32 accumulation. `scale` None means `num_sources`; 1.0 the plain weighted
    sum. `delta` adds `base` [rows.., D] and `gate` float32 [1] (out = base + gate[0] * site).
    `norm_eps` stores the site's LayerNorm (inputs gamma, beta) or, with norm="rms", its RMSNorm
    (gamma) instead (backends/tvm/site_norm.py)."""
    _check(num_sources, "source", feature_size, dtype)
    S, D, rows = num_sources, feature_size, _rows(rank)
    scale = float(S) if scale is None else float(scale)
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("depth_attention")
            srcs = [_param(f"s{i}", (*rows, D), dtype) for i in range(S)]
            w = _param("w", (D,), F32)
            extra = _delta_params(rows, D, dtype) if delta else None
            fused = _norm_params(D, norm_eps, norm)
            out = _param("out", (*rows, D), dtype)
            with T.sblock("root"):
                _site(rows, D, srcs, w, out, eps, scale, norm=fused, delta=extra)
    return ib.get()


def depth_attention_partial_func(
    num_blocks: int,
    num_queries: int,
    feature_size: int,
    dtype: str = "float32",
    eps: float = 1e-6,
    rank: int = 2,
    start: bool = False,
) -> tirx.PrimFunc:
    """Phase 1: `partial(b0, ..., b{J-1}, w[B, D], m[B, rows..], l[B, rows..], acc[B, rows.., D])`
    stores each of B queries' float32 softmax state over J blocks: m the max logit,
    l = sum_j exp(z_j - m), acc = sum_j exp(z_j - m) b_j. With `start`, `partial(b0, ..., w, m0, l0,
    acc0, m, l, acc)` continues an earlier state, so a long history is a chain of short links."""
    _check(num_blocks, "block", feature_size, dtype)
    _check(num_queries, "query", feature_size, dtype)
    J, B, D, rows = num_blocks, num_queries, feature_size, _rows(rank)
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("depth_attention_partial")
            blocks = [_param(f"b{j}", (*rows, D), dtype) for j in range(J)]
            w = _param("w", (B, D), F32)
            before = [_param(f"{n}0", (B, *rows, *tail), F32) for n, tail in (("m", ()), ("l", ()), ("acc", (D,)))] \
                if start else None
            m_out, l_out = _param("m", (B, *rows), F32), _param("l", (B, *rows), F32)
            acc_out = _param("acc", (B, *rows, D), F32)
            with T.sblock("root"):
                queries = [lambda vr, vd, q=q: w[q, vd] for q in range(B)]
                stats = [_stats(f"{j}", rows, blk, queries) for j, blk in enumerate(blocks)]
                e_buf = _alloc("e", *rows, B, J + start)  # with a start state, its rescale last
                with _row_block(rows, "softmax") as vr:
                    # J + B bound scalars: a let per logit and weight (B * J of them nested in one row)
                    # cost TVM's CSE 0.48 s on 42 blocks x 7 queries, 0.06 s now
                    rinv = [_rinv(ss, vr, D, eps) for ss, *_ in stats]
                    for q in range(B):
                        z = [dots[q][vr] * r for (_, *dots), r in zip(stats, rinv)]
                        m0 = [before[0][(q, *vr)]] if start else []
                        m = T.Bind(functools.reduce(T.max, m0 + z))
                        T.buffer_store(m_out, m, [q, *vr])
                        for j, x in enumerate(z + m0):
                            T.buffer_store(e_buf, T.exp(x - m), [*vr, q, j])
                with _row_block(rows, "softmax_sum") as vr:
                    for q in range(B):
                        l0 = [(before[1][(q, *vr)], e_buf[(*vr, q, J)])] if start else []
                        T.buffer_store(l_out, _weighted([(T.float32(1), e_buf[(*vr, q, j)]) for j in range(J)] + l0),
                                       [q, *vr])
                if J >= BLOCK_MAJOR:
                    _block_major_sums(rows, D, blocks, e_buf, acc_out, before[2] if start else None)
                else:  # a loop per query, its J weights in registers
                    for q in range(B):
                        _elementwise(rows, D, f"acc_q{q}", lambda vr, vd, q=q: (
                            acc_out, [q, *vr, vd],
                            _weighted([(e_buf[(*vr, q, j)], _f32(b, *vr, vd)) for j, b in enumerate(blocks)]
                                      + ([(e_buf[(*vr, q, J)], before[2][(q, *vr, vd)])] if start else []))))
    return ib.get()


def _block_major_sums(rows: tuple, size: int, blocks: list, weights, out, start=None) -> None:
    """sum_<j> stages: out[q, rows.., d] = sum_j weights[rows.., q, j] * blocks[j][rows.., d] for every query
    q, one stage per block adding its term to all queries' running sums (fresh [rows.., B, D]
    buffers, the last storing into `out`); a `start` state [B, rows.., D] adds
    weights[rows.., q, J] * start[q, rows.., d] last. Scheduled under one loop over the features, a
    block's vector is loaded once for all queries; used past the block count where a per-query loop's
    weights no longer fit in registers."""
    queries, last = int(out.shape[0]), None
    for j, blk in enumerate(blocks):
        final = j == len(blocks) - 1
        total = None if final else _alloc(f"partial_sum_{j}", *rows, queries, size)
        with T.grid(*rows, size) as (*rs, d), T.sblock(f"sum_{j}"):
            vr, vd = tuple(T.axis.spatial(n, r) for n, r in zip(rows, rs)), T.axis.spatial(size, d)
            x = T.Bind(_f32(blk, *vr, vd))
            for q in range(queries):
                term = weights[(*vr, q, j)] * x
                value = term if last is None else last[(*vr, q, vd)] + term
                if final and start is not None:
                    value = value + weights[(*vr, q, len(blocks))] * start[(q, *vr, vd)]
                dst, idx = (out, [q, *vr, vd]) if final else (total, [*vr, q, vd])
                T.buffer_store(dst, value, idx)
        last = total


def depth_attention_merge_func(
    num_extra: int,
    feature_size: int,
    dtype: str = "float32",
    eps: float = 1e-6,
    scale: float = 1.0,
    rank: int = 2,
) -> tirx.PrimFunc:
    """Phase 2 of Block AttnRes for one site: `merge(m[rows..], l[rows..], acc[rows.., D], e0, ...,
    e{E-1}, w, out)` folds the site's own extra sources into its query's phase-1 state and writes
    out = scale * acc / l (pass scale = J + E to match depth_attention_func's default)."""
    return _merge((), False, num_extra, feature_size, dtype, eps, scale, rank)


def depth_attention_merge_indexed_func(
    num_queries: int,
    num_extra: int,
    feature_size: int,
    dtype: str = "float32",
    eps: float = 1e-6,
    rank: int = 2,
    norm_eps: float | None = None,
    norm: str = "layer",
    delta: bool = False,
) -> tirx.PrimFunc:
    """`depth_attention_merge_func` reading one query of a whole partial state, `merge(m[B, rows..],
    l[B, rows..], acc[B, rows.., D], e0, ..., e{E-1}, w, index, scale, out)`: `index` (int64) and
    `scale` (float32) are arguments, so one kernel serves every site with B queries and E extras,
    without a slice per site. `norm_eps`, `norm`: as in depth_attention_func."""
    return _merge((num_queries,), True, num_extra, feature_size, dtype, eps, None, rank, norm_eps, norm, delta)


def _merge(lead: tuple, indexed: bool, num_extra: int, feature_size: int, dtype: str, eps: float,
           scale: float | None, rank: int, norm_eps: float | None = None, norm: str = "layer",
           delta: bool = False) -> tirx.PrimFunc:
    """The merge over a phase-1 state whose arrays have the leading dims `lead` before the rows: a
    single query's state (`lead` empty, `scale` a constant) or, `indexed`, all of them, read at an
    `index` argument, with a `scale` argument (both before `out`: call_tir's scalar arguments
    precede its outputs)."""
    _check(num_extra, "extra source", feature_size, dtype)
    E, D, rows = num_extra, feature_size, _rows(rank)
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("depth_attention_merge")
            m_in, l_in = _param("m", (*lead, *rows), F32), _param("l", (*lead, *rows), F32)
            acc_in = _param("acc", (*lead, *rows, D), F32)
            extra = [_param(f"e{i}", (*rows, D), dtype) for i in range(E)]
            w = _param("w", (D,), F32)
            plus = _delta_params(rows, D, dtype) if delta else None
            fused = _norm_params(D, norm_eps, norm)
            if indexed:
                at = (T.arg("index", tirx.Var("index", "int64")),)
                scale = T.arg("scale", tirx.Var("scale", F32))
            else:
                at, scale = (), float(scale)
            out = _param("out", (*rows, D), dtype)
            with T.sblock("root"):
                start = (lambda vr: m_in[(*at, *vr)], lambda vr: l_in[(*at, *vr)],
                         lambda vr, vd: acc_in[(*at, *vr, vd)])
                _site(rows, D, extra, w, out, eps, scale, start, fused, delta=plus)
    return ib.get()


def depth_attention_backward_func(
    num_sources: int,
    feature_size: int,
    dtype: str = "float32",
    eps: float = 1e-6,
    scale: float | None = None,
    rank: int = 2,
    chunk: bool = False,
    delta: bool = False,
) -> tirx.PrimFunc:
    """Fused backward `depth_attention_backward(s0, ..., s{S-1}, w, g, ds0, ..., ds{S-1}, dw)`.

    With r_k = 1/rms(s_k), n_k = s_k r_k, z_k = w.n_k, p = softmax(z), u_k = g.s_k, c = scale:
        dz_k = c p_k (u_k - sum_j p_j u_j)
        ds_k = c p_k g + dz_k r_k w - (dz_k z_k r_k^2 / D) s_k
        dw   = sum over rows of sum_k dz_k r_k s_k        (float32, [D])
    One pass per row reduces sum(s^2), w.s and g.s; one writes every ds_k and adds the row's share
    of dw (a partial per thread, summed at the end).

    With `chunk`, `depth_attention_backward_chunk(s0, ..., w, g, m, l, ubar, ds0, ..., dw)` covers a
    chunk of a longer source list given the whole softmax per row (float32: max logit m,
    l = sum_j exp(z_j - m), ubar = sum_j p_j u_j); dw is the chunk's share.
    With `delta`, `gate` (float32 [1]) follows `w`, c becomes c * gate[0], and the whole form also
    stores `ubar` (float32 [1, rows..], after dw), whose sum over rows times c is the gate's gradient."""
    _check(num_sources, "source", feature_size, dtype)
    S, D, rows = num_sources, feature_size, _rows(rank)
    c0 = float(S) if scale is None else float(scale)
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("depth_attention_backward_chunk" if chunk else "depth_attention_backward")
            srcs = [_param(f"s{i}", (*rows, D), dtype) for i in range(S)]
            w = _param("w", (D,), F32)
            gate = _param("gate", (1,), F32) if delta else None
            g = _param("g", (*rows, D), dtype)
            given = [_param(name, rows, F32) for name in ("m", "l", "ubar")] if chunk else None
            grads = [_param(f"ds{i}", (*rows, D), dtype) for i in range(S)]
            dw = _param("dw", (D,), F32)
            ubar_out = _param("ubar_out", (1, *rows), F32) if delta and not chunk else None
            with T.sblock("root"):
                stats = [_stats(f"{k}", rows, s, [lambda vr, vd: w[vd], lambda vr, vd: _f32(g, *vr, vd)])
                         for k, s in enumerate(srcs)]
                cg, ca, cb = (_alloc(name, *rows, S) for name in ("cg", "ca", "cb"))
                with _row_block(rows, "softmax_bwd") as vr:
                    c = T.float32(c0) if gate is None else T.Bind(T.float32(c0) * gate[0])
                    zr = [_logit(ss, dot, vr, D, eps) for ss, dot, _ in stats]
                    if chunk:
                        m, inv = given[0][vr], T.Bind(T.float32(1) / given[1][vr])
                        p = [T.Bind(T.exp(z - m) * inv) for z, _ in zr]
                        ubar = given[2][vr]
                    else:
                        _, e, total, _ = _softmax([z for z, _ in zr])
                        inv = T.Bind(T.float32(1) / total)
                        p = [T.Bind(x * inv) for x in e]
                        ubar = T.Bind(_weighted([(pk, u[vr]) for pk, (_, _, u) in zip(p, stats)]))
                        if ubar_out is not None:
                            T.buffer_store(ubar_out, ubar, [0, *vr])
                    for k, ((z, rinv), pk, (_, _, u)) in enumerate(zip(zr, p, stats)):
                        dz = T.Bind(c * pk * (u[vr] - ubar))
                        T.buffer_store(cg, c * pk, [*vr, k])
                        T.buffer_store(ca, dz * rinv, [*vr, k])
                        T.buffer_store(cb, dz * z * rinv * rinv * T.float32(1.0 / D), [*vr, k])
                for k, (s, ds) in enumerate(zip(srcs, grads)):
                    _elementwise(rows, D, f"ds_{k}", lambda vr, vd, k=k, s=s, ds=ds: (
                        ds, [*vr, vd],
                        cg[(*vr, k)] * _f32(g, *vr, vd) + ca[(*vr, k)] * w[vd] - cb[(*vr, k)] * _f32(s, *vr, vd)))
                _row_reduction("dw", rows, D, [(dw, lambda vr, vd: _weighted(
                    [(ca[(*vr, k)], _f32(s, *vr, vd)) for k, s in enumerate(srcs)]))])
    return ib.get()


# ---- the fused site + norm pair (ops/site_norm.py) ------------------------------------------------

def _row_sums(name: str, rows: tuple, size: int, terms: Sequence[Callable], names: Sequence[str] = ()) -> list:
    """stats_<name>[_<g>] stages: for each term (vr, vd) -> float32 value, its sum over the features
    of each row into a [rows] buffer (`names`, default sum<q>), two per reduction block."""
    outs = [_alloc(f"{names[q] if names else f'sum{q}'}_{name}", *rows) for q in range(len(terms))]
    for g in range(0, len(terms), 2):
        group = list(zip(outs[g : g + 2], terms[g : g + 2]))
        with T.grid(*rows, size) as (*rs, d), T.sblock(f"stats_{name}" + (f"_{g // 2}" if g else "")):
            vr, vd = tuple(T.axis.spatial(n, r) for n, r in zip(rows, rs)), T.axis.reduce(size, d)
            with T.init():
                for buf, _ in group:
                    T.buffer_store(buf, T.float32(0), list(vr))
            new = [T.Bind(buf[vr] + term(vr, vd)) for buf, term in group]
            for (buf, _), v in zip(group, new):
                T.buffer_store(buf, v, list(vr))
    return outs


def _pair_params(size: int, norm: str, weight: bool, bias: bool) -> tuple:
    """(gamma, beta) parameters of the fused pair's norm, None where it has none (an RMSNorm has no beta)."""
    if norm not in NORMS:
        raise ValueError(f"unknown fused norm {norm!r}; expected one of {NORMS}")
    gamma = _param("gamma", (size,), F32) if weight else None
    beta = _param("beta", (size,), F32) if bias and norm == "layer" else None
    return gamma, beta


def depth_attention_norm_func(
    num_sources: int,
    feature_size: int,
    dtype: str = "float32",
    eps: float = 1e-6,
    scale: float | None = None,
    rank: int = 2,
    norm: str = "layer",
    norm_eps: float = 1e-5,
    weight: bool = True,
    bias: bool = True,
) -> tirx.PrimFunc:
    """The fused site + norm pair `depth_attention_norm(s0, ..., w, [gamma], [beta], mixed, normed)`:
    the site's output `mixed` (depth_attention_func's) and the next norm of it, `normed`, a LayerNorm
    (norm="layer") or RMSNorm ("rms") over the features with or without weight and bias. One pass
    over the sources per row: the softmax, the mixed row stored, then its norm from the row still
    in cache (the stages of depth_attention_func's fused norm, which keeps the sum per row only)."""
    _check(num_sources, "source", feature_size, dtype)
    S, D, rows = num_sources, feature_size, _rows(rank)
    scale = float(S) if scale is None else float(scale)
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("depth_attention_norm")
            srcs = [_param(f"s{i}", (*rows, D), dtype) for i in range(S)]
            w = _param("w", (D,), F32)
            gamma, beta = _pair_params(D, norm, weight, bias)
            mixed, normed = _param("mixed", (*rows, D), dtype), _param("normed", (*rows, D), dtype)
            with T.sblock("root"):
                _site(rows, D, srcs, w, normed, eps, scale, norm=(norm, gamma, beta, norm_eps), mixed=mixed)
    return ib.get()


def depth_attention_norm_backward_func(
    num_sources: int,
    feature_size: int,
    dtype: str = "float32",
    eps: float = 1e-6,
    scale: float | None = None,
    rank: int = 2,
    norm: str = "layer",
    norm_eps: float = 1e-5,
    weight: bool = True,
    bias: bool = True,
    grad_mixed: bool = True,
) -> tirx.PrimFunc:
    """The fused pair's backward `depth_attention_norm_backward(s0, ..., w, [gamma], [beta], [gm], gn,
    ds0, ..., dw, [dgamma])` for the gradients gm of `mixed` (absent: nothing else read it) and gn of
    `normed`. Per row it recomputes p and h = c sum_k p_k s_k, then, with g = gn * gamma and
    n = (h - mean) r (RMSNorm: mean 0, no mean(g) term),
        gh = gm + r (g - mean(g) - n mean(g n))
    and runs depth_attention_backward_func's stages on gh. dw and dgamma = sum_rows gn n share one
    row-reduction block; dbeta = sum_rows gn is left to the caller (fused.py)."""
    _check(num_sources, "source", feature_size, dtype)
    S, D, rows = num_sources, feature_size, _rows(rank)
    c = float(S) if scale is None else float(scale)
    layer = norm == "layer"
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("depth_attention_norm_backward")
            srcs = [_param(f"s{i}", (*rows, D), dtype) for i in range(S)]
            w = _param("w", (D,), F32)
            gamma, beta = _pair_params(D, norm, weight, bias)
            gm = _param("gm", (*rows, D), dtype) if grad_mixed else None
            gn = _param("gn", (*rows, D), dtype)
            grads = [_param(f"ds{i}", (*rows, D), dtype) for i in range(S)]
            dw = _param("dw", (D,), F32)
            dgamma = _param("dgamma", (D,), F32) if gamma is not None else None
            with T.sblock("root"):
                stats = [_stats(f"{k}", rows, s, [lambda vr, vd: w[vd]]) for k, s in enumerate(srcs)]
                p_buf, z_buf, r_buf = (_alloc(name, *rows, S) for name in ("p", "z", "rinv"))
                with _row_block(rows, "softmax") as vr:
                    zr = [_logit(ss, dot, vr, D, eps) for ss, dot in stats]
                    _, e, total, _ = _softmax([z for z, _ in zr])
                    inv = T.Bind(T.float32(1) / total)
                    for k, (x, (z, rinv)) in enumerate(zip(e, zr)):
                        T.buffer_store(p_buf, x * inv, [*vr, k])
                        T.buffer_store(z_buf, z, [*vr, k])
                        T.buffer_store(r_buf, rinv, [*vr, k])
                h = _alloc("h", *rows, D)
                _elementwise(rows, D, "mix", lambda vr, vd: (
                    h, [*vr, vd], _weighted([(p_buf[(*vr, k)], _f32(s, *vr, vd)) for k, s in enumerate(srcs)])
                    * T.float32(c)))

                def g(vr, vd):  # the normed output's gradient through the weight
                    x = _f32(gn, *vr, vd)
                    return x if gamma is None else x * _f32(gamma, vd)

                terms = [lambda vr, vd: h[(*vr, vd)] * h[(*vr, vd)], lambda vr, vd: g(vr, vd) * h[(*vr, vd)]]
                if layer:
                    terms += [lambda vr, vd: h[(*vr, vd)], g]
                sums = _row_sums("h", rows, D, terms)
                mean, rstd, k0, kh = (_alloc(name, *rows) for name in ("mean", "rstd", "k0", "kh"))
                with _row_block(rows, "softmax_norm") as vr:
                    inv_d = T.float32(1.0 / D)
                    if layer:
                        mu = T.Bind(sums[2][vr] * inv_d)
                        r = T.Bind(T.rsqrt(T.max(sums[0][vr] * inv_d - mu * mu, T.float32(0)) + T.float32(norm_eps)))
                        mean_g = T.Bind(sums[3][vr] * inv_d)
                        mean_gn = T.Bind((sums[1][vr] * inv_d - mu * mean_g) * r)  # mean(g n)
                    else:
                        mu, mean_g = T.float32(0), T.float32(0)
                        r = T.Bind(T.rsqrt(sums[0][vr] * inv_d + T.float32(norm_eps)))
                        mean_gn = T.Bind(sums[1][vr] * inv_d * r)
                    # gh - gm = r g - r mean(g) - r mean(g n) (h - mu) r = r g + kh h + k0
                    slope = T.Bind(T.float32(0) - r * r * mean_gn)
                    T.buffer_store(mean, mu, list(vr))
                    T.buffer_store(rstd, r, list(vr))
                    T.buffer_store(kh, slope, list(vr))
                    T.buffer_store(k0, T.float32(0) - r * mean_g - slope * mu, list(vr))
                gh = _alloc("gh", *rows, D)

                def grad_h(vr, vd):
                    val = rstd[vr] * g(vr, vd) + kh[vr] * h[(*vr, vd)] + k0[vr]
                    return gh, [*vr, vd], val if gm is None else _f32(gm, *vr, vd) + val

                _elementwise(rows, D, "grad_h", grad_h)
                us = [_row_sums(f"u{k}", rows, D, [lambda vr, vd, s=s: gh[(*vr, vd)] * _f32(s, *vr, vd)])[0]
                      for k, s in enumerate(srcs)]
                cg, ca, cb = (_alloc(name, *rows, S) for name in ("cg", "ca", "cb"))
                with _row_block(rows, "softmax_bwd") as vr:
                    p = [p_buf[(*vr, k)] for k in range(S)]
                    ubar = T.Bind(_weighted([(pk, u[vr]) for pk, u in zip(p, us)]))
                    for k, (pk, u) in enumerate(zip(p, us)):
                        z, rinv = z_buf[(*vr, k)], r_buf[(*vr, k)]
                        dz = T.Bind(T.float32(c) * pk * (u[vr] - ubar))
                        T.buffer_store(cg, T.float32(c) * pk, [*vr, k])
                        T.buffer_store(ca, dz * rinv, [*vr, k])
                        T.buffer_store(cb, dz * z * rinv * rinv * T.float32(1.0 / D), [*vr, k])
                for k, (s, ds) in enumerate(zip(srcs, grads)):
                    _elementwise(rows, D, f"ds_{k}", lambda vr, vd, k=k, s=s, ds=ds: (
                        ds, [*vr, vd],
                        cg[(*vr, k)] * gh[(*vr, vd)] + ca[(*vr, k)] * w[vd] - cb[(*vr, k)] * _f32(s, *vr, vd)))
                sums = [(dw, lambda vr, vd: _weighted([(ca[(*vr, k)], _f32(s, *vr, vd)) for k, s in enumerate(srcs)]))]
                if dgamma is not None:
                    sums.append((dgamma, lambda vr, vd: _f32(gn, *vr, vd) * (h[(*vr, vd)] - mean[vr]) * rstd[vr]))
                _row_reduction("dw", rows, D, sums)
    return ib.get()


def _row_reduction(name: str, rows: tuple, size: int, outs: list) -> None:
    """A reduction over rows into [D] buffers, [(buffer, term(vr, vd))], at most two: the query's and
    the norm weight's gradients (the schedules give each thread or thread block its own partial)."""
    with T.grid(*rows, size) as (*rs, d), T.sblock(name):
        vr, vd = tuple(T.axis.reduce(n, r) for n, r in zip(rows, rs)), T.axis.spatial(size, d)
        with T.init():
            for buf, _ in outs:
                T.buffer_store(buf, T.float32(0), [vd])
        new = [buf[vd] + term(vr, vd) for buf, term in outs]
        new = [T.Bind(v) for v in new] if len(outs) > 1 else new  # two sums: TVM's reducer takes them bound
        for (buf, _), v in zip(outs, new):
            T.buffer_store(buf, v, [vd])
