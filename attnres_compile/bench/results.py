"""Where benchmark results go: JSON with the environment, a text table and PNG plots in one folder,
each written to a temporary name and renamed.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from ..utils.outputs import umask


def environment(threads: int, device: str = "cpu") -> dict:
    """What the numbers were measured on: host, threads, device and library versions."""
    import numpy
    import onnxruntime
    import tvm

    from ..core import __version__

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "device": device,
        "python": platform.python_version(),
        "versions": {"attnres_compile": __version__, "torch": torch.__version__, "tvm": tvm.__version__,
                     "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__},
    }
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A fixed-width text table: columns are (key, header, format spec); missing values print '-'."""
    def cell(row, key, fmt):
        value = row.get(key)
        return "-" if value is None else format(value, fmt) if fmt else str(value)

    cells = [[header for _, header, _ in columns]] + [[cell(r, k, f) for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` atomically (temporary file in the same folder, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 would make results readable by their owner only
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_json(path: Path, data: dict) -> Path:
    return write_text(path, json.dumps(data, indent=2, default=_plain) + "\n")


def save_figure(fig, path: Path) -> Path:
    """Save a matplotlib figure as PNG atomically and close it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp.png")
    os.fchmod(fd, 0o666 & ~umask())
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _plain(value):
    """JSON fallback for numpy scalars and paths."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)
