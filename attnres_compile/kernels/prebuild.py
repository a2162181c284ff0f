"""Build the kernels a rewritten model's forward will need in background processes, before it runs.

`forward_specs` reads the kernels its sites will look up; `start` hands the uncached ones to a
few `python -m attnres_compile.kernels.prebuild` workers (TVM without torch) that build them into
the checked store. cache.get waits for a worker's spec and loads it from disk, or builds it
in-process if the worker failed; `stop` ends the workers. `early` starts workers before a long
trace, on the cores the trace leaves idle: they import TVM meanwhile and take the specs once known.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from . import cache as kernel_cache

MAX_WORKERS = 4  # each imports TVM (~1.3 s of CPU): more pay that without a core to run on
SPECS_PER_WORKER = 4  # fewer specs than this per worker do not repay the worker's import
IMPORT_SPECS = 6  # kernel builds (~0.25 s of CPU each) as long as a worker's TVM import
MIN_SPECS = 8  # fewer missing kernels (~0.25 s of CPU each) are built in-process on first use, as
# before: a worker's start would cost more CPU than it takes off the rewrite's path (and a test
# suite's many small rewrites would each pay it)


def forward_specs(gm, runs_on=None) -> list[kernel_cache.Spec]:
    """The CPU kernels the forward of GraphModule `gm` looks up, in first-use order (duplicates
    dropped), from its depth_attention nodes' source shapes (a symbolic dim at its example size).
    `runs_on`: the device a graph traced on the meta device (a converted decoder's) will run on."""
    import torch
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    from . import fused

    op = torch.ops.attnres.depth_attention.default
    specs: dict[kernel_cache.Spec, None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not op:
            continue
        sources, _, eps, scale, dim = node.args
        val = getattr(sources[0], "meta", {}).get("val")
        device = torch.device(runs_on) if isinstance(val, torch.Tensor) and val.is_meta and runs_on else None
        if not isinstance(val, torch.Tensor) or val.dtype not in fused._DTYPES or (device or val.device).type != "cpu" \
                or val.dim() < 2 or dim not in (-1, val.dim() - 1):
            continue  # no shape (a symbolic_trace graph) or no fused kernel: built on first use, if any
        like = torch.empty((), dtype=val.dtype).expand(*(optimization_hint(n, 1) for n in val.shape))  # no storage
        for kind, count, threads, spec_scale in _forward_keys(fused, len(sources), like, float(scale)):
            specs[kernel_cache.Spec(kind, count, like.dim(), like.shape[-1], fused._DTYPES[val.dtype], float(eps),
                                    spec_scale, "cpu", threads)] = None
    return list(specs)


def _forward_keys(fused, count: int, like, scale: float) -> list[tuple[str, int, int, float]]:
    """(kind, count, threads, scale) of each kernel fused.forward looks up over `count` sources like `like`, in its order."""
    if count <= fused.CHAIN_ABOVE:
        return [("forward", count, fused._threads(count + 1, like), scale)]
    split = kernel_cache.partial_links([0], count)[-2]
    bounds = kernel_cache.partial_links([0], split)
    threads = fused._threads(bounds[1] + 1, like)
    links = [("partial_link" if start else "partial", end - start, threads, 1.0) for start, end in zip(bounds, bounds[1:])]
    return [("merge_indexed", count - split, fused._threads(count - split + 2, like), 1.0), *links]


class Worker:
    """One build process: specs in on stdin (JSON lines), each built spec's entry name out on stdout.
    Started without specs, it imports TVM and waits for `give`."""

    def __init__(self, specs: list[kernel_cache.Spec] | None = None):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                                                          os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, text=True)
        self.done: set[str] = set()
        if specs is not None:
            self.give(specs)

    def give(self, specs: list[kernel_cache.Spec]) -> None:
        """Hand the worker its specs (once; it ends after building them)."""
        try:
            self.proc.stdin.write("".join(json.dumps(list(s)) + "\n" for s in specs))
            self.proc.stdin.close()
        except OSError:  # it ended at once (wait_for then finds it ended)
            pass

    def wait_for(self, spec: kernel_cache.Spec) -> None:
        """Return once the worker has built `spec` or has ended (then the caller finds no entry)."""
        name = kernel_cache._name(spec)
        while name not in self.done:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                return
            self.done.add(line.strip())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError):  # an early worker never given its specs: stdin still open
            self.proc.stdin.close()
        self.proc.stdout.close()


def early(layers: int, size: int, dtype: str) -> list[Worker]:
    """Workers started before a trace whose forward will look up kernels of feature size `size` in
    `dtype` on the CPU, one per core beyond the trace's: none for fewer than MIN_SPECS sublayers (two a
    layer), when the cache folder is the private one, or when it holds kernels of this size and dtype
    already (a warm cache: the few missing, if any, are built as `start` decides)."""
    probe = kernel_cache.Spec("forward", 2, 3, size, dtype, 0.0, 1.0, "cpu", 1)
    if 2 * layers < MIN_SPECS or not kernel_cache._folder(probe).keep or kernel_cache.holds_size(size, dtype):
        return []
    count = min(MAX_WORKERS, len(os.sched_getaffinity(0)) - 1)
    return [Worker() for _ in range(count)]


def start(specs: list[kernel_cache.Spec], early: list[Worker] | None = None) -> list[Worker]:
    """Start building the `specs` that are neither loaded nor cached; returns the workers. `early`
    workers (TVM imported already) take them, however few, the first in first-use order; more start
    for the rest only where each would have SPECS_PER_WORKER after its import. Without early ones,
    none start if fewer than MIN_SPECS are missing. None start, and `early` ones end, where the cache
    folder is the private one, which a worker cannot share, or nothing is missing."""
    early = early or []
    missing = [s for s in specs if s not in kernel_cache._MEMORY and not kernel_cache.cached(s)]
    if len(missing) < (1 if early else max(MIN_SPECS, 1)) or not kernel_cache._folder(missing[0]).keep:
        stop(early)
        return []
    folder = kernel_cache._folder(missing[0])
    late, head = _late_workers(len(missing), len(early))
    workers = [*early, *(Worker() for _ in range(late))]
    _deal(missing[:head], early)
    _deal(missing[head:], workers[len(early):])
    counts = sorted({s.count for s in missing})
    print(f"attnres-compile: compiling {len(missing)} fused depth-attention kernels ({_span(counts)} sources or "
          f"blocks, D={missing[0].size}, {missing[0].dtype}, cpu) in {len(workers)} background process"
          f"{'es' if len(workers) > 1 else ''}; cached in {folder.path}", file=sys.stderr, flush=True)
    return workers


def _late_workers(missing: int, early: int) -> tuple[int, int]:
    """(workers to start now, how many of the `missing` specs in first-use order the `early` ones take).
    A late worker's specs wait for its import (IMPORT_SPECS builds' worth): it takes that many fewer."""
    cores = min(MAX_WORKERS, len(os.sched_getaffinity(0)))
    if not early:
        return max(1, min(cores, missing // SPECS_PER_WORKER)), 0
    late = 0
    while early + late < cores and (missing - early * IMPORT_SPECS) / (early + late + 1) >= SPECS_PER_WORKER:
        late += 1
    return late, missing - late * ((missing - early * IMPORT_SPECS) // (early + late) if late else 0)


def _deal(specs: list[kernel_cache.Spec], workers: list[Worker]) -> None:
    """Hand `specs` to `workers` in turn (first-use order kept within each), recorded as pending."""
    for i, worker in enumerate(workers):
        worker.give(specs[i::len(workers)])
    for i, spec in enumerate(specs):
        kernel_cache.PENDING[spec] = workers[i % len(workers)]


def _span(counts: list[int]) -> str:
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"


def stop(workers: list[Worker]) -> None:
    """End the workers (those still building specs no call needed) and forget their pending specs."""
    for worker in workers:
        worker.stop()
    for spec in [s for s, w in kernel_cache.PENDING.items() if w in workers]:
        del kernel_cache.PENDING[spec]


def main() -> None:
    """The worker: build each spec read from stdin into the disk cache, print its entry name when stored.
    It runs without torch (a CPU kernel's build needs none of it)."""
    sys.modules["torch"] = None
    from . import schedule  # noqa: F401  (TVM, before the specs come: an early worker imports it during the trace)
    for line in sys.stdin:
        spec = kernel_cache.Spec(*json.loads(line))
        if kernel_cache.build_to_disk(spec):
            print(kernel_cache._name(spec), flush=True)


if __name__ == "__main__":
    main()
