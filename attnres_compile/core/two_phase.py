"""The two-phase policy, the same for every format: which sites of a chain share a history, and
whether one partial plus a merge per site moves fewer bytes than one pass per site.
Block-like chains group per block; otherwise (Full) groups of G = ceil(sqrt(n)) consecutive
sites, at most MAX_GROUP, share the first site's history and read at most G extras each.
"""

from __future__ import annotations

import math

MAX_GROUP = 16  # Full's group size beyond 256 sites: extras per site stay bounded, the file linear
STATE_BYTES = 4  # a partial's state is float32
MIN_HISTORY = 12  # shared sources below which a group keeps single-pass sites (two_phase_wins)


def site_groups(terms: list[list]) -> list[tuple[int, int, int]]:
    """(start, end, history length) of each group of a chain's sites, given their source lists in
    order (any hashable source keys: the TVM lowering groups Relax placeholders with it too)."""
    runs, start = [], 0
    for i in range(1, len(terms) + 1):
        if i == len(terms) or terms[i][:-1] != terms[start][:-1]:
            runs.append((start, i, len(terms[start]) - 1))
            start = i
    if len(terms) >= 2 * len(runs):
        return runs
    size = min(math.ceil(math.sqrt(len(terms))), MAX_GROUP)
    groups, start = [], 0
    while start < len(terms):
        history = terms[start][:-1]
        end = start + 1
        while (end < len(terms) and end - start < size and len(terms[end]) > len(history)
               and terms[end][:len(history)] == history):
            end += 1
        groups.append((start, end, len(history)))
        start = end
    return groups


def two_phase_wins(history: int, extras: list[int], itemsize: int, min_history: int | None = None) -> bool:
    """Whether a group of sites over `history` shared sources (and `extras[i]` own ones each) runs as one
    partial plus a merge per site: it must move fewer bytes per row, and the history must be at least
    `min_history` long (a short one stays in cache, where the pair's extra calls cost more)."""
    one_pass = sum(history + e + 1 for e in extras) * itemsize
    two_phase = history * itemsize + sum(2 * STATE_BYTES + (e + 1) * itemsize for e in extras)
    return history >= (MIN_HISTORY if min_history is None else min_history) and two_phase < one_pass
