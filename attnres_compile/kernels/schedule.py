"""Schedules for the kernels in tensorir.py (CPU and CUDA) and a build helper."""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

from . import tir_pipeline
from .target import cores, vector_bits

RF_LANES = 8  # partial sums per row reduction of a forward-family kernel on CPU (schedule_cpu)
CUDA_CHUNKS = 256  # row chunks of the backward on CUDA: thread blocks, each with its own partial dw


def _stages(sch: s_tir.Schedule):
    """[(name, block)] of the top-level stages, in program order."""
    return [(sch.get(b).name_hint, b) for b in sch.get_child_blocks(sch.get_sblock("root"))]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _lanes(target: Target) -> int:
    """float32 lanes of the target's vector registers."""
    return max(vector_bits(target) // 32, 4)


def _divisor(size: int, lanes: int) -> int:
    """The largest divisor of `size` up to `lanes`."""
    return next(f for f in range(min(lanes, size), 0, -1) if size % f == 0)


def _source(name: str) -> str:
    """The source a stats block reduces: stats_<source>[_<group>][_rf]."""
    return name.split("_")[1]


def _fuse_rows(sch: s_tir.Schedule) -> None:
    """Fuse each stage's row loops (one per leading dim of the sources) into one."""
    rows = next(len(sch.get_loops(b)) for n, b in _stages(sch) if n.startswith("softmax"))
    if rows > 1:
        for _, block in _stages(sch):
            sch.fuse(*sch.get_loops(block)[:rows])


def _chunk_rows(sch: s_tir.Schedule, chunks: int) -> bool:
    """Split the rows into a constant number of chunks (a symbolic count would make the binding
    non-affine) and rfactor the backward's query gradient `dw` over them, so each thread or CUDA
    block accumulates its own partial and a last stage sums them. False if there is no dw. Handles
    one dw block only."""
    if "dw" not in [name for name, _ in _stages(sch)]:
        return False
    dw = sch.get_sblock("dw")
    rf = sch.rfactor(sch.split(sch.get_loops(dw)[0], [None, chunks])[1], 0)
    for name, block in _stages(sch):
        if name == "dw":
            continue
        if name != "dw_rf":
            sch.split(sch.get_loops(block)[0], [None, chunks])
        step, chunk = sch.get_loops(block)[:2]
        sch.reorder(chunk, step)
    for level in range(2):
        sch.merge(*[sch.get_loops(b)[level] for n, b in _stages(sch) if n != "dw"])
    return True


def _merge_rows(sch: s_tir.Schedule) -> None:
    """Merge every stage's row loop into one."""
    loops = [sch.get_loops(block)[0] for _, block in _stages(sch)]
    if len(loops) > 1:
        sch.merge(*loops)


def schedule_cpu(func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc:
    """Rows in parallel (more than one core), feature loops vectorised at the target's vector width.
    All stages share one row loop (the backward: one chunk of rows per core, each with its own
    partial query gradient). The stats reductions hold lane-wise partial sums (rfactor), sources
    packed into as few loops as the registers allow; the elementwise stages then re-read the row
    from cache."""
    sch = s_tir.Schedule(func)
    _fuse_rows(sch)
    lanes = _lanes(target)
    max_acc = 24 if lanes >= 16 else 12  # of 32 (AVX-512) or 16 vector registers
    size = next(int(sch.get(sch.get_loops(b)[1]).extent) for n, b in _stages(sch) if n.startswith("stats"))
    backward = "dw" in [name for name, _ in _stages(sch)]
    # rfactor over a predicated split is not affine: partial sums over a divisor of D. The forward
    # family keeps at most RF_LANES of them: every reduction ends in a scalar sum of its partials,
    # and with 16 (AVX-512) those sums were most of a phase-1 partial's instructions (42 blocks,
    # 7 queries, 1 thread: 1.31 ms at 16, 0.95 ms at 8; a one-pass site over 42 sources 0.27 ms
    # against 0.23 ms). The backward's 16 stay: its dw partial shares the split, and at 8 it ran
    # 1.5x slower (9 sources, 2048 x 1024).
    factor = _divisor(size, lanes if backward else min(lanes, RF_LANES))
    for name, block in _stages(sch):
        if name.startswith("stats") and factor > 1:
            sch.rfactor(sch.split(sch.get_loops(block)[1], [None, factor])[1], 0)
    chunked = _chunk_rows(sch, cores(target))
    if not chunked:
        _merge_rows(sch)
    depth = 2 if chunked else 1  # row loops above the feature loops
    stages = _stages(sch)
    if cores(target) > 1:
        # on one core the row loop stays serial: a parallel loop goes through TVM's thread pool
        # even when the pool runs one task, ~10 us per call, 40-55 us when its worker slept
        # (width 256, 128 tokens, 2 sources: 15 us of work)
        sch.parallel(sch.get_loops(stages[0][1])[0])
    reductions = [(name, block) for name, block in stages if name.startswith("stats") and name.endswith("_rf")]
    per_source: dict[str, int] = {}  # accumulators of all of a source's reductions
    for name, block in reductions:
        per_source[_source(name)] = per_source.get(_source(name), 0) + len(sch.get(block).writes)
    groups, count = [[]], 0
    for name, block in stages:
        if not name.startswith("stats") and groups[-1]:
            # a later stage's reductions (a fused norm's, over the site's output) depend on this
            # one: their loops start a group of their own
            groups.append([])
            count = 0
        if (name, block) in reductions:
            # a source joins a group whole (its load is shared) and only where all of its
            # accumulators fit: a phase-1 partial's source has 8 (7 queries), and two of them in
            # one loop spilled 16 accumulators on AVX2 (25 blocks x 7 queries: stats 623 -> 454 us)
            previous = groups[-1] and _source(sch.get(groups[-1][-1]).name_hint) == _source(name)
            if groups[-1] and not previous and count + per_source[_source(name)] > max_acc:
                groups.append([])
                count = 0
            groups[-1].append(block)
            count += len(sch.get(block).writes)
    for group in filter(None, groups):
        # one loop over the features and one over the lanes per group, not one per reduction: TVM's
        # FlattenBuffer costs a function's loops times its accesses (a 43-block partial's 1.46 s ->
        # 0.88 s; merging the lane sums too made a 26-source site 7% slower)
        for loops in ([sch.get_loops(b)[depth] for b in reversed(group)], [sch.get_loops(b)[-1] for b in reversed(group)]):
            if len(loops) > 1:
                sch.merge(*loops)
        sch.vectorize(sch.get_loops(group[0])[-1])
    backward, sums = [], []
    last_stats = max(i for i, (name, _) in enumerate(stages) if name.startswith("stats"))
    for i, (name, block) in enumerate(stages):
        loops = sch.get_loops(block)
        if len(loops) > depth and not name.startswith("stats") and name != "dw":
            # the backward's dw partial is a reduction: an exact split, as for the stats
            d_out, d_in = sch.split(loops[depth], [None, factor if chunked else lanes])
            sch.vectorize(d_in)
            if chunked and i > last_stats:  # (the fused pair's earlier stages feed reductions)
                backward.append(d_out)
            elif name.startswith("sum_"):
                sums.append(d_out)
    if backward:  # every ds_k and the dw partial in one loop over the features: each row loaded once
        sch.merge(*backward)
    if len(sums) > 1:  # a block-major partial's sums: one loop, its queries' running sums in registers
        sch.merge(*sums)
    # the reductions start at zero in their first iteration (LowerInitBlock's branch: the kernels
    # ran as fast as with decompose_reduction, which took ~25 ms per call on a 43-block partial, 4.6
    # of its 6.7 s of scheduling); the backward's dw partial once per chunk, last: after the
    # decomposition it no longer passes the loop primitives' checks
    if chunked:
        rf = sch.get_sblock("dw_rf")
        sch.decompose_reduction(rf, sch.get_loops(rf)[1])
    return sch.mod["main"].with_attr(tir_pipeline.MARK, True)


def schedule_cuda(func: tirx.PrimFunc, target: Target, max_threads: int = 256) -> tirx.PrimFunc:
    """One thread block per row (the backward: per chunk of rows); each thread owns `per_thread`
    contiguous features, kept in registers from the stats to the elementwise stages. Stats reduce
    in-thread, then across the block; every thread computes the per-row scalars. The backward's
    partial query gradients are summed by a second kernel."""
    sch = s_tir.Schedule(func)
    _fuse_rows(sch)
    chunked = _chunk_rows(sch, CUDA_CHUNKS)
    if not chunked:
        _merge_rows(sch)
    depth = 2 if chunked else 1
    row = next(sch.get_loops(b)[depth - 1] for n, b in _stages(sch) if n.startswith("softmax"))
    allocated = list(sch.get(sch.get_sblock("root")).alloc_buffers)
    written = [w.source for _, b in _stages(sch) for w in sch.get(b).writes]  # the fused pair's mixed row
    for name, block in _stages(sch):
        src = sch.get(block).reads[0].source if name.startswith("stats") else None
        if src is not None and src.scope() == "global" and not any(src.same_as(b) for b in allocated + written):
            # registers hold the thread's slice of the source for all its stats and elementwise uses
            readers = [b for n, b in _stages(sch) if n != "dw" and any(r.source.same_as(src) for r in sch.get(b).reads)]
            cache = sch.cache_read(block, 0, "local", consumer_blocks=readers)
            sch.compute_at(cache, row)
    stages = _stages(sch)
    size = next(int(sch.get(sch.get_loops(b)[-1]).extent) for n, b in stages
                if len(sch.get_loops(b)) > depth and n != "dw")
    bits = min(tvm.DataType(str(p.dtype)).bits for p in func.params if isinstance(p.ty, tirx.BufferType))  # not a merge's index, scale
    per_thread = max(1, min(128 // bits, _ceil_div(size, 32)))  # 16-byte loads when D allows
    threads = min(max_threads, _ceil_div(_ceil_div(size, per_thread), 32) * 32)
    per_thread = _ceil_div(size, threads)

    def registers(block) -> None:
        """The block's intermediates (not its output parameters) in each thread's registers."""
        for i, region in enumerate(sch.get(block).writes):
            if any(region.source.same_as(b) for b in allocated):
                sch.set_scope(block, i, "local")

    for name, block in stages:
        loops = sch.get_loops(block)
        if name == "dw":  # the sum of the partials: its own kernel, a thread per feature
            bx, tx = sch.split(loops[-1], [None, min(max_threads, size)])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            continue
        if name.startswith("softmax"):  # per-row scalar stage: computed by every thread
            registers(block)
            continue
        if not name.startswith("stats") and name != "dw_rf":
            # a block-major partial's running sums, the fused pair's mixed row and its gradient:
            # each thread's own features
            registers(block)
        tx, inner = sch.split(loops[-1], [threads, per_thread])
        sch.bind(tx, "threadIdx.x")
        if name.startswith("stats"):
            for i in range(len(sch.get(block).writes)):
                sch.set_scope(block, i, "shared")
        elif name != "dw_rf":
            # 16-byte source loads; float32 math at most 4 wide (TVM's CUDA codegen mis-emits
            # float32x8 broadcasts and has no wider vector types)
            lanes = min(per_thread, 128 // bits if name.endswith("_local") else 4)
            if threads * per_thread == size and per_thread % lanes == 0:
                sch.vectorize(sch.split(inner, [None, lanes])[1])
    sch.bind(sch.get_loops(stages[0][1])[0], "blockIdx.x")
    if chunked:  # each thread zeroes its features of the chunk's partial once
        init = sch.decompose_reduction(sch.get_sblock("dw_rf"), row)
        sch.bind(sch.split(sch.get_loops(init)[-1], [threads, per_thread])[0], "threadIdx.x")
    return sch.mod["main"]


def build(func: tirx.PrimFunc, target: Target | dict):
    """Schedule `func` for the target's kind (cuda or llvm) and compile it; returns the callable
    module (arguments: tvm tensors in the function's parameter order)."""
    target = Target(target)
    schedule = schedule_cuda if target.kind.name == "cuda" else schedule_cpu
    pipeline = tir_pipeline.NAME if target.kind.name == "llvm" else "default"
    return tvm.compile(schedule(func, target), target=target, tir_pipeline=pipeline)
