"""Schedules for the kernels in kernel.py (CPU and CUDA) and a build helper."""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width


def _stages(sch: s_tir.Schedule):
    """[(name, block)] of the top-level stages, in program order."""
    return [(sch.get(b).name_hint, b) for b in sch.get_child_blocks(sch.get_sblock("root"))]


def _merge_rows(sch: s_tir.Schedule) -> None:
    """Merge every stage's row loop into one."""
    loops = [sch.get_loops(block)[0] for _, block in _stages(sch)]
    if len(loops) > 1:
        sch.merge(*loops)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _lanes(target: Target) -> int:
    """float32 lanes of the target's vector registers."""
    width = llvm_get_vector_width(target)
    return max((width if width > 0 else 128) // 32, 4)


def schedule_cpu(func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc:
    """Rows in parallel, feature loops vectorised at the target's vector width.

    All stages are merged under one row loop. Per row, the stats of all S sources are reduced in
    one loop over the features (lane-wise partial sums via rfactor, then a horizontal add), so
    the S rows stream from memory concurrently. The folds are inlined into the output stage:
    one more loop over the features re-reads the S rows from L1/L2 and applies the
    online-softmax rescales with the accumulator in registers."""
    sch = s_tir.Schedule(func)
    lanes = _lanes(target)
    for name, block in _stages(sch):
        if name.startswith("fold"):
            sch.compute_inline(block)
    for name, block in _stages(sch):
        if name.startswith("stats"):
            size = int(sch.get(sch.get_loops(block)[1]).extent)
            # rfactor over a predicated split is not affine: partial sums over a divisor of D
            factor = next(f for f in range(min(lanes, size), 0, -1) if size % f == 0)
            if factor > 1:
                sch.rfactor(sch.split(sch.get_loops(block)[1], [None, factor])[1], 0)
    _merge_rows(sch)
    stages = _stages(sch)
    sch.parallel(sch.get_loops(stages[0][1])[0])
    partials = [block for name, block in stages if name.endswith("_rf")]
    if len(partials) > 1:
        # merge puts the merged loop where the last loop passed is: first in program order,
        # ahead of every consumer
        sch.merge(*[sch.get_loops(block)[1] for block in reversed(partials)])
    for block in partials:
        loops = sch.get_loops(block)
        sch.vectorize(loops[-1])
        sch.decompose_reduction(block, loops[1])
    for name, block in stages:
        loops = sch.get_loops(block)
        if len(loops) > 1 and not name.startswith("stats"):
            sch.vectorize(sch.split(loops[1], [None, lanes])[1])
    return sch.mod["main"]


def schedule_cuda(func: tirx.PrimFunc, target: Target, max_threads: int = 256) -> tirx.PrimFunc:
    """One thread block per row; each thread owns `per_thread` contiguous features.

    Thread t holds features [t*per_thread, (t+1)*per_thread) of the row (vector loads, and the
    accumulator compacts to `per_thread` registers); stats reductions run in-thread then across
    the block (cross-thread allreduce); per-row scalars are computed redundantly by every thread
    into registers, after the reduction results are shared through shared memory."""
    sch = s_tir.Schedule(func)
    _merge_rows(sch)
    row = sch.get_loops(_stages(sch)[0][1])[0]
    for name, block in _stages(sch):
        src = sch.get(block).reads[0].source
        if name.startswith("stats") and src.scope() == "global":
            # registers hold the thread's slice of the source for all its stats and folds
            readers = [b for _, b in _stages(sch) if any(r.source.same_as(src) for r in sch.get(b).reads)]
            cache = sch.cache_read(block, 0, "local", consumer_blocks=readers)
            sch.compute_at(cache, row)
    stages = _stages(sch)
    size = next(int(sch.get(sch.get_loops(b)[-1]).extent) for _, b in stages if len(sch.get_loops(b)) > 1)
    bits = min(tvm.DataType(str(p.dtype)).bits for p in func.params)
    per_thread = max(1, min(128 // bits, _ceil_div(size, 32)))  # 16-byte loads when D allows
    threads = min(max_threads, _ceil_div(_ceil_div(size, per_thread), 32) * 32)
    per_thread = _ceil_div(size, threads)
    for name, block in stages:
        loops = sch.get_loops(block)
        if len(loops) == 1:  # per-row scalar stage: computed by every thread
            if name.startswith("softmax"):
                for i in range(len(sch.get(block).writes)):
                    sch.set_scope(block, i, "local")
            continue
        tx, inner = sch.split(loops[-1], [threads, per_thread])
        sch.bind(tx, "threadIdx.x")
        if name.startswith("stats"):
            for i in range(len(sch.get(block).writes)):
                sch.set_scope(block, i, "shared")
        else:
            if name.startswith("fold"):
                sch.set_scope(block, 0, "local")
            # 16-byte source loads; float32 math at most 4 wide (TVM's CUDA codegen mis-emits
            # float32x8 broadcasts and has no wider vector types)
            lanes = min(per_thread, 128 // bits if name.endswith("_local") else 4)
            if threads * per_thread == size and per_thread % lanes == 0:
                sch.vectorize(sch.split(inner, [None, lanes])[1])
    sch.bind(sch.get_loops(stages[0][1])[0], "blockIdx.x")
    return sch.mod["main"]


def host_target(num_cores: int = 2) -> Target:
    """An llvm target for this machine's CPU with `num_cores` worker threads."""
    mcpu = str(Target.from_device("cpu").attrs["mcpu"])
    return Target({"kind": "llvm", "mcpu": mcpu, "num-cores": num_cores})


def build(func: tirx.PrimFunc, target: Target | dict):
    """Schedule `func` for the target's kind (cuda or llvm) and compile it; returns the callable
    module (arguments: tvm tensors in the function's parameter order)."""
    target = Target(target)
    schedule = schedule_cuda if target.kind.name == "cuda" else schedule_cpu
    return tvm.compile(schedule(func, target), target=target)
