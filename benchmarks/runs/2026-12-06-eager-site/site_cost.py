"""What a Block(8) site costs in eager torch against the residual add it replaced (issue 50, item 2).

The model is `bench model`'s Llama (transformers LlamaConfig, width 256, 12 layers = 24 sublayers,
4 heads, seed 0, batch 1, 128 tokens), exported, rewritten Block(8) by `attnres_compile.rewrite`
and exported again (bench/model.py make_variants), run as the benchmark's worker runs it
(bench/model_worker.py: the forward under no_grad on `two_phase(module)`, the training step's
forward + cross-entropy + backward on the module as saved), at 1 thread:

  1. torch.profiler over one call per variant: events and self CPU time by op (original vs Block);
  2. per site, in the running model (not the profiler): the fused kernels' `forward` / `backward`
     (kernels/fused.py) split into the TVM kernel call and what is around it (key and thread count,
     the output allocations, the argument list), on `time.thread_time` (the clock costs ~1.2 us a read);
  3. the same calls warm, in a loop on one site's tensors, beside `a + b` (the add a site replaced);
     "through the dispatcher" is the op's OpOverload without its eager shortcut (`._op`). On this
     code both grad lines take the dispatcher; site_cost.txt was made with commit 1e84b49, whose
     shortcut (reverted, README.md) let the first skip it.

    python benchmarks/runs/2026-12-06-eager-site/site_cost.py > site_cost.txt
"""

from __future__ import annotations

import collections
import statistics
import time
import timeit

import torch

import attnres_compile
from attnres_compile.ops import depth_attention as op
from attnres_compile.bench.model.measure import make_inputs, make_model, make_variants
from attnres_compile.kernels import fused

torch.set_num_threads(1)
ARGS = tuple(torch.from_numpy(a) for a in make_inputs(1, 128).values())
LABELS = torch.roll(ARGS[0], -1, dims=-1)


def programs():
    variants = make_variants(make_model("llama", 12, 256, 128), ARGS, 8)
    return {v.name: v.program for v in variants if v.name != "full"}


def runners(program):
    infer = attnres_compile.two_phase(program.module()).graph_module
    train = program.module()
    params = list(train.parameters())

    def forward():
        with torch.no_grad():
            return infer(*ARGS)

    def step():
        logits = train(*ARGS)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), LABELS.reshape(-1)).backward()
        for p in params:
            p.grad = None
    return {"forward": forward, "train": step}


def profile(runs: dict) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    print("## 1. torch.profiler, one call each after 3 warm-up calls (self CPU time, profiler on)")
    for kind in ("forward", "train"):
        tables = {}
        for name, run in runs.items():
            for _ in range(3):
                run[kind]()
            with prof(activities=[ProfilerActivity.CPU]) as p:
                run[kind]()
            tables[name] = {e.key: (e.count, e.self_cpu_time_total) for e in p.key_averages()}
        o, b = tables["original"], tables["block"]
        print(f"\n{kind}: events original {sum(c for c, _ in o.values())}, block {sum(c for c, _ in b.values())}; "
              f"self ms original {sum(t for _, t in o.values()) / 1e3:.1f}, block {sum(t for _, t in b.values()) / 1e3:.1f}")
        print(f"  {'op':58s} {'n orig':>6s} {'n block':>7s} {'ms orig':>8s} {'ms block':>8s} {'diff ms':>8s}")
        keys = sorted(set(o) | set(b), key=lambda k: -abs(b.get(k, (0, 0))[1] - o.get(k, (0, 0))[1]))
        for k in keys[:16]:
            (no, to), (nb, tb) = o.get(k, (0, 0)), b.get(k, (0, 0))
            print(f"  {k[:58]:58s} {no:6d} {nb:7d} {to / 1e3:8.2f} {tb / 1e3:8.2f} {(tb - to) / 1e3:+8.2f}")


def split(runs: dict) -> None:
    """Per site in the running training step: fused.forward / fused.backward around the kernel call."""
    clock, times, calls = time.thread_time, collections.defaultdict(float), collections.Counter()
    run_kernel, outer = fused._run, {"forward": fused.forward, "backward": fused.backward}

    def timed_run(*args):
        start = clock()
        run_kernel(*args)
        times["kernel " + split.current] += clock() - start

    def wrap(name):
        def call(*args):
            split.current = name
            start = clock()
            out = outer[name](*args)
            times["total " + name] += clock() - start
            calls[name] += 1
            return out
        return call

    fused._run, fused.forward, fused.backward = timed_run, wrap("forward"), wrap("backward")
    try:
        step = runs["block"]["train"]
        for _ in range(3):
            step()
        times.clear()
        calls.clear()
        for _ in range(5):
            step()
    finally:
        fused._run, fused.forward, fused.backward = run_kernel, outer["forward"], outer["backward"]
    print("\n## 2. per site in the Block(8) training step (thread CPU time, mean of 5 steps x 24 sites)")
    for name in ("forward", "backward"):
        total, kernel = (times[f"{w} {name}"] / calls[name] * 1e6 for w in ("total", "kernel"))
        print(f"  fused.{name}: {total:6.1f} us a call, kernel {kernel:6.1f}, around it {total - kernel:6.1f}")


def warm() -> None:
    print("\n## 3. warm, one site's tensors in a loop (process CPU time, best of 5 x 2000 calls, us a call)")
    eps, scale = 1e-6, 1.0

    def t(fn):
        return min(timeit.repeat(fn, number=2000, repeat=5, timer=time.process_time)) / 2000 * 1e6

    for count in (2, 5, 9):
        src = [torch.randn(1, 128, 256) for _ in range(count)]
        query = torch.randn(256) * 0.1
        grad = torch.randn(1, 128, 256)
        s0 = src[0]
        fn = fused._lookup(("forward", count, s0.dtype, s0.device, 3, 256, -1, eps, scale, fused._threads(count + 1, s0)))
        bfn = fused._lookup(("backward", count, s0.dtype, s0.device, 3, 256, -1, eps, scale,
                             fused._threads(2 * count + 1, s0)))
        out, grads, gq = torch.empty_like(s0), [torch.empty_like(s) for s in src], torch.empty(256)
        leaves = [s.clone().requires_grad_() for s in src]
        param = torch.nn.Parameter(query.clone())
        a, b = leaves[0], leaves[1]
        with torch.no_grad():
            row = {"add, no_grad": t(lambda: a + b),
                   "site op, no_grad": t(lambda: op.depth_attention(src, query, eps, scale, -1))}
        row |= {"fused.forward": t(lambda: fused.forward(src, query, eps, scale, -1)),
                "forward kernel": t(lambda: fn(*src, query, out)),
                "add, grad": t(lambda: a + b),
                "site op, grad (autograd Function)": t(lambda: op.depth_attention(leaves, param, eps, scale, -1)),
                "the same through the dispatcher": t(lambda: op.depth_attention._op(leaves, param, eps, scale, -1)),
                "fused.backward": t(lambda: fused.backward(src, query, grad, eps, scale, -1)),
                "backward kernel": t(lambda: bfn(*src, query, grad, *grads, gq))}
        print(f"  S={count}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))


if __name__ == "__main__":
    progs = programs()
    runs = {name: runners(p) for name, p in progs.items()}
    profile(runs)
    split(runs)
    warm()
