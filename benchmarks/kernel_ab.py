"""Side-by-side CPU time of the TVM site kernels of this checkout and of another one.

Builds each kernel (phase-1 partial `p:J:B`, a link continuing a partial's state `c:J:B`, one-pass site
`s:S`, merge `m:E`, backward `b:S`) from this
checkout's kernels (attnres_compile/kernels: tensorir.py, schedule.py) and from those of another checkout (`--other`, e.g.
`git worktree add /tmp/old REV`), checks that both compute the same numbers, and times them
interleaved at 1 thread on [rows, D] float32 sources: per round each build runs `--min-time`
seconds, and the figure is the median over rounds of (this / other). This checkout's build is
timed a second time as an identical copy (the noise floor).

    python benchmarks/kernel_ab.py --other /tmp/old p:25:7 p:42:7 p:7:6 s:26 m:3 [--rows 128 --size 256]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from pathlib import Path

import numpy as np
import tvm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnres_compile.bench import timing  # noqa: E402
from attnres_compile.kernels.target import host_target  # noqa: E402


def kernels(checkout: Path, tag: str):
    """(definitions, schedule) modules of `checkout`'s kernels (attnres_compile/kernels, or
    backends/tvm's kernel.py and schedule.py before them), imported as a package of their own
    (`tag`), so that their relative imports resolve within that checkout."""
    home = checkout / "attnres_compile/kernels"
    package = types.ModuleType(tag)
    package.__path__ = [str(home if home.is_dir() else checkout / "attnres_compile/backends/tvm")]
    sys.modules[tag] = package
    return [importlib.import_module(f"{tag}.{name}") for name in ("tensorir" if home.is_dir() else "kernel", "schedule")]


def build(kernel, schedule, spec: str, size: int):
    """The compiled function of `spec` (p:J:B, c:J:B, s:S, m:E, b:S)."""
    kind, *n = spec.split(":")
    n = list(map(int, n))
    if kind == "p":
        func = kernel.depth_attention_partial_func(n[0], n[1], size)
    elif kind == "c":
        func = kernel.depth_attention_partial_func(n[0], n[1], size, start=True)
    elif kind == "b":
        func = kernel.depth_attention_backward_func(n[0], size)
    else:
        func = kernel.depth_attention_func(n[0], size) if kind == "s" else kernel.depth_attention_merge_func(n[0], size)
    return schedule.build(func, host_target(1))[func.attrs["global_symbol"]]


def arguments(spec: str, rows: int, size: int, rng) -> list:
    kind, *n = spec.split(":")
    n = list(map(int, n))
    def normal(*shape):
        return tvm.runtime.tensor(rng.standard_normal(shape).astype("float32"))
    def zeros(*shape):
        return tvm.runtime.tensor(np.zeros(shape, "float32"))
    if kind in ("p", "c"):
        J, B = n
        start = [zeros(B, rows), tvm.runtime.tensor(np.ones((B, rows), "float32")), normal(B, rows, size)] if kind == "c" else []
        return ([normal(rows, size) for _ in range(J)] + [normal(B, size)] + start
                + [zeros(B, rows), zeros(B, rows), zeros(B, rows, size)])
    if kind == "s":
        return [normal(rows, size) for _ in range(n[0])] + [normal(size), zeros(rows, size)]
    if kind == "b":
        S = n[0]
        return ([normal(rows, size) for _ in range(S)] + [normal(size), normal(rows, size)]
                + [zeros(rows, size) for _ in range(S)] + [zeros(size)])
    state = [tvm.runtime.tensor(np.zeros(rows, "float32")), tvm.runtime.tensor(np.ones(rows, "float32")), normal(rows, size)]
    return state + [normal(rows, size) for _ in range(n[0])] + [normal(size), zeros(rows, size)]


def outputs(spec: str) -> int:
    """How many of the trailing arguments the kernel writes."""
    kind, *n = spec.split(":")
    return int(n[0]) + 1 if kind == "b" else 3 if kind in ("p", "c") else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help="p:J:B (partial), c:J:B (partial continuing a state), s:S (site), "
                                                  "m:E (merge), b:S (backward)")
    parser.add_argument("--other", type=Path, required=True, help="the other checkout")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--min-time", type=float, default=0.05)
    args = parser.parse_args(argv)
    this, other = kernels(Path(__file__).resolve().parents[1], "this"), kernels(args.other.resolve(), "other")
    rng = np.random.default_rng(0)
    print(f"{'kernel':>10}  {'this us':>9}  {'other us':>9}  {'this/other':>10}  {'copy/this':>9}")
    for spec in args.specs:
        fns = {"this": build(*this, spec, args.size), "other": build(*other, spec, args.size)}
        tensors = arguments(spec, args.rows, args.size, rng)
        outs = {}
        for name, fn in fns.items():
            fn(*tensors)
            outs[name] = [t.numpy().copy() for t in tensors[-outputs(spec):]]
        for a, b in zip(outs["this"], outs["other"]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(np.abs(b).max(), 1e-30))
        calls = {name: (lambda fn=fn: fn(*tensors)) for name, fn in fns.items()}
        calls["copy"] = calls["this"]
        cpu = {k: v["cpu"] for k, v in timing.interleaved_clocks(calls, args.rounds, args.min_time).items()}
        median = {k: float(np.median(v)) * 1e6 for k, v in cpu.items()}
        print(f"{spec:>10}  {median['this']:9.1f}  {median['other']:9.1f}  "
              f"{timing.paired_ratio(cpu['this'], cpu['other']):10.3f}  {timing.paired_ratio(cpu['copy'], cpu['this']):9.3f}")


if __name__ == "__main__":
    main()
