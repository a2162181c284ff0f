"""The study's PNGs from its results: loss curves with seed bands, paired differences while fine-tuning,
normalised entropy over training, stream RMS by depth, and the final weight heatmaps (small: dpi 90)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from samples.study_arms import ATTNRES_ARMS, CONVERTED, FROM_SCRATCH, LABEL

DPI = 90


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, plt, path: Path) -> None:
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=DPI)
    plt.close(fig)
    tmp.replace(path)


def _seeds(runs: dict) -> list[str]:
    return sorted(runs, key=int)


def _style(ax, **settings) -> None:
    ax.set(**settings)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _band(ax, steps, values, label, **kw) -> None:
    """Mean line and a +-1 std band over the rows of `values` (seeds)."""
    v = np.asarray(values)
    mean = v.mean(0)
    ax.plot(steps, mean, label=label, **kw)
    if len(v) > 1:
        std = v.std(0, ddof=1)
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2, color=ax.lines[-1].get_color())


def _ran(arms, results: dict, L: str) -> list[str]:
    """The `arms` that ran at size L (a run of `--parts scratch` has no conversion arms)."""
    return [a for a in arms if a in results["analysis"][L]["arms"]]


def plot_all(results: dict, out: Path) -> None:
    plt = _pyplot()
    sizes = list(results["analysis"])
    _curves_scratch(plt, results, sizes, out / "curves_scratch.png")
    if _ran(CONVERTED, results, sizes[0]):
        _curves_convert(plt, results, sizes, out / "curves_convert.png")
    _entropy(plt, results, sizes, out / "entropy.png")
    _magnitude(plt, results, sizes, out / "magnitude.png")
    for L in sizes:
        _weights(plt, results["analysis"][L]["mechanism"], L, out / f"weights_{L}.png")


def _curves_scratch(plt, results, sizes, path) -> None:
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 3.4), squeeze=False)
    for ax, L in zip(axes[0], sizes):
        runs = results["runs"][L]
        for arm in ("baseline", *_ran(FROM_SCRATCH, results, L)):
            curves = [runs[s][arm]["curve"] for s in _seeds(runs)]
            _band(ax, [p[0] for p in curves[0]], [[p[1] for p in c] for c in curves], LABEL[arm])
        _style(ax, title=f"{L} layers, from scratch", xlabel="step", ylabel="val loss (curve batches)")
    _save(fig, plt, path)


def _curves_convert(plt, results, sizes, path) -> None:
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 3.4), squeeze=False)
    for ax, L in zip(axes[0], sizes):
        runs = results["runs"][L]
        ref = [[p[1] for p in runs[s]["continue"]["curve"]] for s in _seeds(runs)]
        steps = [p[0] for p in runs[_seeds(runs)[0]]["continue"]["curve"]]
        for arm in CONVERTED:
            diffs = [[p[1] - r for p, r in zip(runs[s][arm]["curve"], ref[i])] for i, s in enumerate(_seeds(runs))]
            _band(ax, steps, diffs, LABEL[arm], ls="--" if arm.endswith("paper") else "-")
        ax.axhline(0, color="k", lw=0.8)
        _style(ax, title=f"{L} layers: converted - continued baseline", xlabel="fine-tuning step", ylabel="val loss difference")
    _save(fig, plt, path)


def _entropy(plt, results, sizes, path) -> None:
    rows = 2 if _ran(CONVERTED, results, sizes[0]) else 1
    fig, axes = plt.subplots(rows, len(sizes), figsize=(4.5 * len(sizes), 3 * rows), squeeze=False)
    for col, L in enumerate(sizes):
        runs = results["runs"][L]
        for row, arms, title in ((0, _ran(FROM_SCRATCH, results, L), "from scratch"), (1, CONVERTED, "after conversion"))[:rows]:
            ax = axes[row][col]
            for arm in arms:
                depth = [runs[s][arm]["depth"] for s in _seeds(runs)]
                _band(ax, [d[0] for d in depth[0]], [[np.mean(d[1]["entropy"]) for d in dep] for dep in depth], LABEL[arm])
            _style(ax, title=f"{L} layers, {title}", xlabel="step" if row == 0 else "fine-tuning step",
                   ylabel="entropy / log|S| (1 = uniform)")
    _save(fig, plt, path)


def _magnitude(plt, results, sizes, path) -> None:
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 3.4), squeeze=False)
    for ax, L in zip(axes[0], sizes):
        mech = results["analysis"][L]["mechanism"]
        for arm in _ran(("baseline", *FROM_SCRATCH, "continue", "full-preserve", "full-paper"), results, L):
            rms = mech[arm]["rms"]
            ax.plot(range(1, len(rms) + 1), rms, marker="o", ms=2, label=LABEL[arm], ls="--" if arm in CONVERTED else "-")
        _style(ax, title=f"{L} layers: stream RMS at each site", xlabel="site (sublayer depth)", ylabel="RMS (mean over seeds)",
               yscale="log")
    _save(fig, plt, path)


def _weights(plt, mech: dict, L: str, path) -> None:
    arms = [a for a in ATTNRES_ARMS if a in mech]
    cols = 3
    rows = math.ceil(len(arms) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    from matplotlib.colors import TwoSlopeNorm

    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.8")  # grey: sources a site does not read
    for ax, arm in zip(axes.flat, arms):
        sites = mech[arm]["weights_mean"]
        width = max(len(w) for w in sites)
        mat = np.array([[x * len(w) for x in w] + [math.nan] * (width - len(w)) for w in sites])
        norm = TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=max(2.0, float(np.nanmax(mat))))
        im = ax.imshow(mat, cmap=cmap, norm=norm, aspect="auto", extent=(-0.5, width - 0.5, len(sites) + 0.5, 0.5))
        ax.set(title=LABEL[arm], xlabel="source (0 = v0)", ylabel="site")
        fig.colorbar(im, ax=ax)
    for ax in list(axes.flat)[len(arms):]:
        ax.axis("off")
    fig.suptitle(f"{L} layers: depth-attention weight x |S| at the end (1 = uniform share; mean over seeds)")
    _save(fig, plt, path)
