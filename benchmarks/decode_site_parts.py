"""Where a decode step's AttnRes overhead goes in eager PyTorch, measured inside the model, not in a loop.

One process, 1 thread, CPU time, interleaved rounds (timing.interleaved_clocks): the traced
decoder with past of an HF Llama (bench decode's build), original and Block, and Block with the
op's kernel stubbed out (`op._forward` returns its last source: the dispatcher, the Autograd
kernel and the graph stay, the fused kernel's Python and TVM call go). So per token:
Block - original is the whole overhead, Block - stubbed the kernel's share in place (caches cold
from the layers between sites), stubbed - original the call's share (dispatch, node, tensor list).

    python benchmarks/decode_site_parts.py [--width 256] [--sublayers 24] [--steps 16] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from attnres_compile import op
from attnres_compile.bench import decode, decode_worker, timing
from attnres_compile.bench.decode_sites import site_sources
from attnres_compile.bench.model import VOCAB, make_model


def stubbed(call):
    """`call` with the op's kernel replaced by returning the last source."""
    def run():
        real = op._forward
        op._forward = lambda sources, *args: sources[-1]
        try:
            return call()
        finally:
            op._forward = real
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--sublayers", type=int, default=24)
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = make_model("llama", args.sublayers // 2, args.width, args.prefill + args.steps).model
    variants, geometry, example, spec = decode.make_variants(model, 8)
    ids = np.random.default_rng(0).integers(0, VOCAB, (1, args.prefill + args.steps), dtype=np.int64)
    job = {"heads": geometry["heads"], "head_dims": geometry["head_dims"], "prefill": args.prefill, "steps": args.steps}
    sites = {v.name: len(site_sources(v.program)) for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        calls = {}
        for v in variants:
            if v.name != "full":
                decode.save_files(v, example, spec, geometry["geometry"], Path(tmp), ["eager"])
                calls[v.name] = decode_worker._eager(str(v.files["pt2"]), ids, job)
    calls["block, kernel stubbed"] = stubbed(calls["block"])
    samples = timing.interleaved_clocks(calls, args.rounds, 0.2)
    ms = {k: statistics.median(s["cpu"]) * 1e3 / args.steps for k, s in samples.items()}
    print(f"llama width {args.width}, {args.sublayers} sublayers, Block N=8 ({sites['block']} sites), prefill "
          f"{args.prefill}, {args.steps} decode steps, {args.rounds} rounds, 1 thread, CPU ms per call of "
          f"{args.steps} steps (median, x original, interval):")
    print("\n".join(timing.side_by_side(samples, "original")))
    per_site = 1e3 / sites["block"]
    total = ms["block"] - ms["original"]
    print(f"overhead per token {total:+.3f} ms ({total * per_site:+.1f} us "
          f"a site): kernel in place {ms['block'] - ms['block, kernel stubbed']:+.3f} ms "
          f"({(ms['block'] - ms['block, kernel stubbed']) * per_site:+.1f} us a site), call and graph "
          f"{ms['block, kernel stubbed'] - ms['original']:+.3f} ms "
          f"({(ms['block, kernel stubbed'] - ms['original']) * per_site:+.1f} us a site)")


if __name__ == "__main__":
    main()
