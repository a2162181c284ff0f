"""Interleaved timing: candidates measured in alternating rounds, so drift hits all of them alike.

Every round times each candidate once (each call repeated until `min_time` has passed); the
median over rounds is reported. `interleaved_clocks` keeps each round's wall time, process CPU
time and calling-thread CPU time; `paired_ratio` compares two candidates round by round, so drift
between rounds cancels, and `ratio_interval` bounds that median. Each candidate's turn starts
after PAUSE_S, as onnxruntime's and TVM's pools keep spinning for a while after a run and would
steal a core from the next candidate.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch

CLOCKS = ("wall", "cpu", "thread")  # time.perf_counter, time.process_time, time.thread_time
PAUSE_S = 0.05  # before each candidate's turn: other thread pools stop spinning


def _now() -> tuple[float, float, float]:
    return time.perf_counter(), time.process_time(), time.thread_time()


def _per_call(fn: Callable[[], object], min_time: float, sync: Callable[[], None]) -> tuple[float, float, float]:
    """Seconds per call of `fn` on each clock of CLOCKS, calling it until `min_time` of wall time
    has passed (at least once)."""
    calls, start = 0, _now()
    while True:
        fn()
        calls += 1
        sync()
        now = _now()
        if now[0] - start[0] >= min_time:
            return tuple((b - a) / calls for a, b in zip(start, now))


def interleaved_clocks(candidates: Mapping[str, Callable[[], object]], rounds: int = 5, min_time: float = 0.1,
                       sync: Callable[[], None] = lambda: None, pause: float = PAUSE_S) -> dict[str, dict[str, list[float]]]:
    """{name: {clock: [seconds per call, one per round]}} for each candidate, timed in alternating
    rounds (clocks: CLOCKS), each turn after `pause` seconds idle. Each candidate is called once
    first (warm-up: lazy init, caches, autotuning); `sync` runs after each call (e.g.
    torch.cuda.synchronize) so asynchronous work is counted."""
    for fn in candidates.values():
        fn()
        sync()
    samples: dict[str, dict[str, list[float]]] = {name: {c: [] for c in CLOCKS} for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            time.sleep(pause)
            for clock, value in zip(CLOCKS, _per_call(fn, min_time, sync)):
                samples[name][clock].append(value)
    return samples


def interleaved(candidates: Mapping[str, Callable[[], object]], rounds: int = 5, min_time: float = 0.1,
                sync: Callable[[], None] = lambda: None) -> dict[str, dict]:
    """{name: {"median_ms", "min_ms", "rounds"}} of wall time for each candidate, timed in
    alternating rounds (interleaved_clocks)."""
    return {name: {"median_ms": statistics.median(s["wall"]) * 1e3, "min_ms": min(s["wall"]) * 1e3,
                   "rounds": len(s["wall"])}
            for name, s in interleaved_clocks(candidates, rounds, min_time, sync).items()}


def paired_ratio(samples: Sequence[float], baseline: Sequence[float]) -> float:
    """The median over rounds of samples[i] / baseline[i]: a ratio in which drift between rounds cancels."""
    return statistics.median(a / b for a, b in zip(samples, baseline, strict=True))


def ratio_interval(samples: Sequence[float], baseline: Sequence[float],
                   confidence: float = 0.9) -> tuple[float, float, float]:
    """(low, high, coverage): a distribution-free interval for the median of the per-round ratios
    samples[i] / baseline[i], from order statistics: k is the largest with coverage
    1 - 2 P(Binomial(n, 1/2) < k) >= `confidence`, or 1 (the whole range) when n is too small."""
    ratios = sorted(a / b for a, b in zip(samples, baseline, strict=True))
    n = len(ratios)

    def coverage(k: int) -> float:  # 1 - 2 P(Binomial(n, 1/2) < k)
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = max([k for k in range(1, (n + 1) // 2 + 1) if coverage(k) >= confidence], default=1)
    return ratios[k - 1], ratios[n - k], coverage(k)


def side_by_side(samples: Mapping[str, Mapping[str, list[float]]], baseline: str, clock: str = "cpu") -> list[str]:
    """One line per candidate of `interleaved_clocks` samples: its median ms per call on `clock`, and
    the median ratio to `baseline`'s with its interval (ratio_interval) and that interval's coverage."""
    width = max(map(len, samples))
    lines = []
    for name, s in samples.items():
        low, high, cover = ratio_interval(s[clock], samples[baseline][clock])
        lines.append(f"{name:{width}s} {statistics.median(s[clock]) * 1e3:8.2f} ms  "
                     f"x{paired_ratio(s[clock], samples[baseline][clock]):.3f}  ({low:.3f} .. {high:.3f}, {cover:.0%})")
    return lines


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
