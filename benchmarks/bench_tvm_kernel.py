"""Benchmark the TVM depth-attention kernel (llvm) against unfused torch eager and copy bandwidth.

All three are measured in one run, in interleaved rounds (this is a shared VM: bandwidth drifts),
and the median of each is reported. Usage: python benchmarks/bench_tvm_kernel.py [--rounds N]
"""

from __future__ import annotations

import os

os.environ.setdefault("TVM_NUM_THREADS", "2")  # read by the TVM runtime at import

import argparse
import json
import statistics
import time

import torch
import tvm

from attnres_compile.backends.tvm import build, depth_attention_func, host_target

S, ROWS, D, EPS = 9, 2048, 1024, 1e-6
COPY_BYTES = 256 * 2**20


def _time(fn, reps: int) -> float:
    """Mean seconds per call over `reps` calls (after one warm-up call)."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    threads = int(os.environ["TVM_NUM_THREADS"])
    torch.set_num_threads(threads)

    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randn(ROWS, D, generator=gen) for _ in range(S)]
    w = torch.randn(D, generator=gen) / D**0.5
    scale = float(S)
    out = torch.empty(ROWS, D)

    target = host_target(threads)
    kernel = build(depth_attention_func(S, D), target)
    tvm_args = [tvm.runtime.from_dlpack(t) for t in (*srcs, w, out)]

    def eager():
        V = torch.stack(srcs)
        K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + EPS)
        z = torch.einsum("d,srd->sr", w, K)
        p = z.softmax(0)
        return scale * torch.einsum("sr,srd->rd", p, V)

    expected = eager()
    kernel(*tvm_args)
    max_err = (out - expected).abs().max().item() / expected.abs().max().item()

    big_src = torch.randn(COPY_BYTES // 4, generator=gen)
    big_dst = torch.empty_like(big_src)

    times = {"kernel": [], "eager": [], "copy": []}
    for _ in range(args.rounds):
        times["copy"].append(_time(lambda: big_dst.copy_(big_src), 5))
        times["kernel"].append(_time(lambda: kernel(*tvm_args), 20))
        times["eager"].append(_time(eager, 2))
    med = {k: statistics.median(v) for k, v in times.items()}

    kernel_bytes = (S + 1) * ROWS * D * 4
    copy_bw = 2 * COPY_BYTES / med["copy"]
    kernel_bw = kernel_bytes / med["kernel"]
    result = {
        "shape": {"sources": S, "rows": ROWS, "feature": D, "dtype": "float32"},
        "threads": threads,
        "target": str(target),
        "rounds": args.rounds,
        "kernel_ms": med["kernel"] * 1e3,
        "kernel_ms_min": min(times["kernel"]) * 1e3,
        "eager_ms": med["eager"] * 1e3,
        "copy_ms": med["copy"] * 1e3,
        "speedup_vs_eager": med["eager"] / med["kernel"],
        "kernel_bandwidth_GBps": kernel_bw / 1e9,
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "fraction_of_copy_bandwidth": kernel_bw / copy_bw,
        "max_rel_err_vs_eager": max_err,
    }
    print(json.dumps(result, indent=2))
    print(f"\n{'':14}{'ms':>10}{'GB/s':>10}")
    print(f"{'tvm kernel':14}{result['kernel_ms']:10.2f}{result['kernel_bandwidth_GBps']:10.1f}")
    print(f"{'torch eager':14}{result['eager_ms']:10.2f}{kernel_bytes / med['eager'] / 1e9:10.1f}")
    print(f"{'copy 256 MiB':14}{result['copy_ms']:10.2f}{result['copy_bandwidth_GBps']:10.1f}")
    print(
        f"kernel is {result['speedup_vs_eager']:.1f}x eager and runs at "
        f"{100 * result['fraction_of_copy_bandwidth']:.0f}% of copy bandwidth"
    )


if __name__ == "__main__":
    main()
