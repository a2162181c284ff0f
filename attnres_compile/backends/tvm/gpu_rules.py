"""Default CUDA schedules (no tuning): dlight's GPU rules, each schedule kept only if TVM can lower it.

dlight's `Reduction` rule puts a grouped or depthwise convolution's reduction across threads in a
way `LowerCrossThreadReduction` refuses ("Cross-thread reduction requires all the reduction-related
loops to be the deepest"), and the whole build failed; `lowerable.Lowerable` rejects that schedule
so the next rule (`GeneralReduction`, `Fallback`) gets the operator.
"""

from __future__ import annotations

from tvm import s_tir
from tvm.s_tir import dlight
from tvm.target import Target

from .lowerable import Lowerable


def lowers(sch: s_tir.Schedule, target: Target) -> None:
    """Raise where TVM's cross-thread reduction lowering refuses `sch`."""
    s_tir.transform.LowerCrossThreadReduction()(sch.mod)


def default_rules() -> list[dlight.ScheduleRule]:
    """The CUDA rules in the order they are tried."""
    gpu = dlight.gpu
    return [*(Lowerable(r, lowers) for r in (gpu.Matmul(), gpu.GEMV(), gpu.Reduction(), gpu.GeneralReduction())),
            gpu.Fallback()]
