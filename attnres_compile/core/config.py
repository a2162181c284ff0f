"""`AttnResConfig`: the options of the rewrite, validated once, shared by every format."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .errors import ConfigError

VARIANTS = ("full", "block", "delta")
INITS = ("exact", "paper")
EPS_MIN = 2.0 ** -126  # float32's smallest normal: keys normalise in float32 (but for float64), ONNX's eps is float32
EPS_MAX = 1.0          # RMSNorm eps is 1e-12..1e-5 in practice; above 1 it outweighs a unit-scale row's mean square
SCALES = ("preserve", "paper")


@dataclass(frozen=True)
class AttnResConfig:
    """How residual chains are rewritten (docs/design.md §2).

    variant: "full", "block", or "delta" (the stream stays the plain sum; readers of a site read
        h_k + g_k * the site's mix).
    num_blocks / block_size: for "block", exactly one; B = ceil(m / N) per chain. Optional for
        "delta" (Delta-Block).
    scale: "preserve" (c_k = |S_k|, exact at init) or "paper" (c_k = 1); Full and Block only.
    init: for "delta", the gates' start: "exact" (g_k = 0, bitwise the original) or "paper" (g_k = 1).
    eps: the keys' RMSNorm epsilon, in [EPS_MIN, EPS_MAX] (smaller rounds to 0 in float32 and a
        zero row gives NaN).
    min_chain: chains with fewer links are reported and left alone.
    feature_axis: override (default: 1 for rank-4 NCHW streams, else -1).
    allow_nonlinear: also rewrite streams joined through non-linear ops; the report marks them.
    """

    variant: str = "full"
    num_blocks: int | None = None
    block_size: int | None = None
    scale: str = "preserve"
    eps: float = 1e-6
    min_chain: int = 2
    feature_axis: int | None = None
    allow_nonlinear: bool = False
    init: str = "exact"

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.scale not in SCALES:
            raise ConfigError(f"scale must be one of {SCALES}, got {self.scale!r}")
        for name in ("num_blocks", "block_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.init not in INITS:
            raise ConfigError(f"init must be one of {INITS}, got {self.init!r}")
        if self.init != "exact" and self.variant != "delta":
            raise ConfigError(f"init={self.init!r} applies to variant 'delta' (where its gates start); full and block "
                              "start at zero queries: use scale='paper' for their published form")
        if self.variant == "delta" and self.scale != "preserve":
            raise ConfigError("scale applies to variants full and block: Delta's mix is the published convex one "
                              "(c_k = 1) and its gate sets its size (init 'exact' starts it at 0, 'paper' at 1)")
        if self.variant == "block":
            if (self.num_blocks is None) == (self.block_size is None):
                raise ConfigError("variant 'block' needs exactly one of num_blocks or block_size")
        elif self.variant == "delta":
            if self.num_blocks is not None and self.block_size is not None:
                raise ConfigError("variant 'delta' takes at most one of num_blocks or block_size (Delta-Block)")
        elif self.num_blocks is not None or self.block_size is not None:
            raise ConfigError("num_blocks / block_size apply only to variant 'block' or 'delta'; set variant='block'")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not EPS_MIN <= self.eps <= EPS_MAX:
            raise ConfigError(f"eps={self.eps!r} is out of range: give a number from {EPS_MIN:.3g} (float32's "
                              "smallest normal; the keys' RMSNorm computes in float32, where a smaller eps turns an "
                              f"all-zero row into NaN) to {EPS_MAX:g}")
        if isinstance(self.min_chain, bool) or not isinstance(self.min_chain, int) or self.min_chain < 1:
            raise ConfigError(f"min_chain must be an integer >= 1, got {self.min_chain!r}")
        if self.feature_axis is not None and (isinstance(self.feature_axis, bool) or not isinstance(self.feature_axis, int)):
            raise ConfigError(f"feature_axis must be an integer or None, got {self.feature_axis!r}")
        if not isinstance(self.allow_nonlinear, bool):
            raise ConfigError(f"allow_nonlinear must be True or False, got {self.allow_nonlinear!r}")

    def block_size_for(self, num_sources: int) -> int:
        """Sources per block for a chain of `num_sources` branch outputs (1 means Full)."""
        if self.variant == "full" or (self.block_size is None and self.num_blocks is None):
            return 1
        if self.block_size is not None:
            return self.block_size
        return max(1, math.ceil(num_sources / self.num_blocks))

    @property
    def delta(self) -> bool:
        """Delta AttnRes: the stream is kept and the readers of a site read h_k + g_k * its mix."""
        return self.variant == "delta"

    @property
    def gate_init(self) -> float:
        """Where Delta's gates start: 0 (exact) or 1 (the published form)."""
        return 1.0 if self.init == "paper" else 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
