"""A converted pretrained LLM trained with pipeline parallelism: SmolLM2-135M (samples/smollm2.py),
rewritten to Block AttnRes, split into stages by `attnres_compile.distributed.split_stages`, and
trained with torch.distributed.pipelining (gloo, one process per stage) against the same steps in
one process on real text (pydoc topics).

Prints the plan (what each hop carries, bytes per token), the per-micro-batch losses of both, the
largest pseudo-query gradient difference, seconds per step and each stage's parameter count; with
`--out`, writes them as JSON. SmolLM2 ties its head to the token embedding: pipeline stages cannot
share a parameter, so the head gets its own copy first (`smollm2.load(untie=True)`).

    python benchmarks/pipeline_pretrained.py --stages 2 --schedule 1f1b --blocks 8 --steps 2 --out pp.json
    python benchmarks/pipeline_pretrained.py --stages 4 --schedule zbv --cache --blocks 8 --steps 2  # 2 ranks x 2 stages
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.pipelining.schedules import get_schedule_class  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from attnres_compile import AttnResConfig, rewrite  # noqa: E402
from attnres_compile.distributed import schedule_stage_ranks, split_stages  # noqa: E402
from samples import smollm2  # noqa: E402
from samples.train_pipeline import counting_stage  # noqa: E402

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zbv": "ZBVZeroBubble"}


def batches(tokenizer, steps: int, batch: int, seq: int):
    ids = tokenizer(smollm2.text(200_000), return_tensors="pt")["input_ids"][0]
    need = steps * batch * (seq + 1)
    rows = ids[:need].view(steps, batch, seq + 1)
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


def loss_fn(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def build(blocks: int, micro_batch: torch.Tensor):
    model, tokenizer = smollm2.load(untie=True)
    inputs = {"input_ids": micro_batch, "attention_mask": torch.ones_like(micro_batch), "use_cache": False}
    gm = rewrite(model, inputs, AttnResConfig(variant="block", num_blocks=blocks)).graph_module
    return gm, tokenizer, inputs


def _grads(modules):
    return {n: p.grad.clone() for m in modules for n, p in m.named_parameters() if n.startswith("attnres.") and p.grad is not None}


def reference(gm, data, micro: int, lr: float):
    opt = torch.optim.SGD(gm.parameters(), lr=lr)
    losses, grads, seconds = [], [], []
    for x, y in data:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        mb = [loss_fn(_logits(gm(input_ids=a, attention_mask=torch.ones_like(a), use_cache=False)), b)
              for a, b in zip(x.chunk(micro), y.chunk(micro))]
        (sum(mb) / micro).backward()
        losses.append([v.item() for v in mb])
        grads.append(_grads([gm]))
        opt.step()
        seconds.append(time.perf_counter() - start)
    return losses, grads, seconds


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


def _worker(rank, world, args, rendezvous, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        model, tokenizer = smollm2.load(untie=True)
        data = batches(tokenizer, args.steps, args.batch, args.seq)
        micro_batch = data[0][0].chunk(args.micro)[0]
        gm, _, inputs = build(args.blocks, micro_batch)
        del model
        cls = get_schedule_class(SCHEDULES[args.schedule])
        stage_ranks = schedule_stage_ranks(cls, world, args.stages)
        ids = [s for s, r in enumerate(stage_ranks) if r == rank]
        modules, plan = split_stages(gm, (), {k: v for k, v in inputs.items()}, num_stages=args.stages,
                                     stage_ranks=stage_ranks if args.cache else None)
        mask = inputs["attention_mask"]
        mine = [modules[i] for i in ids]
        stages = [counting_stage()(modules[i], i, args.stages, torch.device("cpu")) for i in ids]
        sched = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=args.micro, loss_fn=loss_fn)
        opt = torch.optim.SGD([p for m in mine for p in m.parameters()], lr=args.lr)
        first, last = 0 in ids, args.stages - 1 in ids
        losses, grads, seconds = [], [], []
        for x, y in data:
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            got: list = []
            sched.step(*((x, mask.repeat(args.micro, 1)) if first else ()), target=y if last else None,
                       losses=got if last else None)
            losses.append([v.item() for v in got] if last else None)
            grads.append({k: v.tolist() for k, v in _grads(mine).items()})
            opt.step()
            seconds.append(time.perf_counter() - start)
        params = {i: sum(p.numel() for p in modules[i].parameters()) for i in ids}
        sent = {i: st.sent / (args.steps * args.micro) for i, st in zip(ids, stages)}
        Path(f"{out}.{rank}").write_text(json.dumps({"losses": losses, "grads": grads, "seconds": seconds,
                                                     "params": params, "sent": sent, "plan": plan.to_dict(),
                                                     "table": plan.table()}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, default=2, help="stages (one process each, or two under interleaved and zbv)")
    p.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    p.add_argument("--cache", action="store_true", help="rank-local cache: hops leave out what the receiving rank holds")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    world = args.stages // (2 if args.schedule in ("interleaved", "zbv") else 1)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        start = time.perf_counter()
        mp.spawn(_worker, args=(world, args, os.path.join(tmp, "rendezvous"), out), nprocs=world)
        spawn_s = time.perf_counter() - start
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    torch.set_num_threads(1)
    model, tokenizer = smollm2.load(untie=True)
    data = batches(tokenizer, args.steps, args.batch, args.seq)
    gm, _, _ = build(args.blocks, data[0][0].chunk(args.micro)[0])
    ref_losses, ref_grads, ref_seconds = reference(gm, data, args.micro, args.lr)
    pp_losses = next(r["losses"] for r in ranks if r["losses"][0] is not None)
    loss_diff = max(abs(a - b) for ra, rb in zip(pp_losses, ref_losses) for a, b in zip(ra, rb))
    grad_diff, grad_max, step_diffs = 0.0, 0.0, []
    for step, want in enumerate(ref_grads):
        got = {k: v for r in ranks for k, v in r["grads"][step].items()}
        diffs = {k: (torch.tensor(got[k]) - w).abs().max().item() for k, w in want.items()}
        grad_diff = max(grad_diff, *diffs.values())
        grad_max = max(grad_max, *(w.abs().max().item() for w in want.values()))
        worst = max(diffs, key=lambda k: diffs[k] / want[k].abs().max().item())  # relative to the query's largest
        step_diffs.append({"max": max(diffs.values()), "worst_relative": worst,
                           "relative": diffs[worst] / want[worst].abs().max().item()})
    result = {"args": vars(args), "plan": ranks[0]["plan"], "pipeline_losses": pp_losses, "reference_losses": ref_losses,
              "max_loss_diff": loss_diff, "max_query_grad_diff": grad_diff, "max_query_grad": grad_max,
              "query_grad_diff_per_step": step_diffs,
              "pipeline_seconds_per_step": [max(r["seconds"][i] for r in ranks) for i in range(args.steps)],
              "reference_seconds_per_step": ref_seconds,
              "params_per_stage": [p for _, p in sorted((int(i), p) for r in ranks for i, p in r["params"].items())],
              "sent_per_micro_batch": {int(i): b for r in ranks for i, b in r["sent"].items()},
              "spawned_run_seconds": spawn_s}
    print(ranks[0]["table"])
    print(f"stages {args.stages} on {world} ranks ({args.schedule}{', cache' if args.cache else ''}), Block N={args.blocks}, micro-batches {args.micro} x {args.batch // args.micro} x {args.seq} tokens")
    print(f"params per stage: {result['params_per_stage']}")
    print(f"forward bytes sent per micro-batch by stage: {dict(sorted(result['sent_per_micro_batch'].items()))}")
    for i, (a, b) in enumerate(zip(pp_losses, ref_losses)):
        print(f"step {i}: pipeline {['%.6f' % v for v in a]}  one process {['%.6f' % v for v in b]}")
    print(f"max |loss diff| {loss_diff:.2e}; max |query grad diff| {grad_diff:.2e} (largest query grad {grad_max:.2e})")
    for i, d in enumerate(step_diffs):
        print(f"step {i}: max |query grad diff| {d['max']:.2e}; relative to its query's largest at most "
              f"{d['relative']:.2e} ({d['worst_relative']})")
    print(f"seconds per step: pipeline {['%.2f' % s for s in result['pipeline_seconds_per_step']]}, "
          f"one process {['%.2f' % s for s in ref_seconds]}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
