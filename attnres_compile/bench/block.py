"""`bench block`: Block AttnRes at inference, the two-phase schedule against one-pass kernels, and history memory.

schedules: one forward's depth-attention work on the TVM kernels, one-pass (a fused call per
site) against two-phase (a partial per block, then a merge per site), checked against each other
and float64, timed interleaved with the copy bandwidth; bytes counted analytically.
history: the source tensors a rewritten model keeps alive, by a liveness walk over the fx graph
and by the RSS high-water mark of an eager forward in a fresh process.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

import torch
from torch import fx, nn

from . import memory, results
from .kernel import tvm_target
from .timing import CopyBandwidth, interleaved, sync_for

SCHEDULES = {"sublayers": 48, "blocks": 8, "rows": [2048, 8192], "features": [1024]}
QUICK_SCHEDULES = {"sublayers": 16, "blocks": 8, "rows": [256, 1024], "features": [256]}
HISTORY = {"sublayers": [12, 24, 48], "blocks": 8, "rows": 4096, "features": 256}
QUICK_HISTORY = {"sublayers": [12], "blocks": 8, "rows": 1024, "features": 128}
EPS = 1e-6
F32 = 4  # bytes per element: sources, queries and the phase-1 state are float32
CHECK_ROWS = 64  # rows compared against the float64 reference (rows are independent)
TOLERANCE = 1e-4  # max |out - ref| / max |ref|
VOCAB = 256


# ---- schedules ---------------------------------------------------------------------------------

def site_terms(sublayers: int, blocks: int) -> tuple[list[list[tuple[int, ...]]], int]:
    """(S_k of every site as source-index groups, B) for a chain of one-branch links, computed by
    the plan code the rewriters use: (0,) is v_0, a longer tuple a (partial) block sum."""
    from ..core.config import AttnResConfig
    from ..core.plan import Chain, Link

    links = [Link(f"h{k}", f"h{k - 1}", [f"v{k}"], [f"add{k}"], ()) for k in range(1, sublayers + 1)]
    size = AttnResConfig(variant="block", num_blocks=blocks).block_size_for(sublayers)
    return Chain(0, links, -1, None).site_terms(size), size


def phases(terms: list[list[tuple[int, ...]]]) -> list[tuple[list[tuple[int, ...]], list[int]]]:
    """[(completed groups, site indices)]: sites sharing all but their last term form one phase 1."""
    return [(list(done), [k for k, _ in sites])
            for done, sites in itertools.groupby(enumerate(terms), key=lambda e: tuple(e[1][:-1]))]


def onepass_bytes(terms, T: int, D: int) -> int:
    """Per site: read |S_k| sources and the query, write the output."""
    return sum((len(groups) + 1) * T * D * F32 + D * F32 for groups in terms)


def _state(T: int, D: int) -> int:
    return (T * D + 2 * T) * F32  # acc [T, D], m and l [T]


def phase1_bytes(terms, T: int, D: int) -> int:
    """Per phase 1: read J sources and Q queries, write Q states."""
    return sum(len(done) * T * D * F32 + len(sites) * (D * F32 + _state(T, D)) for done, sites in phases(terms))


def twophase_bytes(terms, T: int, D: int) -> int:
    """Phase 1, then per merge: read the state, the partial block sum and the query, write the output."""
    return phase1_bytes(terms, T, D) + len(terms) * (_state(T, D) + 2 * T * D * F32 + D * F32)


def _reference(srcs: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """The formula of DESIGN.md §2 in float64 with c_k = |S_k| (preserve)."""
    V = torch.stack([s.double().cpu() for s in srcs])
    z = (V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + EPS) * w.double().cpu()).sum(-1)
    return len(srcs) * (z.softmax(0).unsqueeze(-1) * V).sum(0)


class Forward:
    """The depth-attention work of one forward on [T, D] sources, as TVM calls of both schedules.

    Sources are built as the rewrite builds them: P_k = P_(k-1) + v_k within a block, and a
    completed block sum is its last partial. Each schedule writes one reused output buffer."""

    def __init__(self, terms, T: int, D: int, device: str, kernel):
        import tvm

        gen = torch.Generator(device).manual_seed(0)
        randn = functools.partial(torch.randn, T, D, generator=gen, device=device)
        self.src = {(0,): randn()}
        for groups in terms:
            last = groups[-1]
            self.src[last] = randn() if len(last) == 1 else self.src[last[:-1]] + randn()
        self.terms = terms
        self.w = torch.randn(len(terms), D, generator=gen, device=device) / D**0.5
        self.out1, self.out2 = torch.empty(T, D, device=device), torch.empty(T, D, device=device)
        most = max(len(sites) for _, sites in phases(terms))
        m, l = torch.empty(most, T, device=device), torch.empty(most, T, device=device)
        acc = torch.empty(most, T, D, device=device)

        def call(module, *tensors):  # the function resolved once: a lookup per call costs tens of µs
            return functools.partial(module.jit().main, *[tvm.runtime.from_dlpack(t) for t in tensors])

        self.phases = []  # [(phase-1 call, [(site, one-pass call, merge call)])]
        for done, sites in phases(terms):
            Q, J = len(sites), len(done)
            first = call(kernel("partial", J, Q), *[self.src[g] for g in done], self.w[sites].contiguous(),
                         m[:Q], l[:Q], acc[:Q])
            per_site = [(k, call(kernel("fused", J + 1), *[self.src[g] for g in terms[k]], self.w[k], self.out1),
                         call(kernel("merge", J), m[q], l[q], acc[q], self.src[terms[k][-1]], self.w[k], self.out2))
                        for q, k in enumerate(sites)]
            self.phases.append((first, per_site))

    def one_pass(self) -> None:
        for _, per_site in self.phases:
            for _, fused, _ in per_site:
                fused()

    def phase_one(self) -> None:
        """The phase-1 calls alone: the part of two-phase that one-pass does not have."""
        for first, _ in self.phases:
            first()

    def two_phase(self) -> None:
        for first, per_site in self.phases:
            first()
            for _, _, merge in per_site:
                merge()

    def check(self, sync) -> dict:
        """Run both schedules site by site: max relative difference between them, and the max
        relative error of either against float64 on the first CHECK_ROWS rows."""
        diff = err = 0.0
        for first, per_site in self.phases:
            first()
            for k, fused, merge in per_site:
                fused()
                merge()
                sync()
                scale = self.out1.abs().max().item()
                diff = max(diff, (self.out1 - self.out2).abs().max().item() / scale)
                ref = _reference([self.src[g][:CHECK_ROWS] for g in self.terms[k]], self.w[k])
                for out in (self.out1, self.out2):
                    err = max(err, ((out[:CHECK_ROWS].double().cpu() - ref).abs().max() / ref.abs().max()).item())
        if not (diff <= TOLERANCE and err <= TOLERANCE):
            raise AssertionError(f"two-phase and one-pass disagree: max relative difference {diff:.2e}, "
                                 f"error against float64 {err:.2e} (tolerance {TOLERANCE:.0e})")
        return {"max_diff": diff, "max_err_ref": err}


def _kernels(D: int, target):
    """kernel(kind, n, [queries]) -> built module, cached: fused over n sources (scale n), phase 1
    over n completed sources, merge of one partial sum into n completed (scale n + 1)."""
    from ..kernels.schedule import build
    from ..kernels.tensorir import depth_attention_func, depth_attention_merge_func, depth_attention_partial_func

    make = {"fused": lambda n: depth_attention_func(n, D, "float32", EPS),
            "partial": lambda n, q: depth_attention_partial_func(n, q, D, "float32", EPS),
            "merge": lambda n: depth_attention_merge_func(1, D, "float32", EPS, float(n + 1))}

    @functools.cache
    def kernel(kind: str, *args: int):
        return build(make[kind](*args), target)
    return kernel


def measure_schedules(cfg: dict, device: str, threads: int, rounds: int, min_time: float,
                      progress: TextIO) -> list[dict]:
    """One row per (T, D): both schedules checked, then timed interleaved with the copy."""
    terms, size = site_terms(cfg["sublayers"], cfg["blocks"])
    target, sync, copy = tvm_target(device, threads), sync_for(device), CopyBandwidth(device=device)
    rows = []
    for D in cfg["features"]:
        kernel = _kernels(D, target)
        for T in cfg["rows"]:
            print(f"block schedules T={T} D={D}: building kernels, checking both schedules, timing",
                  file=progress, flush=True)
            fwd = Forward(terms, T, D, device, kernel)
            row = {"rows": T, "features": D, "sublayers": cfg["sublayers"], "blocks": cfg["blocks"], "block_size": size,
                   "onepass_calls": len(terms), "twophase_calls": len(terms) + len(fwd.phases), **fwd.check(sync)}
            times = interleaved({"onepass": fwd.one_pass, "twophase": fwd.two_phase, "phase1": fwd.phase_one,
                                 "copy": copy.fn}, rounds, min_time, sync)
            del fwd
            row["copy_GBps"] = copy.gbps(times["copy"]["median_ms"])
            for name, count in (("onepass", onepass_bytes), ("twophase", twophase_bytes), ("phase1", phase1_bytes)):
                ms = times[name]["median_ms"]
                row.update({f"{name}_ms": ms, f"{name}_bytes": count(terms, T, D),
                            f"{name}_GBps": count(terms, T, D) / (ms * 1e-3) / 1e9})
                row[f"{name}_roofline"] = row[f"{name}_GBps"] / row["copy_GBps"]
            row["ratio"] = row["twophase_ms"] / row["onepass_ms"]
            rows.append(row)
            print(f"block schedules T={T} D={D}: one-pass {row['onepass_ms']:.2f} ms, two-phase "
                  f"{row['twophase_ms']:.2f} ms, copy {row['copy_GBps']:.1f} GB/s", file=progress, flush=True)
    return rows


# ---- history -----------------------------------------------------------------------------------

class MLPStack(nn.Module):
    """A PreNorm MLP-only stack: h = emb(ids); L times h = h + W2 gelu(W1 RMSNorm(h)); RMSNorm(h).
    Hidden size D, so the residual history, not the branch, dominates a forward's activations."""

    def __init__(self, sublayers: int, features: int):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, features)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.RMSNorm(features), nn.Linear(features, features), nn.GELU(), nn.Linear(features, features))
            for _ in range(sublayers))
        self.norm = nn.RMSNorm(features)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for f in self.layers:
            h = h + f(h)
        return self.norm(h)


def history_walk(graph: fx.Graph) -> dict:
    """Peak number of history tensors live at once in eager execution of a rewritten graph, and the
    most terms one site reads. History: the sites' terms (v_0, sources, block sums) and what the
    block sums are added from; each lives from its node to its last user."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    sites = [n for n in nodes if n.target is torch.ops.attnres.depth_attention.default]
    history, todo = set(), [t for s in sites for t in s.args[0]]
    while todo:
        n = todo.pop()
        if n not in history:
            history.add(n)
            if n.meta.get("attnres", {}).get("role") == "block_sum":
                todo += n.all_input_nodes
    spans = [(order[n], max(order[u] for u in n.users)) for n in history]
    return {"tensors": max(sum(a <= i <= b for a, b in spans) for i in range(len(nodes))),
            "site_terms": max(len(s.args[0]) for s in sites)}


def history_worker(variant: str, sublayers: int, blocks: int, T: int, D: int, threads: int) -> dict:
    """In a fresh process: the stack (original, or rewritten Full / Block), its history walk, and
    the RSS high-water mark of a no-grad eager forward above the RSS before it (least of three)."""
    from ..api import rewrite
    from ..core.config import AttnResConfig

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = MLPStack(sublayers, D).eval()
    ids = torch.randint(0, VOCAB, (T,))
    row = {"variant": variant}
    if variant != "original":
        config = AttnResConfig(variant=variant, num_blocks=blocks if variant == "block" else None)
        model = rewrite(model, (ids,), config, verify_outputs=False).graph_module
        row.update(history_walk(model.graph))
    with torch.no_grad():
        model(ids)  # warm-up: the runtime's lazy allocations are not the forward's
        # the least of three: a thread pool or arena that still starts late lands on one reading only
        row["measured_bytes"] = min(memory.forward_peak(lambda: model(ids)) for _ in range(3))
    return row


def _run_worker(*args) -> dict:
    """history_worker in a subprocess. MALLOC_MMAP_THRESHOLD_ fixes glibc's mmap threshold, so
    every tensor is its own mapping, returned on free: RSS then follows the live tensors."""
    code = ("import json, sys; from attnres_compile.bench.block import history_worker; "
            "print(json.dumps(history_worker(*json.loads(sys.argv[1]))))")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"history worker {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def measure_history(cfg: dict, threads: int, progress: TextIO) -> list[dict]:
    """One row per L: analytic (walk) and measured history bytes of Full and Block, measured original."""
    T, D, N = cfg["rows"], cfg["features"], cfg["blocks"]
    tensor = T * D * F32
    rows = []
    for L in cfg["sublayers"]:
        row = {"sublayers": L, "blocks": N, "block_size": site_terms(L, N)[1], "rows": T, "features": D,
               "tensor_bytes": tensor}
        print(f"block history L={L}: original, full and block, each in a fresh process", file=progress, flush=True)
        for variant in ("original", "full", "block"):
            start = time.perf_counter()
            if variant != "original":
                # a first process builds the op's fused kernels into the disk cache: built inside the
                # measuring process (a cold cache), they raised Block's reading by ~2.5 MiB, above Full's
                _run_worker(variant, L, N, T, D, threads)
            got = _run_worker(variant, L, N, T, D, threads)
            row[f"{variant}_measured"] = got["measured_bytes"]
            if variant != "original":
                row.update({f"{variant}_tensors": got["tensors"], f"{variant}_bytes": got["tensors"] * tensor,
                            f"{variant}_terms": got["site_terms"]})
            print(f"block history L={L} {variant}: {got['measured_bytes'] / 2**20:.1f} MiB measured "
                  f"({time.perf_counter() - start:.1f}s)", file=progress, flush=True)
        row["block_over_full"] = row["block_bytes"] / row["full_bytes"]
        row["measured_block_over_full"] = row["block_measured"] / row["full_measured"]
        rows.append(row)
    return rows


# ---- the benchmark -----------------------------------------------------------------------------

def run(args, progress: TextIO) -> dict:
    """Both measurements at the default sizes, or the quick ones with args.quick."""
    sched, hist = (QUICK_SCHEDULES, QUICK_HISTORY) if args.quick else (SCHEDULES, HISTORY)
    rounds, min_time = args.rounds or (2 if args.quick else 5), 0.02 if args.quick else 0.1
    config = {"schedules": {**sched, "dtype": "float32", "eps": EPS, "rounds": rounds, "min_time": min_time},
              "history": {**hist, "dtype": "float32", "device": "cpu", "model": "MLPStack (PreNorm, hidden = D)"}}
    return {"benchmark": "block", "environment": results.environment(args.threads, args.device), "config": config,
            "schedules": measure_schedules(sched, args.device, args.threads, rounds, min_time, progress),
            "history": measure_history(hist, args.threads, progress)}


def table(data: dict) -> str:
    """Schedules: times and checks, then bytes and bandwidth; history: analytic and measured MiB."""
    s, h = data["config"]["schedules"], data["config"]["history"]
    mb, mib = 1e-6, 2**-20
    sched = [{**r, **{f"{k}_MB": r[f"{k}_bytes"] * mb for k in ("onepass", "twophase", "phase1")},
              "onepass_pct": 100 * r["onepass_roofline"], "twophase_pct": 100 * r["twophase_roofline"]}
             for r in data["schedules"]]
    hist = [{**r, **{f"{k}_MiB": r[k] * mib for k in ("full_bytes", "block_bytes", "original_measured",
                                                       "full_measured", "block_measured")}}
            for r in data["history"]]
    shape = [("rows", "T", ""), ("features", "D", "")]
    return "\n".join([
        f"two-phase (2p) vs one-pass (1p): all depth attention of one forward, L={s['sublayers']} sublayers, "
        f"N={s['blocks']} blocks, {s['dtype']}, median ms",
        "phase1: the phase-1 calls of 2p alone; 2p vs 1p: max relative difference of the outputs; "
        "err f64: max relative error of either against float64",
        results.table(sched, shape + [
            ("block_size", "B", ""), ("onepass_calls", "calls 1p", ""), ("twophase_calls", "calls 2p", ""),
            ("onepass_ms", "1p ms", ".2f"), ("twophase_ms", "2p ms", ".2f"), ("ratio", "2p/1p", ".2f"),
            ("phase1_ms", "phase1 ms", ".2f"), ("max_diff", "2p vs 1p", ".1e"), ("max_err_ref", "err f64", ".1e")]),
        "",
        "bytes moved (analytic, MB) and effective bandwidth (GB/s, % of the copy bandwidth)",
        results.table(sched, shape + [
            ("onepass_MB", "1p MB", ".0f"), ("twophase_MB", "2p MB", ".0f"), ("phase1_MB", "phase1 MB", ".0f"),
            ("onepass_GBps", "1p GB/s", ".1f"), ("twophase_GBps", "2p GB/s", ".1f"),
            ("phase1_GBps", "phase1 GB/s", ".1f"), ("copy_GBps", "copy GB/s", ".1f"),
            ("onepass_pct", "1p %copy", ".0f"), ("twophase_pct", "2p %copy", ".0f")]),
        "",
        f"history: source tensors alive in a forward, T={h['rows']} D={h['features']} N={h['blocks']} {h['dtype']}; "
        "analytic = peak of a liveness walk of the rewritten graph,",
        "measured = RSS high-water mark of an eager forward above the RSS before it (MiB, least of three forwards)",
        results.table(hist, [
            ("sublayers", "L", ""), ("block_size", "B", ""), ("full_tensors", "full tensors", ""),
            ("block_tensors", "block tensors", ""), ("full_terms", "full |S|max", ""),
            ("block_terms", "block |S|max", ""),
            ("full_bytes_MiB", "full MiB", ".1f"), ("block_bytes_MiB", "block MiB", ".1f"),
            ("block_over_full", "block/full", ".2f"), ("original_measured_MiB", "orig meas", ".1f"),
            ("full_measured_MiB", "full meas", ".1f"), ("block_measured_MiB", "block meas", ".1f"),
            ("measured_block_over_full", "meas block/full", ".2f")]),
    ])


def plot(data: dict, out_dir: Path) -> list[Path]:
    """block_schedules.png: time and GB/s per (T, D); block_history.png: history MiB against L."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sched = data["schedules"]
    labels = [f"T={r['rows']}\nD={r['features']}" for r in sched]
    x = range(len(sched))
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (name, label) in enumerate((("onepass", "one-pass"), ("twophase", "two-phase"))):
        ax_t.bar([p + (i - 0.5) * 0.4 for p in x], [r[f"{name}_ms"] for r in sched], 0.4, label=label)
        ax_b.bar([p + (i - 1) * 0.3 for p in x], [r[f"{name}_GBps"] for r in sched], 0.3, label=label)
    ax_b.bar([p + 0.3 for p in x], [r["copy_GBps"] for r in sched], 0.3, label="copy (roofline)", color="grey")
    for ax, ylabel in ((ax_t, "ms per forward"), (ax_b, "effective GB/s")):
        ax.set_xticks(list(x), labels)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    s = data["config"]["schedules"]
    fig.suptitle(f"Block AttnRes depth attention, L={s['sublayers']}, N={s['blocks']} "
                 f"({data['environment']['device']})")
    paths = [results.save_figure(fig, out_dir / "block_schedules.png")]

    hist = data["history"]
    L = [r["sublayers"] for r in hist]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, variant in enumerate(("full", "block")):
        ax.plot(L, [r[f"{variant}_bytes"] / 2**20 for r in hist], color=f"C{i}", label=f"{variant} analytic")
        ax.plot(L, [r[f"{variant}_measured"] / 2**20 for r in hist], "o", color=f"C{i}", label=f"{variant} measured")
    ax.plot(L, [r["original_measured"] / 2**20 for r in hist], "s", color="grey", label="original measured")
    h = data["config"]["history"]
    ax.set(xlabel="sublayers L", ylabel="MiB", title=f"history memory, T={h['rows']} D={h['features']} N={h['blocks']}")
    ax.set_xticks(L)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    paths.append(results.save_figure(fig, out_dir / "block_history.png"))
    return paths
