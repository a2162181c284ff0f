"""Default CPU schedules (no tuning) for the fused operators around the depth-attention kernels.

`default_rules` lists them in the order they are tried; the first whose schedule TVM can lower
wins. docs/tvm.md, *CPU schedules*, describes each rule and its tiling.
"""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, sym, tirx
from tvm.ir.expr import TensorLoad  # TVM 0.27's buffer load (tirx.BufferLoad is its factory)
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import SBlockInfo, normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.s_tir.dlight.gpu.matmul import IterKind, detect_iter_traits, make_iter_fusion_index_map
from tvm.target import Target

from ...kernels import tir_pipeline
from ...kernels.target import cores, vector_bits
from .lowerable import Lowerable

ROWS = 4  # rows of the register tile
VECTORS = 4  # vectors per row of the register tile with 32 vector registers (AVX-512)
VECTORS_NARROW = 3  # ... with 16 (AVX2): 12 accumulators, 3 operand vectors and a broadcast
K_UNROLL = 4
K_BLOCK = 512  # K beyond 2 * K_BLOCK is split into blocks of about this size
PARALLEL_MIN = 1 << 14  # elements an injective operator needs before it runs in parallel
RECOMPUTE_MAX = 8  # DotProducts: a producer inlined into at most this many terms per element it writes
PREPROC = "meta_schedule.layout_rewrite_preproc"


def default_rules() -> list[dlight.ScheduleRule]:
    """The CPU rules in the order they are tried."""
    rules = (DotProducts(), Matmul(), dlight.cpu.GEMV(), RowReduction(), dlight.cpu.Reduction(), Injective(),
             Fallback())
    return [Lowerable(rule, lowers) for rule in rules]


def default_schedule(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The schedule of the first rule that applies to `func` (what ApplyDefaultSchedule does per function)."""
    with target:
        for rule in default_rules():
            sch = rule.apply(func, target, False)
            if sch is not None:
                return sch[0] if isinstance(sch, list) else sch
    return None


def lanes(target: Target, bits: int) -> int:
    """Elements of `bits` bits per vector register of the target (at least 4 bytes' worth)."""
    return max(vector_bits(target) // bits, 1)


def _extent(sch: s_tir.Schedule, loop) -> int | None:
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def _largest_divisor(n: int | None, candidates) -> int:
    return next((c for c in candidates if n is not None and n % c == 0), 1)


class _SafeRule(CPUScheduleRule):
    """A CPU rule whose schedule primitives may refuse an unusual operator: then it does not
    apply, and the next rule schedules the operator."""

    def apply(self, func, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            sch = s_tir.Schedule(func)
            infos = normalize_prim_func(sch)
            return None if infos is None else self.schedule(sch, infos, func, target)
        except Exception:  # noqa: BLE001 - ScheduleError, and InternalErrors of layout transforms
            return None

    def schedule(self, sch: s_tir.Schedule, infos: list[SBlockInfo], func: tirx.PrimFunc,
                 target: Target) -> s_tir.Schedule | None:
        """`sch`, a schedule of `func` whose blocks are `infos`, scheduled; None where the rule does not apply."""
        raise NotImplementedError


def lowers(sch: s_tir.Schedule, target: Target) -> None:
    """Raise where TVM's TIR lowering (tvm.compile's, all but code generation) refuses `sch`, or
    where it vectorises a loop with loops inside it: dlight's GEMV did so over the 128 rows of a
    batched [32, 128, 32] x [32, 32, 1] product (HF GraniteMoE's experts as batched_mm), and the
    build ran for over ten minutes without finishing."""
    if _vector_loop_nest(sch):
        raise ValueError("a vectorised loop with loops inside it")
    func = sch.mod["main"].with_attr("global_symbol", "main")
    mod = tirx.transform.BindTarget(target.with_host(target))(tvm.IRModule({"main": func}))
    passes, host_passes, _ = tirx.get_tir_pipeline(tir_pipeline.NAME)
    host_passes()(passes(mod))


def _vector_loop_nest(sch: s_tir.Schedule) -> bool:
    """Whether a block of `sch` sits under a vectorised loop that is not its innermost."""
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        kinds = [sch.get(loop).kind for loop in sch.get_loops(block)]
        if tirx.ForKind.VECTORIZED in kinds[:-1]:
            return True
    return False


class Matmul(_SafeRule):
    """A register-tiled GEMM with its fused epilogue (see the module docstring)."""

    def schedule(self, sch: s_tir.Schedule, infos: list[SBlockInfo], func: tirx.PrimFunc,
                 target: Target) -> s_tir.Schedule | None:
        """The tile as wide as the module docstring says; where padding the columns to it fails (a
        weight of 688 columns read by rows that are a symbolic [batch, sequence] fused: not an
        einsum to `pad_einsum`), the widest tile of whole vectors that divides the columns."""
        try:
            return self._tiled(sch.copy(), infos, func, target, pad=True)
        except Exception:  # noqa: BLE001 - pad_einsum's ScheduleError
            return self._tiled(sch, infos, func, target, pad=False)

    def _tiled(self, sch: s_tir.Schedule, infos: list[SBlockInfo], func: tirx.PrimFunc,
               target: Target, pad: bool) -> s_tir.Schedule | None:
        reductions = [b for b in infos if not b.is_injective()]
        if len(reductions) != 1:
            return None
        main = reductions[0].block_rv
        position = [b.block_rv for b in infos].index(main)
        for producer in infos[:position]:  # casts, reshapes, transposes feeding the GEMM
            sch.compute_inline(producer.block_rv)
        block = sch.get(main)
        if not block.writes[0].source.dtype.is_float:
            return None
        traits = detect_iter_traits(block)
        if traits is None:
            return _one_row(sch, main, func, target)
        rows_kind, cols_kind = _roles(block, traits[3])
        # loops [batch, rows, cols, K]; the accumulators in that layout (a tile is a box there,
        # whatever axes of the output a fused row or column index spans)
        sch.transform_block_layout(main, make_iter_fusion_index_map(
            traits[3], [IterKind.kIter_S, rows_kind, cols_kind, IterKind.kIter_K]))
        writer = sch.reindex(main, ("write", 0))
        s, i, j, k = sch.get_loops(main)
        m, n, kdim = _extent(sch, i), _extent(sch, j), _extent(sch, k)
        lane = lanes(target, block.writes[0].source.dtype.bits)
        vec = n if n is not None and n < lane else lane  # one short vector for narrow outputs
        vectors = VECTORS if vector_bits(target) >= 512 else VECTORS_NARROW
        cols = vec * (vectors if n is None else min(vectors, math.ceil(n / vec)))
        if not pad and n is not None and n % cols:
            cols = vec * _largest_divisor(n // vec, range(vectors, 0, -1))
        rows = ROWS if m is None else min(ROWS, m)
        _pack_weight(sch, main, func, cols, 1 if cols_kind == IterKind.kIter_J else 0)
        _fuse_epilogue(sch, main, writer)
        k_block = _k_block(kdim)
        if k_block is None:  # the accumulators live in registers; else the output accumulates over K blocks
            sch.set_scope(main, 0, "local")
        jo, jv, jl = sch.split(j, [None, cols // vec, vec])
        io, ii = sch.split(i, [None, rows])
        unroll = _largest_divisor(k_block or kdim, (K_UNROLL, 2))
        if k_block is None:
            ko, ki = sch.split(k, [None, unroll])
            sch.reorder(s, jo, io, ko, ki, ii, jv, jl)
            init_at = ko
        else:
            kb, ko, ki = sch.split(k, [None, k_block // unroll, unroll])
            sch.reorder(s, jo, kb, io, ko, ki, ii, jv, jl)
            init_at = kb
        sch.reverse_compute_at(writer, io if k_block is None else jo)
        if k_block is None and m is None:
            tile_accumulators(sch, main, rows)
        sch.vectorize(jl)
        for loop in (jv, ii, ki):
            sch.unroll(loop)
        _vectorize_innermost(sch, writer, lane)
        sch.parallel(sch.fuse(s, jo))
        sch.decompose_reduction(main, init_at)
        return sch


def _one_row(sch: s_tir.Schedule, main, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """A product of one static row by a weight (a decode step built with its batch and sequence fixed):
    TVM drops the unit row loop, so no GEMM rule sees it, and dlight's GEMV took 13x the symbolic-row
    GEMM's time. Tiled as a one-row GEMM: the weight pre-packed into panels of `cols` columns, `cols`
    accumulators in registers over the whole K, the panels in parallel."""
    block = sch.get(main)
    kinds = [iv.iter_type for iv in block.iter_vars]
    weights = [i for i, r in enumerate(block.reads) if any(r.source.same_as(b) for b in _weights(func))]
    if kinds != [tirx.IterVar.DataPar, tirx.IterVar.CommReduce] or len(weights) != 1:
        return None
    writer = sch.reindex(main, ("write", 0))
    j, k = sch.get_loops(main)
    n, kdim = _extent(sch, j), _extent(sch, k)
    if n is None or kdim is None:
        return None
    lane = lanes(target, block.writes[0].source.dtype.bits)
    vec = min(n, lane)
    cols = vec * min(VECTORS if vector_bits(target) >= 512 else VECTORS_NARROW, math.ceil(n / vec))
    _pack_weight(sch, main, func, cols, weights[0])
    _fuse_epilogue(sch, main, writer)
    sch.set_scope(main, 0, "local")
    j, k = sch.get_loops(main)
    jo, jv, jl = sch.split(j, [None, cols // vec, vec])
    ko, ki = sch.split(k, [None, _largest_divisor(kdim, (K_UNROLL, 2))])
    sch.reorder(jo, ko, ki, jv, jl)
    sch.reverse_compute_at(writer, jo)
    sch.vectorize(jl)
    for loop in (jv, ki):
        sch.unroll(loop)
    _vectorize_innermost(sch, writer, lane)
    sch.parallel(jo)
    sch.decompose_reduction(main, ko)
    return sch


def tile_accumulators(sch: s_tir.Schedule, main, rows: int) -> None:
    """Index a symbolic-row GEMM's register accumulators by the row within its tile (row % rows), as TVM
    cannot bound a partial tile's rows and would spill [every row, tile columns] to the stack. Where
    TVM refuses the layout they stay as they were."""
    try:
        sch.transform_layout(main, ("write", 0), lambda *d: [*d[:-2], d[-2] % rows, d[-1]],
                             assume_injective_transform=True)
    except Exception:  # noqa: BLE001 - ScheduleError / InternalError of the layout transform
        pass


class DotProducts(_SafeRule):
    """A contraction every operand reads along its innermost axis, none of them a weight (attention
    scores against keys as stored, rewrites.KeysInPlace): one dot product per output element, terms
    in vector lanes. Producers are inlined, except an operand the product would recompute for most of
    its terms (`_materialised`), which is computed once first."""

    def schedule(self, sch: s_tir.Schedule, infos: list[SBlockInfo], func: tirx.PrimFunc,
                 target: Target) -> s_tir.Schedule | None:
        reductions = [b for b in infos if not b.is_injective()]
        if len(reductions) != 1 or _reads_weight(func, sch.get(reductions[0].block_rv)):
            return None
        main = reductions[0].block_rv
        position = [b.block_rv for b in infos].index(main)
        block = sch.get(main)
        kinds = reductions[0].dom_kind()
        if kinds.count("R") != 1 or not kinds.endswith("R") or not block.writes[0].source.dtype.is_float:
            return None
        k = block.iter_vars[-1].var
        if len(block.reads) < 2 or any(not r.region or not r.region[-1].min.same_as(k) for r in block.reads
                                       if not r.source.same_as(block.writes[0].source)):
            return None
        kept = _materialised(block, [sch.get(p.block_rv) for p in infos[:position]])
        for producer in infos[:position]:
            if sch.get(producer.block_rv).name_hint not in kept:
                sch.compute_inline(producer.block_rv)
        for consumer in reversed(infos[position + 1:]):
            sch.reverse_compute_inline(consumer.block_rv)
        lane = lanes(target, block.writes[0].source.dtype.bits)
        partials = _lane_partials(sch, main, lane)
        if not partials:
            return None
        (name, lane_var), = partials.items()
        rf = next(b for b in sch.get_child_blocks(sch.get_sblock("root")) if sch.get(b).name_hint == name)
        loops = sch.get_loops(main)
        outer = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
        sch.compute_at(rf, outer, preserve_unit_loops=True)
        _lanes_innermost(sch, rf, lane_var)
        points = math.prod(_extent(sch, lp) or PARALLEL_MIN for lp in sch.get_loops(rf))
        if cores(target) > 1 and points >= PARALLEL_MIN:
            sch.parallel(outer)
        return sch


def _reads_weight(func: tirx.PrimFunc, block) -> bool:
    """Whether `block` reads a weight (a constant, `layout_free_buffers`) directly; one that only
    its producers read (the rotary tables of a query and key) leaves it a product of activations."""
    return any(r.source.same_as(b) for r in block.reads for b in _weights(func))


def _weights(func: tirx.PrimFunc) -> list:
    """The parameters of `func` that are weights: its `layout_free_buffers` (constants a schedule may pre-pack)."""
    free = [int(x) for x in func.attrs.get("layout_free_buffers", [])] if func.attrs else []
    return [func.params[x] for x in free if x < len(func.params)]


def _materialised(main, producers: list) -> set[str]:
    """Names of the `producers` that `main` reads directly and would recompute, inlined, for at
    least RECOMPUTE_MAX of its iterations per element they write (static extents only: a symbolic
    operator keeps everything inlined). Such a producer stays a block of its own at the root."""
    if any(not isinstance(iv.dom.extent, tirx.IntImm) for iv in main.iter_vars):
        return set()
    reads = {r.source for r in main.reads}
    terms = math.prod(int(iv.dom.extent) for iv in main.iter_vars)
    kept = set()
    for producer in producers:
        written = producer.writes[0].source if producer.writes else None
        if written is None or written not in reads or not all(isinstance(n, tirx.IntImm) for n in written.shape):
            continue
        if terms >= RECOMPUTE_MAX * math.prod(int(n) for n in written.shape):
            kept.add(producer.name_hint)
    return kept


def _roles(block, block_traits) -> tuple[IterKind, IterKind]:
    """(rows, cols): the vectorised columns are the GEMM axis that is the output's innermost one
    (J for X @ W; I for the 1x1 convolutions of NCHW maps, W[f, c] @ X[c, h*w])."""
    kinds = dict(zip((iv.var for iv in block.iter_vars), (t.kind for t in block_traits)))
    for region in reversed(block.writes[0].region):
        found = {kinds[v] for v in tirx.analysis.undefined_vars(region.min) if v in kinds} - {IterKind.kIter_T}
        if found & {IterKind.kIter_I, IterKind.kIter_J}:
            return (IterKind.kIter_J, IterKind.kIter_I) if IterKind.kIter_I in found else (
                IterKind.kIter_I, IterKind.kIter_J)
    return IterKind.kIter_I, IterKind.kIter_J


def _k_block(k: int | None) -> int | None:
    """The K block size when K is long enough to need blocks, else None."""
    if k is None or k <= 2 * K_BLOCK:
        return None
    divisor = next((b for b in range(K_BLOCK, K_BLOCK // 2, -K_UNROLL) if k % b == 0), None)
    return divisor or K_BLOCK


def _fuse_epilogue(sch: s_tir.Schedule, main, writer) -> None:
    """Everything after the GEMM computed by `writer`, the block copying the accumulators out:
    padding removal and the injective epilogue (bias, residual add, activation) inlined into it."""
    blocks = list(sch.get_child_blocks(sch.get_sblock("root")))
    names = [sch.get(b).name_hint for b in blocks]
    after = blocks[names.index(sch.get(main).name_hint) + 1:]
    position = [sch.get(b).name_hint for b in after].index(sch.get(writer).name_hint)
    for block in after[:position]:  # pad_einsum's un-padding copy
        sch.compute_inline(block)
    epilogue = after[position + 1:]
    for block in epilogue[:-1]:
        sch.compute_inline(block)
    if epilogue:
        sch.reverse_compute_inline(epilogue[-1])


def _pack_weight(sch: s_tir.Schedule, main, func: tirx.PrimFunc, cols: int, operand: int) -> None:
    """Pre-pack a constant column operand ([K, N] or [N, K]) into [N/cols, K, cols] panels,
    padded to whole tiles (the GEMM's columns padded likewise)."""
    block = sch.get(main)
    b = block.reads[operand].source
    if not any(w.same_as(b) for w in _weights(func)):
        return
    if len(b.shape) != 2 or not all(isinstance(d, tirx.IntImm) for d in b.shape):
        return
    *_, jvar, kvar = (iv.var for iv in block.iter_vars)
    index = [r.min for r in block.reads[operand].region]
    if index[0].same_as(kvar) and index[1].same_as(jvar):
        j_axis = 1
    elif index[0].same_as(jvar) and index[1].same_as(kvar):
        j_axis = 0
    else:
        return
    if int(b.shape[j_axis]) % cols:
        sch.pad_einsum(main, [1] * (len(block.iter_vars) - 2) + [cols, 1])
        padded = sch.get(main).reads[operand].source
        producer = next(p for p in sch.get_producers(main) if sch.get(p).writes[0].source.same_as(padded))
    else:
        producer = sch.cache_read(main, operand, "global")
    sch.annotate(producer, PREPROC, True)

    def panels(*dims):
        kk, jj = (dims[0], dims[1]) if j_axis == 1 else (dims[1], dims[0])
        return [jj // cols, kk, jj % cols]

    sch.transform_layout(main, ("read", operand), panels)


def _vectorize_innermost(sch: s_tir.Schedule, block, lane: int) -> None:
    """Vectorise the block's innermost loop by the vector width (or whole, when shorter)."""
    loops = sch.get_loops(block)
    if not loops:
        return
    extent = _extent(sch, loops[-1])
    if extent is None or extent < 2:
        return
    if extent > lane:
        if extent % lane:
            return
        sch.vectorize(sch.split(loops[-1], [None, lane])[1])
    else:
        sch.vectorize(loops[-1])


class RowReduction(_SafeRule):
    """Row reductions in dlight's `Reduction` form (softmax, layer and RMS norms), one row at a time.

    Rows in parallel, every stage computed at the row, each reduction over a static multiple of the
    vector width (or a half or quarter) kept as one partial sum per lane. One static row (a decode
    step built with batch and sequence 1: TVM drops the unit row loop) has its stages computed once
    each; dlight's rules took 280 us for an RMSNorm of 576 there. A stage recomputed per row, or an
    output with no axis beyond the rows (which TVM cannot vectorise), leaves the operator to the
    next rule."""

    def schedule(self, sch: s_tir.Schedule, infos: list[SBlockInfo], func: tirx.PrimFunc,
                 target: Target) -> s_tir.Schedule | None:
        if len(infos) < 2 or all(b.is_injective() for b in infos) or not infos[-1].is_injective():
            return None
        rows = min(len(k) - len(k.lstrip("S")) for k in (b.dom_kind() for b in infos))
        if not rows:
            return None
        if rows == len(infos[-1].dom_kind()):
            if not all(_one_point(sch, b.block_rv) for b in infos if not b.is_injective()):
                return None
            rows = 0  # one static row: the reductions' only spatial iterators are of extent 1
        lane = lanes(target, 32)
        blocks = [*_inline_stages(sch, infos[:-1]), infos[-1].block_rv]
        lane_vars = {}  # a reduction's lane-partial block -> the name of its lane iterator
        for block in blocks[:-1]:
            if _is_reduction(sch, block):
                lane_vars.update(_lane_partials(sch, block, lane))
        last = blocks[-1]
        loops = sch.get_loops(last)
        row = (sch.fuse(*loops[:rows]) if rows > 1 else loops[0]) if rows else None
        _vectorize_innermost(sch, last, lane)
        stages = sch.get_child_blocks(sch.get_sblock("root"))[:-1]
        if row is not None:
            for block in reversed(stages):
                sch.compute_at(block, row, preserve_unit_loops=True)
            if not all(_once_per_row(sch, block, row) for block in stages):
                return None  # a stage not indexed by the rows (a mean over them) would be recomputed per row
            points = math.prod(_extent(sch, lp) or PARALLEL_MIN for lp in sch.get_loops(last))
            if cores(target) > 1 and points >= PARALLEL_MIN:
                sch.parallel(row)
        for block in stages:
            name = sch.get(block).name_hint
            if name in lane_vars:
                _lanes_innermost(sch, block, lane_vars[name])
            elif not _is_reduction(sch, block):
                _vectorize_innermost(sch, block, lane)
        return sch


def _one_point(sch: s_tir.Schedule, block) -> bool:
    """Whether every spatial iterator of `block` has extent 1."""
    return all(isinstance(iv.dom.extent, tirx.IntImm) and int(iv.dom.extent) == 1
               for iv in sch.get(block).iter_vars if iv.iter_type == tirx.IterVar.DataPar)


def _once_per_row(sch: s_tir.Schedule, block, row) -> bool:
    """Whether a stage computed at the row loop does its iterations once in all: its loops under
    the row, times the rows, cover no more points than its iterators."""
    loops = sch.get_loops(block)
    inner = loops[[sch.get(lp).same_as(sch.get(row)) for lp in loops].index(True) + 1:]
    points = sch.get(row).extent
    for lp in inner:
        points = points * sch.get(lp).extent
    return sym.Analyzer().can_prove(points <= math.prod(iv.dom.extent for iv in sch.get(block).iter_vars))


def _is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def _inline_stages(sch: s_tir.Schedule, infos: list[SBlockInfo]) -> list:
    """Inline each elementwise stage that only casts or copies, or that has one reader iterating
    over no more points than it writes (a softmax's exp, read twice, stays computed once, and a
    norm's per-row scale is not recomputed per element); returns the blocks left."""
    left = []
    for info in infos:
        block = sch.get(info.block_rv)
        readers = sch.get_consumers(info.block_rv)
        size = math.prod(_extent_of(x) for x in block.writes[0].source.shape)
        cheap = isinstance(block.body, tirx.BufferStore) and isinstance(block.body.value, (tirx.Cast, TensorLoad))
        once = (len(readers) == 1
                and math.prod(_extent_of(iv.dom.extent) for iv in sch.get(readers[0]).iter_vars) <= size)
        if info.is_injective() and readers and (cheap or once):
            try:
                sch.compute_inline(info.block_rv)
                continue
            except Exception:  # noqa: BLE001 - a stage TVM cannot inline stays
                pass
        left.append(info.block_rv)
    return left


def _extent_of(value) -> int:
    return int(value) if isinstance(value, tirx.IntImm) else PARALLEL_MIN  # symbolic: assume large


def _lane_partials(sch: s_tir.Schedule, block, lane: int) -> dict[str, str]:
    """Split a reduction's trailing reduce loop by the vector width (or a half or quarter of it, at
    least 4, where the extent needs) and keep a partial per lane (rfactor): {the partials' block
    name: its lane iterator's name}, empty where the reduction does not end in one static reduce
    axis longer than, and a multiple of, such a width."""
    kinds = "".join("R" if iv.iter_type == tirx.IterVar.CommReduce else "S" for iv in sch.get(block).iter_vars)
    loops = sch.get_loops(block)
    extent = _extent(sch, loops[-1])
    widths = (w for w in (lane, lane // 2, lane // 4) if w >= 4 and extent and extent > w and extent % w == 0)
    width = next(widths, None)
    if kinds.count("R") != 1 or not kinds.endswith("R") or width is None:
        return {}
    _, inner = sch.split(loops[-1], [None, width])
    name = "v" + sch.get(inner).loop_var.name  # the partials' iterator over the lanes
    partials = sch.rfactor(inner, factor_axis=len(sch.get(block).writes[0].source.shape))
    return {sch.get(partials).name_hint: name}


def _lanes_innermost(sch: s_tir.Schedule, block, lane_var: str) -> None:
    """Move the lane loop of a partials block (first after compute_at, which orders loops as the
    block's iterators) innermost and vectorise it."""
    loops = sch.get_loops(block)
    names = [iv.var.name for iv in sch.get(block).iter_vars]
    i = len(loops) - len(names) + names.index(lane_var)
    if loops[i + 1:]:
        sch.reorder(*loops[i + 1:], loops[i])
    sch.vectorize(loops[i])


class Injective(_SafeRule):
    """All-spatial operators: inlined into their outputs, parallel outer loop, vectorised inner loop."""

    def schedule(self, sch: s_tir.Schedule, infos: list[SBlockInfo], func: tirx.PrimFunc,
                 target: Target) -> s_tir.Schedule | None:
        if not all(b.is_injective() for b in infos):
            return None
        for info in try_inline(sch, infos):
            _parallel_vectorize(sch, info, target)
        return sch


def _parallel_vectorize(sch: s_tir.Schedule, info: SBlockInfo, target: Target) -> None:
    loops = sch.get_loops(info.block_rv)
    if not loops:
        return
    lane = lanes(target, sch.get(info.block_rv).writes[0].source.dtype.bits)
    _vectorize_innermost(sch, info.block_rv, lane)
    loops = sch.get_loops(info.block_rv)
    outer = [lp for lp in loops if sch.get(lp).kind == tirx.ForKind.SERIAL]
    size = math.prod(_extent(sch, lp) or PARALLEL_MIN for lp in loops)
    if outer and size >= PARALLEL_MIN:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])


class Fallback(_SafeRule):
    """Any other operator: each block's outermost spatial loop in parallel, reductions decomposed."""

    def schedule(self, sch: s_tir.Schedule, infos: list[SBlockInfo], func: tirx.PrimFunc,
                 target: Target) -> s_tir.Schedule | None:
        for info in try_inline(sch, infos):
            kinds = info.dom_kind()
            if kinds and kinds[0] == "S":
                sch.parallel(sch.get_loops(info.block_rv)[0])
        return sch
