"""Eager depth_attention (the custom op's reference kernel) against the torch.stack formulation.

Both run side by side in one process, interleaved, median of N repeats; prints JSON then a table.
    python benchmarks/bench_op_eager.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from attnres_compile.op import depth_attention_stacked

op = torch.ops.attnres.depth_attention.default
CASES = [(9, 2048, 1024, torch.float32), (17, 2048, 1024, torch.float32), (5, 8192, 256, torch.float32),
         (33, 128, 4096, torch.float32), (9, 2048, 1024, torch.bfloat16)]


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for s, t, d, dtype in CASES:
        g = torch.Generator().manual_seed(0)
        sources = [torch.randn(t, d, generator=g).to(dtype) for _ in range(s)]
        w = torch.randn(d, generator=g)
        fused = _median_ms(lambda: op(sources, w, 1e-6, float(s), -1), args.repeats)
        stacked = _median_ms(lambda: depth_attention_stacked(sources, w, 1e-6, float(s), -1), args.repeats)
        rows.append({"sources": s, "rows": t, "dim": d, "dtype": str(dtype).replace("torch.", ""),
                     "op_ms": round(fused, 3), "stack_ms": round(stacked, 3), "speedup": round(stacked / fused, 2)})
    print(json.dumps({"threads": torch.get_num_threads(), "results": rows}, indent=2))
    print(f"\n{'S':>3} {'T':>5} {'D':>5} {'dtype':>8} {'op ms':>8} {'stack ms':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['sources']:>3} {r['rows']:>5} {r['dim']:>5} {r['dtype']:>8} {r['op_ms']:>8} {r['stack_ms']:>9} {r['speedup']:>7}x")


if __name__ == "__main__":
    main()
