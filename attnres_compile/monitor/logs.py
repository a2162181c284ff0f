"""Writing the per-site stats of watched steps: a CSV log (always available) and TensorBoard (optional).

The CSV has one row per (step, site, source): `step, chain, site, source, weight, weight_max,
entropy, max_entropy, rms, rows` (the site's columns repeat on its sources' rows), so that a
spreadsheet or pandas reads it as it is and `read_csv` gives back the monitor's history. It is a
log: each watched step appends its complete rows and flushes, so a run that stops leaves the
steps it finished.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch

COLUMNS = ("step", "chain", "site", "source", "weight", "weight_max", "entropy", "max_entropy", "rms", "rows")


class CsvLog:
    """Appends the stats of each watched step to `path` (created anew, header first; `append=True`
    continues an existing log of the same columns, e.g. a resumed run)."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        if append and self.path.is_file():
            with open(self.path, newline="") as f:
                header = next(csv.reader(f), None)
            if header is not None and tuple(header) != COLUMNS:
                raise ValueError(f"{self.path} is not a depth-weight log (its header is {','.join(header)}): "
                                 "give another path, or append=False to start it anew")
            if header is not None:
                return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", newline="") as f:
            csv.writer(f).writerow(COLUMNS)

    def write(self, stats: dict) -> None:
        """Append one watched step's rows (sites without weights, an original model's, are skipped)."""
        rows = [(stats["step"], s["chain"], s["site"], j, f"{w:.6g}", f"{m:.6g}", f"{s['entropy']:.6g}",
                 f"{s['max_entropy']:.6g}", f"{s['rms']:.6g}", s["rows"])
                for s in stats["sites"] if "weights" in s for j, (w, m) in enumerate(zip(s["weights"], s["weights_max"]))]
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerows(rows)


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
