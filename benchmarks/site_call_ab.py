"""One decode site's call, this checkout against another, side by side: `torch.ops.attnres.depth_attention`
at [1, 1, D] under no_grad (a decode step's site), and the parts of its path, 1 thread, CPU time.

Both checkouts cannot register the op in one process, so each round runs one short child per
checkout (alternating which goes first), and the ratio is the median over rounds of this
checkout's time over the other's in the same round (timing.paired_ratio).

    python benchmarks/site_call_ab.py --other /path/to/other/checkout [--size 1024] [--sources 3,9,25] [--rounds 11]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
import attnres_compile
from attnres_compile import fused, op
size, counts, min_time = int(sys.argv[1]), [int(c) for c in sys.argv[2].split(",")], float(sys.argv[3])
def per_call(fn):
    fn(); n, start = 0, time.process_time()
    while time.process_time() - start < min_time:
        fn(); n += 1
    return (time.process_time() - start) / n * 1e6
out = {}
with torch.no_grad():
    for s in counts:
        xs = [torch.randn(1, 1, size) for _ in range(s)]
        q = torch.nn.Parameter(torch.randn(size))
        out["add"] = per_call(lambda: torch.add(xs[0], xs[1]))
        out[f"op {s}"] = per_call(lambda: op.depth_attention(xs, q, 1e-6, 1.0, -1))
        out[f"fused.forward {s}"] = per_call(lambda: fused.forward(xs, q, 1e-6, 1.0, -1))
print(json.dumps(out))
"""


def child(tree: Path, size: int, counts: str, min_time: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(size), counts, str(min_time)], env=env, cwd="/tmp",
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=Path, required=True, help="the checkout to compare with (its repository root)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--sources", default="3,9,25")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--min-time", type=float, default=0.1)
    args = parser.parse_args(argv)
    trees = {"this": HERE, "other": args.other.resolve()}
    samples: dict[str, list[dict]] = {"this": [], "other": []}
    for r in range(args.rounds):
        for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
            samples[name].append(child(trees[name], args.size, args.sources, args.min_time))
    print(f"this {trees['this']}, other {trees['other']}; D={args.size}, {args.rounds} rounds, 1 thread, "
          "CPU us per call")
    for key in samples["this"][0]:
        this, other = ([s[key] for s in samples[n]] for n in ("this", "other"))
        ratio = statistics.median(a / b for a, b in zip(this, other))
        print(f"{key:>20}: this {statistics.median(this):6.2f} us, other {statistics.median(other):6.2f} us, "
              f"this/other x{ratio:.3f} ({min(a / b for a, b in zip(this, other)):.3f} .. "
              f"{max(a / b for a, b in zip(this, other)):.3f})")


if __name__ == "__main__":
    main()
