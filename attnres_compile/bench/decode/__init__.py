"""`bench decode`: what AttnRes costs per generated token with a KV cache, in the same runtime.

measure.py builds the decoders with past and times their steps (worker.py), route.py the
`generate()` route through causal_lm, sites.py where a step's overhead goes; report.py draws."""

from .measure import run, settings
from .report import plot, table

__all__ = ["plot", "run", "settings", "table"]
