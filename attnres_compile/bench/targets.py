"""The project's performance targets as data, and their verdicts from `bench model`'s rows.

Each target limits one measure of one (runtime, variant) over a set of (width, sublayers)
configurations, judged on the 1-thread CPU-time measure. Each configuration's interval
(timing.ratio_interval) is widened by the identical copy's overhead (the noise floor): NOT MET if
some interval lies above the limit, MET if all lie at or below it, else WITHIN NOISE. A target
with no configuration run is "not measured".
"""

from __future__ import annotations

from dataclasses import dataclass

WIDE = ((256, 12), (256, 24), (256, 48))  # (width, sublayers) of the default matrices
LARGE = ((1024, 24),)
MODELS = ("gpt", "llama")
TUNE_MINUTES = 20
MEASURES = {"overhead": "overhead over the original", "vs_onnxruntime": "time against onnxruntime",
            "build_s": "build time"}  # what a verdict line says its target limits
FORMATS = {"overhead": "{:+.1f}%", "vs_onnxruntime": "{:.2f}x", "build_s": "{:.1f} s"}
# the row fields a measure is decided on (1 thread, CPU time; its interval: the field without _pct,
# plus _interval) and reported beside (--threads, wall time)
DECIDING = {"overhead": "cpu_overhead_pct", "vs_onnxruntime": "vs_onnxruntime_cpu"}
BESIDE = {"overhead": "wall_overhead_pct", "vs_onnxruntime": "vs_onnxruntime_wall"}


@dataclass(frozen=True)
class Target:
    """`metric` of (runtime, variant) <= `limit` at every (width, sublayers) of `configs`, both models.

    metric: "overhead" (% over the original in the same runtime and rounds), "vs_onnxruntime"
    (x onnxruntime running the original, in the same rounds), "build_s" (seconds to build; any variant)."""

    what: str
    runtime: str
    variant: str | None
    metric: str
    limit: float
    configs: tuple[tuple[int, int], ...]


TARGETS = (  # issue 50's limits (2026-12-04): the fused site + norm pays for most of a site
    Target("PyTorch eager forward, Block", "eager", "block", "overhead", 3.0, WIDE),
    Target("PyTorch eager forward, Block", "eager", "block", "overhead", 2.0, LARGE),
    Target("PyTorch eager forward, Full", "eager", "full", "overhead", 10.0, ((256, 24),)),
    Target("PyTorch forward + backward, Block", "train", "block", "overhead", 5.0, WIDE),
    Target("onnxruntime, Block", "onnxruntime", "block", "overhead", 5.0, WIDE),
    Target("onnxruntime, Block", "onnxruntime", "block", "overhead", 0.0, LARGE),
    Target("onnxruntime, Full", "onnxruntime", "full", "overhead", 25.0, ((256, 48),)),
    Target("TVM, Block", "tvm", "block", "overhead", 0.0, ((256, 48),)),
    Target("TVM, Full", "tvm", "full", "overhead", 5.0, ((256, 48),)),
    Target("TVM default build, original vs onnxruntime original", "tvm", "original", "vs_onnxruntime", 1.15,
           WIDE + LARGE),
    Target("TVM default build time", "tvm", None, "build_s", 60.0, WIDE + LARGE),
    Target("TVM default build, Block vs onnxruntime original", "tvm", "block", "vs_onnxruntime", 1.10, WIDE + LARGE),
    Target(f"TVM tuned {TUNE_MINUTES} min, Block vs onnxruntime original", "tvm-tuned", "block", "vs_onnxruntime",
           1.0, WIDE + LARGE),
)


def at(targets: tuple[Target, ...], config: tuple[int, int]) -> tuple[Target, ...]:
    """`targets` read at one (width, sublayers): a --factory model's own size. A measure limited
    per width (eager and onnxruntime Block: width 256 and 1024) keeps its first limit, width 256's."""
    first: dict[tuple, Target] = {}
    for t in targets:
        first.setdefault((t.what, t.runtime, t.variant, t.metric), Target(t.what, t.runtime, t.variant, t.metric,
                                                                           t.limit, (config,)))
    return tuple(first.values())


def limit_text(t: Target) -> str:
    unit = {"overhead": f"<= {t.limit:+g}%", "vs_onnxruntime": f"<= {t.limit:g}x", "build_s": f"<= {t.limit:g} s"}
    return unit[t.metric]


def configs_text(configs: tuple[tuple[int, int], ...]) -> str:
    widths = dict.fromkeys(w for w, _ in configs)
    return ", ".join(f"width {w} at {'/'.join(str(d) for ww, d in configs if ww == w)} sublayers" for w in widths)


def evaluate(rows: list[dict], compiles: list[dict], tuning: dict, targets: tuple[Target, ...] = TARGETS,
             models: tuple[str, ...] = MODELS) -> list[dict]:
    """One verdict per target: {"name", "target", "measured" (worst, deciding clock), "beside" (worst,
    other clock), "floor", "where", "covered", "expected", "met" (True, False, None), "verdict",
    "band", "band_where", "note"}. `tuning` ({"tune_minutes", "trials"}): the tuned target holds only
    for a run tuned TUNE_MINUTES. `targets`/`models`: another benchmark's (bench decode)."""
    return [_verdict(t, rows, compiles, tuning, models) for t in targets]


def _verdict(t: Target, rows: list[dict], compiles: list[dict], tuning: dict, models: tuple[str, ...]) -> dict:
    expected = {(m, w, d) for m in models for w, d in t.configs}
    out = {"name": t.what, "target": f"{limit_text(t)} ({configs_text(t.configs)})",
           "runtime": t.runtime, "variant": t.variant, "metric": t.metric, "limit": t.limit,
           "measured": None, "beside": None, "floor": None, "where": None, "expected": len(expected), "covered": 0,
           "met": None, "verdict": "not measured", "band": None, "band_where": None, "note": None}
    if t.metric == "build_s":
        found = [c for c in compiles if (c["model"], c["width"], c["sublayers"]) in expected
                 and c.get(f"{t.runtime}_build_s") is not None]
        values = [(c[f"{t.runtime}_build_s"], c.get(f"{t.runtime}_build_cpu_s"), c) for c in found]
    else:
        key, other = DECIDING[t.metric], BESIDE[t.metric]
        found = [r for r in rows if (r["model"], r["width"], r["sublayers"]) in expected
                 and (r["runtime"], r["variant"]) == (t.runtime, t.variant) and r.get(key) is not None]
        values = [(r[key], r.get(other), r) for r in found]
    out["covered"] = len({(r["model"], r["width"], r["sublayers"]) for _, _, r in values})
    if not values:
        out["note"] = "not run: " + (f"needs --tune-minutes {TUNE_MINUTES}" if t.runtime == "tvm-tuned"
                                     else f"this run has no {configs_text(t.configs)} {t.runtime} rows")
        return out
    worst, _, where = max(values, key=lambda v: v[0])
    copy = _copy(rows, where, t.runtime)
    out.update(measured=worst, beside=max((b for _, b, _ in values if b is not None), default=None),
               where=_where(where) + (f" {where['variant']}" if t.metric == "build_s" else ""),
               floor=copy.get("cpu_overhead_pct") if t.metric != "build_s" else None)
    if t.metric == "build_s":
        out["met"] = worst <= t.limit
    else:
        bands = [(_band(t, r, _copy(rows, r, t.runtime)), r) for _, _, r in values]
        above = [(band, r) for band, r in bands if band[0] > t.limit]
        unclear = [(band, r) for band, r in bands if band[1] > t.limit]
        out["met"] = False if above else True if not unclear else None
        # shown: the clearest miss, else the least clear configuration
        (low, high), shown = max(above, key=lambda b: b[0][0]) if above else max(bands, key=lambda b: b[0][1])
        out.update(band=[low, high], band_where=_where(shown))
        if out["met"] is None:
            out.update(verdict="WITHIN NOISE", note=f"within noise: {_where(shown)} reads {_fmt(t, low)} ... "
                                                    f"{_fmt(t, high)}, which holds the limit; more --rounds or a "
                                                    "quieter machine can tell")
    if out["met"] is not None:
        out["verdict"] = "MET" if out["met"] else "NOT MET"
    if t.runtime == "tvm-tuned" and (tuning.get("tune_minutes") or 0) < TUNE_MINUTES:
        how = f"{tuning['tune_minutes']} min" if tuning.get("tune_minutes") else f"{tuning.get('trials')} trials per task"
        out.update(met=None, verdict="not measured",
                   note=f"not measured: the target is for --tune-minutes {TUNE_MINUTES}; this run tuned {how}")
    elif out["covered"] < out["expected"]:
        out["note"] = "; ".join(filter(None, [out["note"], f"partial: {out['covered']} of {out['expected']} model "
                                                           "configurations run"]))
    return out


def _where(r: dict) -> str:
    return f"{r['model']} {r['width']}/{r['sublayers']}"


def _copy(rows: list[dict], r: dict, runtime: str) -> dict:
    """The identical copy's row in the same runtime and configuration as `r` ({} if none)."""
    return next((c for c in rows if (c["model"], c["width"], c["sublayers"], c["runtime"], c["variant"])
                 == (r["model"], r["width"], r["sublayers"], runtime, "copy")), {})


def _band(t: Target, r: dict, copy: dict) -> tuple[float, float]:
    """[low, high] of row r's measure on the deciding clock: the interval of its median over the
    rounds (the median itself in rows without one), widened by the identical copy's |overhead|."""
    value = r[DECIDING[t.metric]]
    low, high = r.get(f"{DECIDING[t.metric].removesuffix('_pct')}_interval") or (value, value)
    slack = abs(copy.get("cpu_overhead_pct") or 0.0)
    if t.metric == "overhead":
        return low - slack, high + slack
    return low * (1 - slack / 100), high * (1 + slack / 100)


def _fmt(t: Target, value: float) -> str:
    return FORMATS[t.metric].format(value)


def line(v: dict, threads: int) -> str:
    """One verdict as a text line: what, limit, the worst measured (1-thread CPU time, 2-thread wall
    beside; builds: wall, CPU beside), the identical copy's overhead there, the interval the verdict
    was decided on, the verdict."""
    verdict = v["verdict"]
    head = f"{MEASURES[v['metric']]}: {v['name']} {v['target']}: "
    if v["measured"] is None:
        return head + f"{verdict} ({v['note']})"
    fmt = FORMATS[v["metric"]]
    clocks, other = ("1-thread CPU", f"{threads}-thread wall") if v["metric"] != "build_s" else ("wall", "CPU")
    extra = [] if v["beside"] is None else [f"{other} {fmt.format(v['beside'])}"]
    if v["floor"] is not None:
        extra.append(f"identical copy {v['floor']:+.1f}%")
    if v["band"] and v["met"] is not None:
        extra.append(f"with the rounds' spread and the copy's: {fmt.format(v['band'][0])} ... "
                     f"{fmt.format(v['band'][1])} at {v['band_where']}")
    if v["note"]:
        extra.append(v["note"])
    return head + f"{fmt.format(v['measured'])} {clocks} at {v['where']} ({'; '.join(extra)}): {verdict}"
