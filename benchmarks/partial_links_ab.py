"""One phase-1 partial over a long history as chains of links of different lengths, side by side,
hot and cold: the TVM kernels (kernels/tensorir.py, schedule.py) of this checkout, 1 thread.

A chain of links of at most K sources (kernels/cache.py, partial_links) passes its state [queries,
rows, D] from link to link through memory; one link per history (K >= history) has no such
traffic but a kernel per history length. Each form is checked against the first (the normalised
sums acc / l), then timed in interleaved rounds: hot (inputs in cache, the call repeated) and
cold (a 64 MB sweep before each single call, as the sources are in a model's forward; the sweep
is not timed). The first form is timed twice (an identical copy: the noise floor).

    python benchmarks/partial_links_ab.py [--history 43] [--queries 7] [--links 8 15 22 43]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import tvm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnres_compile.bench import timing  # noqa: E402
from attnres_compile.kernels.schedule import build  # noqa: E402
from attnres_compile.kernels.target import host_target  # noqa: E402
from attnres_compile.kernels.tensorir import depth_attention_partial_func  # noqa: E402


def chain(history: int, queries: int, size: int, most: int, built: dict):
    """[(kernel, first source, end)] of a chain of links of at most `most` sources."""
    bounds = [*range(0, history, most), history]
    links = []
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        key = (end - start, i > 0)
        if key not in built:
            func = depth_attention_partial_func(end - start, queries, size, start=i > 0)
            t = time.perf_counter()
            built[key] = build(func, host_target(1))[func.attrs["global_symbol"]]
            print(f"# built the link of {key[0]} sources{' (continuing)' if key[1] else ''} in "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
        links.append((built[key], start, end))
    return links


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", type=int, default=43)
    parser.add_argument("--queries", type=int, default=7)
    parser.add_argument("--links", type=int, nargs="+", default=[8, 15, 22, 43], help="most sources per link")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=150)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    def tensor(*shape):
        return tvm.runtime.tensor(rng.standard_normal(shape).astype("float32"))
    sources = [tensor(args.rows, args.size) for _ in range(args.history)]
    w = tensor(args.queries, args.size)
    states = [[tensor(args.queries, args.rows), tensor(args.queries, args.rows), tensor(args.queries, args.rows, args.size)]
              for _ in range(args.history + 1)]
    built, calls, sums = {}, {}, {}
    for most in args.links:
        links = chain(args.history, args.queries, args.size, most, built)
        def call(links=links):
            for i, (fn, start, end) in enumerate(links):
                fn(*sources[start:end], w, *(states[i - 1] if i else []), *states[i])
            return states[len(links) - 1]
        m, l, acc = call()
        sums[most] = acc.numpy() / l.numpy()[..., None]
        calls[f"links of {most}"] = call
    first = args.links[0]
    for most, value in sums.items():
        err = float(np.abs(value - sums[first]).max())
        print(f"# links of {most}: max abs diff {err:.2e} against links of {first}")
        assert err <= 1e-5 * max(float(np.abs(sums[first]).max()), 1e-30), "the forms disagree"
    calls[f"links of {first} (copy)"] = calls[f"links of {first}"]
    print(f"# history {args.history} sources x {args.queries} queries, rows {args.rows}, D {args.size}, 1 thread, "
          f"process CPU time, median of {args.rounds} interleaved rounds; x = median of this / links of {first}")
    hot = timing.interleaved_clocks(calls, max(args.rounds // 10, 5), 0.05)
    sweep = np.ones(16 << 20, np.float32)
    cold = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            sweep += 1
            t = time.process_time()
            fn()
            cold[name].append(time.process_time() - t)
    for title, samples in (("hot", {k: v["cpu"] for k, v in hot.items()}), ("cold", cold)):
        base = samples[f"links of {first}"]
        print(f"## {title}")
        for name, values in samples.items():
            low, high, cover = timing.ratio_interval(values, base)
            print(f"{name:>22}  {np.median(values) * 1e6:9.1f} us  x{timing.paired_ratio(values, base):.3f}"
                  f"  ({low:.3f} .. {high:.3f}, {cover:.0%})")


if __name__ == "__main__":
    main()
