"""The eager forward with one-core (serial) site kernels against the same kernels with a parallel
row loop, side by side in one process: the cost of entering TVM's thread pool for one-thread calls.

    python benchmarks/eager_pool_ab.py --models gpt,llama --sublayers 24 --rounds 60

Torch runs on 1 thread; TVM's pool has TVM_NUM_THREADS workers (default: the CPU count, as in
a user's process). The original, an identical copy of it (the noise floor), and Block and Full
with each kernel set are timed in interleaved rounds (bench/timing.py; by default one forward per
candidate and round: on a shared machine finer alternation cancels more drift); the table gives each
one's process CPU time per forward (median over rounds) and its paired ratio over the original.
With TVM_NUM_THREADS=1 the two sets should agree (TVM then runs a parallel loop inline).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics

import torch

from attnres_compile.bench.model import make_inputs, make_model, make_variants
from attnres_compile.bench.timing import interleaved_clocks, paired_ratio
from attnres_compile.kernels import fused
from attnres_compile.kernels.cache import Spec, get


def kernel_sets() -> dict[str, dict]:
    """The op's forward kernels as loaded so far (one-core: serial), and each rebuilt for two cores
    (a parallel row loop), under the same keys."""
    serial = {k: v for k, v in fused._KERNELS.items() if v is not False and k[-1] == 1}
    parallel = {}
    for key in serial:
        kind, count, dtype, device, rank, size, _, eps, scale, _ = key
        parallel[key] = get(Spec(kind, count, rank, size, fused._DTYPES[dtype], float(eps), float(scale), "cpu", 2))
    return {"serial": serial, "parallel": parallel}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,llama")
    p.add_argument("--sublayers", type=int, default=24)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--min-time", type=float, default=0.0, help="seconds per candidate and round (0: one forward)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS', 'unset (the CPU count)')}, torch 1 thread, "
          f"width {args.width}, {args.sublayers} sublayers, seq 128, Block N=8, {args.rounds} rounds, process CPU time")
    print(f"{'model':6s} {'variant':8s} {'kernels':9s} {'ms':>8s} {'overhead':>9s}")
    for name in args.models.split(","):
        model = make_model(name, args.sublayers // 2, args.width, 128)
        inputs = tuple(torch.from_numpy(a) for a in make_inputs(1, 128).values())
        modules = {v.name: v.program.module() for v in make_variants(model, inputs, 8)}
        modules["copy"] = copy.deepcopy(modules["original"])
        with torch.no_grad():
            for module in modules.values():
                module(*inputs)  # loads (or builds) the one-core kernels
            sets = kernel_sets()

            def call(variant: str, kernels: str | None = None):
                def run():
                    if kernels:
                        fused._KERNELS.update(sets[kernels])
                    modules[variant](*inputs)
                return run

            candidates = {("original", None): call("original"), ("copy", None): call("copy"),
                          **{(v, k): call(v, k) for v in ("block", "full") for k in sets}}
            cpu = {c: s["cpu"] for c, s in interleaved_clocks(candidates, args.rounds, args.min_time).items()}
        base = cpu[("original", None)]
        for (variant, kernels), t in cpu.items():
            print(f"{name:6s} {variant:8s} {kernels or '-':9s} {statistics.median(t) * 1e3:8.2f} "
                  f"{(paired_ratio(t, base) - 1) * 100:+8.1f}%")


if __name__ == "__main__":
    main()
