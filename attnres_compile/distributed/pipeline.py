"""Pipeline stages of a rewritten model for torch.distributed.pipelining's manual `PipelineStage`.

A site reads values from many earlier blocks, which torch's traced pipelining frontend cannot
run backward through. `split_stages` cuts the graph (re-exported at the micro-batch's fixed
shapes) at block boundaries into GraphModules whose inputs and outputs are everything each hop
carries, a value needed further down relayed stage by stage as a fresh clone so gradients flow
back hop by hop. The `StagePlan` says what crosses each hop and its bytes (docs/distributed.md,
*Pipeline stages*).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..core.errors import ConfigError, TraceError
from ..ops.delta import depth_attention_delta as _DELTA
from ..ops.depth_attention import is_attnres_op
from ..utils.pytree_warning import silenced
from .stage_cache import StageCache, cache_layout, check_ranks, seen_before

aten = torch.ops.aten
MAX_CARRIED = 24  # history tensors one hop may carry before the split is refused (Full past this: use Block)


@dataclass
class Carried:
    """One value crossing a hop: `kind` "history", "stream", "input" or "other"; `made` the stage that
    made it (0: an input); `relayed` when the stage before only passes it on; `cached` when the
    receiving stage reads it from its rank's cache (`stage_cache.seen_before`)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    made: int
    relayed: bool
    cached: bool = False


@dataclass
class Hop:
    """What stage `index` sends to stage `index + 1`."""

    index: int
    values: list[Carried]

    @property
    def bytes(self) -> int:
        """What the hop carries without the cache."""
        return sum(v.bytes for v in self.values)

    @property
    def sent_bytes(self) -> int:
        """What it carries with the cache (the same without `stage_ranks`, and on a hop between two
        stages on one rank, which torch hands over in memory)."""
        return sum(v.bytes for v in self.values if not v.cached)


@dataclass
class StagePlan:
    """The stages (their blocks), what every hop carries, and the figures per micro-batch and token."""

    stages: list[list[str]]
    hops: list[Hop]
    inputs: list[str]
    tokens: int | None  # tokens per micro-batch (elements of the first integer input), None if none
    stage_ranks: list[int] | None = None  # the rank of each stage, when the stages use the rank-local cache
    notes: list[str] = field(default_factory=list)

    def bytes_per_token(self, hop: int, cached: bool = False) -> float | None:
        """Bytes per token hop `hop` carries, without the cache or (`cached`) with it."""
        h = self.hops[hop]
        return (h.sent_bytes if cached else h.bytes) / self.tokens if self.tokens else None

    def to_dict(self) -> dict:
        out = asdict(self)
        for hop, d in zip(self.hops, out["hops"]):
            d["bytes"], d["bytes_per_token"] = hop.bytes, self.bytes_per_token(hop.index)
            d["sent_bytes"], d["sent_bytes_per_token"] = hop.sent_bytes, self.bytes_per_token(hop.index, cached=True)
        return out

    def table(self) -> str:
        """One line per hop: values by kind, bytes per micro-batch and per token; with `stage_ranks`,
        also the ranks of the hop, the values its receiver reads from its rank's cache, and what
        the hop then carries ("local": the two stages share a rank and torch sends nothing)."""
        cache = self.stage_ranks is not None
        head = f"{'hop':>5} {'history':>8} {'stream':>7} {'other':>6} {'bytes':>10} {'B/token':>9}"
        lines = [head + (f" {'ranks':>6} {'cached':>7} {'sent bytes':>11} {'B/token':>9}" if cache else "")]
        for hop in self.hops:
            kinds = [sum(v.kind == k for v in hop.values) for k in ("history", "stream")]
            line = (f"{hop.index}->{hop.index + 1:<2} {kinds[0]:>8} {kinds[1]:>7} {len(hop.values) - sum(kinds):>6} "
                    f"{hop.bytes:>10} {_rounded(self.bytes_per_token(hop.index)):>9}")
            if cache:
                src, dst = self.stage_ranks[hop.index], self.stage_ranks[hop.index + 1]
                sent = ("local", "-") if src == dst else (hop.sent_bytes, _rounded(self.bytes_per_token(hop.index, True)))
                line += f" {f'{src}->{dst}':>6} {sum(v.cached for v in hop.values):>7} {sent[0]:>11} {sent[1]:>9}"
            lines.append(line)
        return "\n".join(lines)


def _rounded(x: float | None) -> int | None:
    return x if x is None else round(x)


def split_stages(gm: fx.GraphModule, example_inputs: Any, kwargs: dict | None = None, num_stages: int | None = None,
                 cuts: list[str] | None = None, max_carried: int = MAX_CARRIED,
                 stage_ranks: Sequence[int] | None = None) -> tuple[list[fx.GraphModule], StagePlan]:
    """Stage modules of `gm` (a rewritten GraphModule) and their plan.

    `example_inputs`/`kwargs`: one micro-batch (stages are built at its shapes). Give `num_stages` or
    `cuts` (the blocks that begin a stage, e.g. ["blocks.2"]). Stage 0 takes the inputs flattened in
    `plan.inputs` order; the last returns the model's output leaves (one tensor alone, else a tuple).
    Tied weights across stages are refused. `stage_ranks` enables the rank-local cache (stage_cache.py).
    """
    _check_split(gm, num_stages, cuts, max_carried)  # before the export, which takes a while
    if stage_ranks is not None and num_stages is not None:
        check_ranks(stage_ranks, num_stages)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    static = _static(gm, args, dict(kwargs or {}))
    graph = static.graph
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    blocks, block_of = _blocks(nodes)
    starts = _cut_blocks(blocks, num_stages, cuts)
    first = block_starts(nodes, block_of)
    stage_of = _assign(nodes, first, starts)
    count = len(starts) + 1
    _refuse_shared_parameters(static, stage_of)
    carried = _carried(graph, stage_of, count)
    history = {s for n in nodes if is_attnres_op(n.target) for s in n.args[0]}
    plain = {n.args[2] for n in nodes if n.target is _DELTA}  # Delta AttnRes: the plain sums, the stream proper
    _refuse_long_history(carried, history, max_carried)
    placeholders = _tensor_inputs(graph)
    plan = StagePlan(
        stages=[[b for b in blocks if stage_of[nodes[first[b]]] == s] for s in range(count)],
        hops=[Hop(h, [_describe(v, history, stage_of, h, plain) for v in carried[h]]) for h in range(count - 1)],
        inputs=[n.name for n in placeholders],
        tokens=next((v.numel() for v in (p.meta.get("val") for p in placeholders)
                     if isinstance(v, torch.Tensor) and not v.dtype.is_floating_point), None),
    )
    cache = None
    if stage_ranks is not None:
        plan.stage_ranks = check_ranks(stage_ranks, count)
        for hop, seen in zip(plan.hops, seen_before(plan, plan.stage_ranks)):
            for v in hop.values:
                v.cached = v.name in seen
        reads, writes = cache_layout(plan, plan.stage_ranks)
        caches = {r: StageCache(r) for r in plan.stage_ranks}
        cache = [(caches[r], reads[s], writes[s]) for s, r in enumerate(plan.stage_ranks)]
    sent = [[v for v, c in zip(carried[h], plan.hops[h].values) if not c.cached] for h in range(count - 1)]
    stages = [_stage_module(static, graph, placeholders, stage_of, carried, sent, s, count, cache and cache[s])
              for s in range(count)]
    return stages, plan


def _tensor_inputs(graph: fx.Graph) -> list[fx.Node]:
    """The model's tensor inputs (stage 0's); a non-tensor input (`use_cache=False`) is fixed at
    the example's value, which the export already baked in."""
    inputs = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        if isinstance(node.meta.get("val"), torch.Tensor):
            inputs.append(node)
        elif node.users:
            raise ConfigError(f"input {node.name!r} is not a tensor but the graph reads it: pipeline stages "
                              f"pass tensors only; fix it in the model (e.g. a default) before splitting")
    return inputs


def _static(gm: fx.GraphModule, args: tuple, kwargs: dict) -> fx.GraphModule:
    """`gm` re-exported at the example's shapes (no symbolic sizes; module scopes kept)."""
    try:
        with silenced():
            static = torch.export.export(gm, args, kwargs, strict=False).module()
    except Exception as exc:  # noqa: BLE001 - the exporter's reason goes into the one line
        raise TraceError(f"could not split the rewritten model into stages: torch.export failed "
                         f"({str(exc).splitlines()[0][:200]}); pass one micro-batch the model accepts") from exc
    # the input guards ep.module() calls first read every input; a stage checks its own input shapes
    for node in [n for n in static.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        static.graph.erase_node(node)
    return static


def _blocks(nodes: list[fx.Node], marks: set[fx.Node] | None = None) -> tuple[list[str], dict[fx.Node, str]]:
    """The blocks (module scopes holding sites, at the first scope depth where sites differ) in
    graph order, and the block of each node inside one. `marks`: other nodes to find the blocks
    by instead of the sites (an original model's residual adds, for the memory profile)."""
    stacks = {n: [path for path, _ in n.meta.get("nn_module_stack", {}).values()] for n in nodes}
    sites = [stacks[n] for n in nodes if (n in marks if marks is not None else is_attnres_op(n.target))]
    depth = next((d for d in range(max(map(len, sites), default=0))
                  if len({s[d] if len(s) > d else None for s in sites}) > 1), None)
    if depth is None:
        held = "depth-attention sites" if marks is None else "residual links"
        raise ConfigError(f"the model has fewer than two blocks holding {held}: nothing to split into pipeline stages")
    block_names = {s[depth] for s in sites if len(s) > depth}
    block_of = {n: s[depth] for n, s in stacks.items() if len(s) > depth and s[depth] in block_names}
    return list(dict.fromkeys(block_of[n] for n in nodes if n in block_of)), block_of


def _check_split(gm, num_stages, cuts, max_carried) -> None:
    """One ConfigError naming the argument of split_stages that cannot work, whatever the model."""
    if not isinstance(gm, fx.GraphModule):
        raise ConfigError(f"split_stages: gm is a {type(gm).__name__}, not a torch.fx.GraphModule: pass the rewritten "
                          "model (attnres_compile.rewrite(model, inputs).graph_module)")
    if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int)):
        raise ConfigError(f"split_stages: num_stages={num_stages!r} is not a whole number")
    if cuts is not None and (isinstance(cuts, str) or not isinstance(cuts, (list, tuple))
                             or not all(isinstance(c, str) for c in cuts)):
        raise ConfigError(f"split_stages: cuts={cuts!r} is not a list of block names (e.g. ['blocks.2'])")
    if isinstance(max_carried, bool) or not isinstance(max_carried, int):
        raise ConfigError(f"split_stages: max_carried={max_carried!r} is not a whole number")
    if max_carried < 0:
        raise ConfigError(f"split_stages: max_carried={max_carried}: at least 0")


def _cut_blocks(blocks: list[str], num_stages: int | None, cuts: list[str] | None) -> list[str]:
    """The blocks that begin stages 1, 2, ...; one ConfigError line for a request that cannot be met."""
    if (num_stages is None) == (cuts is None):
        raise ConfigError("split_stages: give num_stages or cuts (the blocks that begin a stage), not both")
    if cuts is not None:
        unknown = [c for c in cuts if c not in blocks]
        if unknown:
            raise ConfigError(f"split_stages: cut {unknown[0]!r} is not a block; the blocks are "
                              f"{', '.join(blocks[:3])} ... {blocks[-1]}")
        ordered = sorted(set(cuts), key=blocks.index)
        if not ordered or ordered[0] == blocks[0]:
            raise ConfigError(f"split_stages: a cut must leave stage 0 a block: cut after {blocks[0]!r}")
        return ordered
    if not 2 <= num_stages <= len(blocks):
        raise ConfigError(f"split_stages: num_stages={num_stages}, but the model has {len(blocks)} blocks: "
                          f"use 2 to {len(blocks)} stages")
    return [blocks[round(i * len(blocks) / num_stages)] for i in range(1, num_stages)]


def block_starts(nodes: list[fx.Node], block_of: dict[fx.Node, str]) -> dict[str, int]:
    """The index in `nodes` of each block's first node (where a stage beginning with it is cut)."""
    first: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n in block_of:
            first.setdefault(block_of[n], i)
    return first


def _assign(nodes: list[fx.Node], first: dict[str, int], starts: list[str]) -> dict[fx.Node, int]:
    """Stage of every compute node: the number of stage-starting blocks whose first node comes at
    or before it (graph order is execution order, so no stage reads a later one)."""
    bounds = [first[b] for b in starts]
    return {n: sum(i >= b for b in bounds) for i, n in enumerate(nodes)}


def _refuse_shared_parameters(gm: fx.GraphModule, stage_of: dict[fx.Node, int]) -> None:
    """One line for a parameter read by two stages (under one name or two: tied weights), which
    separate processes would train as two copies."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    names: dict[int, list[str]] = {}
    used: dict[int, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            key = id(params[node.target])
            names.setdefault(key, []).append(node.target)
            used.setdefault(key, set()).update(stage_of[u] for u in node.users if u in stage_of)
    for key, stages in used.items():
        if len(stages) > 1:
            raise ConfigError(f"parameter {' = '.join(dict.fromkeys(names[key]))} is used by stages {min(stages)} and "
                              f"{max(stages)} (tied weights): untie it (e.g. tie_word_embeddings=False) or cut so "
                              f"one stage holds all its uses")


def _carried(graph: fx.Graph, stage_of: dict[fx.Node, int], count: int) -> list[list[fx.Node]]:
    """The values each hop carries, in graph order: every value made (or input) at or before the hop
    and read after it."""
    last = count - 1
    hops: list[list[fx.Node]] = [[] for _ in range(count - 1)]
    for node in graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        made = stage_of.get(node, 0)
        read = max((last if u.op == "output" else stage_of.get(u, made) for u in node.users), default=made)
        for h in range(made, read):
            hops[h].append(node)
    return hops


def _refuse_long_history(carried: list[list[fx.Node]], history: set[fx.Node], limit: int) -> None:
    for h, values in enumerate(carried):
        n = sum(v in history for v in values)
        if n > limit:
            raise ConfigError(f"hop {h}->{h + 1} would carry {n} history tensors (more than max_carried={limit}; "
                              f"Full AttnRes carries every earlier sublayer output): rewrite with variant='block' "
                              f"(e.g. num_blocks=8) to carry one sum per block")


def _stage_module(gm: fx.GraphModule, graph: fx.Graph, model_inputs: list[fx.Node], stage_of: dict[fx.Node, int],
                  carried: list[list[fx.Node]], sent: list[list[fx.Node]], s: int, count: int,
                  cache: tuple[StageCache, list[str], dict[str, int]] | None) -> fx.GraphModule:
    """Stage `s` as a GraphModule: placeholders for what hop s-1 sends (stage 0: the model's
    inputs), its own nodes, outputs for what hop s sends (last stage: the model's outputs). With
    a `cache` (this rank's, the names this stage reads from it and writes to it), the values hop
    s-1 left out come from `cache.read`, and those later stages on the rank read go to `cache.write`."""
    new, env = fx.Graph(), {}
    inputs = model_inputs if s == 0 else sent[s - 1]
    for node in inputs:
        env[node] = new.placeholder(node.name)
        env[node].meta.update(node.meta)
    if cache and cache[1]:
        by_name = {n.name: n for n in carried[s - 1]}
        read = new.call_function(cache[0].read, (s, tuple(cache[1]), tuple(env[n] for n in inputs)))
        for i, name in enumerate(cache[1]):
            env[by_name[name]] = new.call_function(operator.getitem, (read, i))
            env[by_name[name]].meta.update(by_name[name].meta)
    mine = [n for n in graph.nodes if stage_of.get(n) == s]
    for attr in dict.fromkeys(a for n in mine for a in n.all_input_nodes if a.op == "get_attr"):
        env[attr] = new.node_copy(attr)
    for node in mine:
        env[node] = new.node_copy(node, lambda a: env[a])
    if s == count - 1:
        leaves = pytree.tree_leaves(next(n for n in graph.nodes if n.op == "output").args[0])
        outs = [env[x] if isinstance(x, fx.Node) else x for x in leaves]
        new.output(outs[0] if len(outs) == 1 else tuple(outs))
    else:
        outs = tuple(_fresh(new, env[v], mine_made=v in mine) for v in sent[s])
        if cache and cache[2]:
            by_name = {n.name: n for n in carried[s]}
            written = tuple(env[by_name[name]] for name in cache[2])
            wrote = new.call_function(cache[0].write, (s, tuple(cache[2]), tuple(cache[2].values()), outs, written))
            outs = tuple(new.call_function(operator.getitem, (wrote, i)) for i in range(len(outs)))
        new.output(outs)
    module = fx.GraphModule(gm, new, class_name=f"Stage{s}")
    module.graph.lint()
    if cache:
        module.stage_cache = cache[0]
    return module


def _fresh(graph: fx.Graph, value: fx.Node, mine_made: bool) -> fx.Node:
    """`value` as a stage output that is neither a stage input nor a view (the V schedules detach
    stage outputs in place): a relayed value is cloned, a value made here goes through
    `fresh_tensor` (whether an op returns a view shows only at run time: `aten.linear` on a 3-D input
    returns one)."""
    out = graph.call_function(aten.clone.default if not mine_made else fresh_tensor, (value,))
    out.meta.update({k: value.meta[k] for k in ("val", "tensor_meta", "nn_module_stack") if k in value.meta})
    return out


def fresh_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when it is a view."""
    return t.clone() if t._is_view() else t


def _describe(node: fx.Node, history: set[fx.Node], stage_of: dict[fx.Node, int], hop: int,
              plain: set[fx.Node] = frozenset()) -> Carried:
    val = node.meta.get("val")
    shape = tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else ()
    size = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
    if node.op == "placeholder":
        kind = "input"
    elif node in history:
        kind = "history"
    elif is_attnres_op(node.target) or node in plain:  # a site's output; a Delta site's plain sum too
        kind = "stream"
    else:
        kind = "other"
    made = stage_of.get(node, 0)
    return Carried(node.name, kind, shape, str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else "",
                   size, made, made < hop)
