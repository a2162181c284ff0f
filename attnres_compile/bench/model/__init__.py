"""`bench model`: whole models, original against an identical copy and the rewrites, per runtime,
with the targets' verdicts (measure.py, worker.py, report.py)."""

from .measure import run, settings
from .report import plot, table

__all__ = ["plot", "run", "settings", "table"]
