"""Peak memory of a forward pass: process RSS high-water mark (Linux) or CUDA allocator peak.
`reset_peak()` clears the kernel's high-water mark (/proc/self/clear_refs) and
`peak_since_reset()` reads VmHWM. Run each candidate in a fresh process, so freed memory is not
reused unseen.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{STATUS} has no {field} line")


def supported() -> bool:
    """Whether this OS exposes a resettable RSS high-water mark (Linux >= 4.0)."""
    try:
        _status_kib("VmHWM")
        return CLEAR_REFS.exists()
    except (OSError, RuntimeError):
        return False


def rss_bytes() -> int:
    """Resident set size now."""
    return _status_kib("VmRSS") * 1024


def reset_peak() -> None:
    """Set the high-water mark to the current RSS."""
    CLEAR_REFS.write_text("5")


def peak_bytes() -> int:
    """The RSS high-water mark since the last `reset_peak` (or process start)."""
    return _status_kib("VmHWM") * 1024


def forward_peak(forward: Callable[[], object]) -> int:
    """Bytes the RSS rose above its level before one call of `forward` (run a warm-up call first:
    lazy allocations are not the forward's)."""
    gc.collect()
    reset_peak()
    before = rss_bytes()
    forward()
    return max(peak_bytes() - before, 0)
