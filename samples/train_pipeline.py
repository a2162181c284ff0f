"""A rewritten model trained with pipeline parallelism: torch.distributed.pipelining's manual
`PipelineStage` and its schedules (GPipe, 1F1B, Interleaved1F1B, ZBV), gloo, CPU.

Every process builds the same seeded GPT, rewrites it to AttnRes, and splits it with
`attnres_compile.distributed.split_stages` into one stage per rank (GPipe, 1F1B) or two (the
interleaved and V schedules: rank r holds stages r and r + world, or r and 2·world − 1 − r, as
`schedule_stage_ranks` reads from torch); with `--cache` a hop leaves out what the receiving rank
already holds (the rank-local cache). The
schedule runs `steps` optimizer steps of `micro` micro-batches; `reference` trains the same
rewritten model in one process on the same micro-batches (mean of their losses), so the
per-micro-batch losses and the pseudo-query gradients must agree to float tolerance.

    python -m samples.train_pipeline --schedules gpipe 1f1b interleaved zbv --world 2 --steps 3
    python -m samples.train_pipeline --schedules interleaved zbv --world 2 --cache  # rank-local cache
    python -m samples.train_pipeline --schedules 1f1b --world 4 --dp 2     # PP x FSDP2: 2 stages x 2 ranks
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

from attnres_compile import AttnResConfig, rewrite
from attnres_compile.distributed import schedule_stage_ranks, split_stages
from samples.models import GPT

SIZE = dict(vocab=64, dim=32, layers=4, heads=2, seq=16, batch=8, micro=4)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "interleaved-zb")


def setup(variant: str, steps: int, seed: int = 0):
    """The rewritten model and `steps` batches (x, y) of SIZE["batch"] sequences, all seeded."""
    torch.manual_seed(seed)
    model = GPT(vocab=SIZE["vocab"], dim=SIZE["dim"], layers=SIZE["layers"], heads=SIZE["heads"], max_len=SIZE["seq"]).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, SIZE["vocab"], (steps, SIZE["batch"], SIZE["seq"] + 1), generator=gen)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    return rewrite(model, (batches[0][0],), config_of(variant)).graph_module, batches


def config_of(variant: str) -> AttnResConfig:
    """The rewrite of a variant name: "full", "block" (N=2), "delta" or "delta-block" (Delta AttnRes, N=2)."""
    name, blocks = variant.removesuffix("-block"), 2 if variant.endswith("block") else None
    return AttnResConfig(variant=name, num_blocks=blocks)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _query_grads(modules) -> dict[str, list[float]]:
    """The pseudo-query gradients (gathered in full from FSDP2 shards: every data-parallel rank calls this)."""
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten().tolist()
            for m in modules for n, p in m.named_parameters() if n.startswith("attnres.") and p.grad is not None}


def reference(variant: str = "block", steps: int = 3, lr: float = 1e-2, dp: int = 1) -> dict:
    """One process: per step the micro-batch losses and the pseudo-query gradients of their mean
    (`dp` data-parallel shards of each batch, each cut into SIZE["micro"] micro-batches)."""
    gm, batches = setup(variant, steps)
    opt = torch.optim.SGD(gm.parameters(), lr=lr)
    losses, grads = [], []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        mb = [loss_fn(gm(a), b) for xs, ys in zip(x.chunk(dp), y.chunk(dp))
              for a, b in zip(xs.chunk(SIZE["micro"]), ys.chunk(SIZE["micro"]))]
        (sum(mb) / len(mb)).backward()
        losses.append([v.item() for v in mb])
        grads.append(_query_grads([gm]))
        opt.step()
    return {"losses": losses, "grads": grads}


def _schedule_class(schedule: str):
    from torch.distributed import pipelining as pp

    return {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B, "interleaved": pp.ScheduleInterleaved1F1B,
            "zbv": pp.ScheduleZBVZeroBubble, "interleaved-zb": pp.ScheduleInterleavedZeroBubble}[schedule]


def counting_stage():
    """PipelineStage that adds up the bytes of the forward sends it posts (what crosses the hop)."""
    from torch.distributed.pipelining import PipelineStage

    class CountingStage(PipelineStage):
        sent = 0

        def get_fwd_send_ops(self, fwd_chunk_id: int):
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops

    return CountingStage


def _train(schedule: str, variant: str, steps: int, lr: float, rank: int, world: int, dp: int, cache: bool) -> dict:
    """This rank's part of pipeline training: its stages (sharded over `dp` data-parallel ranks with
    FSDP2 when dp > 1, on a (pp, dp) device mesh) and its share of every batch; with `cache`, the
    stages leave out of each hop what the receiving rank already holds (rank-local cache)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    stage_cls = counting_stage()
    gm, batches = setup(variant, steps)
    pp_size, pp_rank, dp_rank, group = world // dp, rank, 0, None
    if dp > 1:
        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
        pp_rank, dp_rank, group = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["pp"].get_group()
    batches = [(x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]) for x, y in batches]
    cls = _schedule_class(schedule)
    count = pp_size * (1 if schedule in ("gpipe", "1f1b") else 2)
    ranks = schedule_stage_ranks(cls, pp_size, count)
    ids = [s for s, r in enumerate(ranks) if r == pp_rank]
    micro_batch = batches[0][0].chunk(SIZE["micro"])[0]
    modules, plan = split_stages(gm, (micro_batch,), num_stages=count, stage_ranks=ranks if cache else None)
    mine = [modules[i] for i in ids]
    if dp > 1:
        for module in mine:
            fully_shard(module, mesh=mesh["dp"])
    stages = [stage_cls(modules[i], i, count, torch.device("cpu"), group=group) for i in ids]
    sched = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=SIZE["micro"], loss_fn=loss_fn)
    opt = torch.optim.SGD([p for m in mine for p in m.parameters()], lr=lr)
    losses, grads = [], []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        out: list[torch.Tensor] = []
        first, last = 0 in ids, count - 1 in ids
        sched.step(*((x,) if first else ()), target=y if last else None, losses=out if last else None)
        losses.append([v.item() for v in out] if last else None)
        grads.append(_query_grads(mine))
        opt.step()
    # forward bytes each stage sent per micro-batch (a stage whose next stage is on its own rank sends none)
    sent = {i: st.sent / (steps * SIZE["micro"]) for i, st in zip(ids, stages)}
    held = len(mine[0].stage_cache) if cache else 0  # cache entries left after the steps (none: all read)
    return {"losses": losses, "grads": grads, "plan": plan.to_dict(), "sent": sent, "dp_rank": dp_rank, "held": held}


def _worker(rank: int, world: int, schedules: list[str], variant: str, steps: int, lr: float, dp: int, cache: bool,
            rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        results = {s: _train(s, variant, steps, lr, rank, world, dp, cache) for s in schedules}
        Path(f"{out}.{rank}").write_text(json.dumps(results))
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def traced_frontend(variant: str = "block"):
    """torch's own traced frontend on the same model, the way a user would try first: the rewritten
    graph with `pipe_split` markers where split_stages would cut, through `pipelining.pipeline`.
    Returns the Pipe; its stages read block sums straight from stage 0 (skip connections)."""
    from torch.distributed import pipelining as pp

    from attnres_compile.distributed import pipeline as stages_module

    gm, batches = setup(variant, 1)
    micro_batch = batches[0][0].chunk(SIZE["micro"])[0]
    static = stages_module._static(gm, (micro_batch,), {})
    nodes = [n for n in static.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    blocks, block_of = stages_module._blocks(nodes)
    first = stages_module.block_starts(nodes, block_of)
    for block in blocks[1:]:
        with static.graph.inserting_before(nodes[first[block]]):
            static.graph.call_function(torch.ops.pippy._pipe_split.default, ())
    static.recompile()
    return pp.pipeline(static, mb_args=(micro_batch,)), batches


def _traced_worker(rank: int, world: int, rendezvous: str, out: str) -> None:
    from torch.distributed.pipelining import Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        pipe, batches = traced_frontend()
        schedule = Schedule1F1B(pipe.build_stage(rank, torch.device("cpu")), n_microbatches=SIZE["micro"],
                                loss_fn=loss_fn)
        x, y = batches[0]
        try:
            schedule.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
            error = None
        except Exception as exc:  # noqa: BLE001 - what torch raises is the result
            error = f"{type(exc).__name__}: {exc}"
        Path(f"{out}.{rank}").write_text(json.dumps(error))
    finally:
        dist.destroy_process_group()


def traced_frontend_errors(world: int = 4) -> list[str | None]:
    """Each rank's error when 1F1B runs torch's traced-frontend stages of the model (`world` stages)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_traced_worker, args=(world, os.path.join(tmp, "rendezvous"), out), nprocs=world)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def run(schedules=SCHEDULES, world: int = 2, variant: str = "block", steps: int = 3, lr: float = 1e-2,
        dp: int = 1, cache: bool = False) -> dict:
    """Train under each schedule with `world` gloo processes (world // dp pipeline ranks × `dp`
    FSDP2 ranks, the rank-local cache with `cache`); per schedule the micro-batch losses (from
    the ranks holding the last stage, in data-parallel order), the pseudo-query gradients of all
    ranks merged, rank 0's plan, the forward bytes each stage sent per micro-batch and the cache
    entries the ranks held after the steps."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_worker, args=(world, list(schedules), variant, steps, lr, dp, cache, os.path.join(tmp, "rendezvous"), out),
                 nprocs=world)
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    merged = {}
    for s in schedules:
        last = sorted((r[s]["dp_rank"], r[s]["losses"]) for r in ranks if r[s]["losses"][0] is not None)
        losses = [[v for _, rank_losses in last for v in rank_losses[i]] for i in range(steps)]
        grads = [{k: v for r in ranks for k, v in r[s]["grads"][i].items()} for i in range(steps)]
        sent = {int(k): v for r in ranks for k, v in r[s]["sent"].items()}
        merged[s] = {"losses": losses, "grads": grads, "plan": ranks[0][s]["plan"], "sent": sent,
                     "held": sum(r[s]["held"] for r in ranks)}
    return merged


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--variant", choices=["full", "block", "delta", "delta-block"], default="block")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dp", type=int, default=1, help="FSDP2 data-parallel ranks per stage (world = stages x dp)")
    p.add_argument("--cache", action="store_true",
                   help="rank-local cache: a hop leaves out what the receiving rank already holds (interleaved, zbv)")
    args = p.parse_args(argv)
    ref = reference(args.variant, args.steps, dp=args.dp)
    results = run(args.schedules, args.world, args.variant, args.steps, dp=args.dp, cache=args.cache)
    print(f"{'schedule':<12}{'max |loss diff|':>16}{'max |query grad diff|':>22}  forward bytes sent per micro-batch by stage (plan)")
    for s, r in results.items():
        dl = max(abs(a - b) for sa, sb in zip(r["losses"], ref["losses"]) for a, b in zip(sa, sb))
        dg = max(abs(a - b) for ga, gb in zip(r["grads"], ref["grads"]) for k in gb for a, b in zip(ga[k], gb[k]))
        hops = {h["index"]: h["sent_bytes"] for h in r["plan"]["hops"]}
        sent = " ".join(f"{i}:{int(b)}({hops.get(i, 0)})" for i, b in sorted(r["sent"].items()))
        print(f"{s:<12}{dl:>16.2e}{dg:>22.2e}  {sent}")
    return {"reference": ref, **results}


if __name__ == "__main__":
    main()
