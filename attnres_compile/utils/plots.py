"""PNG plots of monitor stats and training curves (matplotlib, imported only when a plot is drawn)."""

from __future__ import annotations

import math
from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def weight_matrix(stats: dict, chain: str) -> list[list[float]]:
    """Rows = sites 1..n of `chain`, columns = sources 0..max; NaN where a site does not read a source."""
    sites = [s for s in stats["sites"] if s["chain"] == chain and "weights" in s]
    width = max(len(s["weights"]) for s in sites)
    return [s["weights"] + [math.nan] * (width - len(s["weights"])) for s in sites]


def plot_heatmap(stats: dict, path: str | Path, title: str | None = None) -> Path:
    """Site x source heatmap of the mean depth-attention weights, one panel per chain (as in the paper's figure)."""
    plt = _pyplot()
    chains = sorted({s["chain"] for s in stats["sites"] if "weights" in s})
    if not chains:
        raise ValueError("no depth-attention weights in these stats (an original model has none)")
    mats = [weight_matrix(stats, c) for c in chains]
    fig, axes = plt.subplots(1, len(chains), figsize=(1 + 5 * len(chains), 4.5), squeeze=False)
    for ax, chain, mat in zip(axes[0], chains, mats):
        im = ax.imshow(mat, cmap="viridis", vmin=0, vmax=1, aspect="auto",
                       extent=(-0.5, len(mat[0]) - 0.5, len(mat) + 0.5, 0.5))
        if len(mat) * len(mat[0]) <= 200:
            for i, row in enumerate(mat, start=1):
                for j, w in enumerate(row):
                    if not math.isnan(w):
                        ax.text(j, i, f"{w:.2f}", ha="center", va="center", fontsize=6, color="white" if w < 0.5 else "black")
        for axis in (ax.xaxis, ax.yaxis):
            axis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("source (0 = root v0)")
        ax.set_ylabel("site")
        ax.set_title(chain)
        fig.colorbar(im, ax=ax, label="mean weight")
    if title:
        fig.suptitle(title)
    return _save(fig, plt, path)


def plot_magnitude(curves: dict[str, list[float]], path: str | Path, title: str = "stream RMS by depth") -> Path:
    """RMS of the stream at each site, one line per model (e.g. original against rewritten)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rms in curves.items():
        ax.plot(range(1, len(rms) + 1), rms, marker="o", ms=3, label=label)
    ax.set_xlabel("site (sublayer depth)")
    ax.set_ylabel("RMS of site value")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    return _save(fig, plt, path)


def plot_curves(curves: dict[str, list[tuple[int, float]]], path: str | Path, title: str = "validation loss") -> Path:
    """Loss curves: one line per run, each a list of (step, loss)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        steps, losses = zip(*points)
        ax.plot(steps, losses, marker=".", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/char)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, plt, path)


def plot_weights_over_steps(history: list[dict], path: str | Path, panels: int = 12, title: str | None = None) -> Path:
    """Depth weights over training steps from a monitor's history: first each site's normalised entropy
    (1 = uniform), then up to `panels - 1` sites' per-source mean weights, against the step."""
    plt = _pyplot()
    keys = [(s["chain"], s["site"]) for s in history[-1]["sites"] if "weights" in s]
    if not keys:
        raise ValueError("no depth-attention weights in this history (an original model has none)")
    steps = [h["step"] for h in history]
    by_key = [{(s["chain"], s["site"]): s for s in h["sites"]} for h in history]
    last = by_key[-1]
    m = min(panels - 1, len(keys))
    lowest = min(keys, key=lambda k: last[k]["entropy"] / last[k]["max_entropy"])
    chosen = sorted({keys[round(i * (len(keys) - 1) / max(1, m - 1))] for i in range(m)}, key=keys.index)
    if lowest not in chosen:  # in place of the spread's second-to-last
        chosen = sorted([*chosen[:-2], chosen[-1], lowest], key=keys.index)
    cols = min(4, len(chosen) + 1)
    rows = math.ceil((len(chosen) + 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    cmap = plt.get_cmap("viridis")
    ax = flat[0]
    for i, key in enumerate(keys):
        ax.plot(steps, [h[key]["entropy"] / h[key]["max_entropy"] if key in h else math.nan for h in by_key],
                color=cmap(i / max(1, len(keys) - 1)), lw=0.8)
    ax.set_title("entropy / log|S|, every site\n(colour: depth)", fontsize=8)
    ax.set_xlabel("step", fontsize=7)
    for ax, key in zip(flat[1:], chosen):
        n = last[key]["sources"]
        for j in range(n):
            ax.plot(steps, [h[key]["weights"][j] if key in h else math.nan for h in by_key], marker=".", ms=3,
                    color=cmap(j / max(1, n - 1)), label=f"src{j}" if n <= 10 else None)
        ax.set_ylim(0, 1)
        ax.set_title(f"{key[0]} site {key[1]}", fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        if n <= 10:
            ax.legend(fontsize=5, ncol=2, loc="upper right")
    for ax in flat:
        ax.tick_params(labelsize=6)
    for ax in flat[len(chosen) + 1:]:
        ax.axis("off")
    fig.suptitle(title or "mean depth weight per source over steps", fontsize=10)
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
