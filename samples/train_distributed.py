"""The rewritten model trained under torch.distributed: DDP and FSDP2 (`fully_shard`), gloo, CPU.

Every process builds the same seeded GPT, rewrites it to AttnRes (traced at the whole global
batch: the rewritten module takes any batch size, like the original) and trains it on its shard
of each global batch. `reference` trains the same rewritten model in one process on the whole
global batches, so the losses and the final pseudo-queries must agree to float tolerance.

Modes: `ddp` and `fsdp` wrap the flat GraphModule (FSDP2 on the root only: its graph reads every
parameter through get_attr and calls no submodule). `fsdp_blocks`, `fsdp_offload` and
`fsdp_checkpoint` train the same model as called blocks (attnres_compile.distributed.called_blocks):
`fully_shard` per block and on the root, the last two with `CPUOffloadPolicy` and with every block
checkpointed (sites recomputed, `SitePolicy(save_sites=False)`). Every other step is watched by a
`DepthMonitor` (its stats all_reduced over the processes: those of the whole global batch).

    python -m samples.train_distributed --modes ddp fsdp fsdp_blocks --world 2 --steps 5
"""

from __future__ import annotations

import argparse
import copy
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
from attnres_compile.distributed import SitePolicy, block_names, called_blocks, checkpoint_blocks
from attnres_compile.monitor import DepthMonitor
from attnres_compile.ops.depth_attention import is_attnres_op
from samples.models import GPT

SIZE = dict(vocab=64, dim=32, layers=2, heads=2, seq=16, micro=4)
MODES = ("ddp", "fsdp", "fsdp_blocks", "fsdp_offload", "fsdp_checkpoint")
WATCH_EVERY = 2  # the monitor watches steps 0, 2, ...


def setup(variant: str, steps: int, world: int, seed: int = 0):
    """The rewritten model and `steps` global batches (x, y) of `world * micro` sequences, all seeded."""
    torch.manual_seed(seed)
    model = GPT(vocab=SIZE["vocab"], dim=SIZE["dim"], layers=SIZE["layers"], heads=SIZE["heads"], max_len=SIZE["seq"]).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, SIZE["vocab"], (steps, world * SIZE["micro"], SIZE["seq"] + 1), generator=gen)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    config = AttnResConfig(variant=variant, num_blocks=2 if variant == "block" else None)
    gm = rewrite(model, (batches[0][0],), config).graph_module
    return gm, batches


def _step(gm, opt, x, y) -> torch.Tensor:
    """One optimiser step on the mean loss over the batch (x, y); returns that loss."""
    loss = F.cross_entropy(gm(x).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def _queries(gm) -> dict[str, list[float]]:
    out = {}
    for name, p in gm.named_parameters():
        if name.startswith("attnres."):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().tolist()
    return out


def _watched(module, opt, batches, shard) -> tuple[list[float], list[dict]]:
    """Train `module` on `shard(x), shard(y)` of each global batch, watching every WATCH_EVERY-th
    step; (losses, the monitor's history)."""
    monitor, losses = DepthMonitor(module, every=WATCH_EVERY), []
    for step, (x, y) in enumerate(batches):
        with monitor.watch(step):
            loss = _step(module, opt, shard(x), shard(y))
        if dist.is_initialized():
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses, monitor.history


def reference(variant: str = "full", steps: int = 5, world: int = 2, lr: float = 1e-2) -> dict:
    """Single-process training on the whole global batches: {"losses", "queries", "depth" (the
    monitor's history)}."""
    gm, batches = setup(variant, steps, world)
    losses, depth = _watched(gm, torch.optim.Adam(gm.parameters(), lr=lr), batches, lambda t: t)
    return {"losses": losses, "queries": _queries(gm), "depth": depth}


def _wrap(mode: str, gm, example: torch.Tensor, world: int) -> tuple[torch.nn.Module, dict]:
    """`gm` wrapped for `mode`, and what the mode reports (blocks sharded, site recompute counts)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(gm), {}
    mesh = init_device_mesh("cpu", (world,))
    if mode == "fsdp":
        return fully_shard(gm, mesh=mesh), {}
    module, info, policy = called_blocks(gm, (example,)), {}, None
    if mode == "fsdp_checkpoint":
        policy = SitePolicy(save_sites=False)
        checkpoint_blocks(module, policy)
        info["policy"] = policy
    offload = CPUOffloadPolicy(pin_memory=False) if mode != "fsdp_blocks" else OffloadPolicy()
    info["blocks"] = block_names(module)
    for name in info["blocks"]:
        fully_shard(module.get_submodule(name), mesh=mesh, offload_policy=offload)
    fully_shard(module, mesh=mesh, offload_policy=offload)
    # every parameter a sharded DTensor, each block's in its own FSDP group (gathered by that block's call)
    info["sharded"] = all(isinstance(p, DTensor) and p.placements[0].is_shard() for p in module.parameters())
    return module, info


def _train(mode: str, gm, batches, rank: int, world: int, lr: float) -> dict:
    """Train `gm` wrapped for `mode` on this rank's shards; {"losses" (averaged over ranks), "queries",
    "depth" (reduced over ranks)} and, for the called-block modes, the blocks sharded and the sites recomputed."""
    wrapped, info = _wrap(mode, gm, batches[0][0], world)
    opt = torch.optim.Adam(wrapped.parameters(), lr=lr)
    losses, depth = _watched(wrapped, opt, batches, lambda t: t.chunk(world)[rank])
    out = {"losses": losses, "queries": _queries(wrapped.module if mode == "ddp" else wrapped), "depth": depth}
    if "blocks" in info:
        out["blocks"], out["sharded"] = info["blocks"], info["sharded"]
    if "policy" in info:
        out["recomputed"], out["site_calls"] = info["policy"].recomputed, len(batches) * _sites(gm)
    return out


def _sites(gm) -> int:
    return sum(is_attnres_op(n.target) for n in gm.graph.nodes)


def _worker(rank: int, world: int, modes: list[str], variant: str, steps: int, lr: float, rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        base, batches = setup(variant, steps, world)
        results = {mode: _train(mode, copy.deepcopy(base), batches, rank, world, lr) for mode in modes}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        # Free the wrapped modules (FSDP2 state sits in reference cycles) while the interpreter is alive:
        # gloo work objects destroyed during interpreter shutdown abort the process.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(modes=MODES, world: int = 2, variant: str = "full", steps: int = 5, lr: float = 1e-2) -> dict:
    """Train under each of `modes` with `world` gloo processes (spawned); {mode: {"losses", "queries"}} from rank 0."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, list(modes), variant, steps, lr, os.path.join(tmp, "rendezvous"), out), nprocs=world)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--variant", choices=["full", "block"], default="full")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    ref = reference(args.variant, args.steps, args.world)
    results = run(args.modes, args.world, args.variant, args.steps)
    print(f"{'step':>4}{'single':>12}" + "".join(f"{m:>12}" for m in args.modes))
    for i, loss in enumerate(ref["losses"]):
        print(f"{i:>4}{loss:>12.6f}" + "".join(f"{results[m]['losses'][i]:>12.6f}" for m in args.modes))
    return {"reference": ref, **results}


if __name__ == "__main__":
    main()
