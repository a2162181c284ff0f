"""Depth-attention observability: what each AttnRes site attends to, while training and afterwards.

`DepthMonitor` (watch.py) collects per-site stats in the training forward; collapse.py finds
collapsed sites and dead sources and `CollapseController` damps them; logs.py and plots.py write
and draw the stats; residual.py probes an original model's stream; checkpoint.py reads a saved
`.pt2`. docs/monitor.md has the stats' format.
"""

from .checkpoint import inspect_weights, load_checkpoint
from .collapse import find_collapse, format_stats
from .controller import CollapseController
from .logs import CsvLog, log_stats, read_csv, tensorboard_writer
from .residual import ResidualProbe, record, trace_sites
from .watch import DepthMonitor, reduce_sums

__all__ = ["CollapseController", "CsvLog", "DepthMonitor", "ResidualProbe", "find_collapse", "format_stats",
           "inspect_weights", "load_checkpoint", "log_stats", "read_csv", "record", "reduce_sums", "tensorboard_writer",
           "trace_sites"]
