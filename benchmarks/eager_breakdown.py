"""Where the eager forward's AttnRes overhead goes: the fused kernels, and everything else.

    python benchmarks/eager_breakdown.py --models gpt --sublayers 24 --rounds 20

Torch on 1 thread, process CPU time, interleaved rounds in one process (bench/timing.py). Per
model: the original, an identical copy (the noise floor), Full and Block as they run, Full after
`two_phase` (partial + merges where a history is long), and Full and Block with every fused kernel
call replaced by a copy of its first source into the output (the same graph, op calls and history;
"no kernel"), each with its paired overhead over the original and the CPU time per forward spent
inside the kernel calls; then two-phase Full over one-pass Full, with its interval. (Llama at 48
sublayers: the two-phase and Block modules read 35-50 ms per forward slower in this loop than in
direct calls or `bench model`, cause unknown: README, "Two-phase Full in eager PyTorch".) Then,
per source count, one kernel call over [128, D] sources just evicted from the caches, against
torch's own `sum` over the same cold sources (a read-only pass) and the same call on hot sources:
whether the kernel reads cold sources as fast as torch does.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from attnres_compile import op, two_phase
from attnres_compile.bench.model import make_inputs, make_model, make_variants
from attnres_compile.bench.timing import interleaved_clocks, paired_ratio, ratio_interval
from attnres_compile.kernels import fused


class Kernels:
    """Wraps fused._run: counts the CPU time inside the kernel calls, or (skip) replaces each
    call by a copy of its first tensor into its output."""

    def __init__(self):
        self.run, self.seconds, self.skip = fused._run, 0.0, False

    def __call__(self, fn, device, args, threads):
        if self.skip:
            args[-1].copy_(args[0])
            return
        start = time.process_time()
        self.run(fn, device, args, threads)
        self.seconds += time.process_time() - start


def models(args, kernels: Kernels) -> None:
    print(f"torch 1 thread, width {args.width}, {args.sublayers} sublayers, seq 128, Block N=8, "
          f"{args.rounds} rounds, process CPU time")
    print(f"{'model':6s} {'variant':16s} {'ms':>8s} {'overhead':>9s} {'kernels ms':>11s}")
    for name in args.models.split(","):
        model = make_model(name, args.sublayers // 2, args.width, 128)
        inputs = tuple(torch.from_numpy(a) for a in make_inputs(1, 128).values())
        modules = {v.name: v.program.module() for v in make_variants(model, inputs, 8)}
        modules["copy"] = copy.deepcopy(modules["original"])
        modules["full two-phase"] = two_phase(copy.deepcopy(modules["full"])).graph_module
        spent: dict[str, list[float]] = {}

        def call(variant: str, skip: bool = False):
            label = variant + (" (no kernel)" if skip else "")
            spent[label] = []

            def run():
                kernels.skip, kernels.seconds = skip, 0.0
                modules[variant](*inputs)
                spent[label].append(kernels.seconds)
            return label, run

        with torch.no_grad():
            candidates = dict(call(v) for v in ("original", "copy", "full", "full two-phase", "block"))
            candidates.update(call(v, skip=True) for v in ("full", "block"))
            cpu = {c: s["cpu"] for c, s in interleaved_clocks(candidates, args.rounds, 0.0).items()}
        kernels.skip = False  # the next model's rewrite is verified with the kernels running
        base = cpu["original"]
        for label, t in cpu.items():
            print(f"{name:6s} {label:16s} {statistics.median(t) * 1e3:8.2f} {(paired_ratio(t, base) - 1) * 100:+8.1f}% "
                  f"{statistics.median(spent[label]) * 1e3:11.2f}")
        low, high, coverage = ratio_interval(cpu["full two-phase"], cpu["full"])
        print(f"{name:6s} two-phase / one-pass Full: x{paired_ratio(cpu['full two-phase'], cpu['full']):.3f} "
              f"({low:.3f} ... {high:.3f}, {coverage:.0%})")


def cold_reads(args) -> None:
    rows, size = 128, args.width
    evict = torch.ones(64 * 2**20 // 4)  # 64 MiB: more than the last-level cache
    query = torch.randn(size) / size**0.5
    print(f"\none kernel call over S sources of [{rows}, {size}] float32, median of {args.rounds} (us; GB/s read)")
    print(f"{'S':>3s} {'kernel, cold':>18s} {'torch sum, cold':>18s} {'kernel, hot':>18s}")
    for count in (2, 5, 9, 25):
        sources = [torch.randn(1, rows, size) for _ in range(count)]
        op.depth_attention(sources, query, 1e-6, 1.0, -1)  # builds or loads the kernel
        kernel = next(v for k, v in fused._KERNELS.items() if k[:2] == ("forward", count) and v)
        out = torch.empty(1, rows, size)
        times: dict[str, list[float]] = {"cold": [], "sum": [], "hot": []}
        for _ in range(args.rounds):
            for what in times:
                if what == "hot":
                    kernel(*sources, query, out)  # the sources now in cache
                else:
                    evict.add_(1.0)
                start = time.perf_counter()
                if what == "sum":
                    for s in sources:
                        s.sum()
                else:
                    kernel(*sources, query, out)
                times[what].append(time.perf_counter() - start)
        nbytes = count * rows * size * 4
        cells = [f"{statistics.median(v) * 1e6:7.0f} ({nbytes / statistics.median(v) / 1e9:4.1f})" for v in times.values()]
        print(f"{count:3d} " + " ".join(f"{c:>18s}" for c in cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt")
    p.add_argument("--sublayers", type=int, default=24)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--only", choices=("models", "reads"), help="run one of the two parts")
    args = p.parse_args()
    torch.set_num_threads(1)
    kernels = fused._run = Kernels()
    if args.only != "reads":
        models(args, kernels)
    if args.only != "models":
        cold_reads(args)


if __name__ == "__main__":
    main()
