"""Memory-budgeted planning of pipeline training for an AttnRes rewrite: which N fits each rank.

`plan_memory` predicts every rank's peak bytes, from a one-micro-batch profile (memory_profile.py),
a stage layout and a torch schedule (along its own `pipeline_order`), for each Block N whose
boundaries fall on the stage cuts, and picks the largest N that fits (Full when it fits).
docs/distributed.md, *Planning for a memory budget*, lists the terms.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

from ..core.errors import ConfigError
from .checkpointing import SitePolicy
from .memory_profile import Profile, profile_model
from .pipeline import Carried, Hop, StagePlan, _cut_blocks
from .stage_cache import schedule_stage_ranks, seen_before

# the command line's schedule names and torch's (`get_schedule_class`)
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zbv": "ZBVZeroBubble"}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbv": 2}
OPTIMIZERS = {"adam": 2, "sgd": 0, "momentum": 1}  # state tensors per parameter (Adam: exp_avg, exp_avg_sq)
# Layout bounds, checked before torch builds a schedule's order (whose time grows with the square of
# the micro-batches per rank: zbv at 16 ranks x 256 micro-batches takes 5 s, at 2 x 2048 40 s).
MAX_STAGES = 256
MAX_MICRO_BATCHES = 256
MAX_ACTIONS = 8192  # stages x micro-batches


@dataclass
class RankMemory:
    """One rank's predicted peak and its parts, in bytes; `in_flight`: micro-batches each of its
    stages holds at that moment."""

    rank: int
    stages: list[int]
    params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    history: int
    transient: int
    in_flight: list[int]
    host: int = 0  # offloaded saved tensors at the peak (host memory)

    @property
    def peak(self) -> int:
        return (self.params + self.grads + self.optimizer + self.buffers + self.activations + self.history
                + self.transient)


@dataclass
class MemoryPlan:
    """The chosen rewrite and its per-rank figures (`ranks`), per-hop bytes (`hops`, a `StagePlan`
    whose `sent_bytes` are with the cache), and every N that was tried (`candidates`)."""

    budget: int
    schedule: str
    micro_batches: int
    optimizer: str
    variant: str
    num_blocks: int
    block_size: int
    block_starts: list[int]  # sublayer index where each block begins
    stages: list[list[str]]
    stage_ranks: list[int]
    ranks: list[RankMemory]
    hops: StagePlan
    candidates: list[dict]
    profile: Profile
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return max(r.peak for r in self.ranks) <= self.budget

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("hops", "profile")}
        out["profile"] = self.profile.to_dict()
        for d, r in zip(out["ranks"], self.ranks):
            d["peak"] = r.peak
        out["hops"] = self.hops.to_dict()["hops"]
        return out

    def table(self) -> str:
        what = "Full" if self.variant == "full" else f"Block N={self.num_blocks} (B={self.block_size} sublayers)"
        lines = [f"memory plan: {what}, {len(self.stages)} stages on {len(self.ranks)} ranks, {self.schedule}, "
                 f"{self.micro_batches} micro-batches of {self.profile.tokens} tokens, {self.optimizer} "
                 f"({OPTIMIZERS[self.optimizer]} states per parameter), budget {_size(self.budget)} per rank",
                 ("every sublayer output is a source (block size 1)" if self.variant == "full" else
                  f"blocks begin at sublayers {', '.join(map(str, self.block_starts))}")
                 + "; stages begin at " + ", ".join(s[0] for s in self.stages),
                 f"{'rank':>4} {'stages':>7} {'params':>9} {'grads':>9} {'optim':>9} {'buffers':>9} {'activ':>9} "
                 f"{'history':>9} {'backward':>9} {'peak':>9} {'in flight':>9}"]
        for r in self.ranks:
            lines.append(f"{r.rank:>4} {','.join(map(str, r.stages)):>7} " + " ".join(
                f"{_size(v):>9}" for v in (r.params, r.grads, r.optimizer, r.buffers, r.activations, r.history,
                                            r.transient, r.peak)) + f" {','.join(map(str, r.in_flight)):>9}")
        lines += ["bytes per hop (per micro-batch), without and with the rank-local cache:",
                  *("  " + line for line in self.hops.table().splitlines())]
        tried = ", ".join(f"{'Full' if c['block_size'] == 1 else 'N=' + str(c['num_blocks'])}: {_size(c['peak'])}"
                          for c in self.candidates)
        lines.append(f"largest rank peak per rewrite aligned with the cuts: {tried}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # unreachable


def plan_memory(profile: Profile, budget: int, stages: int, schedule: str = "1f1b", ranks: int | None = None,
                micro_batches: int | None = None, optimizer: str = "adam", checkpoint: SitePolicy | None = None,
                offload: bool = False, num_blocks: int | None = None, block_size: int | None = None) -> MemoryPlan:
    """The largest Block N (or Full) whose boundaries fall on the cuts of `stages` even stages and
    whose predicted peak fits `budget` bytes on every rank; ConfigError naming the smallest budget
    that fits when none does. `ranks`: default stages / stages per rank of the schedule (1 for
    gpipe/1f1b, 2 for interleaved/zbv); `micro_batches`: default `stages`; `num_blocks` (or
    `block_size`): plan only this N (or B; the block size must divide the cuts)."""
    if not isinstance(profile, Profile):
        raise ConfigError(f"plan_memory: profile is {type(profile).__name__}, not a memory_profile.Profile "
                          "(profile_model(...), or plan_traced for a traced model)")
    _whole("budget", budget, 1, None)
    _whole("stages", stages, 2, MAX_STAGES)
    if stages > len(profile.layers):  # before any schedule is built
        raise ConfigError(f"{stages} stages, but the model has {len(profile.layers)} layers: use 2 to "
                          f"{len(profile.layers)} stages")
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if value is not None:
            _whole(name, value, 1, None)
    ranks, micro_batches, order = check_layout(stages, schedule, ranks, micro_batches, optimizer)
    starts = _cut_blocks(profile.layers, stages, None)
    stage_of_layer = [sum(profile.layers.index(s) <= i for s in starts) for i in range(len(profile.layers))]
    stage_ranks = schedule_stage_ranks(SCHEDULES[schedule], ranks, stages)
    total = sum(profile.links)
    cuts = [sum(profile.links[:profile.layers.index(s)]) for s in starts]
    sizes = sorted({math.ceil(total / n) for n in ([num_blocks] if num_blocks else range(1, total + 1))})
    if block_size:
        sizes = [min(block_size, total)]
    if (num_blocks or block_size) and any(c % sizes[0] for c in cuts):
        raise ConfigError(f"Block N={math.ceil(total / sizes[0])} (blocks of {sizes[0]} sublayers) does not align with "
                          f"the stage cuts at sublayers {', '.join(map(str, cuts))}: drop --blocks/--block-size to let "
                          f"the planner choose")
    candidates = []
    for size in (b for b in sizes if all(c % b == 0 for c in cuts)):
        plan = _evaluate(profile, size, stage_of_layer, stage_ranks, order, micro_batches, optimizer, checkpoint,
                         offload, budget, schedule)
        candidates.append(plan)
    for plan in candidates:
        plan.candidates = [{"num_blocks": c.num_blocks, "block_size": c.block_size,
                            "peak": max(r.peak for r in c.ranks)} for c in candidates]
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        least = min(candidates, key=lambda c: max(r.peak for r in c.ranks))
        peak = max(r.peak for r in least.ranks)
        what = "Full" if least.block_size == 1 else f"Block N={least.num_blocks}"
        raise ConfigError(f"no rewrite aligned with the {stages} stage cuts fits {_size(budget)} per rank under "
                          f"{schedule} with {micro_batches} micro-batches: the smallest budget that fits is {peak} B "
                          f"({_size(peak)}, {what}); raise --budget, or use more stages or fewer micro-batches")
    return fitting[0]


def check_layout(stages: int, schedule: str, ranks: int | None = None, micro_batches: int | None = None,
                 optimizer: str = "adam") -> tuple[int, int, dict[int, list]]:
    """(ranks, micro-batches, torch's pipeline_order per rank) of a layout, or a ConfigError line for
    a value that cannot work whatever the model (the command line checks it before any work). Every
    number is bounded (MAX_STAGES, MAX_MICRO_BATCHES, MAX_ACTIONS; ranks <= stages) before torch's
    schedule is built."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    per_rank = STAGES_PER_RANK[schedule]
    _whole("stages", stages, 1, MAX_STAGES)
    if ranks is not None:
        _whole("ranks", ranks, 1, MAX_STAGES)
    if micro_batches is not None:
        _whole("micro_batches", micro_batches, 1, MAX_MICRO_BATCHES)
    ranks = ranks or max(1, stages // per_rank)
    if stages < 2:
        raise ConfigError(f"{stages} stage: a pipeline needs at least 2 stages")
    if stages != ranks * per_rank and not (schedule == "interleaved" and stages % ranks == 0 and stages > ranks):
        need = "a multiple of the ranks, at least twice" if schedule == "interleaved" else f"{per_rank} per rank"
        raise ConfigError(f"{schedule} needs stages {need}: {stages} stages on {ranks} rank(s) do not fit; change "
                          f"--stages or --ranks")
    micro_batches = micro_batches or stages
    if stages * micro_batches > MAX_ACTIONS:
        raise ConfigError(f"stages x micro-batches = {stages * micro_batches}: at most {MAX_ACTIONS} (torch's schedule "
                          f"order grows with their product); use fewer --stages or --micro-batches")
    return ranks, micro_batches, _pipeline_order(schedule, ranks, stages, micro_batches)


def _whole(name: str, value, low: int, high: int | None) -> None:
    """ConfigError naming `name` unless `value` is a whole number (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} is not a whole number")
    if value < low:
        raise ConfigError(f"{name}={value}: at least {low}")
    if high is not None and value > high:
        raise ConfigError(f"{name}={value}: at most {high}")


@functools.lru_cache(maxsize=4)  # the command line checks the layout, then plans it
def _pipeline_order(schedule: str, ranks: int, stages: int, micro_batches: int) -> dict[int, list]:
    """torch's own `pipeline_order` of the schedule: per rank its actions (stage, F/B/I/W, micro-batch).
    The schedule classes read only these attributes of their stages while building it."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    cls = get_schedule_class(SCHEDULES[schedule])
    local = stages // ranks
    fake = [SimpleNamespace(num_stages=stages, group_size=ranks, group_rank=0, stage_index=i, submod=None)
            for i in range(local)]
    try:
        built = cls(fake[0] if local == 1 else fake, n_microbatches=micro_batches)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"torch's {SCHEDULES[schedule]} schedule refuses {micro_batches} micro-batches on {ranks} "
                          f"ranks ({str(exc).splitlines()[0].strip().rstrip('.')}): change --micro-batches") from None
    return {r: [a for a in acts if a is not None and a.microbatch_index is not None]
            for r, acts in built.pipeline_order.items()}


def _evaluate(profile: Profile, size: int, stage_of_layer: list[int], stage_ranks: list[int], order: dict,
              micro: int, optimizer: str, checkpoint: SitePolicy | None, offload: bool, budget: int,
              schedule: str) -> MemoryPlan:
    """The plan for block size `size` (1: Full): hops, per-stage terms, per-rank peaks."""
    count = max(stage_of_layer) + 1
    total = sum(profile.links)
    layer_first = [sum(profile.links[:i]) for i in range(len(profile.layers))]
    sub_stage = [stage_of_layer[i] for i, n in enumerate(profile.links) for _ in range(n)]  # stage of each sublayer
    hops = _hops(profile, size, stage_of_layer, layer_first, sub_stage, count)
    plan_hops = StagePlan([[name for name, s in zip(profile.layers, stage_of_layer) if s == k] for k in range(count)],
                          hops, [], profile.tokens, stage_ranks)
    for hop, seen in zip(hops, seen_before(plan_hops, stage_ranks)):
        for v in hop.values:
            v.cached = v.name in seen
    per_stage = [_stage_terms(profile, k, stage_of_layer, hops, micro, size, checkpoint, offload) for k in range(count)]
    rank_mem = [_rank_peak(r, [k for k in range(count) if stage_ranks[k] == r], per_stage, order[r], optimizer)
                for r in sorted(order)]
    num_blocks = math.ceil(total / size)
    notes = [*profile.notes, f"activations profiled on one micro-batch in one process; loss: {profile.loss}",
             "peak without the cache (split_stages' default stages); gradients from each stage's first backward"]
    if checkpoint is not None or offload:
        notes.append("checkpointing/offload terms are predictions only: not measured (stage modules are flat)")
    return MemoryPlan(budget, schedule, micro, optimizer, "full" if size == 1 else "block", num_blocks, size,
                      list(range(0, total, size)), plan_hops.stages, stage_ranks, rank_mem, plan_hops, [], profile,
                      notes)


def _hops(profile: Profile, size: int, stage_of_layer: list[int], layer_first: list[int], sub_stage: list[int],
          count: int) -> list[Hop]:
    """What each hop carries: the stream, the embedding and the finished block sums (or, B = 1,
    every earlier source), and the other values crossing the cut, each with the stage that made it."""
    hops = []
    for h in range(count - 1):
        layer = stage_of_layer.index(h + 1)
        cut = layer_first[layer]
        boundary = profile.boundaries[layer - 1]
        history = [Carried("embedding", "history", (), profile.dtype, profile.stream, 0, h > 0)]
        for k in range(1, cut // size + 1):
            made = sub_stage[k * size - 1]
            name = f"source{k}" if size == 1 else f"block{k}"
            history.append(Carried(name, "history", (), profile.dtype, profile.stream, made, made < h))
        stream = Carried("stream", "stream", (), profile.dtype, profile.stream, h, False)
        made_stage = [0, *stage_of_layer]  # part i + 1 is layer i; part 0 runs in stage 0
        other = [Carried(name, "other", (), "", size_, made_stage[part], made_stage[part] < h)
                 for name, size_, part in boundary.other]
        hops.append(Hop(h, [*history, stream, *other]))
    return hops


@dataclass
class _StageTerms:
    params: int
    buffers: int  # allocated once: model buffers; receive, gradient and output buffers for every micro-batch
    activations: int  # per micro-batch in flight
    history: int  # per micro-batch in flight
    history_buffers: int  # the history's share of the receive and gradient buffers (not in `buffers`)
    transient: int  # during one backward
    host: int  # per micro-batch in flight, offloaded


def _stage_terms(profile: Profile, k: int, stage_of_layer: list[int], hops: list[Hop], micro: int, size: int,
                 checkpoint: SitePolicy | None, offload: bool) -> _StageTerms:
    parts = [0] * (k == 0) + [i + 1 for i, s in enumerate(stage_of_layer) if s == k]
    links = sum(profile.links[p - 1] for p in parts if p)
    params = sum(profile.params[p] for p in parts) + links * profile.width * profile.itemsize  # + pseudo-queries
    inbound = hops[k - 1] if k > 0 else None
    outbound = hops[k] if k < len(hops) else None
    grad_kinds = ("history", "stream")
    history_buffers = micro * sum(v.bytes for hop in (inbound, outbound) if hop for v in hop.values
                                  if v.kind == "history")
    buffers = micro * (inbound.bytes if inbound else 0) + sum(profile.buffers[p] for p in parts) - history_buffers
    buffers += micro * (sum(v.bytes for v in outbound.values if v.kind in grad_kinds) if outbound else 0)
    buffers += micro * profile.outputs if outbound is None else 0
    relayed = [v for v in (outbound.values if outbound else []) if v.made < k]
    held, history, transient = _activations(profile, parts, links, relayed, size, checkpoint)
    if outbound is None:  # the last stage's backward starts with the loss and the head
        transient = max(transient, profile.transient_head)
    transient += sum(v.bytes for v in inbound.values if v.kind in grad_kinds) if inbound else 0
    host = 0
    if offload:
        kept = sum(v.bytes for v in outbound.values) if outbound else 0  # stage outputs stay for the sends/backward
        host, held, history = held + history - kept, kept, 0
    return _StageTerms(params, buffers, held, history, history_buffers, transient, host)


def _activations(profile: Profile, parts: list[int], links: int, relayed: list[Carried], size: int,
                 checkpoint: SitePolicy | None) -> tuple[int, int, int]:
    """(activations, history, backward transient) of one micro-batch in a stage of `links` sublayers
    relaying `relayed`. Without checkpointing: the profiled activations and one source per sublayer;
    checkpointed layers keep their inputs (and with `save_sites` the sites' outputs), and backward
    recomputes one layer at a time on top of the transient."""
    copies = sum(v.bytes for v in relayed if v.kind != "history")
    relayed_history = sum(v.bytes for v in relayed if v.kind == "history")
    if checkpoint is None:
        return (sum(profile.held[p] for p in parts) + copies, links * profile.stream + relayed_history,
                profile.transient)
    layers = [p for p in parts if p]
    sources = links if size == 1 else min(links, len(layers) + links // size)
    kept = profile.held[0] * (0 in parts) + (len(layers) + checkpoint.save_sites * links) * profile.stream
    return (kept + copies, sources * profile.stream + relayed_history,
            profile.transient + max(profile.held[p] for p in layers))


def _rank_peak(rank: int, stages: list[int], terms: list[_StageTerms], actions: list, optimizer: str) -> RankMemory:
    """Walk the rank's actions: a forward adds a micro-batch to its stage; a backward (B, or I of a
    split one) adds its transient while it runs; a full backward (B) or a weight pass (W) frees the
    micro-batch and leaves the stage's parameter gradients (allocated by its first backward of the
    step: `zero_grad()` sets them to None). The peak is the largest level on the way."""
    held = dict.fromkeys(stages, 0)
    graded: set[int] = set()
    best: list = [-1, dict(held), set(), 0]

    def consider(extra: int) -> None:
        level = sum(held[t] * (terms[t].activations + terms[t].history) for t in stages) + extra
        level += sum(terms[t].params for t in graded)
        if level > best[0]:
            best[:] = [level, dict(held), set(graded), extra]

    for action in actions:
        kind, s = action.computation_type.value, action.stage_index
        if kind == "F":
            held[s] += 1
            consider(0)
        elif kind in ("B", "I"):
            consider(terms[s].transient)
        if kind in ("B", "W"):
            held[s] -= 1
            graded.add(s)
            consider(0)
    _, at, grads, during = best
    params = sum(terms[s].params for s in stages)
    history = sum(at[s] * terms[s].history + terms[s].history_buffers for s in stages)
    return RankMemory(rank, stages, params, sum(terms[s].params for s in grads), OPTIMIZERS[optimizer] * params,
                      sum(terms[s].buffers for s in stages), sum(at[s] * terms[s].activations for s in stages),
                      history, during, [at[s] for s in stages], sum(at[s] * terms[s].host for s in stages))


def plan_traced(traced, report, budget: int, stages: int, **options) -> MemoryPlan:
    """`plan_memory` for a traced model (`api.trace`) and its analysis (`api.inspect`'s report): the
    longest chain planned for rewriting (the residual stream) is profiled on the traced example."""
    if getattr(traced, "graph_module", None) is None:
        raise ConfigError(f"plan_traced: traced is {type(traced).__name__}, not what attnres_compile.fx.trace.trace "
                          "returns")
    try:
        chains = [c for c in report["chains"] if c["status"] != "skipped"]
    except (TypeError, KeyError, IndexError):
        raise ConfigError(f"plan_traced: report is {type(report).__name__}, not the report of "
                          "attnres_compile.inspect (or fx.pipeline.inspect_traced) for this model") from None
    if not chains:
        raise ConfigError("no residual chain to rewrite, so nothing to plan: see the chains above")
    chain = max(chains, key=lambda c: c["links"])
    args = traced.args if traced.args is not None else ()
    return plan_memory(profile_model(traced.graph_module, args, traced.kwargs, chain), budget, stages, **options)
