"""The evidence study on a real pretrained LLM: does converting SmolLM2-135M to AttnRes and fine-tuning it
beat fine-tuning the original? (issue 48, item 5)

SmolLM2-135M-Instruct (samples/smollm2.py) is fine-tuned on real English (Python's `pydoc_data.topics`,
split by topic: every 10th topic in sorted order is held out; its first 16 sequences give the curves, its
first 96 the final losses). Arms, every one from the same pretrained weights on the same batches of its seed:

  continue       the original, fine-tuned the usual way (AdamW, one group)
  block8         rewritten to Block AttnRes (N = 8, preserve: exact at the start), the queries in their
                 own group without weight decay at the model's learning rate, ramped from 0 over 20 steps
                 (attnres_compile.training.param_groups(query_lr_scale=1) + query_warmup)
  full           rewritten to Full AttnRes, the same
  block8-recipe  Block N = 8 with the recommended recipe's query rate (0.01 x the model's: stable, and the
                 depth weights barely move in a short fine-tune; docs/finetune.md)
  delta8         rewritten to Delta-Block AttnRes (N = 8, gates at 0: exact at the start; issue 64), the gates
                 and queries in their own group at 100 x the model's rate (the published fine-tuning's
                 --lr_attnres / --lr), ramped from 0 over 20 steps
  delta          rewritten to Delta AttnRes (every sublayer output a source), the same

AdamW at a constant learning rate (no schedule besides the queries' warm-up), so `continue` run longer
is the same run with more steps: it runs until the largest equal-compute point (its steps times the
converted arm's measured per-step CPU-time ratio, 1 thread, `time.process_time`) and is evaluated there
as well as at the equal-steps point. Each arm of each seed runs in its own worker process (1 thread).
Depth weights (per site: entropy, weight on the embeddings and on the newest source) are read at every
evaluation with `attnres_compile.monitor.DepthMonitor` on one held-out batch.

    nice python -m samples.study_llm --out benchmarks/runs/study-smollm2          # 3 seeds x 300 steps
    python -m samples.study_llm --steps 4 --seeds 1 --eval-every 2 --out /tmp/s   # minutes: a smoke run
    python -m samples.study_llm --report-only --out benchmarks/runs/study-smollm2
    python -m samples.study_llm --resume --out benchmarks/runs/study-smollm2      # after a run was cut short

Writes results.json (every curve), summary.md and PNGs; progress lines on stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

ARMS = {  # name -> (variant, query_lr_scale); None: the original model / the recipe's default scale
    "continue": (None, None),
    "block8": ("block", 1.0),
    "full": ("full", 1.0),
    "block8-recipe": ("block", None),
    "delta8": ("delta-block", 100.0),
    "delta": ("delta", 100.0),
}
HELD_OUT_EVERY = 10  # every 10th topic (sorted by name) is held out
EXTRA = 1.15  # `continue` runs this many times the steps, for equal-compute points
EXTRA_EVAL = 10  # ...and is evaluated every this many steps past the equal-steps point


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m samples.study_llm", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/study_llm")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-rows", type=int, default=16, help="held-out sequences per curve point (seq tokens each)")
    p.add_argument("--final-rows", type=int, default=96, help="held-out sequences for the final losses (all if fewer)")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished runs of OUT/results.partial.json (same settings) and run the rest")
    args = p.parse_args(argv)
    for flag in ("seeds", "steps", "batch", "seq", "eval_every", "eval_rows", "final_rows", "workers", "blocks"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if "continue" not in args.arms:
        p.error("--arms needs 'continue' (the reference)")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


# ---------------------------------------------------------------- data (also in workers)

def split_text() -> tuple[str, str]:
    """(train, held-out) text: pydoc topics sorted by name, every HELD_OUT_EVERY-th held out."""
    from pydoc_data import topics

    names = sorted(topics.topics)
    held = [topics.topics[k] for i, k in enumerate(names) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [topics.topics[k] for i, k in enumerate(names) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return "\n".join(train), "\n".join(held)


def token_data(tokenizer, seq: int):
    """(train ids, held-out rows [R, seq + 1]) as int64 tensors."""
    train, held = split_text()
    ids = tokenizer(train, return_tensors="pt")["input_ids"][0]
    held_ids = tokenizer(held, return_tensors="pt")["input_ids"][0]
    rows = len(held_ids) // (seq + 1)
    return ids, held_ids[: rows * (seq + 1)].view(rows, seq + 1)


def train_batch(ids, seed: int, step: int, batch: int, seq: int):
    import torch

    starts = np.random.default_rng([seed, step]).integers(0, len(ids) - seq - 1, batch)
    rows = torch.stack([ids[s: s + seq + 1] for s in starts])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def loss_of(model, x, y):
    import torch
    from torch.nn import functional as F

    out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def evaluate(model, rows, batch: int) -> float:
    """Mean next-token loss over `rows` (every token weighs the same)."""
    import torch

    total = 0.0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            r = rows[i: i + batch]
            total += loss_of(model, r[:, :-1], r[:, 1:]).item() * len(r)
    return total / len(rows)


# ---------------------------------------------------------------- one arm (in a worker)

def depth_summary(monitor, rows) -> dict:
    """Per site: normalised entropy, weight x |S| on v0 (the embeddings) and on the newest source; the weights;
    and (Delta) the gates."""
    import torch

    monitor.reset()
    with torch.no_grad():
        monitor(input_ids=rows[:, :-1], attention_mask=torch.ones_like(rows[:, :-1]), use_cache=False)
    sites = monitor.stats()["sites"]
    out = {"entropy": [round(s["entropy"] / s["max_entropy"], 5) for s in sites],
           "v0": [round(s["weights"][0] * len(s["weights"]), 4) for s in sites],
           "newest": [round(s["weights"][-1] * len(s["weights"]), 4) for s in sites],
           "weights": [[round(w, 5) for w in s["weights"]] for s in sites]}
    if any("gate" in s for s in sites):  # Delta AttnRes: each site's gate
        out["gate"] = [round(s["gate"], 6) for s in sites]
    return out


def run_arm(spec: dict) -> dict:
    """Fine-tune one arm of one seed; its record: curve [[step, held-out loss]], final losses, depth, CPU time."""
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from attnres_compile import AttnResConfig, rewrite
    from attnres_compile.monitor import DepthMonitor
    from attnres_compile.training import param_groups, query_warmup
    from samples import smollm2

    a = spec["args"]
    torch.manual_seed(spec["seed"])
    model, tokenizer = smollm2.load()
    ids, held = token_data(tokenizer, a["seq"])
    curve_rows, final_rows = held[: a["eval_rows"]], held[: a["final_rows"]]
    variant, scale = ARMS[spec["arm"]]
    rec = {"arm": spec["arm"], "seed": spec["seed"], "curve": [], "depth": [], "finals": {}, "step_cpu": [], "train_loss": []}
    x0, _ = train_batch(ids, spec["seed"], 0, a["batch"], a["seq"])
    rec["start_loss"] = evaluate(model, final_rows, a["batch"])
    monitor = None
    if variant is None:
        opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], weight_decay=a["weight_decay"])
        sched = None
    else:
        t0 = time.perf_counter()
        name, blocked = variant.removesuffix("-block"), variant.endswith("block")
        config = AttnResConfig(variant=name, num_blocks=a["blocks"] if blocked else None)
        model = rewrite(model, {"input_ids": x0, "attention_mask": torch.ones_like(x0), "use_cache": False},
                        config).graph_module
        rec["rewrite_s"] = time.perf_counter() - t0
        rec["converted_loss"] = evaluate(model, final_rows, a["batch"])
        kw = {} if scale is None else {"query_lr_scale": scale}
        opt = torch.optim.AdamW(param_groups(model, a["lr"], weight_decay=a["weight_decay"], **kw), lr=a["lr"])
        sched = query_warmup(opt)
        monitor = DepthMonitor(model)
    model.train()
    steps = spec["steps"]
    evals = set(range(0, a["steps"] + 1, a["eval_every"])) | set(range(a["steps"], steps + 1, EXTRA_EVAL))
    cpu = wall = 0.0
    for step in range(steps + 1):
        if step in evals:
            model.eval()
            rec["curve"].append([step, evaluate(model, curve_rows, a["batch"]), cpu])
            if monitor is not None:
                rec["depth"].append([step, depth_summary(monitor, curve_rows[: a["batch"]])])
            model.train()
            print(f"  {spec['arm']} seed {spec['seed']} step {step}: held-out {rec['curve'][-1][1]:.4f} "
                  f"({cpu / max(step, 1):.2f} s CPU/step)", file=sys.stderr, flush=True)
        if step >= a["steps"] and step in evals:  # the equal-steps point, and (continue) equal-compute points
            model.eval()
            rec["finals"][str(step)] = evaluate(model, final_rows, a["batch"])
            model.train()
        if step == steps:
            break
        x, y = train_batch(ids, spec["seed"], step, a["batch"], a["seq"])
        c0, w0 = time.process_time(), time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        rec["step_cpu"].append(time.process_time() - c0)
        cpu, wall = cpu + rec["step_cpu"][-1], wall + time.perf_counter() - w0
        rec["train_loss"].append(round(loss.item(), 5))
    rec["final"] = rec["finals"][str(a["steps"])]
    # the median step: the first steps of a converted arm may build kernels (a cold cache), which is not per-step cost
    rec.update(steps=steps, cpu_s=cpu, wall_s=wall, cpu_s_per_step=float(np.median(rec["step_cpu"])),
               wall_s_per_step=wall / steps)
    return rec


# ---------------------------------------------------------------- orchestration

def resumed(partial: Path, fresh: dict, specs: list) -> tuple[dict, float, list]:
    """A cut-short run's results, its elapsed seconds and the specs it has not finished.

    Only a run with the same settings (arms and workers aside) continues: a finished run of other
    settings would not pair with the new ones."""
    if not partial.is_file():
        raise SystemExit(f"study_llm: --resume: {partial} not found (nothing to resume; run without --resume)")
    old = json.loads(partial.read_text())
    differ = sorted(k for k in fresh["config"] if k not in ("arms", "workers", "resume")
                    and old["config"].get(k) != fresh["config"][k])
    if differ:
        raise SystemExit(f"study_llm: --resume: {partial} was run with other settings ({', '.join(differ)}); "
                         "give the same settings or another --out")
    done = {(int(seed), arm) for seed, arms in old["runs"].items() for arm in arms}
    old["command"] += " ; python -m samples.study_llm " + " ".join(fresh["command"].split()[3:])
    old["config"]["arms"] = sorted(set(old["config"]["arms"]) | set(fresh["config"]["arms"]),
                                   key=list(ARMS).index)
    print(f"resuming: {len(done)} runs kept, {sum((s['seed'], s['arm']) not in done for s in specs)} to run",
          file=sys.stderr, flush=True)
    return old, old.get("elapsed_s", 0.0), [s for s in specs if (s["seed"], s["arm"]) not in done]

def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        from samples import study_llm_report

        study_llm_report.write_all(json.loads((out / "results.json").read_text()), out)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    a = {k: v for k, v in vars(args).items() if k not in ("argv", "report_only", "out")}
    specs = []  # arm-major in the order given: a run cut short has whole arms
    for arm in args.arms:
        for seed in range(args.seeds):
            steps = round(args.steps * EXTRA) if arm == "continue" else args.steps
            specs.append({"arm": arm, "seed": seed, "steps": steps, "args": a})
    results = {"command": "python -m samples.study_llm " + " ".join(args.argv), "config": a,
               "environment": {"python": platform.python_version(), "cpu_count": multiprocessing.cpu_count(),
                               "workers": args.workers, "threads_per_worker": 1},
               "runs": {}}
    earlier = 0.0
    if args.resume:
        results, earlier, specs = resumed(out / "results.partial.json", results, specs)
    start = time.perf_counter() - earlier
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        futures = {pool.submit(run_arm, s): s for s in specs}
        for fut in as_completed(futures):
            rec = fut.result()
            results["runs"].setdefault(str(rec["seed"]), {})[rec["arm"]] = rec
            results["elapsed_s"] = time.perf_counter() - start
            (out / "results.partial.json").write_text(json.dumps(results))
            print(f"done: {rec['arm']} seed {rec['seed']} final {rec['final']:.4f} "
                  f"[{(time.perf_counter() - start) / 60:.0f} min]", file=sys.stderr, flush=True)
    from samples import study_llm_report

    study_llm_report.write_all(results, out)
    (out / "results.partial.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
