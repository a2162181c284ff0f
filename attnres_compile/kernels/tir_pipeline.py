"""TVM's default TIR pipeline, with the CPU site kernels' buffers compacted before it.

The default CompactBufferAllocation proves every compacted extent with TVM's Z3 prover, which is
slow on kernels with hundreds of intermediates. The CPU kernels (schedule.schedule_cpu) index
their intermediates only inside their shapes, so `CompactKernels` runs the first passes on them
with is_strict=False; every other function goes through the default pipeline as it is.
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
