"""TensorIR for the fused depth-attention kernel and the Block AttnRes two-phase pair.

The functions are generated per source count: every source is its own [rows, D] buffer (never
stacked) and `rows` is symbolic. They hold the schedule-free algorithm with the row loop
outermost, so the per-row online-softmax state (m, l, acc[D]) stays in registers or cache once
scheduled (schedule.py):

    for each row:
        for each source k:                s_k[row] is read from memory once
            stats_k:   sum(s_k^2) and w.s_k, one reduction block with both sums from one load
            softmax_k: z_k, the running max m and denominator l, the rescales
                       a_k = exp(m_old - m) and b_k = exp(z_k - m)
            fold_k:    acc = acc * a_k + b_k * s_k   (s_k[row] re-read while it is in cache)
        out = scale * acc / l

Each step writes fresh intermediates (SSA style) so the block scope stays a stage pipeline, which
the schedule primitives (rfactor, compute_at) require; scheduling shrinks them to one row and
buffer reuse folds them together. Arithmetic is float32 whatever the storage dtype. Block names
(stats*, softmax*, and the elementwise fold*/out/store*) are what the schedules key on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

F32 = "float32"
DTYPES = ("float32", "float16", "bfloat16")


def _f32(buf, *idx):
    x = buf[idx]
    return x if buf.dtype == F32 else T.cast(x, F32)


def _alloc(name: str, *shape):
    return IRBuilder.name(name, T.sblock_alloc_buffer(shape, F32, layout=None))


def _param(name: str, shape, dtype: str):
    return IRBuilder.name(name, T.match_buffer(T.arg(name, T.handle()), shape, dtype, layout=None))


class _Row:
    """The row loop variable and the symbolic row count; makes row-bound blocks."""

    def __init__(self, rows, loop_var):
        self.rows, self.var = rows, loop_var

    def axis(self):
        return T.axis.spatial(self.rows, self.var)

    def elementwise(self, name: str, size: int, body: Callable):
        """A [row, d] block storing body(vr, vd) -> (buffer, indices, float32 value)."""
        with T.serial(size) as d:
            with T.sblock(name):
                vr, vd = self.axis(), T.axis.spatial(size, d)
                buf, idx, val = body(vr, vd)
                T.buffer_store(buf, val if buf.dtype == F32 else T.cast(val, buf.dtype), idx)


class _State:
    """Online-softmax state (m, l, acc) of one query, as readers of the latest step's buffers.

    `start` None begins the softmax at the first folded source; otherwise it is the initial
    (m(vr), l(vr), acc(vr, vd)) readers, e.g. a phase-1 result."""

    def __init__(self, tag: str, row: _Row, size: int, start=None):
        self.tag, self.row, self.size = tag, row, size
        self.m = self.l = self.acc = None
        if start is not None:
            self.m, self.l, self.acc = start

    def fold(self, name: str, src, ss, dot, eps: float):
        """softmax_* and fold_* blocks: merge source `src` with statistics (ss, dot) [rows]."""
        row, size, n = self.row, self.size, f"{self.tag}_{name}"
        m, l = _alloc(f"m{n}", row.rows), _alloc(f"l{n}", row.rows)
        if self.m is not None:
            a, b = _alloc(f"a{n}", row.rows), _alloc(f"b{n}", row.rows)
        with T.sblock(f"softmax{n}"):
            vr = row.axis()
            z = T.Bind(dot[vr] * T.rsqrt(ss[vr] * T.float32(1.0 / size) + T.float32(eps)))
            if self.m is None:
                T.buffer_store(m, z, [vr])
                T.buffer_store(l, T.float32(1), [vr])
            else:
                m_old = self.m(vr)
                m_new = T.Bind(T.max(m_old, z))
                ea = T.Bind(T.exp(m_old - m_new))
                eb = T.Bind(T.exp(z - m_new))
                T.buffer_store(m, m_new, [vr])
                T.buffer_store(l, self.l(vr) * ea + eb, [vr])
                T.buffer_store(a, ea, [vr])
                T.buffer_store(b, eb, [vr])
        acc, acc_old = _alloc(f"acc{n}", row.rows, size), self.acc
        if acc_old is None:
            row.elementwise(f"fold{n}", size, lambda vr, vd: (acc, [vr, vd], _f32(src, vr, vd)))
        else:
            row.elementwise(
                f"fold{n}", size,
                lambda vr, vd: (acc, [vr, vd], acc_old(vr, vd) * a[vr] + b[vr] * _f32(src, vr, vd)),
            )
        self.m, self.l = (lambda vr: m[vr]), (lambda vr: l[vr])
        self.acc = lambda vr, vd: acc[vr, vd]


def _stats(name: str, row: _Row, src, queries: Sequence[Callable]):
    """stats_* block: sum(src^2) and w_q . src for every query from one load of src[row, :].
    Returns the [rows] buffers (ss, [dot_q])."""
    size = src.shape[1]
    outs = [_alloc(f"ss_{name}", row.rows)]
    outs += [_alloc(f"dot{q}_{name}", row.rows) for q in range(len(queries))]
    with T.serial(size) as d:
        with T.sblock(f"stats_{name}"):
            vr, vd = row.axis(), T.axis.reduce(size, d)
            with T.init():
                for buf in outs:
                    T.buffer_store(buf, T.float32(0), [vr])
            x = _f32(src, vr, vd)
            terms = [x * x] + [x * w(vd) for w in queries]
            new = [T.Bind(buf[vr] + t) for buf, t in zip(outs, terms)]
            for buf, v in zip(outs, new):
                T.buffer_store(buf, v, [vr])
    return outs[0], outs[1:]


def _normalise(row: _Row, st: _State, out, scale: float):
    """out block: out = scale * acc / l in the storage dtype."""
    row.elementwise(
        "out", out.shape[1], lambda vr, vd: (out, [vr, vd], st.acc(vr, vd) * (T.float32(scale) / st.l(vr)))
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

    One read of each source per row, online softmax, float32 accumulation. `scale` None means
    `num_sources` (out = S * softmax-weighted mean, Block AttnRes' convention); pass 1.0 for the
    plain softmax-weighted sum."""
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
                with T.serial(rows) as r:
                    row = _Row(rows, r)
                    st = _State("", row, D)
                    for k, src in enumerate(srcs):
                        ss, (dot,) = _stats(f"{k}", row, src, [lambda vd: w[vd]])
                        st.fold(f"{k}", src, ss, dot, eps)
                    _normalise(row, st, out, scale)
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
    J completed blocks (float32), reading each block once per row for all queries."""
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
                with T.serial(rows) as r:
                    row = _Row(rows, r)
                    states = [_State(f"_q{q}", row, D) for q in range(B)]
                    queries = [lambda vd, q=q: w[q, vd] for q in range(B)]
                    for j, blk in enumerate(blocks):
                        ss, dots = _stats(f"{j}", row, blk, queries)
                        for st, dot in zip(states, dots):
                            st.fold(f"{j}", blk, ss, dot, eps)
                    for q, st in enumerate(states):
                        with T.sblock(f"store_ml_q{q}"):
                            vr = row.axis()
                            T.buffer_store(m_out, st.m(vr), [q, vr])
                            T.buffer_store(l_out, st.l(vr), [q, vr])
                        row.elementwise(
                            f"store_acc_q{q}", D, lambda vr, vd, q=q, st=st: (acc_out, [q, vr, vd], st.acc(vr, vd))
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
                with T.serial(rows) as r:
                    row = _Row(rows, r)
                    start = (lambda vr: m_in[vr], lambda vr: l_in[vr], lambda vr, vd: acc_in[vr, vd])
                    st = _State("", row, D, start)
                    for k, src in enumerate(extra):
                        ss, (dot,) = _stats(f"{k}", row, src, [lambda vd: w[vd]])
                        st.fold(f"{k}", src, ss, dot, eps)
                    _normalise(row, st, out, float(scale))
    return ib.get()
