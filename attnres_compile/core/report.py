"""The report: a JSON-able dict first (`Report.data`), a printed table second (`str(report)`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

from . import __version__
from .config import AttnResConfig
from .graph_view import format_shape
from .plan import Plan
from .verify import describe, nothing_compared


class Report:
    """What analysis found, what was rewritten and why not, and the verification, as data."""

    def __init__(self, data: dict):
        self.data = data

    def __getitem__(self, key):
        return self.data[key]

    def to_json(self, indent: int | None = 2) -> str:
        """Strict JSON: non-finite numbers (an infinite min_rtol) are written as strings ("inf", "nan")."""
        return json.dumps(_finite(self.data), indent=indent, default=str, allow_nan=False)

    def __str__(self) -> str:
        return format_table(self.data)

    __repr__ = __str__


@dataclass
class ExportResult:
    """A rewrite or export written to a file: its `report`, and `written`, the files written (the model first,
    then its external data); nothing when there was nothing to rewrite."""

    report: Report
    written: list[Path] = field(default_factory=list)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def build(plan: Plan, view: nx.DiGraph, config: AttnResConfig, source: str, sites=None,
          verification: list[dict] | None = None, notes: list[str] | None = None,
          dynamic_dims: dict[str, list[int]] | None = None, passes: dict[str, int] | None = None,
          extra: dict | None = None) -> Report:
    """The report for one analysis (and rewrite, when `sites` is given); `dynamic_dims`: the
    traced module's symbolic input axes ({input: [axis, ...]}); `passes`: what each pass of the
    rewrite did, by name; `extra`: a format's own entries (ONNX: the ops it unfused and read)."""
    sites = sites or []
    by_chain: dict[int, list] = {}
    for s in sites:
        by_chain.setdefault(s.chain, []).append(s)
    chains = []
    for c in plan.chains:
        block = config.block_size_for(len(c.sources) - 1) if c.rewrite else None
        chains.append({
            "index": c.index,
            "status": "rewritten" if by_chain.get(c.index) else ("planned" if c.rewrite else "skipped"),
            "reason": c.reason,
            "changes_function": c.changes_function,
            "through": c.through,
            "links": len(c.links),
            "sources": len(c.sources),
            "root": c.root,
            "feature_axis": c.feature_axis,
            "feature_size": c.feature_size,
            "shape": format_shape(c.links[0].shape),
            "block_size": block,
            "detail": [{"site": k, "result": link.result, "skip": link.skip, "branches": link.branches, "adds": link.adds}
                       for k, link in enumerate(c.links, start=1)],
            "sites": [{"site": s.site, "node": s.node, "param": s.param, "terms": s.num_terms, "scale": s.scale,
                       **({"gate": s.gate} if s.gate else {})} for s in by_chain.get(c.index, [])],
        })
    in_links = sum(len(link.adds) for c in plan.chains for link in c.links)
    data = {
        "tool": "attnres-compile",
        "version": __version__,
        "source": source,
        "config": config.to_dict(),
        "summary": {
            "nodes": view.number_of_nodes(),
            "adds": plan.adds_total,
            "adds_in_links": in_links,
            "adds_skipped": len(plan.skipped_adds),
            "links": sum(len(c.links) for c in plan.chains),
            "chains": len(plan.chains),
            "chains_rewritten": len(by_chain),
            "sites_rewritten": len(sites),
            "existing_sites": len(plan.existing_sites),
            "changes_function": any(c.changes_function for c in plan.chains if by_chain.get(c.index)),
        },
        "chains": chains,
        "skipped_adds": [{"node": s.node, "target": s.target, "reason": s.reason} for s in plan.skipped_adds],
        "verification": verification,
        "dynamic_dims": dynamic_dims or {},
        "passes": passes or {},
        "notes": notes or [],
        **(extra or {}),
    }
    return Report(data)


def verification_lines(rows: list[dict], against: str = "rewritten", compared: str | None = None) -> list[str]:
    """The verification's header (what was compared: `compared`, else the original against the
    `against` model; the inputs also tried with zero rows) and one line per row; a run that
    compared no value says so instead of showing nothing."""
    zeroed = next((r["zero_rows"]["inputs"] for r in rows if "zero_rows" in r), None)
    also = f"; also with zero rows in {', '.join(zeroed)}" if zeroed else ""
    lines = [f"verification ({compared or f'original vs {against}'}, same inputs{also}):"]
    lines += [f"  {describe(row)}" + (f"  at {row['at']}" if row.get("at") else "") for row in rows]
    empty = nothing_compared(rows)
    return lines + ([f"  {empty}"] if empty else [])


def describe_check(check: dict) -> str:
    """One line of a weight-quantized model's verification (onnx/weights.py)."""
    mark = {True: "✓", False: "✗", None: "·"}[check["ok"]]
    if check["check"] == "perplexity":
        return (f"{mark} perplexity {check['quantized']:.3f} against {check['fp32']:.3f} in float32 "
                f"({check['change']:+.2%}, bound {check['bound']})")
    if check["check"] == "next-token agreement":
        return f"{mark} next-token agreement with float32 {check['value']:.1%} (bound {check['bound']})"
    rows = ", ".join(f"{r['equal']}/{check['tokens']}" + ("" if r["first_difference"] is None else
                                                          f" (first difference at {r['first_difference']})")
                     for r in check["rows"])
    return f"{mark} {check['check']}: {rows} equal (no verdict: a near-tie flips the rest of a sequence)"


def weights_lines(info: dict) -> list[str]:
    """The report's lines for a weight-quantized output (onnx/weights.py)."""
    scheme = "with a float minimum (as llama.cpp's Q4_1)" if info.get("minimum") else "symmetric"
    head = (f"weights: {info['weights']} ({info['method']}: {info['bits']} bits in blocks of {info['block_size']}, "
            f"{scheme}"
            + (f", the LM head at {info['head_bits']} bits" if info.get("head_bits") else "")
            + (f", computing in int8 (accuracy_level {info['accuracy_level']})" if info.get("accuracy_level") == 4 else "")
            + f"; {info['quantized']} MatMuls quantized"
            + (f" ({info['transposed']} through a transposed copy of a tied weight)" if info.get("transposed") else "")
            + f", {info['kept']} with activations on both sides kept; sites, norms and embeddings float32): "
            f"{info['bytes_before'] / 1e6:.1f} -> {info['bytes_after'] / 1e6:.1f} MB of weights")
    check = info.get("verification")
    if not check:
        return [head, "  not verified (verify_outputs=False)"]
    rows = check["rows_evaluated"]
    out = [head, f"  verified against the float32 model on {rows[0]} row(s) x {rows[1]} tokens"
                 + (f" ({check['source']})" if check["source"] else "") + f", {check['positions']} predictions:"]
    return out + [f"    {describe_check(c)}" for c in check["checks"]]


def variant_name(cfg: dict) -> str:
    """"full", "block (N=8)", "delta", "delta-block (B=2)", ... of a report's config."""
    block = f" (N={cfg['num_blocks']})" if cfg.get("num_blocks") else f" (B={cfg['block_size']})" if cfg.get("block_size") else ""
    name = "delta-block" if cfg["variant"] == "delta" and block else cfg["variant"]
    return name + block


def format_table(data: dict) -> str:
    s = data["summary"]
    cfg = data["config"]
    variant = variant_name(cfg)
    scale = f"init={cfg.get('init', 'exact')}" if cfg["variant"] == "delta" else f"scale={cfg['scale']}"
    if data.get("rewritten") is False:
        variant, scale = "none (the original model, not rewritten)", "scale=-"
    lines = [
        f"attnres-compile {data['version']}  source={data['source']}  variant={variant}  {scale}",
        f"{s['nodes']} nodes, {s['adds']} adds: {s['adds_in_links']} in {s['links']} residual links, {s['adds_skipped']} not residual; "
        f"{s['chains']} chains, {s['chains_rewritten']} rewritten, {s['sites_rewritten']} sites",
        "",
        f"{'chain':>5}  {'status':<9} {'links':>5} {'srcs':>4} {'axis':>4} {'D':>6} {'block':>5}  root -> last site / reason",
    ]
    for c in data["chains"]:
        block = "" if c["block_size"] is None else str(c["block_size"])
        tail = f"{c['root']} -> {c['detail'][-1]['result']}"
        if c["changes_function"]:
            why = f"through {', '.join(c['through'])}" if c["through"] else "Delta gates start at 1 (init='paper')"
            tail += f"  [CHANGES FUNCTION: {why}]"
        if c["reason"]:
            tail += f"  ({c['reason']})"
        lines.append(f"{c['index']:>5}  {c['status']:<9} {c['links']:>5} {c['sources']:>4} {c['feature_axis']:>4} "
                     f"{str(c['feature_size']):>6} {block:>5}  {tail}")
    if data["skipped_adds"]:
        lines += ["", "adds that are not residual links:"]
        reasons: dict[str, list[str]] = {}
        for a in data["skipped_adds"]:
            reasons.setdefault(a["reason"], []).append(a["node"])
        for reason, nodes in reasons.items():
            shown = ", ".join(nodes[:6]) + (f", ... (+{len(nodes) - 6})" if len(nodes) > 6 else "")
            lines.append(f"  {len(nodes):>4} x {reason}: {shown}")
    if data["verification"] is not None:
        against = "written" if data.get("rewritten") is False else "rewritten"
        lines += ["", *verification_lines(data["verification"], against, data.get("compared"))]
    if data.get("verified_shapes"):
        lines.append("verified at: " + "; ".join(", ".join(f"{name} {'x'.join(map(str, dims)) or 'scalar'}"
                                                           for name, dims in shapes.items())
                                                 for shapes in data["verified_shapes"]))
    if data.get("weights"):
        lines += ["", *weights_lines(data["weights"])]
    if data.get("dynamic_dims"):
        dims = ", ".join(f"{name}[{','.join(map(str, axes))}]" for name, axes in data["dynamic_dims"].items())
        lines.append(f"dynamic input dims: {dims}")
    lines += [f"note: {n}" for n in data["notes"]]
    return "\n".join(lines)
