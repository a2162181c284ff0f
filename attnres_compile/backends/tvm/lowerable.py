"""Default schedule rules whose schedules are kept only where TVM can lower them (CPU and CUDA).

dlight's ApplyDefaultSchedule takes the first rule that returns a schedule, lowerable or not, so
one bad schedule failed the whole build. `Lowerable` rejects such a schedule, and a rule that
raises, so the next rule gets the operator; where none is left it stays unscheduled (serial
loops on CPU, which build).
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.target import Target

Check = Callable[[s_tir.Schedule, Target], object]  # raises where TVM cannot lower the schedule


class Lowerable(dlight.ScheduleRule):
    """`rule`, but None where it raises or `check` raises on one of its schedules."""

    def __init__(self, rule: dlight.ScheduleRule, check: Check):
        self.rule, self.check = rule, check

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        try:
            space = self.rule.apply(func, target, tunable)
            for sch in [space] if isinstance(space, s_tir.Schedule) else space or []:
                self.check(sch, target)
        except Exception:  # noqa: BLE001 - whatever the rule or the lowering refuses, the next rule gets the operator
            return None
        return space
