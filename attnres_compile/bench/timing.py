"""Interleaved timing: candidates measured in alternating rounds, so drift hits all of them alike.

A shared machine's speed drifts by tens of percent within minutes; timing A for a minute and
then B for a minute turns that drift into a false ratio. Here every round times each candidate
once (each call repeated until `min_time` has passed), and the median over rounds is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch


def _per_call(fn: Callable[[], object], min_time: float, sync: Callable[[], None]) -> float:
    """Seconds per call of `fn`, calling it until `min_time` has passed (at least once)."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / calls


def interleaved(candidates: Mapping[str, Callable[[], object]], rounds: int = 5, min_time: float = 0.1,
                sync: Callable[[], None] = lambda: None) -> dict[str, dict]:
    """{name: {"median_ms", "min_ms", "rounds"}} for each candidate, timed in alternating rounds.

    Each candidate is called once first (warm-up: lazy init, caches, autotuning); `sync` runs
    after each call (e.g. torch.cuda.synchronize) so asynchronous work is counted."""
    for fn in candidates.values():
        fn()
        sync()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            samples[name].append(_per_call(fn, min_time, sync))
    return {name: {"median_ms": statistics.median(s) * 1e3, "min_ms": min(s) * 1e3, "rounds": len(s)}
            for name, s in samples.items()}


class CopyBandwidth:
    """The machine's copy bandwidth, the roofline of a memory-bound op: dst.copy_(src) of `nbytes`.

    `fn` is a candidate for `interleaved`; `gbps(ms)` turns its time into GB/s (read + write).
    The buffer is far larger than the last-level cache so the copy streams from memory."""

    def __init__(self, nbytes: int = 256 * 2**20, device: str = "cpu"):
        self.nbytes = nbytes
        self.src = torch.ones(nbytes // 4, device=device)
        self.dst = torch.empty_like(self.src)

    def fn(self) -> None:
        self.dst.copy_(self.src)

    def gbps(self, ms: float) -> float:
        return 2 * self.nbytes / (ms * 1e-3) / 1e9


def sync_for(device: str) -> Callable[[], None]:
    """The synchronisation to time work on `device` ("cpu" needs none)."""
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
