"""Rewrite-then-train: a character-level GPT on Python's own docs (`pydoc_data.topics`), on the CPU.

Five runs, same seed, same initial weights, same steps and same token batches:
  baseline                 the PreNorm GPT as written
  full, block              that initial model rewritten to Full / Block AttnRes (`--scale`), trained from scratch
  full-convert, block-convert
                           the baseline at step `--convert-at` rewritten with scale=preserve (its validation
                           loss must equal the baseline's there: asserted), then trained on to the end with
                           the baseline's Adam state carried over (the new pseudo-queries start fresh)

The rewritten models are torch.export GraphModules traced at the training batch shape, so
training and validation batches all have that shape. GPT has no dropout, so train and eval
modes are the same and no run switches mode. Writes to `--out`: results.json (first),
val_loss.png, weights_<run>.png (site x source heatmaps), magnitude.png (stream RMS by depth)
and <run>.pt2 (the trained rewritten programs, for `monitor.inspect_weights`).

    python -m samples.train_tiny_lm --out runs/tiny_lm          # about 4 min on 2 idle cores
    python -m samples.train_tiny_lm --tiny --out /tmp/tiny      # seconds, for tests
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from attnres_compile.monitor import DepthMonitor, find_collapse, log_stats, record, tensorboard_writer, trace_sites
from samples.char_lm import attnres, build_model, evaluate, load_text, lr_factor, make_opt, train_step, windows

RUNS = ("baseline", "full", "block", "full-convert", "block-convert")
PAPER = {"note": "arXiv 2603.15031, 16-layer ablation, validation loss", "baseline": 1.766, "full": 1.737, "block": 1.746}
TINY = dict(layers=2, dim=32, heads=2, batch=4, seq=32, steps=8, eval_every=4, eval_batches=2, blocks=2)
CONVERT_TOL = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/tiny_lm")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--convert-at", type=int, help="baseline step the convert runs start from (default: steps // 2)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--blocks", type=int, default=4, help="number of blocks N for the block runs")
    p.add_argument("--scale", choices=["paper", "preserve"], default="paper", help="output scale of the from-scratch runs")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensorboard", action="store_true", help="also log to OUT/tensorboard (needs tensorboard)")
    p.add_argument("--tiny", action="store_true", help=f"a seconds-long size for tests (flags given still win): {TINY}")
    argv = sys.argv[1:] if argv is None else argv
    if "--tiny" in argv:
        p.set_defaults(**TINY)
    args = p.parse_args(argv)
    args.warmup = min(args.warmup, args.steps // 4)
    args.convert_at = args.steps // 2 if args.convert_at is None else args.convert_at
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown:
        p.error(f"unknown runs {unknown}; choose from {RUNS}")
    if any(r.endswith("-convert") for r in args.runs) and "baseline" not in args.runs:
        p.error("the convert runs start from the baseline: include baseline in --runs")
    if not 0 < args.convert_at < args.steps:
        p.error(f"--convert-at must be inside (0, {args.steps})")
    return args


def train(name, model, opt, args, data, val_batches, start, writer=None, expect=None, snapshot_at=None) -> dict:
    """Train `model` from step `start` to `args.steps`; returns its record.

    `expect`: the validation loss the model must have at `start` (conversion check).
    `snapshot_at`: step at which the weights and Adam state are kept (record["snapshot"]).
    """
    monitor = DepthMonitor(model) if isinstance(model, torch.fx.GraphModule) else None
    evals = set(range(start, args.steps, args.eval_every)) | {start, args.steps}
    rec = {"start_step": start, "val": [], "train_loss": []}
    t0, eval_s = time.perf_counter(), 0.0
    for step in range(start, args.steps + 1):
        if step in evals:
            te = time.perf_counter()
            loss, stats = evaluate(model, val_batches, monitor)
            eval_s += time.perf_counter() - te
            rec["val"].append([step, loss])
            print(f"  {name:<14} step {step:>5}  val {loss:.4f}", flush=True)
            if expect is not None and step == start and abs(loss - expect) > CONVERT_TOL:
                raise AssertionError(f"{name}: val loss after the preserve rewrite is {loss:.6f}, baseline had {expect:.6f}")
            if stats is not None:
                rec.setdefault("entropy", []).append([step, [s["entropy"] for s in stats["sites"]]])
                rec["depth"] = stats
                log_stats(writer, stats, step, prefix=name)
            if writer is not None:
                writer.add_scalar(f"val_loss/{name}", loss, step)
        if step == snapshot_at:
            rec["snapshot"] = {"model": copy.deepcopy(model.state_dict()),
                               "adam": {n: copy.deepcopy(opt.state[p]) for n, p in model.named_parameters() if p in opt.state}}
        if step == args.steps:
            break
        x, y = data[step]
        rec["train_loss"].append(train_step(model, opt, x, y, lr_factor(step, args.steps, args.warmup)))
    rec["seconds"] = time.perf_counter() - t0
    rec["train_seconds"] = rec["seconds"] - eval_s
    rec["final"] = rec["val"][-1][1]
    return rec


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_ids, val_ids, vocab = load_text()
    gen = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(train_ids) - args.seq - 1, (args.steps, args.batch), generator=gen)
    data = [windows(train_ids, s, args.seq) for s in starts]
    val_starts = torch.linspace(0, len(val_ids) - args.seq - 2, args.eval_batches * args.batch).long()
    val_batches = [windows(val_ids, s, args.seq) for s in val_starts.view(args.eval_batches, args.batch)]
    example = data[0][0]
    writer = tensorboard_writer(out / "tensorboard") if args.tensorboard else None
    if args.tensorboard and writer is None:
        print("tensorboard is not installed: not logging to it")

    model0 = build_model(args.seed, len(vocab), args.layers, args.dim, args.heads, args.seq)
    n_params = sum(p.numel() for p in model0.parameters())
    print(f"{len(train_ids)} train / {len(val_ids)} val characters, vocab {len(vocab)}; GPT {args.layers}x{args.dim}, "
          f"{n_params / 1e6:.2f}M parameters; {args.steps} steps of {args.batch}x{args.seq} characters")
    scratch = [n for n in args.runs if not n.endswith("-convert")]
    # every from-scratch model is made before any trains: all start from model0's initial weights
    models = {name: model0 if name == "baseline" else attnres(model0, example, name, args.scale, args.blocks) for name in scratch}
    runs = {}
    for name in scratch:
        snap = args.convert_at if name == "baseline" else None
        runs[name] = train(name, models[name], make_opt(models[name], args.lr), args, data, val_batches, 0, writer, snapshot_at=snap)
    for name in [n for n in args.runs if n.endswith("-convert")]:
        base, snap = runs["baseline"], runs["baseline"]["snapshot"]
        model = build_model(args.seed, len(vocab), args.layers, args.dim, args.heads, args.seq)
        model.load_state_dict(snap["model"])
        gm = models[name] = attnres(model, example, name.split("-")[0], "preserve", args.blocks)
        expect = dict(map(tuple, base["val"]))[args.convert_at]
        runs[name] = train(name, gm, make_opt(gm, args.lr, snap["adam"]), args, data, val_batches, args.convert_at, writer, expect=expect)
        runs[name]["convert_check"] = {"baseline": expect, "rewritten": runs[name]["val"][0][1],
                                       "abs_diff": abs(runs[name]["val"][0][1] - expect)}
    runs.get("baseline", {}).pop("snapshot", None)
    if "baseline" in models:
        gm0, sites = trace_sites(models["baseline"], (example,))
        runs["baseline"]["depth"] = record(gm0, [x for x, _ in val_batches], sites)

    results = summarize(args, runs, len(vocab), n_params, len(train_ids), len(val_ids))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    save_artifacts(out, runs, models, val_batches[0][0])
    if writer is not None:
        writer.close()
    print_table(results)
    return results


def summarize(args, runs: dict, vocab: int, n_params: int, n_train: int, n_val: int) -> dict:
    base = runs.get("baseline", {}).get("final")
    for name, rec in runs.items():
        if base is not None:
            rec["delta_vs_baseline"] = rec["final"] - base
        if "entropy" in rec:  # a rewritten run
            rec["collapse"] = find_collapse(rec["depth"])
    return {"config": dict(vars(args)), "vocab": vocab, "params": n_params, "train_chars": n_train, "val_chars": n_val,
            "runs": runs, "paper_reference": PAPER}


def save_artifacts(out: Path, runs: dict, models: dict, example: torch.Tensor) -> None:
    """The rewritten programs (`.pt2`, with a validation batch as their example input), then plots if matplotlib is there."""
    rewritten = [n for n in models if n != "baseline"]
    for name in rewritten:
        torch.export.save(torch.export.export(models[name], (example,), strict=False), str(out / f"{name}.pt2"))
    try:
        from attnres_compile.utils.plots import plot_curves, plot_heatmap, plot_magnitude

        plot_curves({n: r["val"] for n, r in runs.items()}, out / "val_loss.png", "validation loss (nats/char)")
    except ImportError as exc:
        print(f"no plots: {exc}")
        return
    plot_magnitude({n: [s["rms"] for s in r["depth"]["sites"]] for n, r in runs.items()}, out / "magnitude.png",
                   "stream RMS at each site after training")
    for name in rewritten:
        plot_heatmap(runs[name]["depth"], out / f"weights_{name}.png", f"{name}: mean depth-attention weights")


def print_table(results: dict) -> None:
    print(f"\n{'run':<15}{'from step':>10}{'val loss':>10}{'vs base':>9}{'train s':>9}  collapse")
    for name, r in results["runs"].items():
        delta = f"{r['delta_vs_baseline']:+.4f}" if "delta_vs_baseline" in r else ""
        flags = len(r.get("collapse", []))
        print(f"{name:<15}{r['start_step']:>10}{r['final']:>10.4f}{delta:>9}{r['train_seconds']:>9.1f}  {flags}")
    ref = results["paper_reference"]
    print(f"paper (16 layers): baseline {ref['baseline']}, full {ref['full']}, block {ref['block']}")


if __name__ == "__main__":
    main()
