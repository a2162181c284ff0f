"""The eager forward with one-core (serial) site kernels against the same kernels with a parallel
row loop, side by side in one process: the cost of entering TVM's thread pool for one-thread calls.

    python benchmarks/eager_pool_ab.py --models gpt,llama --sublayers 24 --rounds 80

Torch runs on 1 thread; TVM's pool has TVM_NUM_THREADS workers (default: the CPU count, as in
a user's process). Each round runs the original, then Block and Full with each kernel set,
timing process CPU time; the table gives medians over the rounds and the overhead over the
original. With TVM_NUM_THREADS=1 the two sets should agree (TVM then runs a parallel loop inline).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from attnres_compile import fused
from attnres_compile.bench.model import make_inputs, make_model, make_variants
from attnres_compile.kernel_cache import Spec, get


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
    p.add_argument("--rounds", type=int, default=80)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS', 'unset (the CPU count)')}, torch 1 thread, "
          f"width {args.width}, {args.sublayers} sublayers, seq 128, Block N=8, {args.rounds} rounds, process CPU time")
    print(f"{'model':6s} {'variant':8s} {'kernels':9s} {'ms':>8s} {'overhead':>9s}")
    for name in args.models.split(","):
        model = make_model(name, args.sublayers // 2, args.width, 128)
        inputs = tuple(torch.from_numpy(a) for a in make_inputs(1, 128).values())
        modules = {v.name: v.program.module() for v in make_variants(model, inputs, 8)}
        with torch.no_grad():
            for module in modules.values():
                module(*inputs)  # loads (or builds) the one-core kernels
            sets = kernel_sets()
            runs = [("original", None)] + [(v, k) for v in ("block", "full") for k in sets]
            times: dict[tuple, list[float]] = {run: [] for run in runs}
            for _ in range(args.rounds):
                for variant, kernels in runs:
                    if kernels:
                        fused._KERNELS.update(sets[kernels])
                    start = time.process_time()
                    modules[variant](*inputs)
                    times[(variant, kernels)].append(time.process_time() - start)
        base = statistics.median(times[runs[0]])
        for (variant, kernels), t in times.items():
            ms = statistics.median(t)
            print(f"{name:6s} {variant:8s} {kernels or '-':9s} {ms * 1e3:8.2f} {(ms / base - 1) * 100:+8.1f}%")


if __name__ == "__main__":
    main()
