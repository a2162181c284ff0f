"""Does converting a trained model to AttnRes and fine-tuning it beat fine-tuning the original? (issue 15)

The character-level PreNorm GPT of samples/char_lm.py at several depths; every arm of every seed is
trained on one thread in its own worker process, so a seed fixes every loss:

  from scratch, S steps      baseline; full, block (AttnRes, paper scale), delta-block, delta (Delta AttnRes, paper
                             init: gates 1), each rewritten from the baseline's init
  conversion, C more steps   the baseline trained S steps, then fine-tuned as it is (continue) or rewritten
                             with preserve / paper scale (Full, Block) and fine-tuned: fresh Adam (or
                             --ft-adam carry), a new warmup + cosine schedule, the same batches for all arms
  equal compute              baseline and continue again for round(r x steps) steps, r = the measured
                             per-step CPU-time ratio (time.process_time, 1 thread) of each AttnRes arm to the baseline
  query-LR sweep             the conversion arms' pseudo-query LR, chosen on the dev half of the held-out
                             text (every reported loss is on the other half) with its own seed

`--parts scratch` runs only the from-scratch arms (no conversion, no sweep). Writes results.json, summary.md
(generated from the results) and PNGs to --out; progress on stderr.

    nice python -m samples.study --out benchmarks/runs/study-chargpt             # the default budget
    python -m samples.study --tiny --out /tmp/study                               # seconds (the test)
    nice python -m samples.study --sizes 16 --parts scratch --out benchmarks/runs/study-chargpt-delta  # from scratch only
    python -m samples.study --report-only --out benchmarks/runs/study-chargpt     # summary and plots again from results.json
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import platform
import sys
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from attnres_compile.ops import depth_attention as op
from attnres_compile.monitor import DepthMonitor, ResidualProbe, find_collapse, trace_sites
from samples.char_lm import attnres, build_model, evaluate, load_text, lr_factor, make_opt, train_step, windows
from samples.study_arms import FROM_SCRATCH

SCRATCH = ("baseline", *FROM_SCRATCH)
CONVERT = ("continue", "full-preserve", "block-preserve", "full-paper", "block-paper")
VARIANTS = ("full", "block")  # the conversion's
PARTS = ("scratch", "convert")
CONVERT_TOL = 1e-5  # |loss after the preserve rewrite - loss before| on the validation half
CALIBRATION = {"rounds": 3, "steps": 4, "warmup": 2}  # per-step cost: alternating rounds, median
TINY = dict(sizes="1,2", dim=16, heads=2, batch=4, seq=16, steps=6, ft_steps=4, warmup=2, ft_warmup=1, eval_every=3,
            curve_batches=2, val_batches=4, blocks=2, sweep_lrs="0,0.01", workers=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m samples.study", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/study")
    p.add_argument("--parts", default="scratch,convert",
                   help="comma-separated parts to run: scratch (the from-scratch arms), convert (conversion, its sweep)")
    p.add_argument("--sizes", default="8,16", help="comma-separated layer counts (each layer is 2 sublayers)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=200, help="from-scratch steps S (also the baseline's before conversion)")
    p.add_argument("--ft-steps", type=int, default=100, help="fine-tuning steps C after conversion")
    p.add_argument("--lr", type=float, default=3e-3, help="peak LR from scratch (pseudo-queries included)")
    p.add_argument("--ft-lr", type=float, default=1e-3, help="peak LR of the original parameters when fine-tuning")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ft-warmup", type=int, default=10)
    p.add_argument("--ft-adam", choices=["fresh", "carry"], default="fresh",
                   help="fine-tuning Adam state: fresh, or the baseline's carried over (pseudo-queries start fresh)")
    p.add_argument("--blocks", type=int, default=4, help="number of blocks N of Block AttnRes")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..n-1 per arm")
    p.add_argument("--query-lr", type=float, help="peak LR of the pseudo-queries when fine-tuning (skips the sweep)")
    p.add_argument("--sweep-lrs", default="0,1e-3,3e-3,1e-2,3e-2", help="query LRs of the sweep (0 is a control, never chosen)")
    p.add_argument("--sweep-seed", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--curve-batches", type=int, default=6, help="validation batches per curve point (the final loss uses all)")
    p.add_argument("--val-batches", type=int, help="use only this many batches (spread evenly) of each held-out half (default: all)")
    p.add_argument("--workers", type=int, default=2, help="worker processes, one thread each")
    p.add_argument("--kernel", choices=op.KERNELS, default=os.environ.get("ATTNRES_KERNEL") or "auto",
                   help="depth_attention implementation (sets ATTNRES_KERNEL; default: that variable, else auto)")
    p.add_argument("--ratios-from", help="a results.json whose equal-compute ratios to reuse instead of measuring them")
    p.add_argument("--report-only", action="store_true", help="rewrite summary.md and the plots from OUT/results.json")
    p.add_argument("--tiny", action="store_true", help=f"a seconds-long size for tests (flags given still win): {TINY}")
    argv = sys.argv[1:] if argv is None else argv
    if "--tiny" in argv:
        p.set_defaults(**TINY)
    args = p.parse_args(argv)
    args.argv = list(argv)
    try:
        args.sizes = sorted({int(s) for s in args.sizes.split(",") if s})
        parts = args.parts.split(",")
        args.parts = [part for part in PARTS if part in parts]
        args.sweep_lrs = [float(s) for s in args.sweep_lrs.split(",") if s]
    except ValueError as exc:
        p.error(f"--sizes and --sweep-lrs take comma-separated numbers ({exc})")
    if set(parts) - set(PARTS) or "scratch" not in parts:
        p.error(f"--parts takes a comma-separated subset of {PARTS} that holds scratch (conversion starts from its baseline)")
    if not args.sizes or min(args.sizes) < 1:
        p.error("--sizes needs at least one layer count >= 1")
    if args.query_lr is None and not [lr for lr in args.sweep_lrs if lr > 0]:
        p.error("--sweep-lrs needs a positive LR (0 is only a control), or give --query-lr")
    for flag in ("steps", "ft_steps", "seeds", "workers", "eval_every", "curve_batches", "val_batches", "batch", "seq"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.ratios_from and not Path(args.ratios_from).is_file():
        p.error(f"--ratios-from {args.ratios_from}: no such file (give a results.json written by this study)")
    return args


# ---------------------------------------------------------------- data and models (also run in workers)

def heldout_batches(part: str, cfg: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The non-overlapping windows of the "dev" (first) or "val" (second) half of the held-out text, in batches:
    all of them, or cfg["val_batches"] spread evenly."""
    _, heldout, _ = load_text()
    half = len(heldout) // 2
    ids = heldout[:half] if part == "dev" else heldout[half:]
    n = (len(ids) - 1) // cfg["seq"] // cfg["batch"] * cfg["batch"]
    starts = torch.arange(n) * cfg["seq"]
    batches = [windows(ids, s, cfg["seq"]) for s in starts.view(-1, cfg["batch"])]
    return spread(batches, cfg["val_batches"] or len(batches))


def spread(batches: list, count: int) -> list:
    """`count` batches spread evenly over `batches`."""
    idx = np.linspace(0, len(batches) - 1, min(count, len(batches))).round().astype(int)
    return [batches[i] for i in idx]


def train_batch(seed: int, phase: int, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of (seed, phase, step): phase 0 from scratch, 1 fine-tuning; any run length reads a prefix."""
    train_ids, _, _ = load_text()
    starts = np.random.default_rng([seed, phase, step]).integers(0, len(train_ids) - seq - 1, batch)
    return windows(train_ids, torch.from_numpy(starts), seq)


_TEMPLATES: dict = {}


def template(cfg: dict, layers: int, variant: str | None, scale: str | None):
    """(GraphModule, monitor sites) of one structure, made once per process: the baseline traced with
    torch.export (sites from `trace_sites`), or that graph rewritten to AttnRes (`scale`: char_lm.attnres's form).
    Runs load their weights into a copy; a rewrite changes no weight."""
    key = (layers, variant, scale)
    if key not in _TEMPLATES:
        example = train_batch(0, 0, 0, cfg["batch"], cfg["seq"])[0]
        if variant is None:
            vocab = len(load_text()[2])
            _TEMPLATES[key] = trace_sites(build_model(0, vocab, layers, cfg["dim"], cfg["heads"], cfg["seq"]), (example,))
        else:
            base, _ = template(cfg, layers, None, None)
            _TEMPLATES[key] = (attnres(base, example, variant, scale, cfg["blocks"]), None)
    return _TEMPLATES[key]


def instantiate(cfg: dict, layers: int, variant: str | None, scale: str | None, state: dict):
    """A trainable copy of the template holding `state` (original weights); the AttnRes parameters keep the
    rewrite's start (pseudo-queries zero: uniform weights; Delta's gates 0 or 1 by the form)."""
    gm, sites = template(cfg, layers, variant, scale)
    gm = copy.deepcopy(gm)
    missing, unexpected = gm.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("attnres.") for k in missing):
        raise AssertionError(f"state does not fit the {variant or 'baseline'} graph: missing {missing}, unexpected {unexpected}")
    return gm, sites


def _site_summary(stats: dict, final: bool) -> dict:
    """Per-site normalised entropy (1 = uniform weights); when `final` also per-site RMS and the weights."""
    sites = stats["sites"]
    out = {"rms": [round(s["rms"], 5) for s in sites]} if final else {}
    if "weights" in sites[0]:
        out["entropy"] = [round(s["entropy"] / s["max_entropy"], 5) for s in sites]
        if final:
            out["weights"] = [[round(w, 5) for w in s["weights"]] for s in sites]
    return out


def run_arm(spec: dict) -> dict:
    """Train one arm (in a worker); returns its record: curve, final loss on the whole eval half, depth stats, CPU time."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    cfg = spec["cfg"]
    state = spec["init"]
    if state is None:
        vocab = len(load_text()[2])
        state = build_model(spec["seed"], vocab, spec["layers"], cfg["dim"], cfg["heads"], cfg["seq"]).state_dict()
    gm, sites = instantiate(cfg, spec["layers"], spec["variant"], spec["scale"], state)
    opt = make_opt(gm, spec["lr"], spec["adam"], spec["query_lr"])
    monitor = DepthMonitor(gm) if sites is None else ResidualProbe(gm, sites)
    full = heldout_batches(spec["eval"], cfg)
    curve_batches = spread(full, cfg["curve_batches"])
    steps, phase = spec["steps"], 1 if spec["kind"] == "ft" else 0
    rec = {"steps": steps, "curve": [], "depth": []}
    if phase:
        rec["start_loss"], _ = evaluate(gm, full)
        if spec["expect"] is not None and abs(rec["start_loss"] - spec["expect"]) > CONVERT_TOL:
            raise AssertionError(f"{spec['name']}: loss after the preserve rewrite is {rec['start_loss']:.7f}, "
                                 f"the baseline had {spec['expect']:.7f}")
    cpu = wall = 0.0
    for step in range(steps + 1):
        if step % cfg["eval_every"] == 0 or step == steps:
            loss, stats = evaluate(gm, curve_batches, monitor)
            rec["curve"].append([step, loss])
            if spec["variant"] is not None:
                rec["depth"].append([step, _site_summary(stats, final=False)])
        if step == steps:
            break
        x, y = train_batch(spec["seed"], phase, step, cfg["batch"], cfg["seq"])
        c0, w0 = time.process_time(), time.perf_counter()
        train_step(gm, opt, x, y, lr_factor(step, steps, spec["warmup"]))
        cpu, wall = cpu + time.process_time() - c0, wall + time.perf_counter() - w0
    rec["final"], _ = evaluate(gm, full)
    rec["final_depth"] = _site_summary(stats, final=True)
    rec["collapse"] = find_collapse(stats) if "entropy" in rec["final_depth"] else []
    gates = [p.item() for n, p in gm.named_parameters() if n.startswith("attnres.") and ".gate" in n]
    if gates:  # Delta's
        rec["gates"] = gates
    rec.update(cpu_s=cpu, wall_s=wall, cpu_ms_per_step=1e3 * cpu / steps, wall_ms_per_step=1e3 * wall / steps)
    if spec["keep_state"]:
        rec["state"] = {k: v.detach().clone() for k, v in gm.state_dict().items()}
        rec["adam"] = {n: copy.deepcopy(opt.state[p]) for n, p in gm.named_parameters() if p in opt.state}
    return rec


# ---------------------------------------------------------------- per-step cost

def calibrate(cfg: dict, layers: int) -> dict:
    """Per-step CPU and wall ms (1 thread) of the baseline, an identical copy of it (the noise control) and each
    AttnRes arm from scratch, timed in alternating rounds on the same batches; median over rounds. Also which
    depth-attention implementation one training step of each arm ran (`implementation_calls`)."""
    torch.set_num_threads(1)
    vocab = len(load_text()[2])
    state = build_model(0, vocab, layers, cfg["dim"], cfg["heads"], cfg["seq"]).state_dict()
    arms = {"baseline": (None, None), "baseline-copy": (None, None), **{v: (v, "paper") for v in FROM_SCRATCH}}
    models = {a: instantiate(cfg, layers, v, s, state)[0] for a, (v, s) in arms.items()}
    opts = {a: make_opt(m, 1e-4) for a, m in models.items()}
    batches = [train_batch(0, 0, i, cfg["batch"], cfg["seq"]) for i in range(CALIBRATION["steps"])]
    times = {a: {"cpu": [], "wall": []} for a in arms}
    calls = {}
    for rnd in range(-1, CALIBRATION["rounds"]):
        for a in arms:
            todo = batches[:CALIBRATION["warmup"]] if rnd < 0 else batches
            c0, w0 = time.process_time(), time.perf_counter()
            for x, y in todo:
                train_step(models[a], opts[a], x, y, 1.0)
            if rnd >= 0:
                times[a]["cpu"].append(1e3 * (time.process_time() - c0) / len(todo))
                times[a]["wall"].append(1e3 * (time.perf_counter() - w0) / len(todo))
            else:  # after the warmup (kernels built): one more step, counted
                with implementation_calls() as calls[a]:
                    train_step(models[a], opts[a], *batches[0], 1.0)
    ms = {a: {"cpu_ms": float(np.median(t["cpu"])), "wall_ms": float(np.median(t["wall"])), "calls": calls[a]}
          for a, t in times.items()}
    base = ms["baseline"]["cpu_ms"]
    return {"per_step": ms, "ratio": {a: ms[a]["cpu_ms"] / base for a in ("baseline-copy", *FROM_SCRATCH)}}


@contextmanager
def implementation_calls():
    """Yields {"fused": n, "eager": m}, filled on exit: the fused TVM kernel launches and the eager reference calls
    (forward, backward, merge of depth_attention and Delta) made meanwhile in this process."""
    from attnres_compile.kernels import fused
    from attnres_compile.ops import delta, two_phase

    counts = {"fused": 0, "eager": 0}
    patched = [(fused, "_run", "fused")] + [(m, f, "eager") for m in (op, delta, two_phase) for f in
                                            ("forward_reference", "backward_reference", "partial_reference", "merge_reference")
                                            if hasattr(m, f)]
    saved = [(m, f, getattr(m, f)) for m, f, _ in patched]

    def counting(fn, kind):
        def call(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)
        return call
    for (m, f, kind), (_, _, fn) in zip(patched, saved):
        setattr(m, f, counting(fn, kind))
    try:
        yield counts
    finally:
        for m, f, fn in saved:
            setattr(m, f, fn)


def used_ratios(args, cost: dict) -> dict:
    """{layers: {arm: ratio}} of the AttnRes arms from scratch: measured, rounded to 0.05 (so small timing noise
    rarely changes a step count), or read from --ratios-from."""
    if args.ratios_from:
        pinned = json.loads(Path(args.ratios_from).read_text())["cost"]
        missing = [L for L in args.sizes if str(L) not in pinned or set(FROM_SCRATCH) - set(pinned[str(L)]["ratio_used"])]
        if missing:
            sys.exit(f"--ratios-from {args.ratios_from} has no ratios of {FROM_SCRATCH} for sizes {missing}; measure them (drop the flag)")
        return {L: pinned[str(L)]["ratio_used"] for L in args.sizes}
    return {L: {v: max(0.05, round(cost[L]["ratio"][v] * 20) / 20) for v in FROM_SCRATCH} for L in args.sizes}


# ---------------------------------------------------------------- the task graph

@dataclass
class Task:
    key: tuple
    deps: list
    build: Callable[[dict], dict]  # results so far -> spec


def cfg_of(args) -> dict:
    return {k: getattr(args, k) for k in ("dim", "heads", "batch", "seq", "blocks", "eval_every", "curve_batches", "val_batches")}


def tasks_for(args, ratios: dict) -> list[Task]:
    """Every run, in priority order (the sweep's pretraining and the baselines first: others wait on them)."""
    cfg = cfg_of(args)

    def spec(name, layers, seed, kind, variant=None, scale=None, steps=None, init=None, adam=None, query_lr=None,
             expect=None, keep_state=False, part="val"):
        ft = kind == "ft"
        return {"name": name, "layers": layers, "seed": seed, "kind": kind, "variant": variant, "scale": scale, "cfg": cfg,
                "steps": steps or (args.ft_steps if ft else args.steps), "warmup": args.ft_warmup if ft else args.warmup,
                "lr": args.ft_lr if ft else args.lr, "query_lr": query_lr, "init": init,
                "adam": adam if args.ft_adam == "carry" else None, "expect": expect, "keep_state": keep_state, "eval": part}

    def conversion(key_base, name, layers, seed, part, query_lr=None, steps=None):
        variant, scale = (None, None) if name.startswith("continue") else name.split("-")

        def build(res):
            base = res[key_base]
            qlr = query_lr if query_lr is not None or variant is None else chosen_query_lr(args, res)
            return spec(name, layers, seed, "ft", variant, scale, steps, base["state"], base["adam"], qlr,
                        base["final"] if scale == "preserve" else None, part=part)
        return build

    tasks = []
    sweep_keys = []
    convert = "convert" in args.parts
    if convert and args.query_lr is None:
        L0, s0 = args.sizes[0], args.sweep_seed
        pre = ("sweep", "pretrain")
        tasks.append(Task(pre, [], lambda res: spec("sweep-pretrain", L0, s0, "scratch", keep_state=True, part="dev")))
        sweep_keys = [("sweep", "continue")] + [("sweep", f"{v}-preserve", lr) for lr in args.sweep_lrs for v in VARIANTS]
    for L in sorted(args.sizes, reverse=True):
        for seed in range(args.seeds):
            tasks.append(Task(("run", L, seed, "baseline"), [],
                              lambda res, L=L, seed=seed: spec("baseline", L, seed, "scratch", keep_state=True)))
    for key in sweep_keys:
        qlr = key[2] if len(key) == 3 else None
        tasks.append(Task(key, [pre], conversion(pre, key[1], args.sizes[0], args.sweep_seed, "dev", qlr)))
    for L in sorted(args.sizes, reverse=True):
        for seed in range(args.seeds):
            base = ("run", L, seed, "baseline")
            for v in FROM_SCRATCH:
                tasks.append(Task(("run", L, seed, v), [], lambda res, L=L, seed=seed, v=v: spec(v, L, seed, "scratch", v, "paper")))
                steps = round(args.steps * ratios[L][v])
                if steps != args.steps:
                    name = f"baseline@{v}-cost"
                    tasks.append(Task(("run", L, seed, name), [],
                                      lambda res, L=L, seed=seed, n=name, s=steps: spec(n, L, seed, "scratch", steps=s)))
            if not convert:
                continue
            for name in CONVERT:
                deps = [base] + (sweep_keys if name != "continue" else [])
                tasks.append(Task(("run", L, seed, name), deps, conversion(base, name, L, seed, "val")))
            for v in VARIANTS:
                steps = round(args.ft_steps * ratios[L][v])
                if steps != args.ft_steps:
                    name = f"continue@{v}-cost"
                    tasks.append(Task(("run", L, seed, name), [base], conversion(base, name, L, seed, "val", steps=steps)))
    return tasks


def chosen_query_lr(args, res: dict) -> float:
    """--query-lr, else the positive sweep LR with the lowest dev loss averaged over Full and Block (ties: the smaller)."""
    if args.query_lr is not None:
        return args.query_lr
    score = {lr: np.mean([res[("sweep", f"{v}-preserve", lr)]["final"] for v in VARIANTS]) for lr in args.sweep_lrs if lr > 0}
    return min(score, key=lambda lr: (score[lr], lr))


def execute(tasks: list[Task], workers: int, progress: Callable[[Task, dict, int], None]) -> dict:
    """Run the tasks, each as soon as its dependencies are done, in list order, on `workers` one-thread processes."""
    results, pending, running = {}, list(tasks), {}
    if workers == 1:
        for n, task in enumerate(tasks, 1):
            results[task.key] = run_arm(task.build(results))
            progress(task, results[task.key], n)
        return results
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        while pending or running:
            for task in [t for t in pending if all(d in results for d in t.deps)]:
                if len(running) >= workers:
                    break
                pending.remove(task)
                running[pool.submit(run_arm, task.build(results))] = task
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                task = running.pop(fut)
                results[task.key] = fut.result()
                progress(task, results[task.key], len(results))
    return results


# ---------------------------------------------------------------- main

@contextmanager
def kernel_selected(mode: str):
    """The depth_attention implementation `mode`, here and in workers spawned meanwhile (ATTNRES_KERNEL), restored
    after; yields what runs: the fused TVM kernels (where they apply: float32 on the last axis here) or the eager reference."""
    from attnres_compile.kernels import fused

    env = os.environ.get("ATTNRES_KERNEL")
    os.environ["ATTNRES_KERNEL"] = mode
    previous = op.set_kernel(mode)
    try:
        tvm = mode != "eager" and fused.available()
        yield {"ATTNRES_KERNEL": mode, "implementation": "fused TVM kernels" if tvm else "eager reference"}
    finally:
        op.set_kernel(previous)
        if env is None:
            os.environ.pop("ATTNRES_KERNEL")
        else:
            os.environ["ATTNRES_KERNEL"] = env


def environment(args, kernel: dict) -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "workers": args.workers, "threads_per_worker": 1, "nice": os.nice(0),
            "kernel": kernel,
            "timing": "time.process_time of each process at 1 thread (CPU time); wall clock beside it"}


def main(argv: list[str] | None = None) -> dict:
    from samples import study_report

    args = parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        path = out / "results.json"
        if not path.is_file():
            sys.exit(f"--report-only: {path} does not exist; run the study first (without --report-only)")
        results = json.loads(path.read_text())
        study_report.write_all(results, out)
        return results
    threads = torch.get_num_threads()
    with kernel_selected(args.kernel) as kernel, warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export's pytree deprecations, on every copy
        torch.set_num_threads(1)
        try:
            return run_study(args, out, kernel)
        finally:
            torch.set_num_threads(threads)


def run_study(args, out: Path, kernel: dict) -> dict:
    """Measure the per-step cost, run every arm, write the results, summary and plots to `out`."""
    from samples import study_report

    out.mkdir(parents=True, exist_ok=True)
    t0, c0 = time.perf_counter(), time.process_time()
    log = lambda msg: print(f"[{_clock(t0)}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    train_ids, heldout, vocab = load_text()
    steps = f"{args.steps} + {args.ft_steps}" if "convert" in args.parts else str(args.steps)
    log(f"study: sizes {args.sizes} x {args.seeds} seeds, dim {args.dim}, {steps} steps of "
        f"{args.batch}x{args.seq} chars, {args.workers} workers x 1 thread, {kernel['implementation']}; measuring per-step cost")
    cfg = cfg_of(args)
    cost = {}
    for L in args.sizes:
        cost[L] = calibrate(cfg, L)
        log(f"  {L} layers: ms/step (cpu) " + ", ".join(f"{a} {m['cpu_ms']:.1f}" for a, m in cost[L]["per_step"].items()))
    ratios = used_ratios(args, cost)
    for L in args.sizes:
        cost[L]["ratio_used"] = ratios[L]
    tasks = tasks_for(args, ratios)
    log(f"{len(tasks)} runs; equal-compute ratios used {ratios}")

    def progress(task: Task, rec: dict, n: int) -> None:
        kind, *rest = task.key
        where = f"{rest[0]} layers, seed {rest[1]}, {rest[2]}" if kind == "run" else "sweep " + " query LR ".join(map(str, rest))
        log(f"[{n}/{len(tasks)}] {where}: {rec['steps']} steps, loss {rec['final']:.4f}, {rec['cpu_ms_per_step']:.0f} ms/step (CPU)")

    done = execute(tasks, args.workers, progress)
    results = assemble(args, done, cost, kernel, len(vocab), len(train_ids), len(heldout))
    results["elapsed"] = {"wall_s": time.perf_counter() - t0, "main_cpu_s": time.process_time() - c0,
                          "runs_cpu_s": sum(r["cpu_s"] for r in done.values())}
    study_report.write_all(results, out)
    log(f"done in {_clock(t0)}: {out}/results.json, summary.md, PNGs")
    return results


def assemble(args, done: dict, cost: dict, kernel: dict, vocab: int, n_train: int, n_heldout: int) -> dict:
    """The JSON-able results: config, environment, cost, sweep and runs[layers][seed][arm] (weights dropped; no
    sweep and no query LR without the conversion part)."""
    for rec in done.values():
        rec.pop("state", None)
        rec.pop("adam", None)
    config = {k: v for k, v in vars(args).items() if k not in ("argv", "report_only")}
    sweep = None
    convert = "convert" in args.parts
    if convert and args.query_lr is None:
        sweep = {"layers": args.sizes[0], "seed": args.sweep_seed, "part": "dev", "continue": done[("sweep", "continue")]["final"],
                 "runs": [{"variant": v, "query_lr": lr, "final": done[("sweep", f"{v}-preserve", lr)]["final"],
                           "curve": done[("sweep", f"{v}-preserve", lr)]["curve"]}
                          for lr in args.sweep_lrs for v in VARIANTS],
                 "chosen": chosen_query_lr(args, done)}
    runs = {}
    for key, rec in done.items():
        if key[0] == "run":
            runs.setdefault(str(key[1]), {}).setdefault(str(key[2]), {})[key[3]] = rec
    return {"command": "python -m samples.study " + " ".join(args.argv), "config": config, "environment": environment(args, kernel),
            "data": {"train_chars": n_train, "heldout_chars": n_heldout, "vocab": vocab,
                     "split": "held-out = last 10% of the text; dev = its first half (query-LR sweep), val = its second half (all reported losses)"},
            "query_lr": chosen_query_lr(args, done) if convert else None, "cost": {str(L): c for L, c in cost.items()},
            "sweep": sweep, "runs": runs}


def _clock(t0: float) -> str:
    s = int(time.perf_counter() - t0)
    return f"{s // 60}:{s % 60:02d}"


if __name__ == "__main__":
    main()
