"""Fine-tuning a converted pretrained LLM: does the converted model track the original?

SmolLM2-135M (samples/smollm2.py) is rewritten to AttnRes (exact at init) and fine-tuned beside
the original on the same batches of real text (pydoc topics), with the same optimizer and
learning rate: the original the usual way; the converted model once the usual way (one parameter
group: the first steps only, to show what goes wrong), once with the recommended recipe
(`attnres_compile.training.param_groups` + `query_warmup`), and once with its queries frozen (the
control: the converted model's weights then get the original's gradients up to rounding, so its
deviation is what rounding alone grows into under that optimizer). Reported per arm: the training loss at
every step and the largest relative deviation from the original's loss at the same step; and the
gradient norms at step 0 (pseudo-queries against all other weights), the reason for the recipe.

`--watch-every N --watch-out DIR` watches the recipe arm's depth weights every N steps
(`attnres_compile.monitor.DepthMonitor`, with a `CollapseController` at its defaults) and writes,
per recipe, DIR/RECIPE/weights.csv (one row per step, site and source), weights_over_steps.png and
watch.txt (the last watched step's table, the controller's actions, watched and unwatched step times).

    python benchmarks/finetune_pretrained.py --steps 50 --out finetune.json
    python benchmarks/finetune_pretrained.py --steps 20 --recipes adamw-3e-4 --watch-every 5 --watch-out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from attnres_compile import AttnResConfig, rewrite  # noqa: E402
from attnres_compile.monitor import CollapseController, DepthMonitor, find_collapse, format_stats  # noqa: E402
from attnres_compile.utils.pytree_warning import deepcopy  # noqa: E402
from attnres_compile.training import QUERY_LR_SCALE, is_query, param_groups, query_warmup  # noqa: E402
from samples import smollm2  # noqa: E402

RECIPES = {"sgd-1e-2": ("sgd", 1e-2), "adamw-1e-4": ("adamw", 1e-4), "adamw-3e-4": ("adamw", 3e-4)}


def batches(tokenizer, steps: int, batch: int, seq: int):
    ids = tokenizer(smollm2.text(400_000), return_tensors="pt")["input_ids"][0]
    rows = ids[: steps * batch * (seq + 1)].view(steps, batch, seq + 1)
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


def loss_of(model, x, y):
    out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def optimizer(kind: str, params, lr: float):
    return torch.optim.SGD(params, lr=lr) if kind == "sgd" else torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def train(model, data, kind: str, lr: float, recipe: bool, frozen: bool = False,
          query_lr_scale: float = QUERY_LR_SCALE, watch: dict | None = None) -> list[float]:
    """The loss at each step. `watch` ({"every", "out"}): the depth weights watched (module docstring);
    it receives the monitor, the controller and each step's CPU seconds."""
    if recipe or frozen:
        groups = param_groups(model, lr, weight_decay=0.0 if kind == "sgd" else 0.01, query_lr_scale=query_lr_scale)
        if frozen:
            groups[1]["lr"] = 0.0
        opt = optimizer(kind, groups, lr)
        sched = query_warmup(opt)
    else:
        opt, sched = optimizer(kind, model.parameters(), lr), None
    monitor = contextlib.nullcontext
    if watch is not None:
        watch["monitor"] = DepthMonitor(model, every=watch["every"], csv=watch["out"] / "weights.csv")
        watch["controller"], watch["cpu_s"] = CollapseController(opt, model), []
        monitor = watch["monitor"].watch
    losses = []
    for step, (x, y) in enumerate(data):
        cpu = time.process_time()
        opt.zero_grad(set_to_none=True)
        with monitor(step):
            loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
        if watch is not None:
            watch["cpu_s"].append(time.process_time() - cpu)
            if watch["monitor"].watching(step):
                watch["controller"].update(watch["monitor"].stats())
    return losses


def watch_report(watch: dict, out: Path) -> None:
    """weights_over_steps.png and watch.txt in `out` (the module docstring)."""
    from attnres_compile.utils.plots import plot_weights_over_steps

    monitor, controller = watch["monitor"], watch["controller"]
    history = monitor.history
    plot_weights_over_steps(history, out / "weights_over_steps.png",
                            title="SmolLM2-135M, the recipe arm: mean depth weight per source over steps")
    watched = [t for i, t in enumerate(watch["cpu_s"]) if monitor.watching(i)]
    unwatched = [t for i, t in enumerate(watch["cpu_s"]) if not monitor.watching(i)]
    last = history[-1]
    lines = [f"watched steps {[h['step'] for h in history]} of {len(watch['cpu_s'])}; CPU seconds per step (process, "
             f"forward + backward + AdamW; a shared machine): watched {statistics.median(watched):.2f} "
             f"(median of {len(watched)}), unwatched {statistics.median(unwatched):.2f} (median of {len(unwatched)})",
             f"controller actions: {controller.actions or 'none'}", "",
             f"step {last['step']} (the last watched):", format_stats(last, find_collapse(last))]
    (out / "watch.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:2]), flush=True)


def grad_norms(gm, x, y) -> dict:
    gm.zero_grad(set_to_none=True)
    loss_of(gm, x, y).backward()
    q = torch.sqrt(sum((p.grad.double() ** 2).sum() for n, p in gm.named_parameters() if is_query(n) and p.grad is not None))
    w = torch.sqrt(sum((p.grad.double() ** 2).sum() for n, p in gm.named_parameters() if not is_query(n) and p.grad is not None))
    gm.zero_grad(set_to_none=True)
    return {"queries": q.item(), "weights": w.item()}


def deviation(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--plain-steps", type=int, default=10, help="steps of the converted model trained the usual way")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--variant", choices=["block", "full"], default="block")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    p.add_argument("--query-lr-scale", type=float, default=QUERY_LR_SCALE, help="the recipe's query learning-rate scale")
    p.add_argument("--watch-every", type=int, help="watch the recipe arm's depth weights every N steps")
    p.add_argument("--watch-out", help="folder for the watched weights (CSV, plot, table)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if (args.watch_every is None) != (args.watch_out is None):
        p.error("--watch-every and --watch-out go together")
    torch.manual_seed(0)
    model, tokenizer = smollm2.load()
    data = batches(tokenizer, args.steps, args.batch, args.seq)
    x0 = data[0][0]
    config = AttnResConfig(variant=args.variant, num_blocks=args.blocks if args.variant == "block" else None)
    start = time.perf_counter()
    gm = rewrite(model, {"input_ids": x0, "attention_mask": torch.ones_like(x0), "use_cache": False}, config).graph_module
    result = {"args": vars(args), "rewrite_seconds": time.perf_counter() - start,
              "grad_norms_step0": grad_norms(gm, *data[0]), "arms": {}}
    print(f"step-0 gradient norms: queries {result['grad_norms_step0']['queries']:.2f}, "
          f"all other weights {result['grad_norms_step0']['weights']:.2f}", flush=True)
    for name in args.recipes:
        kind, lr = RECIPES[name]
        t = time.perf_counter()
        original = train(copy.deepcopy(model), data, kind, lr, recipe=False)
        plain = train(deepcopy(gm), data[: args.plain_steps], kind, lr, recipe=False)
        watch = {"every": args.watch_every, "out": Path(args.watch_out) / name} if args.watch_every else None
        recommended = train(deepcopy(gm), data, kind, lr, recipe=True, query_lr_scale=args.query_lr_scale, watch=watch)
        if watch is not None:
            watch_report(watch, watch["out"])
        frozen = train(deepcopy(gm), data, kind, lr, recipe=False, frozen=True)
        arm = {"original": original, "converted_plain": plain, "converted_recipe": recommended,
               "converted_frozen": frozen, "max_rel_dev_plain": deviation(plain, original),
               "max_rel_dev_recipe": deviation(recommended, original), "max_rel_dev_frozen": deviation(frozen, original),
               "seconds": time.perf_counter() - t}
        result["arms"][name] = arm
        print(f"{name:<11} original {original[0]:.3f} -> {original[-1]:.3f}; converted the usual way: max deviation "
              f"{100 * arm['max_rel_dev_plain']:.1f}% over {len(plain)} steps (loss {max(plain):.2f} at worst); with "
              f"the recipe: {100 * arm['max_rel_dev_recipe']:.3f}% over {len(recommended)} steps; queries frozen "
              f"(control): {100 * arm['max_rel_dev_frozen']:.3f}% [{arm['seconds']:.0f} s]", flush=True)
        if args.out:  # after every recipe: a run cut short keeps the recipes it finished (~14 min each for Full)
            Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
