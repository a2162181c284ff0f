"""Running per-site sums (weights per source, their maxima, entropy, squares) and the stats read from them.
Sums stay on the data's device (no host sync while collecting; `summary` converts once), and are
sums, not means, so micro-batches and processes (all_reduce) add up.
"""

from __future__ import annotations

import math
import re

import torch

_QUERY_NAME = re.compile(r"(chain\d+)\.site(\d+)$")
_GATE_NAME = re.compile(r"(chain\d+)\.gate(\d+)$")


def site_of(name: str) -> tuple[str, int] | None:
    """(chain, k) of a pseudo-query parameter named `...chain<i>.site<k>` (the rewrite's
    `attnres.chain<i>.site<k>`, under any prefix: DDP's `module.`), else None."""
    match = _QUERY_NAME.search(name)
    return None if match is None else (match.group(1), int(match.group(2)))


def gate_of(name: str) -> tuple[str, int] | None:
    """(chain, k) of a Delta AttnRes gate parameter named `...chain<i>.gate<k>`, else None."""
    match = _GATE_NAME.search(name)
    return None if match is None else (match.group(1), int(match.group(2)))


def site_order(key: tuple[str, int]) -> tuple[int, int]:
    """Sort key of a (chain, k): chain0 site 1, chain0 site 2, ..., chain1 site 1, ..."""
    return int(key[0].removeprefix("chain")), key[1]


class SiteSums:
    """One site's sums: `rows` weight vectors (one per token) and `numel` output elements; `name`
    names the site in the stats."""

    def __init__(self, name: str):
        self.name, self.rows, self.numel = name, 0, 0
        self.weight_sum = self.weight_max = self.entropy_sum = self.sq = None

    def add_weights(self, p: torch.Tensor) -> None:
        """Add the softmax weights of one call, shape [sources, *rows]."""
        flat = p.reshape(p.shape[0], -1)
        total, peak = flat.sum(1, dtype=torch.float64), flat.amax(1).double()
        entropy = torch.special.entr(flat).sum(dtype=torch.float64)
        if self.weight_sum is None:
            self.weight_sum, self.weight_max, self.entropy_sum = total, peak, entropy
        else:
            self.weight_sum, self.weight_max = self.weight_sum + total, torch.maximum(self.weight_max, peak)
            self.entropy_sum = self.entropy_sum + entropy
        self.rows += flat.shape[1]

    def add_value(self, value: torch.Tensor) -> None:
        """Add the squares of a site's value (its output, or an original model's residual sum)."""
        sq = torch.linalg.vector_norm(value.detach()).double().square()  # in float64 it is ~40x slower on CPU
        self.sq = sq if self.sq is None else self.sq + sq
        self.numel += value.numel()

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sums, maxima) as two float64 vectors: [weight_sum..., entropy_sum, sq, rows, numel] and
        [weight_max...], what an all_reduce with SUM and MAX combines over processes."""
        sums = torch.cat([self.weight_sum, torch.stack([self.entropy_sum, self.sq]),
                          torch.tensor([self.rows, self.numel], dtype=torch.float64, device=self.sq.device)])
        return sums, self.weight_max

    def unpack(self, sums: torch.Tensor, maxima: torch.Tensor) -> None:
        """Replace the sums by reduced ones (the layout of `packed`)."""
        n = len(self.weight_sum)
        self.weight_sum, self.entropy_sum, self.sq = sums[:n], sums[n], sums[n + 1]
        self.rows, self.numel = int(sums[n + 2]), int(sums[n + 3])
        self.weight_max = maxima

    def summary(self) -> dict:
        """{"name", "rows", "rms"[, "sources", "weights", "weights_max", "entropy", "max_entropy"]}: name
        is the pseudo-query's (or, for an original model, the residual sum's node name); weights is the mean over tokens of each source's weight (sums to 1), weights_max its maximum
        over tokens, entropy the mean over tokens of the weights' entropy in nats."""
        out = {"name": self.name, "rows": self.rows,
               "rms": math.sqrt(float(self.sq) / self.numel) if self.numel else None}
        if self.weight_sum is not None:
            out.update(sources=len(self.weight_sum), weights=(self.weight_sum / self.rows).tolist(),
                       weights_max=self.weight_max.tolist(), entropy=float(self.entropy_sum) / self.rows,
                       max_entropy=math.log(len(self.weight_sum)))
        return out


def stats_of(sums: dict[tuple[str, int], SiteSums], **top) -> dict:
    """{**top, "sites": [{"chain", "site", **summary}]} in site order."""
    return {**top, "sites": [{"chain": c, "site": k, **sums[(c, k)].summary()} for c, k in sorted(sums, key=site_order)]}
