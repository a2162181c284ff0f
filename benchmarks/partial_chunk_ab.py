"""Eager two-phase Full forward: the fused partial as chains of PARTIAL_CHUNK-source links against one
partial kernel per history, side by side.

`bench model`'s GPT-2 or Llama, rewritten to Full and put through `two_phase`, runs at 1 thread
with `kernels/cache.py`'s `PARTIAL_CHUNK` set per candidate before each call (8, the default; 1000, one
link per history: the form before chains), interleaved, plus an identical copy of the first.

    python benchmarks/partial_chunk_ab.py gpt [--sublayers 48] [--rounds 25]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attnres_compile as ac  # noqa: E402
from attnres_compile.kernels import cache as kernel_cache  # noqa: E402
from attnres_compile.bench import timing  # noqa: E402
from attnres_compile.bench.model import make_inputs, make_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["gpt", "llama"])
    parser.add_argument("--sublayers", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = make_model(args.model, args.sublayers // 2, 256, 128)
    inputs = tuple(torch.from_numpy(v) for v in make_inputs(1, 128).values())
    rewritten = ac.rewrite(torch.export.export(model, inputs), inputs, ac.AttnResConfig(variant="full")).graph_module
    module = ac.two_phase(torch.export.export(rewritten, inputs).module()).graph_module

    def forward(chunk: int):
        def call():
            kernel_cache.PARTIAL_CHUNK = chunk
            with torch.no_grad():
                return module(*inputs)
        return call

    candidates = {"links of 8": forward(8), "one per history": forward(1000), "links of 8 (copy)": forward(8)}
    outputs = {name: call() for name, call in candidates.items()}
    diff = float((outputs["one per history"] - outputs["links of 8"]).abs().max())
    print(f"{args.model} Full {args.sublayers} sublayers: max abs diff one per history vs links of 8 {diff:.2e}")
    samples = timing.interleaved_clocks(candidates, args.rounds, 0.5)
    print(f"1 thread, process CPU time per forward, median of {args.rounds} interleaved rounds; x = this / links of 8")
    print("\n".join(timing.side_by_side(samples, "links of 8")))


if __name__ == "__main__":
    main()
