"""What the depth-attention op costs per call beyond its fused kernels, in eager PyTorch.

Per source count S, at [1, T, D] float32 sources and a Parameter query (as in a rewritten model),
1 thread, CPU time, interleaved rounds (median): the fused forward + backward kernels called
directly (`fused.forward`, `fused.backward`), the op's forward under no_grad, and a training
call: the op under autograd, then `backward` on its output. A `torch.add` of two sources under the
same autograd calls is the engine's own fixed cost. It measures the attnres_compile that Python
imports (printed first): to compare checkouts, run it under each, from outside both
(`cd /tmp && PYTHONPATH=/tmp/old python /path/to/benchmarks/op_call_overhead.py`).

    python benchmarks/op_call_overhead.py [--sources 2,4,6,9] [--rows 128] [--size 256]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import attnres_compile  # registers torch.ops.attnres
from attnres_compile.bench import timing
from attnres_compile.kernels import fused

OP = torch.ops.attnres.depth_attention.default


def candidates(count: int, rows: int, size: int) -> dict:
    leaves = [torch.randn(1, rows, size, requires_grad=True) for _ in range(count)]
    query = torch.nn.Parameter(torch.randn(size) / size ** 0.5)
    grad = torch.randn(1, rows, size)
    data = [s.detach() for s in leaves]

    def kernels():
        fused.forward(data, query.detach(), 1e-6, 1.0, -1)
        fused.backward(data, query.detach(), grad, 1e-6, 1.0, -1)

    def forward():
        with torch.no_grad():
            OP(data, query, 1e-6, 1.0, -1)

    def training(fn):
        def step():
            fn().backward(grad)
            for t in (*leaves, query):
                t.grad = None
        return step
    return {"kernels": kernels, "no_grad forward": forward,
            "op forward+backward": training(lambda: OP(leaves, query, 1e-6, 1.0, -1)),
            "add forward+backward": training(lambda: leaves[0] + leaves[1])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", default="2,4,6,9")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--min-time", type=float, default=0.05)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, attnres_compile from {Path(attnres_compile.__file__).parent}")
    names = list(candidates(2, 4, 8))
    print(f"{'S':>3}  " + "  ".join(f"{n + ' us':>23}" for n in names) + f"  {'op beyond kernels + add':>23}")
    for count in map(int, args.sources.split(",")):
        cpu = timing.interleaved_clocks(candidates(count, args.rows, args.size), args.rounds, args.min_time)
        us = {k: float(np.median(v["cpu"])) * 1e6 for k, v in cpu.items()}
        beyond = us["op forward+backward"] - us["kernels"] - us["add forward+backward"]
        print(f"{count:>3}  " + "  ".join(f"{us[n]:23.1f}" for n in names) + f"  {beyond:23.1f}")


if __name__ == "__main__":
    main()
