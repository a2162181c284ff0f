"""Reading the stats: collapsed sites and dead sources (`find_collapse`), and a printed table."""

from __future__ import annotations


def find_collapse(stats: dict, min_entropy: float = 0.1, dead_weight: float = 1e-3) -> list[dict]:
    """Collapsed sites (mean token entropy below `min_entropy` nats, i.e. about one source read)
    and dead sources (weight below `dead_weight` at every token of every site that reads them)."""
    flags, peak = [], {}
    for s in stats["sites"]:
        if "weights" not in s:
            continue
        if s["entropy"] < min_entropy:
            flags.append({"kind": "site", "chain": s["chain"], "site": s["site"], "entropy": s["entropy"]})
        for j, w in enumerate(s["weights_max"]):
            seen = peak.setdefault((s["chain"], j), [0.0, []])
            seen[0] = max(seen[0], w)
            seen[1].append(s["site"])
    for (chain, j), (w, sites) in sorted(peak.items()):
        if w < dead_weight:
            flags.append({"kind": "source", "chain": chain, "source": j, "max_weight": w, "sites": sites})
    return flags


def format_stats(stats: dict, collapse: list[dict] | None = None) -> str:
    """A printed table: one row per site, its entropy against log|S| and its largest mean weights."""
    lines = [f"{'chain':<8}{'site':>5}{'|S|':>5}{'entropy':>9}{'log|S|':>8}{'rms':>9}  top sources (mean weight)"]
    for s in stats["sites"]:
        if "weights" not in s:
            lines.append(f"{s['chain']:<8}{s['site']:>5}{'':>5}{'':>9}{'':>8}{s['rms']:>9.4f}")
            continue
        top = sorted(enumerate(s["weights"]), key=lambda t: -t[1])[:3]
        tops = ", ".join(f"src{j}:{w:.2f}" for j, w in top)
        lines.append(f"{s['chain']:<8}{s['site']:>5}{s['sources']:>5}{s['entropy']:>9.3f}{s['max_entropy']:>8.3f}{s['rms']:>9.4f}  {tops}")
    for f in collapse or []:
        where = f"site {f['site']} (entropy {f['entropy']:.3f})" if f["kind"] == "site" else f"source {f['source']} (max weight {f['max_weight']:.2e})"
        lines.append(f"collapse: {f['chain']} {where}")
    return "\n".join(lines)
