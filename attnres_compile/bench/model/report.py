"""Views of `bench model`'s data: the text table (rows, clocks, noise floor, builds, targets,
profiles) and the PNG plots. Data first: everything here is computed from the data dict."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path

from .. import results
from .. import targets as model_targets
from . import profile

PLOT_COLORS = {"eager": "tab:blue", "train": "tab:purple", "onnxruntime": "tab:orange", "tvm": "tab:green",
               "tvm-tuned": "tab:olive", "generate": "tab:red"}
PLOT_STYLES = {"original": ("^", ":"), "copy": ("x", ":"), "full": ("s", "--"), "block": ("o", "-"),
               "delta": ("D", "--"), "delta-block": ("v", "-")}  # marker, line


def columns(threads: int) -> list[tuple[str, str, str]]:
    many = f"{threads}T"
    return [("model", "model", ""), ("width", "width", "d"), ("sublayers", "sublayers", "d"), ("runtime", "runtime", ""),
            ("variant", "variant", ""), ("sites", "sites", "d"), ("cpu_ms", "1T cpu ms", ".3f"),
            ("cpu_overhead_pct", "1T cpu ovh %", "+.1f"), ("cpu_interval", "1T interval %", ""),
            ("wall_ms", f"{many} wall ms", ".3f"),
            ("wall_overhead_pct", f"{many} wall ovh %", "+.1f"), ("vs_onnxruntime_cpu", "1T x ort", ".2f"),
            ("vs_onnxruntime_wall", f"{many} x ort", ".2f"), ("forward_peak_mb", "fwd peak MiB", ".1f"),
            ("peak_rss_mb", "peak RSS MiB", ".0f"), ("max_abs_err", "max abs err", ".1e"), ("note", "note", "")]


def table(data: dict) -> str:
    """The rows as a text table, then how the clocks behaved, the noise floor, build times,
    the target lines and (with --profile) the profiles."""
    cfg = data["config"]
    rows = [{**r, "note": r.get("error") or r.get("memory_error"), "cpu_interval": interval_text(r)}
            for r in data["rows"]]
    lines = [results.table(rows, columns(cfg["threads"])), ""]
    lines.append(f"seq {cfg['seq']}, batch {cfg['batch']}, Block N={cfg['blocks']}, {cfg['device']}; TVM {cfg['tvm']}; "
                 f"1T: 1 thread, process CPU time; {cfg['threads']}T: {cfg['threads']} threads, wall time; "
                 f"ovh = median over {cfg['rounds']} interleaved rounds of variant / original - 1; "
                 f"interval: where that median lies ({coverage_text(data['rows'])}, from the rounds' order statistics); "
                 "x ort = the same against onnxruntime running the original")
    lines += clock_lines(data["rows"]) + floor_lines(data["rows"], cfg["threads"])
    for c in data["compile"]:
        stages = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in c.items() if k.endswith("_s"))
        lines.append(f"compile {c['model']} {c['width']}/{c['sublayers']} {c['variant']}: {stages}")
    lines += [model_targets.line(t, cfg["threads"]) for t in data["targets"]]
    lines += delta_lines(data["rows"])
    if data.get("profiles"):
        lines += ["", profile.tables(data["profiles"])]
    return "\n".join(lines)


DELTA_TARGET = 1.0  # Delta-Block's overhead over the original at most Block's + 1 point (issue 64)


def delta_lines(rows: list[dict]) -> list[str]:
    """Per run with both: Delta-Block's 1-thread overhead beside Block's, their difference in points and
    the identical copy's overhead, against the +1 point target: MET, NOT MET or WITHIN NOISE by the
    difference -/+ the copy's |overhead|."""
    out = []
    for r in rows:
        if r["variant"] != "delta-block" or r.get("cpu_overhead_pct") is None:
            continue
        key = (r["model"], r["width"], r["sublayers"], r["runtime"])
        same = {v["variant"]: v for v in rows if (v["model"], v["width"], v["sublayers"], v["runtime"]) == key}
        block, copy = same.get("block", {}).get("cpu_overhead_pct"), same.get("copy", {}).get("cpu_overhead_pct")
        if block is None:
            continue
        diff = r["cpu_overhead_pct"] - block
        floor = abs(copy or 0.0)
        verdict = "MET" if diff + floor <= DELTA_TARGET else "NOT MET" if diff - floor > DELTA_TARGET else "WITHIN NOISE"
        out.append(f"delta-block vs block: {r['model']} {r['width']}/{r['sublayers']} {r['runtime']}: "
                   f"{r['cpu_overhead_pct']:+.1f}% vs {block:+.1f}% = {diff:+.1f} points (target <= "
                   f"{DELTA_TARGET:+g}; identical copy {copy if copy is not None else float('nan'):+.1f}%): {verdict}")
    return out


def interval_text(row: dict) -> str | None:
    """A row's 1-thread overhead interval as "low..high" (None: no interval)."""
    interval = row.get("cpu_overhead_interval")
    return None if not interval or row.get("variant") == "original" else f"{interval[0]:+.1f}..{interval[1]:+.1f}"


def coverage_text(rows: list[dict]) -> str:
    coverage = [r["cpu_interval_coverage"] for r in rows if r.get("cpu_interval_coverage") is not None]
    return f"{min(coverage):.0%} confidence" if coverage else "none measured"


def clock_lines(rows: list[dict]) -> list[str]:
    """Whether the 1-thread work ran in the calling thread (thread CPU = process CPU) and how much
    of a core the worker got (CPU / wall: under 1 on a busy machine)."""
    timed = [r for r in rows if r.get("in_thread") is not None]
    if not timed:
        return []
    low = min(timed, key=lambda r: r["in_thread"])
    share = statistics.median(r["cpu_share"] for r in timed)
    return [f"1-thread runs: thread CPU / process CPU time >= {low['in_thread']:.3f} in every row (lowest: "
            f"{low['runtime']} {low['variant']}, {low['model']} {low['width']}/{low['sublayers']}), so the work ran "
            f"in the calling thread; CPU / wall time median {share:.2f}"
            + (" (the machine was busy: CPU-time ratios are the reliable ones)" if share < 0.9 else "")]


def floor_lines(rows: list[dict], threads: int) -> list[str]:
    """The identical copy's overhead per runtime, worst over the configurations: the noise floor."""
    parts = []
    for runtime in dict.fromkeys(r["runtime"] for r in rows):
        copies = [r for r in rows if (r["runtime"], r["variant"]) == (runtime, "copy")]
        cpu = [abs(r["cpu_overhead_pct"]) for r in copies if r.get("cpu_overhead_pct") is not None]
        wall = [abs(r["wall_overhead_pct"]) for r in copies if r.get("wall_overhead_pct") is not None]
        if cpu or wall:
            parts.append(f"{runtime} " + " / ".join(f"{max(v):.1f}% {clock}" for v, clock in
                                                     ((cpu, "1T cpu"), (wall, f"{threads}T wall")) if v))
    return ["identical copy (noise floor), worst |overhead| over the configurations: " + "; ".join(parts)] if parts else []


def plot(data: dict, out_dir: Path) -> list[Path]:
    """model_overhead.png (1-thread CPU overhead % vs depth), model_latency.png (1-thread CPU ms vs
    depth) and model_vs_onnxruntime.png (TVM x onnxruntime's original), a panel per model and width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["model"], r["width"]) for r in data["rows"]))
    tvm = [r for r in data["rows"] if r.get("vs_onnxruntime_cpu") is not None]
    rewrites = tuple(v for v in PLOT_STYLES
                     if v not in ("original", "copy") and any(r["variant"] == v for r in data["rows"]))
    figures = [("cpu_overhead_pct", "overhead over the original, 1-thread CPU time (%)", ("copy", *rewrites),
                "model_overhead.png", data["rows"]),
               ("cpu_ms", "1-thread CPU time per call (ms)", ("original", *rewrites), "model_latency.png",
                data["rows"]),
               ("vs_onnxruntime_cpu", "x onnxruntime running the original, 1-thread CPU time",
                ("original", *(v for v in rewrites if v != "full")), "model_vs_onnxruntime.png", tvm)]
    paths = []
    for key, ylabel, variants, fname, rows in figures:
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
        for ax, (model, width) in zip(axes[0], panels):
            _panel(ax, [r for r in rows if (r["model"], r["width"]) == (model, width)], key, variants)
            ax.set_title(f"{model}, width {width}")
            ax.set_ylabel(ylabel)
        paths.append(results.save_figure(fig, out_dir / fname))
    return paths


def _panel(ax, rows: list[dict], key: str, variants: Iterable[str]) -> None:
    """One line per runtime (colour) and variant (marker, line style) of `key` against depth."""
    for runtime in dict.fromkeys(r["runtime"] for r in rows):
        for variant in variants:
            pts = sorted((r["sublayers"], r[key]) for r in rows
                         if (r["runtime"], r["variant"]) == (runtime, variant) and r.get(key) is not None)
            if pts:
                marker, line = PLOT_STYLES[variant]
                ax.plot(*zip(*pts), line, marker=marker, color=PLOT_COLORS[runtime], label=f"{runtime} {variant}")
    if key == "cpu_overhead_pct":
        ax.axhline(0, color="grey", lw=0.5)
    elif key == "vs_onnxruntime_cpu":
        ax.axhline(1.15, color="red", lw=0.8, label="1.15x (original, target)")
        ax.axhline(1.10, color="red", lw=0.8, ls="--", label="1.10x (Block, target)")
    else:
        ax.set_yscale("log")
    ax.set_xticks(sorted({r["sublayers"] for r in rows}) or [0])
    ax.set_xlabel("sublayers")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
