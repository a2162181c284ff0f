"""The study's statistics and its Markdown summary, computed from results.json alone (so `--report-only`
refreshes them): paired differences per seed with a t interval, verdicts that say "no detectable
difference" when the interval holds 0, the mechanism (weights, entropy, stream RMS, collapse)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from samples import study_plots
from samples.study_arms import CONVERTED, FROM_SCRATCH, LABEL

# two-sided 95% Student t quantiles t(0.975, df), df = 1..30; larger df use 1.96
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]

# the Delta AttnRes paper's from-scratch validation perplexities after 10K steps (FineWeb-Edu), by model size
PUBLISHED = {"220M": {"baseline": 38.71, "block": 37.39, "full": 37.30, "delta-block": 37.08, "delta": 36.83},
             "1B": {"baseline": 29.70, "block": 31.76, "full": 33.36, "delta-block": 29.19},
             "8B": {"baseline": 18.58, "delta-block": 16.00}}
PUBLISHED_SOURCE = ("Published: Delta Attention Residuals (arXiv 2605.18855), validation perplexity after 10K steps on "
                    "FineWeb-Edu, from scratch.")
PUBLISHED_NOTE = ("At 8B the paper also gives replacement AttnRes (not split into Full and Block here): 17.43 (-6.2%). "
                  "At 1B replacement AttnRes (Full, Block) is worse than the baseline and Delta-Block better.")


def paired(values: list[float], refs: list[float]) -> dict:
    """Per-seed differences values - refs, their mean, sample std, 95% t interval of the mean, and how many are < 0."""
    d = [v - r for v, r in zip(values, refs)]
    n, mean = len(d), float(np.mean(d))
    std = float(np.std(d, ddof=1)) if n > 1 else None
    ci = None
    if std is not None:
        half = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * std / math.sqrt(n)
        ci = [mean - half, mean + half]
    verdict = "one seed: no interval" if ci is None else "lower" if ci[1] < 0 else "higher" if ci[0] > 0 else "no detectable difference"
    return {"diffs": d, "mean": mean, "std": std, "ci95": ci, "n": n, "n_lower": sum(x < 0 for x in d), "verdict": verdict}


def _finals(runs: dict, arm: str) -> list[float]:
    return [runs[s][arm]["final"] for s in sorted(runs, key=int)]


def comparisons(runs: dict) -> list[dict]:
    """(arm, reference, kind) pairs of one size: equal steps, equal compute (the reference given the arm's cost in
    steps; the plain reference when the ratio rounded to 1) and, with the conversion, the paper-vs-preserve control."""
    arms = runs[next(iter(runs))]
    pairs = []
    for v in _present(FROM_SCRATCH, arms):
        pairs += [(v, "baseline", "equal steps", "scratch"),
                  (v, f"baseline@{v}-cost" if f"baseline@{v}-cost" in arms else "baseline", "equal compute", "scratch")]
    if "continue" not in arms:
        return [{"arm": a, "ref": r, "kind": k, "phase": ph, **paired(_finals(runs, a), _finals(runs, r))} for a, r, k, ph in pairs]
    for arm in CONVERTED:
        v = arm.split("-")[0]
        pairs += [(arm, "continue", "equal steps", "conversion"),
                  (arm, f"continue@{v}-cost" if f"continue@{v}-cost" in arms else "continue", "equal compute", "conversion")]
    pairs += [(f"{v}-paper", f"{v}-preserve", "control", "conversion") for v in ("full", "block")]
    return [{"arm": a, "ref": r, "kind": k, "phase": ph, **paired(_finals(runs, a), _finals(runs, r))} for a, r, k, ph in pairs]


def _present(arms: tuple, among) -> list[str]:
    """The `arms` (in their order) that ran: `among` is a seed's runs or a list of arm names."""
    return [a for a in arms if a in among]


def converted(analysis: dict) -> bool:
    """Whether the study ran the conversion part (results of `--parts scratch` have none)."""
    return "continue" in next(iter(analysis.values()))["arms"]


def mechanism(runs: dict) -> dict:
    """Per arm, averaged over seeds: normalised entropy (mean over sites) at the first and last eval, the weight on
    v0 and on each site's newest source relative to uniform (x 1/|S|), argmax shares, site RMS profile, collapse flags,
    Delta's final gate."""
    seeds = sorted(runs, key=int)
    out = {}
    for arm in runs[seeds[0]]:
        if "@" in arm:
            continue
        recs = [runs[s][arm] for s in seeds]
        rms = np.mean([r["final_depth"]["rms"] for r in recs], axis=0)
        m = {"rms": rms.tolist(), "rms_first": float(rms[0]), "rms_last": float(rms[-1]), "rms_max": float(rms.max()),
             "collapse_flags": sum(len(r["collapse"]) for r in recs)}
        if "gates" in recs[0]:
            m["gate_mean"] = float(np.mean([r["gates"] for r in recs]))
        if "entropy" in recs[0]["final_depth"]:
            m["entropy_start"] = float(np.mean([np.mean(r["depth"][0][1]["entropy"]) for r in recs]))
            m["entropy_end"] = float(np.mean([np.mean(r["final_depth"]["entropy"]) for r in recs]))
            m["entropy_min_site"] = float(np.mean([np.min(r["final_depth"]["entropy"]) for r in recs]))
            weights = [w for r in recs for w in r["final_depth"]["weights"]]
            m["v0_rel"] = float(np.mean([w[0] * len(w) for w in weights]))
            m["newest_rel"] = float(np.mean([w[-1] * len(w) for w in weights]))
            top = [int(np.argmax(w)) for w in weights]
            m["argmax_v0"] = float(np.mean([t == 0 for t in top]))
            m["argmax_newest"] = float(np.mean([t == len(w) - 1 for t, w in zip(top, weights)]))
            m["weights_mean"] = [np.mean(site, axis=0).tolist() for site in zip(*(r["final_depth"]["weights"] for r in recs))]
        out[arm] = m
    return out


def analyze(results: dict) -> dict:
    """Per size: mean +- std per arm, comparisons, in-run per-step cost, conversion check, mechanism."""
    out = {}
    for L, runs in sorted(results["runs"].items(), key=lambda kv: int(kv[0])):
        seeds = sorted(runs, key=int)
        arms = list(runs[seeds[0]])
        stats = {a: {"mean": float(np.mean(_finals(runs, a))), "std": float(np.std(_finals(runs, a), ddof=1)) if len(seeds) > 1 else None,
                     "steps": runs[seeds[0]][a]["steps"]} for a in arms}
        cost = {a: {"cpu_ms": float(np.median([runs[s][a]["cpu_ms_per_step"] for s in seeds])),
                    "wall_ms": float(np.median([runs[s][a]["wall_ms_per_step"] for s in seeds]))} for a in arms}
        for a in arms:
            ref = "continue" if a in CONVERTED or a.startswith("continue") else "baseline"
            cost[a]["ratio"] = cost[a]["cpu_ms"] / cost[ref]["cpu_ms"]
        out[L] = {"arms": stats, "comparisons": comparisons(runs), "cost_in_run": cost, "mechanism": mechanism(runs)}
        if "continue" in arms:
            out[L]["conversion_check"] = {a: max(abs(runs[s][a]["start_loss"] - runs[s]["continue"]["start_loss"]) for s in seeds)
                                          for a in CONVERTED}
            out[L]["continue_gain"] = float(np.mean([runs[s]["continue"]["start_loss"] - runs[s]["continue"]["final"] for s in seeds]))
    return out


# ---------------------------------------------------------------- Markdown

def _pm(mean: float, std: float | None) -> str:
    return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"


def _diff(c: dict) -> str:
    ci = "" if c["ci95"] is None else f" [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}]"
    return f"{c['mean']:+.4f}{ci}"


def _find(an: dict, arm: str, kind: str) -> dict:
    return next(c for c in an["comparisons"] if c["arm"] == arm and c["kind"] == kind)


def summary_markdown(results: dict, analysis: dict) -> str:
    cfg, env = results["config"], results["environment"]
    sizes = list(analysis)
    n_seeds = cfg["seeds"]
    conv = converted(analysis)
    title = ("Does converting a trained model to AttnRes and fine-tuning it beat fine-tuning the original?" if conv else
             "Does AttnRes (Full, Block, Delta-Block, Delta) trained from scratch beat the baseline?")
    lines = [f"# {title}", "", "Generated by `samples/study.py` from `results.json` (rerun the command to refresh it).", "",
             f"    {results['command']}", ""]
    lines += [_answer_scratch(analysis), ""] + ([_answer(analysis, cfg), ""] if conv else [])
    lines += ["## Set-up", "",
              f"- Data: `pydoc_data.topics`, {results['data']['train_chars']:,} training characters, vocabulary "
              f"{results['data']['vocab']}; {results['data']['split']}.",
              f"- Model: PreNorm GPT (samples/models.py), {', '.join(sizes)} layers (2 sublayers each), width {cfg['dim']}, "
              f"{cfg['heads']} heads, batches of {cfg['batch']}x{cfg['seq']} characters; Adam (0.9, 0.95), gradient "
              f"clip 1, warmup + cosine to a tenth.",
              f"- From scratch: {cfg['steps']} steps at peak LR {cfg['lr']:g} (AttnRes parameters too), every arm from the "
              f"baseline's initial weights, each in its published form: Full and Block (N = {cfg['blocks']}) with the paper "
              f"scale (c_k = 1), Delta-Block (N = {cfg['blocks']}) and Delta (every sublayer a source) with the paper init "
              f"(gates 1; `init=\"paper\"`), pseudo-queries 0."]
    if conv:
        lines.append(f"- Conversion: the from-scratch baseline after {cfg['steps']} steps, fine-tuned {cfg['ft_steps']} more "
                     f"steps (new warmup {cfg['ft_warmup']} + cosine, peak LR {cfg['ft_lr']:g} for the original parameters, "
                     f"{results['query_lr']:g} for the pseudo-queries; Adam state: {cfg['ft_adam']}) as it is (`continue`) or "
                     f"rewritten first. Every arm of a seed sees the same batches.")
    lines += [f"- Seeds 0..{n_seeds - 1} (initial weights and batch order). Paired difference = arm minus its reference, "
              f"per seed; the interval is the 95% paired t interval of the mean (n = {n_seeds}, so t = "
              f"{T975[n_seeds - 2] if n_seeds > 1 else float('nan'):.2f}: wide). All losses: mean nats/char over the "
              f"whole validation half.",
              f"- Equal compute (equal CPU time): the reference ({'baseline or continue' if conv else 'baseline'}) trained "
              f"round(r x steps) steps under its own schedule, r = that arm's own per-step CPU-time ratio measured before "
              f"the runs (rounded to 0.05).",
              f"- Machine: {env['cpu_count']} CPUs, {env['workers']} worker processes x {env['threads_per_worker']} thread, "
              f"torch {env['torch']}, depth_attention: {env['kernel']['implementation']} "
              f"(ATTNRES_KERNEL={env['kernel']['ATTNRES_KERNEL']}). "
              f"Run time {results['elapsed']['wall_s'] / 60:.1f} min wall, "
              f"{results['elapsed']['runs_cpu_s'] / 60:.1f} min of training CPU time.", ""]
    lines += _cost_section(results, analysis)
    lines += _sweep_section(results) if conv else []
    lines += _table_section(analysis, cfg)
    lines += _published_section(analysis)
    lines += _mechanism_section(analysis)
    lines += _limits(results, analysis, cfg)
    return "\n".join(lines) + "\n"


def _answer_scratch(analysis: dict) -> str:
    """The from-scratch headline: each AttnRes arm against the baseline at equal steps and at equal CPU time."""
    rows = [(L, a, _find(an, a, "equal steps"), _find(an, a, "equal compute"))
            for L, an in analysis.items() for a in _present(FROM_SCRATCH, an["arms"])]
    both = [f"{LABEL[a]} at {L} layers" for L, a, s, c in rows if s["verdict"] == c["verdict"] == "lower"]
    steps = [f"{LABEL[a]} at {L} layers" for L, a, s, c in rows if s["verdict"] == "lower" and c["verdict"] != "lower"]
    if both:
        head = f"yes, for {', '.join(both)} (lower at equal steps and at equal CPU time)"
    elif steps:
        head = f"only at equal steps, for {', '.join(steps)}; not at equal CPU time"
    else:
        head = "no, not detectably (no 95% paired interval below 0, at equal steps or at equal CPU time)"
    worse = [f"{LABEL[a]} at {L} layers (equal {k})" for L, a, s, c in rows
             for k, x in (("steps", s), ("CPU time", c)) if x["verdict"] == "higher"]
    if worse:
        head += f"; detectably worse: {', '.join(worse)}"
    per = "; ".join(f"{LABEL[a]} at {L} layers: equal steps {_diff(s)} ({s['n_lower']}/{s['n']} seeds lower), equal CPU "
                    f"time {_diff(c)} ({c['n_lower']}/{c['n']})" for L, a, s, c in rows)
    return f"**Answer (from scratch, validation loss against the baseline): {head}.** {per} (nats/char; negative = better)."


def _answer(analysis: dict, cfg: dict) -> str:
    """The conversion headline: for each converted arm and size, the verdict at equal steps and at equal compute."""
    rows = []
    for L, an in analysis.items():
        for arm in CONVERTED:
            rows.append((L, arm, _find(an, arm, "equal steps"), _find(an, arm, "equal compute")))
    better_steps = [(L, a) for L, a, s, _ in rows if s["verdict"] == "lower"]
    better_both = [(L, a) for L, a, s, c in rows if s["verdict"] == "lower" and c["verdict"] == "lower"]
    worse = [(L, a, k) for L, a, s, c in rows for k, x in (("steps", s), ("compute", c)) if x["verdict"] == "higher"]
    name = lambda items: ", ".join(f"{a} at {L} layers" for L, a, *_ in items)  # noqa: E731
    if better_both:
        head = (f"**Answer (conversion): yes, for {name(better_both)}** — lower validation loss than continuing the "
                f"baseline at equal steps and at equal compute (95% paired t interval below 0).")
    elif better_steps:
        head = (f"**Answer (conversion): only at equal steps.** {name(better_steps)} end lower than the continued baseline "
                f"at equal steps, but not at equal compute (the baseline given AttnRes's per-step cost in extra steps).")
    else:
        head = ("**Answer (conversion): no, not detectably.** No converted arm ends lower than the continued baseline with "
                "a 95% paired t interval that excludes 0, at equal steps or at equal compute.")
    if worse:
        head += " Detectably worse: " + ", ".join(f"{a} at {L} layers (equal {k})" for L, a, k in worse) + "."
    best = min(rows, key=lambda r: r[2]["mean"])
    head += (f" The largest mean gain at equal steps: {best[1]} at {best[0]} layers, {_diff(best[2])} nats/char "
             f"({best[2]['n_lower']}/{best[2]['n']} seeds lower).")
    return head


def _implementation(calls: dict | None) -> str:
    """What one training step's depth attention ran, from calibrate's call counts (older results: none recorded)."""
    if calls is None:
        return ""
    if not calls["fused"] and not calls["eager"]:
        return "none (no depth attention)"
    if not calls["eager"]:
        return f"fused TVM ({calls['fused']} launches)"
    return f"eager reference ({calls['eager']} calls)" if not calls["fused"] else f"mixed: {calls['fused']} fused, {calls['eager']} eager"


def _cost_section(results: dict, analysis: dict) -> list[str]:
    conv = converted(analysis)
    lines = ["## Per-step cost", "",
             "One training step, measured before the runs in one process alone at 1 thread (time.process_time, wall "
             "clock beside it), alternating rounds, median; `copy` is an identical copy of the baseline, so its ratio is "
             "the noise floor. Equal-compute runs use the CPU ratio rounded to 0.05. Implementation: the depth-attention "
             "calls of one training step of that arm, counted (fused TVM kernel launches, eager reference calls). In-run: "
             "median over seeds of each arm's own steps (workers side by side)"
             + ("; the conversion arms against `continue`." if conv else "."), "",
             f"| layers | arm | implementation | CPU ms | wall ms | CPU ratio | wall ratio | ratio used | in-run CPU ratio{' (scratch / converted)' if conv else ''} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for L, an in analysis.items():
        c, run = results["cost"][L], an["cost_in_run"]
        ps, base = c["per_step"], c["per_step"]["baseline"]
        for arm, m in ps.items():
            used = f"{c['ratio_used'][arm]:.2f}" if arm in c["ratio_used"] else ""
            in_run = (f"{run[arm]['ratio']:.2f}" + (f" / {run[arm + '-preserve']['ratio']:.2f}" if arm + "-preserve" in run else "")
                      if arm in c["ratio_used"] else "")
            lines.append(f"| {L} | {arm} | {_implementation(m.get('calls'))} | {m['cpu_ms']:.1f} | {m['wall_ms']:.1f} | "
                         f"{m['cpu_ms'] / base['cpu_ms']:.2f} | {m['wall_ms'] / base['wall_ms']:.2f} | {used} | {in_run} |")
    return lines + [""]


def _sweep_section(results: dict) -> list[str]:
    sw = results["sweep"]
    if sw is None:
        return ["## Pseudo-query LR", "", f"Given on the command line: {results['query_lr']:g} (no sweep).", ""]
    lines = ["## Pseudo-query LR sweep", "",
             f"{sw['layers']} layers, seed {sw['seed']} (not a reported seed), preserve conversion, dev half of the held-out "
             f"text; the continued baseline there: {sw['continue']:.4f}. LR 0 keeps the weights uniform (the function "
             f"stays the baseline's: a control, never chosen). Chosen: the lowest mean of Full and Block.", "",
             "| query LR | Full dev loss | Block dev loss | mean - continue |", "|---|---|---|---|"]
    by = {}
    for r in sw["runs"]:
        by.setdefault(r["query_lr"], {})[r["variant"]] = r["final"]
    for lr, v in by.items():
        mark = " **(chosen)**" if lr == sw["chosen"] else ""
        lines.append(f"| {lr:g}{mark} | {v['full']:.4f} | {v['block']:.4f} | {(v['full'] + v['block']) / 2 - sw['continue']:+.4f} |")
    positive = sorted(lr for lr in by if lr > 0)
    if len(positive) > 1 and sw["chosen"] in (positive[0], positive[-1]):
        lines += ["", f"The chosen LR is at the edge of the sweep ({sw['chosen']:g}): a wider sweep may find a better one."]
    return lines + [""]


def _table_section(analysis: dict, cfg: dict) -> list[str]:
    conv = converted(analysis)
    lines = ["## Results", "",
             "Validation loss after training (nats/char, mean ± std over seeds) and the paired difference to the "
             "reference (mean [95% t interval]; negative = better; seeds lower / seeds). Equal compute: the reference "
             "trained r x its steps.", "",
             "| layers | arm | loss | vs reference, equal steps | seeds lower | equal compute: reference steps | difference | seeds lower |",
             "|---|---|---|---|---|---|---|---|"]
    for L, an in analysis.items():
        st = an["arms"]
        for ref, arms in (("baseline", _present(FROM_SCRATCH, st)), ("continue", CONVERTED))[:2 if conv else 1]:
            lines.append(f"| {L} | {LABEL[ref]} | {_pm(st[ref]['mean'], st[ref]['std'])} | (reference) | | | | |")
            for arm in arms:
                s, c = _find(an, arm, "equal steps"), _find(an, arm, "equal compute")
                lines.append(f"| {L} | {LABEL[arm]} | {_pm(st[arm]['mean'], st[arm]['std'])} | {_diff(s)} | "
                             f"{s['n_lower']}/{s['n']} | {st[c['ref']]['steps']} | {_diff(c)} | {c['n_lower']}/{c['n']} |")
    if not conv:
        return lines + ["", "![validation loss from scratch](curves_scratch.png)", ""]
    lines += ["", "For scale, fine-tuning itself (the continued baseline) lowers the loss by " + ", ".join(
        f"{an['continue_gain']:.4f} at {L} layers" for L, an in analysis.items()) + " (mean over seeds)."]
    lines += ["", "Conversion check (|loss right after the rewrite - loss of the baseline it came from|, max over seeds; "
              "preserve must be <= 1e-5, paper differs only through the LayerNorm eps):", ""]
    for L, an in analysis.items():
        lines.append(f"- {L} layers: " + ", ".join(f"{a} {d:.1e}" for a, d in an["conversion_check"].items()))
    lines += ["", "Control, paper minus preserve conversion (a PreNorm model's readers are all norms, so the two "
              "should train alike): " + "; ".join(
                  f"{L} layers {c['arm'].split('-')[0]} {_diff(c)}" for L, an in analysis.items() for c in an["comparisons"]
                  if c["kind"] == "control"), ""]
    lines += ["![validation loss from scratch](curves_scratch.png)", "",
              "![paired difference to the continued baseline while fine-tuning](curves_convert.png)", ""]
    return lines


def _published_section(analysis: dict) -> list[str]:
    """Ours beside the Delta AttnRes paper's from-scratch numbers, each as a change against its own baseline: the
    paper's validation perplexity, ours the per-character perplexity exp(loss) at equal steps."""
    sizes = list(PUBLISHED)
    lines = ["## Beside the published numbers", "",
             f"{PUBLISHED_SOURCE} Ours: exp(validation loss) per character, mean over seeds, at equal steps "
             f"({', '.join(analysis)} layers). Each cell: perplexity (change against that column's baseline); "
             f"blank: not published.", "",
             "| arm | " + " | ".join(f"ours, {L} layers" for L in analysis) + " | " + " | ".join(f"paper {s}" for s in sizes) + " |",
             "|---|" + "---|" * (len(analysis) + len(sizes))]
    for arm in ("baseline", *FROM_SCRATCH):
        ours = []
        for an in analysis.values():
            if arm in an["arms"]:
                ppl, base = math.exp(an["arms"][arm]["mean"]), math.exp(an["arms"]["baseline"]["mean"])
                ours.append(f"{ppl:.3f} ({ppl / base - 1:+.1%})")
            else:
                ours.append("")
        paper = [f"{PUBLISHED[s][arm]:.2f} ({PUBLISHED[s][arm] / PUBLISHED[s]['baseline'] - 1:+.1%})" if arm in PUBLISHED[s]
                 else "" for s in sizes]
        lines.append(f"| {LABEL[arm]} | " + " | ".join(ours + paper) + " |")
    return lines + ["", PUBLISHED_NOTE, ""]


def _mechanism_section(analysis: dict) -> list[str]:
    lines = ["## Mechanism", "",
             "Measured with `attnres_compile.monitor.DepthMonitor` on the curve batches of the validation half. "
             "Normalised entropy: mean over sites of the weights' entropy / log|S| (1 = uniform, as every rewritten model "
             "starts). Weight on v0 (the embeddings) and on each site's newest source: mean over sites of weight x |S| "
             "(1 = uniform share). RMS: the stream value at the first and last site (the AttnRes output, Delta's "
             "h_k + g_k x mix, or the residual sum of the baseline), mean over seeds. Gate: Delta's g_k at the end, mean "
             "over sites and seeds (they start at 1). Collapse: `monitor.find_collapse` flags (all seeds).", "",
             "| layers | arm | entropy start -> end (lowest site) | v0 weight x|S| | newest x|S| | argmax v0 / newest | RMS first -> last (max) | gate | collapse |",
             "|---|---|---|---|---|---|---|---|---|"]
    for L, an in analysis.items():
        for arm, m in an["mechanism"].items():
            gate = f"{m['gate_mean']:.3f}" if "gate_mean" in m else ""
            if "entropy_end" in m:
                lines.append(f"| {L} | {LABEL[arm]} | {m['entropy_start']:.3f} -> {m['entropy_end']:.3f} ({m['entropy_min_site']:.3f}) | "
                             f"{m['v0_rel']:.2f} | {m['newest_rel']:.2f} | {m['argmax_v0']:.0%} / {m['argmax_newest']:.0%} | "
                             f"{m['rms_first']:.2f} -> {m['rms_last']:.2f} ({m['rms_max']:.2f}) | {gate} | {m['collapse_flags']} |")
            else:
                lines.append(f"| {L} | {LABEL[arm]} | | | | | {m['rms_first']:.2f} -> {m['rms_last']:.2f} ({m['rms_max']:.2f}) | | |")
    lines += [""] + _mechanism_text(analysis) + ["",
              "![normalised entropy over training](entropy.png)", "", "![stream RMS by depth](magnitude.png)", ""]
    lines += [f"![mean depth-attention weights, {L} layers](weights_{L}.png)" for L in analysis] + [""]
    return lines


def _mechanism_text(analysis: dict) -> list[str]:
    out = []
    for L, an in analysis.items():
        m = an["mechanism"]
        ends = ", ".join(f"{a} {m[a]['entropy_end']:.3f}" for a in _present(FROM_SCRATCH + CONVERTED, m))
        base, full = m["baseline"], m["full"]
        text = (f"- {L} layers: normalised entropy at the end {ends} (from 1.000). "
                f"Baseline stream RMS grows x{base['rms_last'] / base['rms_first']:.1f} from the first to the last site; "
                f"Full from scratch (paper scale) x{full['rms_last'] / full['rms_first']:.1f} (max {full['rms_max']:.2f} "
                f"against the baseline's {base['rms_max']:.2f})")
        if "full-preserve" in m:
            text += (f"; Full converted with preserve x{m['full-preserve']['rms_last'] / m['full-preserve']['rms_first']:.1f} "
                     f"(preserve multiplies the convex mix by |S_k|, so its magnitude follows the baseline's)")
        out.append(text + f". Collapse flags: {sum(x['collapse_flags'] for x in m.values())}.")
    return out


def _limits(results: dict, analysis: dict, cfg: dict) -> list[str]:
    n = cfg["seeds"]
    steps = f"{cfg['steps']} + {cfg['ft_steps']}" if converted(analysis) else str(cfg["steps"])
    lines = ["## What this does and does not show", "",
             f"- It compares arms on one small character-level task ({results['data']['train_chars']:,} characters, width "
             f"{cfg['dim']}, {', '.join(analysis)} layers, {steps} steps). It does not show how the answer scales to large "
             f"models or long runs: the published numbers above are 220M-8B parameters, 10K steps of FineWeb-Edu tokens; "
             f"only the sign and rough size of a change compare, not the perplexities.",
             f"- {n} seeds per arm: the t interval is wide and a difference smaller than it is not ruled out; "
             f"{n}/{n} seeds of one sign alone has a two-sided sign-test p of {2 * 0.5 ** n:.2f} (p < 0.05 needs 6 seeds).",
             f"- Equal compute is the CPU time of this implementation ({results['environment']['kernel']['implementation']}, "
             "1 thread, width " + str(cfg["dim"]) + "): another kernel or width changes r, and a smaller r moves the "
             "equal-compute columns towards the equal-steps ones.",
             "- Validation loss only; no downstream task."]
    if converted(analysis):
        lines[2] += (" The conversion's pre-training and fine-tuning use the same distribution (no shift of data).")
        lines.insert(4, "- The pseudo-query LR was chosen on the dev half with one seed at one size; the reported losses "
                        "are on the other half, so the choice does not select on them, but the best LR may differ at other sizes.")
    return lines


def write_all(results: dict, out: Path) -> None:
    """results.json (with the analysis), summary.md and the PNGs, each written whole or not at all."""
    out.mkdir(parents=True, exist_ok=True)
    results["analysis"] = analyze(results)
    _atomic(out / "results.json", compact_json(results))
    _atomic(out / "summary.md", summary_markdown(results, results["analysis"]))
    study_plots.plot_all(results, out)


def compact_json(obj) -> str:
    """Indented JSON with every list of numbers on one line (the curves and weights would take a line per number)."""
    text = json.dumps(obj, indent=1)
    flat = lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]"  # noqa: E731
    text = re.sub(r"\[\s+([-+\d.eE,\s]*?)\s+\]", flat, text)  # lists of numbers
    return re.sub(r"\[\s+((?:\[[-+\d.eE, ]*\],\s+)*\[[-+\d.eE, ]*\])\s+\]", flat, text)  # lists of those


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
