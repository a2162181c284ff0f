"""Time chain analysis and the fx rewrite on synthetic chains of 250..2,000 links; size the ONNX rewrite.

Analysis is about linear in graph size; Full's rewritten fx graph holds O(L^2) source
references (site k reads k+1 sources), Block's O(L*N). The ONNX rows rewrite an ONNX chain
(branches h @ W_k) with Full AttnRes, each size in a fresh process: seconds, peak RSS, the
written file and its function nodes, which the two-phase form keeps O(L) (the per-site form
defined one function per site, 1.14 million function nodes and 39 MB at 500 links).
Prints JSON then tables.
    python benchmarks/bench_rewrite_scale.py

With --kernels, what depth costs the fused kernels instead: a deep PreNorm GPT (30 layers, 60
sublayers, width 576, SmolLM2's depth and width) rewritten with Full and Block(8) AttnRes and
verified (which runs the fused forward), then one training step (the fused backward), each in a
fresh process with an empty kernel cache (ATTNRES_KERNEL_CACHE in a temporary folder): seconds
(wall; the CPU time of the process, which bounds the wall time on an idle machine when the
kernels build beside it, and of its children: the kernel build workers and gcc), the load average, and the kernels compiled. Then the per-call cost of the fused kernels' chained path for a long
source list (kernels/fused.py, CHAIN_ABOVE) against the one-kernel-per-count form it replaces.
    python benchmarks/bench_rewrite_scale.py --kernels [--out FILE]
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import attnres_compile as ac

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from samples.models import long_chain, onnx_chain  # noqa: E402

LINKS = (250, 500, 1000, 2000)


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def onnx_full(links: int) -> dict:
    """Full ONNX rewrite of an L-link chain, in this process (run it in a fresh one)."""
    import onnx

    from attnres_compile.onnx.pipeline import rewrite_onnx

    with tempfile.TemporaryDirectory() as folder:
        src, out = onnx_chain(Path(folder) / "chain.onnx", links), Path(folder) / "full.onnx"
        seconds = _seconds(lambda: rewrite_onnx(src, out, verify_outputs=False))
        model = onnx.load(str(out))
        return {"links": links, "onnx_full_s": round(seconds, 1), "file_mb": round(out.stat().st_size / 2**20, 2),
                "function_nodes": sum(len(f.node) for f in model.functions),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def _cpu() -> tuple[float, float]:
    """CPU seconds of this process, and of its waited-for children (the kernel build workers, gcc)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime


def cold_rewrite(variant: str) -> dict:
    """Full or Block(8) AttnRes on the deep GPT with an empty kernel cache, in this process (run it
    in a fresh one): the verified rewrite's seconds, one training step's, the kernels compiled."""
    from samples.models import GPT, _tokens

    from attnres_compile.kernels import cache as kernel_cache

    with tempfile.TemporaryDirectory() as folder:
        os.environ["ATTNRES_KERNEL_CACHE"] = folder
        torch.manual_seed(0)
        model, (idx,) = GPT(dim=576, layers=30, heads=9).eval(), _tokens()
        cfg = ac.AttnResConfig(variant="block", num_blocks=8) if variant == "block8" else ac.AttnResConfig()
        t, cpu = time.perf_counter(), _cpu()
        result = ac.rewrite(model, (idx,), cfg)
        rewrite_s, (own, children) = time.perf_counter() - t, (b - a for a, b in zip(cpu, _cpu()))
        assert all(row.get("ok") is not False for row in result.report.data["verification"]), result.report
        forward_kernels = len(kernel_cache._MEMORY)
        t = time.perf_counter()
        result.graph_module(idx).float().square().mean().backward()
        step_s = time.perf_counter() - t
        return {"variant": variant, "rewrite_s": round(rewrite_s, 1), "rewrite_cpu_s": round(own, 1),
                "children_cpu_s": round(children, 1),
                "load": [round(x, 1) for x in os.getloadavg()], "forward_kernels": forward_kernels,
                "train_step_s": round(step_s, 1), "kernels": len(kernel_cache._MEMORY)}


def traffic(count: int, itemsize: int) -> dict:
    """Bytes per row and feature each path moves (reads + writes; the per-row scalars left out), as
    kernels/fused.py runs them: the per-count kernels read every source once (the backward also g)
    and write the output (the backward: every source gradient); the chained forward's links write
    the float32 state (acc) and each link after the first reads it, the merge reads it and the last
    sources; the chained backward runs the chain over all sources, reads acc and g for ubar (in
    place, and then reads acc again, for low-precision g), then its chunks read their sources and g
    and write the gradients. Returns the ratios chained / per-count."""
    from attnres_compile.kernels.cache import PARTIAL_CHUNK, partial_links

    def chain(n: int) -> int:
        links = len(partial_links([0], n)) - 1
        return n * itemsize + links * 4 + (links - 1) * 4

    split = partial_links([0], count)[-2]
    forward = chain(split) + 4 + (count - split) * itemsize + itemsize
    ubar = 4 + itemsize if itemsize == 4 else 4 + itemsize + 4 + 4
    backward = chain(count) + ubar + 2 * count * itemsize + -(-count // PARTIAL_CHUNK) * itemsize
    return {"forward": round(forward / ((count + 1) * itemsize), 3),
            "backward": round(backward / ((2 * count + 1) * itemsize), 3)}


def per_call(count: int, dtype: torch.dtype, rows: int = 2048, size: int = 576, rounds: int = 7) -> dict:
    """ms per call of the fused forward and backward over `count` sources of [rows, size], the
    chained path (count > CHAIN_ABOVE) against the kernel of its own count (CHAIN_ABOVE lifted),
    and that kernel again (the noise floor): 1 thread on process CPU time, 2 threads on wall time,
    interleaved rounds (bench/timing.py), median ratios with their intervals."""
    from attnres_compile.bench.timing import interleaved_clocks, paired_ratio, ratio_interval
    from attnres_compile.kernels import fused

    g = torch.Generator().manual_seed(0)
    sources = [(torch.randn(rows, size, generator=g) * (1 + i % 3)).to(dtype) for i in range(count)]
    w = torch.randn(size, generator=g) / size**0.5
    grad = torch.randn(rows, size, generator=g).to(dtype)
    chain_above = fused.CHAIN_ABOVE

    def call(direction: str, chained: bool):
        def run():
            fused.CHAIN_ABOVE = chain_above if chained else count
            try:
                if direction == "forward":
                    return fused.forward(sources, w, 1e-6, float(count), -1)
                return fused.backward(sources, w, grad, 1e-6, float(count), -1)
            finally:
                fused.CHAIN_ABOVE = chain_above
        return run

    row = {"count": count, "dtype": str(dtype).removeprefix("torch."), "rows": rows, "size": size,
           "traffic_ratio": traffic(count, sources[0].element_size())}
    threads = torch.get_num_threads()
    try:
        for direction in ("forward", "backward"):
            for n, clock in ((1, "cpu"), (2, "wall")):
                torch.set_num_threads(n)
                ref = call(direction, False)()
                got = call(direction, True)()
                tol = 1e-4 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps  # relative to the largest entry
                for a, b in zip(*(([x] if direction == "forward" else [*x[0], x[1]]) for x in (got, ref))):
                    assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max(), direction
                samples = interleaved_clocks({"per_count": call(direction, False), "chained": call(direction, True),
                                              "per_count_again": call(direction, False)}, rounds)
                base = samples["per_count"][clock]
                for name in ("chained", "per_count_again"):
                    low, high, _ = ratio_interval(samples[name][clock], base)
                    row[f"{direction}_{n}t_{name}_ratio"] = [round(paired_ratio(samples[name][clock], base), 3),
                                                            round(low, 3), round(high, 3)]
                for name in ("per_count", "chained"):
                    row[f"{direction}_{n}t_{name}_ms"] = round(statistics.median(samples[name][clock]) * 1e3, 2)
    finally:
        torch.set_num_threads(threads)
    return row


def kernels_main(out: str | None) -> None:
    """The --kernels run: cold rewrites in fresh processes, then per-call times in this one."""
    cold = [json.loads(subprocess.run([sys.executable, __file__, "--cold", variant], capture_output=True, text=True,
                                      check=True).stdout) for variant in ("full", "block8")]
    from attnres_compile.kernels.fused import CHAIN_ABOVE

    calls = [per_call(40, torch.float32), per_call(40, torch.bfloat16), per_call(CHAIN_ABOVE + 1, torch.float32)]
    result = {"model": "samples.models.GPT(dim=576, layers=30, heads=9), tokens [2, 16]", "cold": cold,
              "per_call": calls}
    text = json.dumps(result, indent=2)
    lines = [f"{'variant':>8} {'rewrite s':>10} {'CPU s':>6} {'children':>9} {'kernels':>8} {'train step s':>13} "
             f"{'kernels':>8}  load"]
    lines += [f"{r['variant']:>8} {r['rewrite_s']:>10} {r['rewrite_cpu_s']:>6} {r['children_cpu_s']:>9} {r['forward_kernels']:>8} "
              f"{r['train_step_s']:>13} {r['kernels']:>8}  {r['load'][0]}" for r in cold]
    lines += ["", "per call, sources of [2048, 576]: chained / per-count kernel (median, interval), "
              "1 thread process CPU time, 2 threads wall; traffic: the bytes each moves, chained / per-count"]
    for r in calls:
        for direction in ("forward", "backward"):
            for n in (1, 2):
                ratio, again = r[f"{direction}_{n}t_chained_ratio"], r[f"{direction}_{n}t_per_count_again_ratio"]
                lines.append(f"{r['count']:>3} {r['dtype']:>9} {direction:>8} {n}t  per-count {r[f'{direction}_{n}t_per_count_ms']:8.2f} ms"
                             f"  chained {r[f'{direction}_{n}t_chained_ms']:8.2f} ms  x{ratio[0]:.3f} ({ratio[1]:.3f}"
                             f" .. {ratio[2]:.3f})  identical copy x{again[0]:.3f}"
                             f"  traffic x{r['traffic_ratio'][direction]:.2f}")
    print(text)
    print("\n" + "\n".join(lines))
    if out:
        Path(out).write_text(text + "\n")
        Path(out).with_suffix(".txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    x = torch.randn(2, 4)
    rows = []
    for links in LINKS:
        row = {"links": links, "inspect_s": round(_seconds(lambda: ac.inspect(long_chain(links), (x,))), 3)}
        for name, cfg in (("block8", ac.AttnResConfig(variant="block", num_blocks=8)), ("full", ac.AttnResConfig())):
            row[f"rewrite_{name}_s"] = round(_seconds(lambda: ac.rewrite(long_chain(links), (x,), cfg, verify_outputs=False)), 3)
        rows.append(row)
    onnx_rows = [json.loads(subprocess.run([sys.executable, __file__, "--onnx", str(links)], capture_output=True,
                                           text=True, check=True).stdout) for links in LINKS]
    print(json.dumps({"fx": rows, "onnx": onnx_rows}, indent=2))
    print(f"\n{'links':>6} {'inspect s':>10} {'block8 s':>9} {'full s':>8}")
    for r in rows:
        print(f"{r['links']:>6} {r['inspect_s']:>10} {r['rewrite_block8_s']:>9} {r['rewrite_full_s']:>8}")
    print(f"\n{'links':>6} {'ONNX full s':>12} {'file MB':>8} {'function nodes':>15} {'peak RSS MB':>12}")
    for r in onnx_rows:
        print(f"{r['links']:>6} {r['onnx_full_s']:>12} {r['file_mb']:>8} {r['function_nodes']:>15} {r['peak_rss_mb']:>12}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--onnx"]:
        print(json.dumps(onnx_full(int(sys.argv[2]))))
    elif sys.argv[1:2] == ["--cold"]:
        print(json.dumps(cold_rewrite(sys.argv[2])))
    elif sys.argv[1:2] == ["--kernels"]:
        kernels_main(sys.argv[3] if sys.argv[2:3] == ["--out"] else None)
    else:
        main()
