"""Depth-attention observability: what each AttnRes site attends to, while training and afterwards.

- `DepthMonitor` (watch.py): per-site statistics (mean weight per source, its maximum, entropy,
  output RMS) collected during the training forward on chosen steps, through an observer of the
  depth-attention op: no second forward, nothing on other steps; reduced over the data-parallel
  group under torch.distributed.
- `find_collapse`, `format_stats` (collapse.py): collapsed sites and dead sources; a table.
- `CollapseController` (controller.py): scales a collapsed site's query steps down (or freezes it).
- `CsvLog`, `read_csv`, `tensorboard_writer`, `log_stats` (logs.py): the stats of each watched
  step to CSV and TensorBoard; `plots.plot_weights_over_steps` draws a history.
- `ResidualProbe`, `trace_sites`, `record` (residual.py): the stream RMS of an original model,
  site by site (an fx Interpreter: an original model has no op to observe); `record` runs batches
  through either.
- `inspect_weights` (checkpoint.py): the stats of a saved `.pt2` (`attnres-compile inspect --weights`).

Stats are a JSON-able dict, {"step", "sites": [{"chain", "site", "name", "rows", "rms", "sources",
"weights", "weights_max", "entropy", "max_entropy"}]}; docs/monitor.md has the whole story.
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
