"""Writing the per-site stats of watched steps: a CSV log (always available) and TensorBoard (optional).
The CSV has one row per (step, site, source): `step, chain, site, source, weight, weight_max,
entropy, max_entropy, rms, rows`; `read_csv` gives back the monitor's history. Each watched step
appends its rows and flushes.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import torch

from ..utils.file_kind import special

COLUMNS = ("step", "chain", "site", "source", "weight", "weight_max", "entropy", "max_entropy", "rms", "rows")


class CsvLog:
    """Appends the stats of each watched step to `path`. An existing file is continued with
    `append=True`, restarted with `overwrite=True`, else FileExistsError; a non-regular file is
    refused (ValueError)."""

    def __init__(self, path: str | Path, append: bool = False, overwrite: bool = False):
        self.path = Path(path)
        if append and overwrite:
            raise ValueError("append=True continues the log, overwrite=True starts it anew: pass one")
        if os.path.lexists(self.path):
            kind = special(self.path)
            if kind:
                raise ValueError(f"{self.path} is {kind}, not a file: give the path of a CSV log")
            if not self.path.exists():
                raise FileExistsError(f"{self.path} exists (a dangling symlink): give another path, or "
                                      "overwrite=True to replace it")
            header = _header(self.path)
            ours = header is not None and tuple(header) == COLUMNS
            if append and (ours or header is None and self.path.stat().st_size == 0):
                if header is None:
                    _write_header(self.path)
                return
            if append:
                raise FileExistsError(f"{self.path} is not a depth-weight log (its header is "
                                      f"{','.join(header or [])[:80]}): give another path, or overwrite=True "
                                      "to replace it")
            if not overwrite:
                what = "a depth-weight log" if ours else "a file that is not a depth-weight log"
                raise FileExistsError(f"{self.path} exists ({what}): give another path, append=True to continue "
                                      "a log of this monitor, or overwrite=True to start it anew")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _write_header(self.path)

    def write(self, stats: dict) -> None:
        """Append one watched step's rows (sites without weights, an original model's, are skipped)."""
        rows = [(stats["step"], s["chain"], s["site"], j, f"{w:.6g}", f"{m:.6g}", f"{s['entropy']:.6g}",
                 f"{s['max_entropy']:.6g}", f"{s['rms']:.6g}", s["rows"])
                for s in stats["sites"] if "weights" in s for j, (w, m) in enumerate(zip(s["weights"], s["weights_max"]))]
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerows(rows)


def _header(path: Path) -> list[str] | None:
    try:
        with open(path, newline="") as f:
            return next(csv.reader(f), None)
    except (UnicodeDecodeError, csv.Error):
        return ["(not text)"]


def _write_header(path: Path) -> None:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerow(COLUMNS)


def read_csv(path: str | Path) -> list[dict]:
    """The history a `CsvLog` holds: per step, in file order, stats as `DepthMonitor.stats()` gives
    them (without the names)."""
    steps: dict[int, dict] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            stats = steps.setdefault(int(r["step"]), {"step": int(r["step"]), "sites": []})
            site = stats["sites"][-1] if stats["sites"] else None
            if site is None or (site["chain"], site["site"]) != (r["chain"], int(r["site"])):
                site = {"chain": r["chain"], "site": int(r["site"]), "rows": int(r["rows"]), "rms": float(r["rms"]),
                        "sources": 0, "weights": [], "weights_max": [], "entropy": float(r["entropy"]),
                        "max_entropy": float(r["max_entropy"])}
                stats["sites"].append(site)
            site["weights"].append(float(r["weight"]))
            site["weights_max"].append(float(r["weight_max"]))
            site["sources"] += 1
    return list(steps.values())


def tensorboard_writer(logdir: str | Path):
    """A `SummaryWriter` for `logdir`, or None when tensorboard is not installed (it is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(logdir))


def log_stats(writer, stats: dict, step: int, prefix: str = "attnres") -> None:
    """To TensorBoard: per-site entropy, largest mean weight and RMS as scalars, each chain's site x
    source weights as a grey-level image (white = 1); a no-op when `writer` is None."""
    if writer is None:
        return
    from ..utils.plots import weight_matrix

    for s in stats["sites"]:
        tag = f"{prefix}/{s['chain']}/site{s['site']:02d}"
        writer.add_scalar(f"{tag}/rms", s["rms"], step)
        if "weights" in s:
            writer.add_scalar(f"{tag}/entropy", s["entropy"], step)
            writer.add_scalar(f"{tag}/max_weight", max(s["weights"]), step)
    for chain in sorted({s["chain"] for s in stats["sites"] if "weights" in s}):
        image = torch.tensor(weight_matrix(stats, chain)).nan_to_num(0.0)
        writer.add_image(f"{prefix}/{chain}/weights", image[None], step, dataformats="CHW")
    writer.flush()
