"""TensorIR for the fused depth-attention kernel and the Block AttnRes two-phase pair.

The functions are generated per source count: every source is its own [rows, D] buffer (never
stacked) and `rows` is symbolic. Per source k they compute, row by row:

    stats_k:   sum(s_k^2) and w.s_k, both reduced from the same load of s_k
    softmax_k: z_k = w.s_k / rms(s_k), running max m and denominator l, and the rescales
               a_k = exp(m_old - m), b_k = exp(z_k - m)
    fold_k:    acc = acc * a_k + b_k * s_k
    out:       scale * acc / l   (after the last source)

Each stage is its own loop nest writing fresh [rows]/[rows, D] intermediates (SSA style), so the
block scope is a stage pipeline, which rfactor, compute_at and compute_inline require. The
schedules (schedule.py) merge all row loops into one, so per row a source is loaded from memory
once and the intermediates shrink to one row held in registers or L1. Arithmetic is float32
whatever the storage dtype. The schedules key on the block names: stats* (reductions), softmax*
and store_ml* (per-row scalars), fold* and the rest elementwise over the feature axis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

F32 = "float32"
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
    return IRBuilder.name(name, T.match_buffer(T.arg(name, T.handle()), shape, dtype, layout=None))


@contextmanager
def _row_block(rows, name: str):
    """A per-row scalar stage; yields the row axis."""
    with T.serial(rows) as r, T.sblock(name):
        yield T.axis.spatial(rows, r)


def _elementwise(rows, size: int, name: str, body: Callable):
    """A [row, d] stage storing body(vr, vd) -> (buffer, indices, float32 value)."""
    with T.grid(rows, size) as (r, d), T.sblock(name):
        vr, vd = T.axis.spatial(rows, r), T.axis.spatial(size, d)
        buf, idx, val = body(vr, vd)
        T.buffer_store(buf, val if buf.dtype == F32 else T.cast(val, buf.dtype), idx)


def _stats(name: str, rows, src, queries: Sequence[Callable]):
    """stats_* stages: sum(src^2) and w_q . src for every query. Returns the [rows] buffers
    (ss, [dot_q]). The sums go two per reduction block (TVM registers a sum reducer for one or
    two buffers, not more); the schedules load src[row, d] once for all of them."""
    size = src.shape[1]
    outs = [(_alloc(f"ss_{name}", rows), lambda x, vd: x * x)]
    outs += [(_alloc(f"dot{q}_{name}", rows), lambda x, vd, w=w: x * w(vd)) for q, w in enumerate(queries)]
    for g in range(0, len(outs), 2):
        group = outs[g : g + 2]
        with T.grid(rows, size) as (r, d), T.sblock(f"stats_{name}" + (f"_{g // 2}" if g else "")):
            vr, vd = T.axis.spatial(rows, r), T.axis.reduce(size, d)
            with T.init():
                for buf, _ in group:
                    T.buffer_store(buf, T.float32(0), [vr])
            x = _f32(src, vr, vd)
            new = [T.Bind(buf[vr] + term(x, vd)) for buf, term in group]
            for (buf, _), v in zip(group, new):
                T.buffer_store(buf, v, [vr])
    return outs[0][0], [buf for buf, _ in outs[1:]]


class _State:
    """Online-softmax state (m, l, acc) of one query: readers of the latest step's buffers.

    `start` None begins the softmax at the first folded source; otherwise it is the initial
    readers (m(vr), l(vr), acc(vr, vd)), e.g. a phase-1 result."""

    def __init__(self, tag: str, rows, size: int, start=None):
        self.tag, self.rows, self.size = tag, rows, size
        self.m, self.l, self.acc = start if start is not None else (None, None, None)

    def fold(self, name: str, src, ss, dot, eps: float):
        """softmax_* and fold_* stages: merge `src` given its stats (ss, dot)."""
        rows, size, n = self.rows, self.size, f"{self.tag}_{name}"
        m, l = _alloc(f"m{n}", rows), _alloc(f"l{n}", rows)
        acc, m_old, l_old, acc_old = _alloc(f"acc{n}", rows, size), self.m, self.l, self.acc
        if m_old is not None:
            a, b = _alloc(f"a{n}", rows), _alloc(f"b{n}", rows)
        with _row_block(rows, f"softmax{n}") as vr:
            z = T.Bind(dot[vr] * T.rsqrt(ss[vr] * T.float32(1.0 / size) + T.float32(eps)))
            if m_old is None:
                T.buffer_store(m, z, [vr])
                T.buffer_store(l, T.float32(1), [vr])
            else:
                m_new = T.Bind(T.max(m_old(vr), z))
                ea, eb = T.Bind(T.exp(m_old(vr) - m_new)), T.Bind(T.exp(z - m_new))
                T.buffer_store(m, m_new, [vr])
                T.buffer_store(l, l_old(vr) * ea + eb, [vr])
                T.buffer_store(a, ea, [vr])
                T.buffer_store(b, eb, [vr])
        if acc_old is None:
            _elementwise(rows, size, f"fold{n}", lambda vr, vd: (acc, [vr, vd], _f32(src, vr, vd)))
        else:
            _elementwise(
                rows, size, f"fold{n}",
                lambda vr, vd: (acc, [vr, vd], acc_old(vr, vd) * a[vr] + b[vr] * _f32(src, vr, vd)),
            )
        self.m, self.l, self.acc = (lambda vr: m[vr]), (lambda vr: l[vr]), (lambda vr, vd: acc[vr, vd])

    def normalise(self, out, scale: float):
        """out stage: out = scale * acc / l in the storage dtype."""
        _elementwise(
            self.rows, self.size, "out",
            lambda vr, vd: (out, [vr, vd], self.acc(vr, vd) * (T.float32(scale) / self.l(vr))),
        )


def _check(count: int, what: str, size: int, dtype: str):
    if count < 1:
        raise ValueError(f"need at least one {what}, got {count}")
    if size < 1:
        raise ValueError(f"feature_size must be positive, got {size}")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported storage dtype {dtype!r}; expected one of {DTYPES}")


def depth_attention_func(
    num_sources: int,
    feature_size: int,
    dtype: str = "float32",
    eps: float = 1e-6,
    scale: float | None = None,
) -> tirx.PrimFunc:
    """Fused depth attention `depth_attention(s0, ..., s{S-1}, w, out)` over [rows, D] sources.

    Online softmax over the sources with float32 accumulation. `scale` None means `num_sources`
    (out = S * softmax-weighted mean, Block AttnRes' convention); 1.0 gives the plain weighted sum."""
    _check(num_sources, "source", feature_size, dtype)
    S, D = num_sources, feature_size
    scale = float(S) if scale is None else float(scale)
    rows = tirx.Var("rows", "int32")
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("depth_attention")
            srcs = [_param(f"s{i}", (rows, D), dtype) for i in range(S)]
            w = _param("w", (D,), F32)
            out = _param("out", (rows, D), dtype)
            with T.sblock("root"):
                st = _State("", rows, D)
                for k, src in enumerate(srcs):
                    ss, (dot,) = _stats(f"{k}", rows, src, [lambda vd: w[vd]])
                    st.fold(f"{k}", src, ss, dot, eps)
                st.normalise(out, scale)
    return ib.get()


def depth_attention_partial_func(
    num_blocks: int,
    num_queries: int,
    feature_size: int,
    dtype: str = "float32",
    eps: float = 1e-6,
) -> tirx.PrimFunc:
    """Phase 1 of Block AttnRes: `partial(b0, ..., b{J-1}, w[B, D], m[B, rows], l[B, rows],
    acc[B, rows, D])` stores the unnormalised online-softmax state of each of B queries over the
    J completed blocks (float32); the schedules load each block once per row for all queries."""
    _check(num_blocks, "block", feature_size, dtype)
    _check(num_queries, "query", feature_size, dtype)
    J, B, D = num_blocks, num_queries, feature_size
    rows = tirx.Var("rows", "int32")
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("depth_attention_partial")
            blocks = [_param(f"b{j}", (rows, D), dtype) for j in range(J)]
            w = _param("w", (B, D), F32)
            m_out, l_out = _param("m", (B, rows), F32), _param("l", (B, rows), F32)
            acc_out = _param("acc", (B, rows, D), F32)
            with T.sblock("root"):
                states = [_State(f"_q{q}", rows, D) for q in range(B)]
                queries = [lambda vd, q=q: w[q, vd] for q in range(B)]
                for j, blk in enumerate(blocks):
                    ss, dots = _stats(f"{j}", rows, blk, queries)
                    for st, dot in zip(states, dots):
                        st.fold(f"{j}", blk, ss, dot, eps)
                for q, st in enumerate(states):
                    with _row_block(rows, f"store_ml_q{q}") as vr:
                        T.buffer_store(m_out, st.m(vr), [q, vr])
                        T.buffer_store(l_out, st.l(vr), [q, vr])
                    _elementwise(
                        rows, D, f"store_acc_q{q}",
                        lambda vr, vd, q=q, st=st: (acc_out, [q, vr, vd], st.acc(vr, vd)),
                    )
    return ib.get()


def depth_attention_merge_func(
    num_extra: int,
    feature_size: int,
    dtype: str = "float32",
    eps: float = 1e-6,
    scale: float = 1.0,
) -> tirx.PrimFunc:
    """Phase 2 of Block AttnRes for one site: `merge(m[rows], l[rows], acc[rows, D], e0, ...,
    e{E-1}, w, out)` folds the site's own extra sources into its query's phase-1 state and writes
    out = scale * acc / l (pass scale = J + E to match depth_attention_func's default)."""
    _check(num_extra, "extra source", feature_size, dtype)
    E, D = num_extra, feature_size
    rows = tirx.Var("rows", "int32")
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("depth_attention_merge")
            m_in, l_in = _param("m", (rows,), F32), _param("l", (rows,), F32)
            acc_in = _param("acc", (rows, D), F32)
            extra = [_param(f"e{i}", (rows, D), dtype) for i in range(E)]
            w = _param("w", (D,), F32)
            out = _param("out", (rows, D), dtype)
            with T.sblock("root"):
                start = (lambda vr: m_in[vr], lambda vr: l_in[vr], lambda vr, vd: acc_in[vr, vd])
                st = _State("", rows, D, start)
                for k, src in enumerate(extra):
                    ss, (dot,) = _stats(f"{k}", rows, src, [lambda vd: w[vd]])
                    st.fold(f"{k}", src, ss, dot, eps)
                st.normalise(out, float(scale))
    return ib.get()
