"""The rank-local cache of interleaved and V pipeline schedules: a hop leaves out what its receiver's rank already holds.

`seen_before` is the rule; `split_stages(..., stage_ranks=...)` builds stages that follow it
(docs/distributed.md, *The rank-local cache*). The first stage on a rank to hold a value writes
it to the `StageCache` per micro-batch slot; readers' gradients go to a mailbox the writer adds
in its own backward. Both are autograd Functions on the stage's inputs and outputs, so they also
run inside torch's `stage_backward_input`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from ..core.errors import ConfigError

V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # torch places their stages in a V


def seen_before(plan: Any, stage_ranks: Sequence[int]) -> list[frozenset[str]]:
    """Per hop h of `plan` (stage h to h + 1), the values it carries that the receiving rank already
    holds for the micro-batch: one made by stage m is on the rank of every stage m … h. A hop
    between two stages on one rank leaves nothing out.
    """
    ranks = check_ranks(stage_ranks, len(plan.stages))
    seen = []
    for hop in plan.hops:
        src, dst = ranks[hop.index], ranks[hop.index + 1]
        seen.append(frozenset() if src == dst else
                    frozenset(v.name for v in hop.values if dst in ranks[v.made:hop.index]))
    return seen


def schedule_stage_ranks(schedule: Any, pp_size: int, num_stages: int) -> list[int]:
    """The rank of each stage under `schedule` (a torch schedule class or its name, e.g.
    "Interleaved1F1B", "ZBVZeroBubble"), from torch's own `generate_stage_to_rank_mapping`: loop
    placement (stage s on rank s mod P) but for the V schedules."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    cls = schedules.get_schedule_class(schedule) if isinstance(schedule, str) else schedule
    style = "v" if any(c.__name__ in V_SCHEDULES for c in cls.__mro__) else "loop"
    try:
        mapping = generate_stage_to_rank_mapping(pp_size, num_stages, style=style)
    except ValueError as exc:
        raise ConfigError(f"{cls.__name__} cannot place {num_stages} stages on {pp_size} ranks ({exc})") from exc
    return [mapping[s] for s in range(num_stages)]


def check_ranks(stage_ranks: Sequence[int], count: int) -> list[int]:
    """`stage_ranks` as ints, or one line if it does not give a rank for each of `count` stages."""
    if isinstance(stage_ranks, (str, bytes)) or not all(isinstance(r, numbers.Integral) and not isinstance(r, bool)
                                                         and r >= 0 for r in stage_ranks):
        raise ConfigError(f"stage_ranks={list(stage_ranks)!r}: give a whole number (a rank, 0 or more) per stage")
    ranks = [int(r) for r in stage_ranks]
    if len(ranks) != count:
        raise ConfigError(f"stage_ranks has {len(ranks)} entries for {count} stages: give the rank of every stage "
                          f"(e.g. schedule_stage_ranks(ScheduleInterleaved1F1B, world, {count}))")
    return ranks


def cache_layout(plan: Any, stage_ranks: Sequence[int]) -> tuple[list[list[str]], list[dict[str, int]]]:
    """Per stage, the values it reads from its rank's cache (in hop order), and the values it
    writes there with how many later stages on the rank read each: a value is written by the
    first stage on the receiving rank that held it, and read by every later stage on that rank
    whose hop left it out."""
    ranks = check_ranks(stage_ranks, len(plan.stages))
    reads: list[list[str]] = [[] for _ in ranks]
    writes: list[dict[str, int]] = [{} for _ in ranks]
    for hop, seen in zip(plan.hops, seen_before(plan, ranks)):
        dst = ranks[hop.index + 1]
        for v in hop.values:
            if v.name in seen:
                writer = next(t for t in range(v.made, hop.index) if ranks[t] == dst)
                writes[writer][v.name] = writes[writer].get(v.name, 0) + 1
                reads[hop.index + 1].append(v.name)
    return reads, writes


class _Mailbox:
    """The gradient of one cached value of one micro-batch, summed over the stages that read it."""

    __slots__ = ("count", "expected", "grad", "name", "stage")

    def __init__(self, name: str, stage: int):
        self.name, self.stage, self.expected, self.count, self.grad = name, stage, 0, 0, None

    def deposit(self, grad: torch.Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad
        self.count += 1

    def collect(self) -> torch.Tensor | None:
        if self.count != self.expected:
            raise RuntimeError(f"rank cache: the gradient of {self.name} (cached by stage {self.stage}) has {self.count} of "
                               f"its {self.expected} readers' parts when stage {self.stage} runs its backward: the schedule "
                               f"ran the writing stage's backward before a reading stage's")
        return self.grad


class _Write(torch.autograd.Function):
    """Identity on the stage's outputs (`n` anchors) that, in backward, adds to each cached value
    the gradient its readers left in its mailbox. The outputs are fresh tensors (not views: V
    schedules detach stage outputs in place) sharing the anchors' storage."""

    @staticmethod
    def forward(ctx, boxes, n, *tensors):
        ctx.boxes, ctx.n, ctx.totals = boxes, n, None
        return tuple(t.detach() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        if ctx.totals is None:  # once, should autograd run this node again (a split weight pass)
            ctx.totals = [box.collect() for box in ctx.boxes]
        return (None, None, *grads, *ctx.totals)


class _Read(torch.autograd.Function):
    """The cached values as outputs of a node whose inputs are the stage's own inputs (`n`
    anchors): autograd then runs its backward in the stage's backward, also in ZBV's input pass
    (`autograd.grad` w.r.t. the stage inputs), and it leaves each value's gradient in the writer's
    mailbox. The anchors get no gradient from it."""

    @staticmethod
    def forward(ctx, boxes, n, *tensors):
        ctx.boxes, ctx.n, ctx.done = boxes, n, False
        return tuple(t.detach() for t in tensors[n:])

    @staticmethod
    def backward(ctx, *grads):
        if not ctx.done:
            ctx.done = True
            for box, grad in zip(ctx.boxes, grads):
                box.deposit(grad)
        return (None, None, *(None for _ in range(ctx.n + len(grads))))


class StageCache:
    """One rank's cache: per micro-batch slot and value name, the tensor (detached), the mailbox
    for its gradient, and how many reads are left. Stage graphs built by `split_stages` with
    `stage_ranks` call `write` and `read`; a slot is the stage's forward count (shape inference
    included: every stage runs it once), so the k-th forward of each stage is one micro-batch."""

    def __init__(self, rank: int):
        self.rank = rank
        self._entries: dict[tuple[int, str], list] = {}
        self._calls: dict[tuple[int, str], int] = {}

    def __len__(self) -> int:
        """Entries held (written, not yet read by every reader)."""
        return len(self._entries)

    def _slot(self, stage: int, op: str) -> int:
        slot = self._calls.get((stage, op), 0)
        self._calls[(stage, op)] = slot + 1
        return slot

    def write(self, stage: int, names: tuple[str, ...], readers: tuple[int, ...], outputs: tuple,
              values: tuple) -> tuple:
        """Keep `values` for `readers` later stages of this micro-batch; `outputs` (the stage's)
        come back through `_Write` when a value needs its readers' gradient."""
        slot = self._slot(stage, "write")
        boxes, routed = [], []
        for name, count, value in zip(names, readers, values):
            box = _Mailbox(name, stage) if value.requires_grad else None
            self._entries[(slot, name)] = [value.detach(), box, count]
            if box is not None:
                boxes.append(box)
                routed.append(value)
        if not boxes:
            return outputs
        anchors = [i for i, t in enumerate(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not anchors:
            raise RuntimeError(f"stage {stage} caches {boxes[0].name} but returns no tensor that requires grad "
                               f"to route its gradient through")
        fresh = _Write.apply(boxes, len(anchors), *(outputs[i] for i in anchors), *routed)
        out = list(outputs)
        for i, t in zip(anchors, fresh):
            out[i] = t
        return tuple(out)

    def read(self, stage: int, names: tuple[str, ...], inputs: tuple) -> tuple:
        """This micro-batch's `names`, in order; those that need a gradient come through `_Read`
        anchored on the stage's `inputs`."""
        slot = self._slot(stage, "read")
        entries = [self._take(slot, name, stage) for name in names]
        routed = [i for i, e in enumerate(entries) if e[1] is not None and torch.is_grad_enabled()]
        values = [e[0] for e in entries]
        if not routed:
            return tuple(values)
        anchors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        if not anchors:
            raise RuntimeError(f"stage {stage} reads {names[routed[0]]} from the rank cache but none of its inputs "
                               f"requires grad to route that value's gradient through")
        boxes = [entries[i][1] for i in routed]
        for box in boxes:
            box.expected += 1
        for i, t in zip(routed, _Read.apply(boxes, len(anchors), *anchors, *(values[i] for i in routed))):
            values[i] = t
        return tuple(values)

    def _take(self, slot: int, name: str, stage: int) -> list:
        entry = self._entries.get((slot, name))
        if entry is None:
            raise RuntimeError(f"stage {stage} reads {name} of micro-batch slot {slot} from rank {self.rank}'s cache, "
                               f"but no earlier stage on this rank wrote it: run the stages on the ranks given as "
                               f"stage_ranks to split_stages")
        entry[2] -= 1
        if entry[2] == 0:
            del self._entries[(slot, name)]
        return entry
