"""Default CUDA schedules (no tuning): dlight's GPU rules, each schedule kept only if TVM can lower it.

dlight takes the first rule that returns a schedule, whether or not TVM can lower that schedule.
Its `Reduction` rule puts a grouped or depthwise convolution's reduction across threads in a way
`LowerCrossThreadReduction` refuses ("Cross-thread reduction requires all the reduction-related
loops to be the deepest"), and the whole build failed; `Lowerable` rejects such a schedule so
the next rule (`GeneralReduction`, `Fallback`) gets the operator.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.target import Target


class Lowerable(dlight.ScheduleRule):
    """`rule`, but None where its schedule fails TVM's cross-thread reduction lowering."""

    def __init__(self, rule: dlight.ScheduleRule):
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        space = self.rule.apply(func, target, tunable)
        if space is None:
            return None
        for sch in [space] if isinstance(space, s_tir.Schedule) else space:
            try:
                s_tir.transform.LowerCrossThreadReduction()(sch.mod)
            except Exception:  # noqa: BLE001 - whatever the lowering refuses, the next rule gets the operator
                return None
        return space


def default_rules() -> list[dlight.ScheduleRule]:
    """The CUDA rules in the order they are tried."""
    gpu = dlight.gpu
    return [*map(Lowerable, (gpu.Matmul(), gpu.GEMV(), gpu.Reduction(), gpu.GeneralReduction())), gpu.Fallback()]
