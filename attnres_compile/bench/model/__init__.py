"""`bench model`: whole models, original against an identical copy and the Full and Block rewrites,
per runtime (torch eager, forward + backward, onnxruntime, TVM), with the targets' verdicts.

measure.py builds and times them (each artifact in a fresh worker: worker.py); report.py draws
the table and plots."""

from .measure import run, settings
from .report import plot, table

__all__ = ["plot", "run", "settings", "table"]
