"""What watching the depth weights costs a training step: `DepthMonitor` on and off its watched steps.

One training step (forward, backward, AdamW step) of a rewritten model, 1-thread CPU time
(`time.process_time`), four candidates timed in alternating rounds (attnres_compile.bench.timing):
`plain` (no monitor), `plain copy` (the same call again: the noise control), `unwatched` (inside
`monitor.watch(step)` on a step it does not watch) and `watched` (on a step it watches: weights,
entropy and RMS of every site computed from the op's own inputs). All four train the same module
and optimizer, so they do the same work but for the monitor. A busy machine widens the ratios'
intervals, so the monitor's own CPU time in a watched step (its observer's calls, and the
read-out as the step ends) is also clocked directly, and given as a share of the plain step. Models: a tiny char GPT (width 64, 4
layers, Full) and a Llama of SmolLM2-135M's shape (width 576, 30 layers, GQA 9/3, random weights,
Block N=8, as in docs/finetune.md).

    python benchmarks/monitor_overhead.py --out benchmarks/runs/2026-12-05-monitor
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from attnres_compile import AttnResConfig, rewrite  # noqa: E402
from attnres_compile.bench.timing import interleaved_clocks, paired_ratio, ratio_interval, side_by_side  # noqa: E402
from attnres_compile.monitor import DepthMonitor  # noqa: E402
from attnres_compile.training import param_groups  # noqa: E402


def tiny():
    """(rewritten module, tokens, what it is): a char GPT, width 64, 4 layers, Full AttnRes, 8 x 64 tokens."""
    from samples.models import GPT

    model = GPT(vocab=64, dim=64, layers=4, heads=4, max_len=64).eval()
    x = torch.randint(0, 64, (8, 65), generator=torch.Generator().manual_seed(1))
    gm = rewrite(model, (x[:, :-1],), AttnResConfig(variant="full"), verify_outputs=False).graph_module
    return gm, x, "GPT width 64, 4 layers (8 sublayers), Full, 8 x 64 tokens", lambda m, ids: m(ids)


def smollm2_shape():
    """A Llama of SmolLM2-135M's shape (random weights), Block N=8, 2 x 64 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    x = torch.randint(0, 49152, (2, 65), generator=torch.Generator().manual_seed(1))
    ids = x[:, :-1]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    gm = rewrite(model, inputs, AttnResConfig(variant="block", num_blocks=8), verify_outputs=False).graph_module
    return gm, x, "Llama width 576, 30 layers (60 sublayers; SmolLM2-135M's shape), Block N=8, 2 x 64 tokens", \
        lambda m, ids: m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


def measure(build, rounds: int) -> dict:
    gm, tokens, what, logits_of = build()
    gm.train()
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(param_groups(gm, lr=1e-4, weight_decay=0.01), lr=1e-4)
    monitor = DepthMonitor(gm, every=2)
    own = {"observer": [], "read_out": []}
    observe, stats = monitor._observe, monitor.stats

    def clocked(fn, into):
        def run(*args):
            start = time.process_time()
            result = fn(*args)
            own[into][-1] += time.process_time() - start
            return result
        return run

    monitor._observe, monitor.stats = clocked(observe, "observer"), clocked(stats, "read_out")

    def step():
        loss = F.cross_entropy(logits_of(gm, x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def watched_at(n):
        def run():
            own["observer"].append(0.0)
            own["read_out"].append(0.0)
            with monitor.watch(n):
                step()
        return run

    samples = interleaved_clocks({"plain": step, "plain copy": step, "unwatched": watched_at(1), "watched": watched_at(0)},
                                 rounds=rounds, min_time=0.5)
    sites = len(stats()["sites"])
    plain_ms = statistics.median(samples["plain"]["cpu"]) * 1e3
    watched = [i for i in range(len(own["observer"])) if own["observer"][i] > 0]
    result = {"model": what, "sites": sites, "rounds": rounds,
              "cpu_ms": {k: statistics.median(v["cpu"]) * 1e3 for k, v in samples.items()}, "ratio": {},
              "monitor_ms": {k: statistics.median(own[k][i] for i in watched) * 1e3 for k in own}}
    for name in ("plain copy", "unwatched", "watched"):
        low, high, cover = ratio_interval(samples[name]["cpu"], samples["plain"]["cpu"])
        result["ratio"][name] = {"median": paired_ratio(samples[name]["cpu"], samples["plain"]["cpu"]),
                                 "low": low, "high": high, "coverage": cover}
    result["lines"] = side_by_side(samples, "plain") + [
        f"the monitor's own CPU time in a watched step (median of {len(watched)}): observer "
        f"{result['monitor_ms']['observer']:.2f} ms ({sites} sites, {result['monitor_ms']['observer'] / sites * 1e3:.0f} us a site), "
        f"read-out {result['monitor_ms']['read_out']:.2f} ms; together "
        f"{100 * sum(result['monitor_ms'].values()) / plain_ms:.1f}% of the plain step"]
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=["tiny", "576"], default=["tiny", "576"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results, lines = [], []
    for name in args.models:
        r = measure(tiny if name == "tiny" else smollm2_shape, args.rounds)
        results.append(r)
        lines += [f"{r['model']}: {r['sites']} sites; training step (forward, backward, AdamW), 1-thread CPU time, "
                  f"median of {r['rounds']} interleaved rounds, ratio to plain (interval, coverage):", *r["lines"], ""]
        print("\n".join(lines[-(len(r["lines"]) + 2):]), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "overhead.json").write_text(json.dumps(results, indent=1))
        (out / "overhead.txt").write_text("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
