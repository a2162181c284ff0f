"""Default CUDA schedules (no tuning): dlight's GPU rules, each schedule kept only if TVM can lower it
(`lowerable.Lowerable`), e.g. a grouped convolution's cross-thread reduction that
`LowerCrossThreadReduction` refuses passes to the next rule.
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
