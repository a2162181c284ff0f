"""Where a decode step's AttnRes overhead goes: sites, operators, and one site's cost at [1, 1, D].
At [1, 1, D] a site costs its call, not its bytes: this times one op call per source count the
variants use against a plain add (a residual), in a 1-thread worker, and compares the sum over a
variant's sites with its measured overhead per token.
"""

from __future__ import annotations

import statistics

import torch
from torch import fx

from ..model.worker import Workers, set_threads

SITE_MIN_TIME = 0.05
SITE_ROUNDS = 3


def site_sources(gm: fx.GraphModule) -> list[int]:
    """The number of sources of each depth_attention call in `gm`, in graph order."""
    op = torch.ops.attnres.depth_attention.default
    return [len(n.args[0]) for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def op_count(gm: fx.GraphModule) -> int:
    """Operator calls in `gm` (call_function nodes other than getitem): what a step dispatches."""
    import operator

    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)


def time_sites(job: dict) -> dict:
    """In a worker at 1 thread: CPU microseconds per call of an add and of the op (fused path and
    eager reference) at [1, 1, width] for each source count in job["counts"]."""
    from ...ops import depth_attention as op
    from .. import timing

    set_threads(1)
    width = job["width"]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 1, width, generator=g) for _ in range(max(job["counts"]))]
    q = torch.randn(width, generator=g)
    calls = {"add": lambda: torch.add(xs[0], xs[1])}
    for n in job["counts"]:
        calls[f"op {n}"] = lambda n=n: op.depth_attention(xs[:n], q, 1e-6, 1.0, -1)
        calls[f"reference {n}"] = lambda n=n: op.forward_reference(xs[:n], q, 1e-6, 1.0, -1)
    with torch.no_grad():
        samples = timing.interleaved_clocks(calls, job["rounds"], job["min_time"])
    return {name: statistics.median(s["cpu"]) * 1e6 for name, s in samples.items()}


def measure(width: int, sources: dict[str, list[int]], s, workers: Workers) -> dict:
    """{"add_us", "op_us" {count: us}, "reference_us", and per variant: sites, source counts, the
    estimated overhead per token (sum of its sites' op time less one add each) in ms}."""
    counts = sorted({n for v in sources.values() for n in v})
    if not counts:
        return {}
    us = workers.run(time_sites, {"width": width, "counts": counts, "rounds": SITE_ROUNDS,
                                  "min_time": SITE_MIN_TIME}, 600)
    out = {"add_us": us["add"], "op_us": {n: us[f"op {n}"] for n in counts},
           "reference_us": {n: us[f"reference {n}"] for n in counts}, "variants": {}}
    for name, counts_of in sources.items():
        if counts_of:
            est = sum(out["op_us"][n] - out["add_us"] for n in counts_of) / 1e3
            out["variants"][name] = {"sites": len(counts_of), "sources": counts_of, "estimated_overhead_ms": est}
    return out
