"""Views of `bench decode`'s data: the text table (rows, clocks, noise floor, site costs, targets)
and the PNG plots, computed from the data dict alone."""

from __future__ import annotations

from pathlib import Path

from .. import results
from .. import targets as model_targets
from ..model.report import _panel, clock_lines, coverage_text, floor_lines, interval_text


def columns(threads: int) -> list[tuple[str, str, str]]:
    many = f"{threads}T"
    return [("model", "model", ""), ("width", "width", "d"), ("sublayers", "sublayers", "d"),
            ("runtime", "runtime", ""),
            ("variant", "variant", ""), ("sites", "sites", "d"), ("ops", "ops", "d"),
            ("cpu_token_ms", "1T cpu ms/token", ".3f"), ("cpu_overhead_pct", "1T cpu ovh %", "+.1f"),
            ("cpu_interval", "1T interval %", ""), ("wall_token_ms", f"{many} wall ms/token", ".3f"),
            ("wall_overhead_pct", f"{many} wall ovh %", "+.1f"), ("max_abs_err", "max abs err", ".1e"),
            ("note", "note", "")]


def table(data: dict) -> str:
    """The rows, how the clocks behaved, the noise floor, one site's cost and the target lines."""
    cfg = data["config"]
    rows = [{**r, "note": r.get("error"), "cpu_interval": interval_text(r)} for r in data["rows"]]
    lines = [results.table(rows, columns(cfg["threads"])), ""]
    lines.append(f"prefill {cfg['prefill']} tokens (untimed), then {cfg['steps']} decode steps of 1 token, batch 1, "
                 f"Block N={cfg['blocks']}; TVM {cfg['tvm']}; hf: HF's own forward with a DynamicCache, against the "
                 f"traced original; 1T: 1 thread, process CPU time; {cfg['threads']}T: {cfg['threads']} threads, wall "
                 f"time; ovh = median over {cfg['rounds']} interleaved rounds of variant / original - 1; interval: "
                 f"where that median lies ({coverage_text(data['rows'])}); ops: operator calls of the traced step")
    if any(r["runtime"] == "generate" for r in data["rows"]):
        lines.append("generate: one greedy HF generate() call per round, prefill included, over the new tokens; "
                     "original: the model's own generate(); copy: an identical model's; traced: generation.causal_lm "
                     "over its traced decoder with past; block: causal_lm over the Block rewrite (each checked against "
                     "original's step logits)")
    lines += clock_lines(data["rows"]) + floor_lines(data["rows"], cfg["threads"])
    lines += [site_line(s, data["rows"]) for s in data["sites"] if s.get("op_us")]
    lines += [model_targets.line(t, cfg["threads"]) for t in data["targets"]]
    return "\n".join(lines)


def site_line(site: dict, rows: list[dict]) -> str:
    """One site at [1, 1, D] against an add; per rewritten variant, the overhead per token its op calls
    predict (eager) and what each runtime measured, per token and per site."""
    ops, ref = site["op_us"], site["reference_us"]
    low, high = min(ops, key=ops.get), max(ops, key=ops.get)
    parts = [f"sites {site['model']} {site['width']}/{site['sublayers']} at [1, 1, {site['width']}], 1T CPU: add "
             f"{site['add_us']:.1f} us; op {ops[low]:.1f} us ({low} sources) .. {ops[high]:.1f} us ({high} sources); "
             f"eager reference {min(ref.values()):.1f} .. {max(ref.values()):.1f} us"]
    for name, v in site["variants"].items():
        measured = []
        for runtime in dict.fromkeys(r["runtime"] for r in rows):
            orig, mine = _row(rows, site, runtime, "original"), _row(rows, site, runtime, name)
            if mine.get("cpu_token_ms") and orig.get("cpu_token_ms"):
                delta = mine["cpu_token_ms"] - orig["cpu_token_ms"]
                measured.append(f"{runtime} {delta:+.3f} ms ({delta / v['sites'] * 1e3:+.1f} us a site)")
        parts.append(f"{name}: {v['sites']} sites, op calls less adds predict "
                     f"{v['estimated_overhead_ms']:+.3f} ms/token"
                     + (", measured " + ", ".join(measured) if measured else ""))
    return "; ".join(parts)


def _row(rows: list[dict], site: dict, runtime: str, variant: str) -> dict:
    return next((r for r in rows if (r["model"], r["width"], r["sublayers"], r["runtime"], r["variant"])
                 == (site["model"], site["width"], site["sublayers"], runtime, variant)), {})


def plot(data: dict, out_dir: Path) -> list[Path]:
    """decode_overhead.png (1-thread CPU overhead per token, %) and decode_latency.png (1-thread CPU
    ms per token) against depth, a panel per model and width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["model"], r["width"]) for r in data["rows"]))
    paths = []
    for key, ylabel, variants, fname in (
            ("cpu_overhead_pct", "overhead per token over the original, 1-thread CPU (%)", ("copy", "full", "block"),
             "decode_overhead.png"),
            ("cpu_token_ms", "1-thread CPU ms per decoded token", ("original", "full", "block"), "decode_latency.png")):
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
        for ax, (model, width) in zip(axes[0], panels):
            _panel(ax, [r for r in data["rows"] if (r["model"], r["width"]) == (model, width)], key, variants)
            ax.set_title(f"decode, {model}, width {width}")
            ax.set_ylabel(ylabel)
        paths.append(results.save_figure(fig, out_dir / fname))
    return paths
