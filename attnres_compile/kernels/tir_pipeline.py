"""TVM's default TIR pipeline, with the CPU site kernels' buffers compacted before it.

The default pipeline's CompactBufferAllocation proves each compacted extent <= the buffer's
symbolic shape with TVM's Z3 prover, whose problem holds every loop bound before it: 2.8 s on a
phase-1 partial over 43 blocks and 6 queries (~600 [rows] intermediates), 11.7 s of GPT-2
Full's 56 s `tvm.compile` at 48 sublayers. The CPU kernels (schedule.schedule_cpu) index their
intermediates only inside their shapes, so the compaction needs no proof: `CompactKernels` runs
the pipeline's first passes on them with is_strict=False, and the default pipeline's strict pass
then sees constant shapes. Every other function goes through the default pipeline as it is.
"""

from __future__ import annotations

import tvm
from tvm import s_tir
from tvm.s_tir.pipeline import default_s_tir_pipeline
from tvm.tirx import compilation_pipeline

NAME = __name__  # the registered pipeline's name: this module's (benchmarks/kernel_ab.py imports two checkouts)
MARK = "attnres.compact_loose"  # PrimFunc attribute set by schedule.schedule_cpu


@tvm.transform.module_pass(opt_level=0, name="CompactKernels")
class CompactKernels:
    """The default pipeline's passes up to CompactBufferAllocation, on the functions marked MARK,
    with the compaction not strict."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        marked = {gv: f for gv, f in mod.functions_items()
                  if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and MARK in f.attrs}
        if not marked:
            return mod
        passes = tvm.transform.Sequential([
            s_tir.transform.CanonicalizeLoop(), s_tir.transform.LowerCrossThreadReduction(),
            s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
            s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.CompactBufferAllocation(is_strict=False)])
        compacted = passes(tvm.IRModule(marked))
        mod = mod.clone()
        for gv in marked:
            mod.update_func(gv, compacted[gv].without_attr(MARK))
        return mod


def _pipeline():
    pipeline, host, device = default_s_tir_pipeline()
    return tvm.transform.Sequential([CompactKernels(), pipeline]), host, device


compilation_pipeline.register_tir_pipeline(NAME, _pipeline)
