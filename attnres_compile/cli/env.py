"""The environment variables that steer a run, checked before any work: a bad value is one line
and exit 2 at the start, not a failure after tracing or a crash in a child process."""

from __future__ import annotations

import os

from ..core.errors import ConfigError


def check() -> None:
    """ConfigError for an unknown ATTNRES_KERNEL or an unusable ATTNRES_COMPILE_MEMORY_LIMIT."""
    from ..ops import depth_attention as op
    from ..utils import isolate

    kernel = os.environ.get("ATTNRES_KERNEL")
    if kernel and kernel not in op.KERNELS:
        raise ConfigError(op.unknown_kernel(f"ATTNRES_KERNEL={kernel!r}"))
    if os.environ.get(isolate.MEMORY_ENV, "").strip():
        isolate.memory_budget()
