"""The memory planner's prediction against the measured per-rank peak of real pipeline training (CPU, gloo).

A tiny HF Llama (untied head) rewritten to Block AttnRes is split by `split_stages` into one
stage per rank and trained with torch's `PipelineStage` and a schedule (GPipe or 1F1B) and Adam.
Each rank counts the bytes of the tensor storages alive (`LiveBytes`, a dispatch mode: on CPU torch
keeps no allocator statistics, and RSS mixes in the interpreter, the libraries and freed pages
the allocator keeps) from before the first step, its parameters included, and reports the peak of
its last step: parameters, gradients, Adam's state, torch's receive and gradient buffers, the
micro-batches in flight and the backward's temporaries. `predict` is `plan_memory` on a one-process
profile of the original model; it never sees the pipeline run.

    python -m samples.pipeline_memory --schedules 1f1b gpipe --blocks 2 --micro 4
    python -m samples.pipeline_memory --factory smollm2 --blocks 4 --micro 4 --out benchmarks/runs/distributed/smollm2-memory.json
    attnres-compile inspect samples.pipeline_memory:smollm2_micro_batch --budget 3GiB --stages 6 --schedule interleaved
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

SIZE = dict(layers=4, hidden=64, intermediate=128, heads=2, vocab=128, seq=64, micro_batch=2)


def model_and_inputs():
    """The tiny Llama (eval mode, untied head: stages must not share a weight) and one micro-batch."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=SIZE["layers"], hidden_size=SIZE["hidden"],
                         intermediate_size=SIZE["intermediate"], num_attention_heads=SIZE["heads"],
                         num_key_value_heads=SIZE["heads"], vocab_size=SIZE["vocab"],
                         max_position_embeddings=SIZE["seq"], tie_word_embeddings=False)
    ids = torch.randint(0, SIZE["vocab"], (SIZE["micro_batch"], SIZE["seq"]))
    return tf.LlamaForCausalLM(cfg).eval(), {"input_ids": ids, "use_cache": False}


def profile(blocks: int, factory: str = "tiny"):
    """The one-process profile of the model (the planner's input), for a Block N=`blocks` rewrite."""
    from attnres_compile import AttnResConfig
    from attnres_compile.fx.pipeline import inspect_traced
    from attnres_compile.fx.trace import trace
    from attnres_compile.distributed.memory_profile import profile_model

    model, inputs = FACTORIES[factory]()
    traced = trace(model, inputs)
    report = inspect_traced(traced, AttnResConfig(variant="block", num_blocks=blocks))
    return profile_model(traced.graph_module, (), traced.kwargs, report["chains"][0])


def predict(measured_profile, schedule: str, blocks: int, micro: int, world: int = 2, budget: int = 2**40):
    """The planner's `MemoryPlan` for Block N=`blocks` on `world` stages (one per rank)."""
    from attnres_compile.distributed.planner import plan_memory

    return plan_memory(measured_profile, budget, world, schedule=schedule, micro_batches=micro, num_blocks=blocks)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _stage_module(blocks: int, rank: int, world: int, factory: str = "tiny") -> tuple[torch.nn.Module, tuple, int]:
    """This rank's stage of the model rewritten to Block N=`blocks`, in training mode; the shape of
    one micro-batch of token ids and the vocabulary size."""
    from attnres_compile import AttnResConfig, rewrite
    from attnres_compile.distributed import split_stages

    model, inputs = FACTORIES[factory]()
    gm = rewrite(model, inputs, AttnResConfig(variant="block", num_blocks=blocks), verify_outputs=False).graph_module
    stage = split_stages(gm, (), inputs, num_stages=world)[0][rank].train()
    return stage, tuple(inputs["input_ids"].shape), model.config.vocab_size


def _measure(built: tuple, schedule: str, micro: int, rank: int, world: int, steps: int) -> dict:
    """Train `module` as stage `rank` for `steps` steps under a fresh schedule and Adam; the live
    bytes before the last step and the peak during it (forward, backward and the optimizer step)."""
    from torch.distributed import pipelining as pp

    from attnres_compile.distributed.memory_profile import LiveBytes

    module, (rows, seq), vocab = built
    stage = pp.PipelineStage(module, rank, world, torch.device("cpu"))
    sched = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}[schedule](stage, n_microbatches=micro, loss_fn=loss_fn)
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    module.zero_grad(set_to_none=True)
    live = LiveBytes()
    live.track(list(module.parameters()), list(module.buffers()))
    with live:
        for _ in range(steps):
            x = torch.randint(0, vocab, (rows * micro, seq), generator=gen)
            opt.zero_grad(set_to_none=True)
            live.reset_peak()
            before = live.live
            sched.step(*((x,) if rank == 0 else ()), target=x if rank == world - 1 else None)
            opt.step()
    return {"before": before, "peak": live.peak}


def _worker(rank: int, world: int, runs: list, steps: int, factory: str, rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        modules = {blocks: _stage_module(blocks, rank, world, factory) for blocks in {b for _, b, _ in runs}}
        results = [_measure(modules[blocks], schedule, micro, rank, world, steps) for schedule, blocks, micro in runs]
        Path(f"{out}.{rank}").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(runs: list[tuple[str, int, int]], world: int = 2, steps: int = 2, factory: str = "tiny") -> list[list[dict]]:
    """Per run (schedule, N, micro-batches), per rank: the live bytes before its last step and the
    peak during it (forward, backward and the optimizer step)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_worker, args=(world, runs, steps, factory, os.path.join(tmp, "rendezvous"), out), nprocs=world)
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    return [[ranks[r][i] for r in range(world)] for i in range(len(runs))]


def compare(runs: list[tuple[str, int, int]], world: int = 2, profiles: dict | None = None,
            factory: str = "tiny") -> list[dict]:
    """Predicted and measured peak per run and rank, and their relative difference (`profiles`:
    {N: profile} already made)."""
    measured = measure(runs, world, factory=factory)
    profiles = {blocks: (profiles or {}).get(blocks) or profile(blocks, factory) for blocks in {b for _, b, _ in runs}}
    rows = []
    for (schedule, blocks, micro), got in zip(runs, measured):
        plan = predict(profiles[blocks], schedule, blocks, micro, world)
        for r, m in zip(plan.ranks, got):
            rows.append({"schedule": schedule, "blocks": blocks, "micro": micro, "rank": r.rank, "predicted": r.peak,
                         "measured": m["peak"], "error": r.peak / m["peak"] - 1,
                         "plan": plan.to_dict()["ranks"][r.rank]})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedules", nargs="+", choices=["gpipe", "1f1b"], default=["1f1b", "gpipe"])
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--factory", choices=sorted(FACTORIES), default="tiny",
                   help="tiny: the 4-layer Llama; smollm2: SmolLM2-135M, 2 x 128 tokens per micro-batch")
    p.add_argument("--out", help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    rows = compare([(s, args.blocks, args.micro) for s in args.schedules], factory=args.factory)
    if args.out:
        Path(args.out).write_text(json.dumps({"factory": args.factory, "rows": rows}, indent=1) + "\n")
    print(f"{'schedule':<9}{'N':>3}{'micro':>6}{'rank':>5}{'predicted B':>13}{'measured B':>12}{'error':>8}")
    for row in rows:
        print(f"{row['schedule']:<9}{row['blocks']:>3}{row['micro']:>6}{row['rank']:>5}{row['predicted']:>13}"
              f"{row['measured']:>12}{row['error']:>+8.1%}")
    return rows



def smollm2_micro_batch():
    """(model, one micro-batch) for `inspect --budget` on a real pretrained model: SmolLM2-135M
    (samples/smollm2.py, its head untied as stages need), 2 rows of 128 tokens of pydoc text."""
    from samples import smollm2

    model, tokenizer = smollm2.load(untie=True)
    ids = tokenizer(smollm2.text(20_000), return_tensors="pt")["input_ids"][0][:256].view(2, 128)
    return model, {"input_ids": ids, "use_cache": False}


FACTORIES = {"tiny": model_and_inputs, "smollm2": smollm2_micro_batch}


if __name__ == "__main__":
    main()
