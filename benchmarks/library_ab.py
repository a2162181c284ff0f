"""Side-by-side CPU time of compiled TVM libraries of one model (e.g. one build of this checkout, one of another).

Loads every library (`vm_files.save` output, as `bench model` writes them) in one process at 1
thread (TVM_NUM_THREADS=1), checks that each computes what the first does, and times them in
interleaved rounds (each call repeated for `--min-time` seconds): per library the process CPU time
per forward, and the median over rounds of (this / first) with its interval. List the first
library twice (a copy under another name: `cp a.so a_copy.so`) for the noise floor.

    python benchmarks/library_ab.py --inputs inputs.npz new.so old.so new_copy.so [--rounds 21]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TVM_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnres_compile.bench import timing  # noqa: E402
from attnres_compile.bench.model.worker import runner  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("libraries", nargs="+", help="compiled libraries (.so) of one model, the baseline first")
    parser.add_argument("--inputs", required=True, help=".npz with the model's inputs, in its input order")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--min-time", type=float, default=0.3)
    args = parser.parse_args(argv)
    inputs = dict(np.load(args.inputs))
    calls, outputs = {}, {}
    for i, path in enumerate(args.libraries):
        name = f"{i}:{Path(path).name}"
        calls[name], read = runner("tvm", path, inputs, "cpu", 1)  # bench model's own TVM runner
        outputs[name] = read(calls[name]())["logits"]
    first = next(iter(outputs))
    for name, out in outputs.items():
        print(f"{name} max abs diff vs {first} {float(np.abs(out - outputs[first]).max()):.2e}")
    samples = timing.interleaved_clocks(calls, args.rounds, args.min_time)
    print(f"1 thread, process CPU time per forward, median of {args.rounds} interleaved rounds; x = median of this / {first}")
    print("\n".join(timing.side_by_side(samples, first)))


if __name__ == "__main__":
    main()
