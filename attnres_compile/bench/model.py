"""Whole models: what the AttnRes rewrite costs a deployed model, per runtime, side by side.

Models are HF transformers decoders from random configs (seed 0): GPT-2 (a PreNorm GPT) and
Llama, at several depths (two sublayers, attention and MLP, per layer). Each is exported once
with torch.export; the original is that program's module and the Full and Block rewrites are
`rewrite`s of the same program, so all three variants take the same path everywhere: the same
ONNX exporter, the same TVM pipeline and tuning database. Per runtime (torch eager,
onnxruntime, the TVM artifact) the rewritten outputs are checked against the original's, then
the three variants are timed in alternating rounds (timing.interleaved), and each artifact's
peak memory is measured in a fresh process (model_worker.py).

TVM's untuned operators are naive (a model runs ~100x slower than onnxruntime), so the TVM
column is tuned with meta_schedule. Records are keyed by workload: the rewrites and the other
depths of a model reuse the original's, so each (model, width, seq, batch) is tuned once into
the database folder (default OUT/tuning-db), and later runs against it are cache hits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from ..config import AttnResConfig
from ..errors import ConfigError, VerificationError, first_line
from . import results, timing
from .model_worker import Unavailable, onnxruntime_providers, runner

MODELS = ("gpt", "llama")
RUNTIMES = ("eager", "onnxruntime", "tvm")
VARIANTS = ("original", "full", "block")
VOCAB = 1024
HEADS = 4
LLAMA_MLP_RATIO = 11008 / 4096  # Llama-2-7B's intermediate / hidden, ~2.7
TARGET_PCT = 5.0  # the target: Block costs at most 5% latency over the original
TARGET_RUNTIMES = ("tvm", "onnxruntime")
RTOL = 1e-4  # preserve mode is exact up to float32 summation order: |diff| <= RTOL * (1 + max|ref|)
WORKER_TIMEOUT_S = 600
MIB = 2**20

DEFAULTS = {"models": list(MODELS), "sublayers": [12, 24, 48], "runtimes": list(RUNTIMES), "width": 256,
            "seq": 128, "batch": 1, "trials": 16, "min_time": 0.2}
QUICK = {"models": ["gpt"], "sublayers": [12], "runtimes": list(RUNTIMES), "width": 64, "seq": 32, "batch": 1,
         "trials": 0, "min_time": 0.05}  # a CI smoke test: about a minute, TVM untuned


@dataclass
class Settings:
    """The benchmark's matrix and knobs: flags given win over the (quick) defaults."""

    models: list[str]
    sublayers: list[int]
    runtimes: list[str]
    width: int
    seq: int
    batch: int
    blocks: int
    trials: int
    tuning_db: Path
    device: str
    threads: int
    rounds: int
    min_time: float


def settings(args) -> Settings:
    """The Settings for the `bench model` flags in `args` (an argparse.Namespace; absent flags take defaults)."""
    base = QUICK if getattr(args, "quick", False) else DEFAULTS
    pick = {k: getattr(args, k, None) for k in ("models", "sublayers", "runtimes", "width", "seq", "batch", "trials")}
    s = Settings(**{k: base[k] if v is None else v for k, v in pick.items()},
                 blocks=getattr(args, "blocks", None) or 8,
                 tuning_db=Path(getattr(args, "tuning_db", None) or Path(args.out) / "tuning-db"),
                 device=getattr(args, "device", "cpu"), threads=getattr(args, "threads", None) or os.cpu_count() or 1,
                 rounds=getattr(args, "rounds", None) or (2 if getattr(args, "quick", False) else 5),
                 min_time=base["min_time"])
    if any(n % 2 for n in s.sublayers):
        raise ConfigError(f"--sublayers must be even (two sublayers per layer), got {s.sublayers}")
    if s.width % HEADS:
        raise ConfigError(f"--width must be a multiple of {HEADS} (the number of heads), got {s.width}")
    if min(s.width, s.seq, s.batch, s.blocks) < 1 or s.trials < 0:
        raise ConfigError("--width, --seq, --batch and --blocks must be positive and --trials >= 0")
    return s


class Progress:
    """Progress lines with the seconds elapsed since the benchmark started."""

    def __init__(self, stream: TextIO):
        self.stream, self.start = stream, time.perf_counter()

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", file=self.stream, flush=True)


# ---------------------------------------------------------------- models

class CausalLMLogits(torch.nn.Module):
    """An HF causal LM as (input_ids, attention_mask) -> logits: plain tensors for torch.export."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("bench model needs transformers: pip install 'transformers>=5,<6'") from None
    return transformers


def make_model(name: str, layers: int, width: int, seq: int) -> torch.nn.Module:
    """GPT-2 or Llama with `layers` layers of hidden size `width`, random weights (seed 0), eval mode."""
    tf = _transformers()
    torch.manual_seed(0)
    if name == "gpt":
        config = tf.GPT2Config(n_layer=layers, n_embd=width, n_head=HEADS, vocab_size=VOCAB, n_positions=seq,
                               bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(config)
    else:
        config = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=HEADS,
                                num_key_value_heads=HEADS, intermediate_size=round(width * LLAMA_MLP_RATIO),
                                vocab_size=VOCAB, max_position_embeddings=seq)
        model = tf.LlamaForCausalLM(config)
    return CausalLMLogits(model.eval()).eval()


def make_inputs(batch: int, seq: int) -> dict[str, np.ndarray]:
    """Token ids (seed 0) and an all-ones attention mask, in the forward's argument order."""
    ids = np.random.default_rng(0).integers(0, VOCAB, (batch, seq), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((batch, seq), np.int64)}


@dataclass
class Variant:
    """One variant of a model: its exported program (saved for eager, exported to ONNX), its number of
    sites, what was made of it for each runtime, and how long each stage took."""

    name: str
    program: torch.export.ExportedProgram
    sites: int
    artifacts: dict[str, Any] = field(default_factory=dict)  # runtime -> .pt2 / .onnx / .so path or executable
    times: dict[str, float] = field(default_factory=dict)    # stage -> seconds
    tuning: dict | None = None                                # TVM's tuning summary (tune.TuningSummary)


def make_variants(model: torch.nn.Module, args: tuple, blocks: int) -> list[Variant]:
    """The exported original and its verified Full and Block (N=`blocks`) rewrites."""
    from .. import rewrite

    start = time.perf_counter()
    program = torch.export.export(model, args)
    variants = [Variant("original", program, 0, times={"export": time.perf_counter() - start})]
    for name, config in (("full", AttnResConfig(variant="full")),
                         ("block", AttnResConfig(variant="block", num_blocks=blocks))):
        start = time.perf_counter()
        result = rewrite(program, args, config)
        if not result.modified or not all(v["ok"] for v in result.report["verification"]):
            raise VerificationError(f"the {name} rewrite changed nothing or differs from the original model")
        rewritten = torch.export.export(result.graph_module, args)
        variants.append(Variant(name, rewritten, result.report["summary"]["sites_rewritten"],
                                times={"export": time.perf_counter() - start}))
    return variants


# ---------------------------------------------------------------- artifacts

def save_artifacts(variant: Variant, args: tuple, folder: Path, s: Settings, progress: Progress) -> None:
    """Write what each runtime loads: .pt2 (eager), .onnx (onnxruntime, and TVM's input), TVM .so."""
    from ..passes import onnx_export, onnx_io

    if "eager" in s.runtimes:
        path = folder / f"{variant.name}.pt2"
        torch.export.save(variant.program, str(path))
        variant.artifacts["eager"] = path
    if not {"onnxruntime", "tvm"} & set(s.runtimes):
        return
    start = time.perf_counter()
    path = folder / f"{variant.name}.onnx"
    onnx_io.write(onnx_export.export(variant.program.module(), args), path)
    variant.times["onnx"] = time.perf_counter() - start
    variant.artifacts["onnxruntime"] = path
    progress.log(f"  {variant.name}: ONNX exported ({variant.times['onnx']:.1f} s)")
    if "tvm" in s.runtimes:
        try:
            variant.artifacts["tvm"] = compile_tvm(variant, path, folder, s, progress)
        except Exception as exc:  # noqa: BLE001 - recorded in the TVM rows; the other runtimes go on
            variant.artifacts["tvm"] = Unavailable(f"TVM compile failed: {first_line(exc)}")
            progress.log(f"  {variant.name}: {variant.artifacts['tvm']}")


def compile_tvm(variant: Variant, onnx_path: Path, folder: Path, s: Settings, progress: Progress) -> Any:
    """Compile the ONNX file with static input shapes; tuned on CPU when trials > 0 (shared database).
    Returns the exported .so (CPU) or the executable itself (CUDA, run in this process only)."""
    from ..backends.tvm.importers import import_model
    from ..backends.tvm.pipeline import build, make_target
    from ..backends.tvm.schedule import host_target

    start = time.perf_counter()
    imported = import_model(onnx_path)
    shapes = {name: (s.batch, s.seq) for name in imported.inputs}
    if s.device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        built = build(imported, make_target("cuda", f"sm_{major}{minor}"), input_shapes=shapes)
    else:
        built = build(imported, host_target(s.threads), input_shapes=shapes, tune=s.trials > 0, trials=s.trials,
                      tuning_db=s.tuning_db, progress=progress.stream)
    variant.times["tvm"] = time.perf_counter() - start
    tuning = variant.tuning = built.tuning
    how = "untuned" if tuning is None else (f"{tuning['tuned']} task(s) tuned, {tuning['reused']} reused"
                                            + (f", {tuning['untunable']} untunable" if tuning.get("untunable") else ""))
    progress.log(f"  {variant.name}: TVM compiled, {how} ({variant.times['tvm']:.1f} s)")
    if s.device == "cuda":
        return built.executable
    path = folder / f"{variant.name}.so"
    built.executable.export_library(str(path))
    return path


# ---------------------------------------------------------------- measurement

def time_runtime(runtime: str, variants: list[Variant], inputs: dict[str, np.ndarray],
                 reference: np.ndarray, s: Settings) -> dict[str, dict]:
    """{variant: row fields} for one runtime: outputs checked against its original, then timed side by side."""
    try:
        if runtime == "onnxruntime":
            onnxruntime_providers(s.device)  # skip early, with the reason, when the device is not usable
        calls = {}
        for v in variants:
            artifact = v.artifacts[runtime]
            if isinstance(artifact, Exception):
                raise artifact
            calls[v.name] = runner(runtime, artifact, inputs, s.device, s.threads)
    except Unavailable as exc:
        return {v.name: {"error": str(exc)} for v in variants}
    except Exception as exc:  # noqa: BLE001 - the rows record why this runtime has no numbers
        return {v.name: {"error": first_line(exc)} for v in variants}
    outputs = {name: to_numpy(call()) for name, (call, to_numpy) in calls.items()}
    measured = timing.interleaved({name: call for name, (call, _) in calls.items()}, s.rounds, s.min_time,
                                  timing.sync_for(s.device))
    rows = {}
    base = measured["original"]["median_ms"]
    for name, out in outputs.items():
        expected = reference if name == "original" else outputs["original"]
        err = float(np.abs(out - expected).max())
        tol = RTOL * (1 + float(np.abs(expected).max()))
        rows[name] = {"median_ms": measured[name]["median_ms"], "min_ms": measured[name]["min_ms"],
                      "overhead_pct": (measured[name]["median_ms"] / base - 1) * 100, "max_abs_err": err,
                      "error": None if err <= tol else f"output differs: max abs {err:.3g} > tolerance {tol:.3g}"}
    return rows


def measure_memory(runtime: str, artifact: Any, inputs_path: Path, s: Settings) -> dict:
    """forward_peak_mb and peak_rss_mb of the artifact in a fresh worker process, or memory_error."""
    if isinstance(artifact, Exception):
        return {"memory_error": "no artifact"}
    if s.device == "cuda" and runtime != "eager":
        return {"memory_error": "skipped: on cuda only torch's allocator is measured"}
    env = {**os.environ, "TVM_NUM_THREADS": str(s.threads), "OMP_NUM_THREADS": str(s.threads),
           "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),  # fixed: glibc unmaps large buffers when freed
           "MKL_DISABLE_FAST_MM": "1"}  # MKL's buffer pool would keep the warm-up's GEMM buffers resident
    command = [sys.executable, "-m", "attnres_compile.bench.model_worker", runtime, str(artifact), str(inputs_path),
               "--device", s.device, "--threads", str(s.threads)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"memory_error": f"worker timed out after {WORKER_TIMEOUT_S} s"}
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        return {"memory_error": f"worker exited {done.returncode}: {lines[-1] if lines else 'no message'}"[:300]}
    try:
        out = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"memory_error": f"worker printed no JSON: {done.stdout[-200:]!r}"}
    return {"forward_peak_mb": out["forward_peak_bytes"] / MIB,
            "peak_rss_mb": out["peak_rss_bytes"] / MIB if "peak_rss_bytes" in out else None}


def bench_one(name: str, sublayers: int, s: Settings, progress: Progress) -> tuple[list[dict], list[dict]]:
    """Rows (one per runtime x variant) and compile records (one per variant) of one model at one depth."""
    progress.log(f"{name}/{sublayers}: exporting and rewriting ({sublayers // 2} layers, width {s.width})")
    model = make_model(name, sublayers // 2, s.width, s.seq).to(s.device)
    inputs = make_inputs(s.batch, s.seq)
    args = tuple(torch.from_numpy(a).to(s.device) for a in inputs.values())
    with torch.no_grad():
        reference = model(*args).cpu().numpy()
    variants = make_variants(model, args, s.blocks)
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"attnres-bench-{name}-{sublayers}-") as tmp:
        folder = Path(tmp)
        inputs_path = folder / "inputs.npz"
        np.savez(inputs_path, **inputs)
        for v in variants:
            save_artifacts(v, args, folder, s, progress)
        for runtime in s.runtimes:
            start = time.perf_counter()
            timed = time_runtime(runtime, variants, inputs, reference, s)
            summary = ", ".join(f"{v}: {r['median_ms']:.2f} ms" for v, r in timed.items() if "median_ms" in r)
            progress.log(f"{name}/{sublayers} {runtime}: {summary or timed['original']['error']} "
                         f"({time.perf_counter() - start:.1f} s)")
            start = time.perf_counter()
            for v in variants:
                memory = measure_memory(runtime, v.artifacts[runtime], inputs_path, s)
                rows.append({"model": name, "sublayers": sublayers, "runtime": runtime, "variant": v.name,
                             "sites": v.sites, **timed[v.name], **memory})
            progress.log(f"{name}/{sublayers} {runtime}: peak memory measured ({time.perf_counter() - start:.1f} s)")
    compiles = [{"model": name, "sublayers": sublayers, "variant": v.name, "sites": v.sites,
                 **{f"{stage}_s": t for stage, t in v.times.items()}, "tuning": v.tuning} for v in variants]
    return rows, compiles


def block_targets(rows: list[dict], runtimes: Iterable[str]) -> list[dict]:
    """The issue's target per runtime: the worst Block overhead over the models and depths run."""
    targets = []
    for runtime in TARGET_RUNTIMES:
        if runtime not in runtimes:
            continue
        block = [r for r in rows
                 if (r["runtime"], r["variant"]) == (runtime, "block") and r.get("overhead_pct") is not None]
        worst = max(block, key=lambda r: r["overhead_pct"], default=None)
        targets.append({
            "name": f"Block latency overhead in {runtime}",
            "target": f"<= {TARGET_PCT:g}% over the original",
            "measured": None if worst is None else worst["overhead_pct"],
            "where": None if worst is None else f"worst of {len(block)}: {worst['model']}/{worst['sublayers']} sublayers",
            "met": None if worst is None else worst["overhead_pct"] <= TARGET_PCT,
        })
    return targets


def run(args, progress: TextIO) -> dict:
    """Every model x depth x runtime x variant: latency, overhead %, peak memory, output error.

    Row fields: model, sublayers, runtime, variant, sites; median_ms and min_ms over the rounds;
    overhead_pct against the same runtime's original; forward_peak_mb and peak_rss_mb (MiB, in
    a fresh process) or memory_error; max_abs_err of a rewrite against its runtime's original
    (of the original: against torch eager); error: None, an output mismatch, or why the runtime
    has no numbers."""
    s = settings(args)
    log = Progress(progress)
    rows, compiles = [], []
    for name in s.models:
        for sublayers in s.sublayers:
            group_rows, group_compiles = bench_one(name, sublayers, s, log)
            rows += group_rows
            compiles += group_compiles
    log.log("model benchmark done")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(s).items()}
    config.update(vocab=VOCAB, heads=HEADS, mlp={"gpt": 4.0, "llama": round(LLAMA_MLP_RATIO, 4)},
                  tvm="untuned" if s.trials == 0 or s.device == "cuda" else f"meta_schedule, {s.trials} trials per task")
    return {"benchmark": "model", "environment": results.environment(s.threads, s.device), "config": config,
            "rows": rows, "compile": compiles, "targets": block_targets(rows, s.runtimes)}


# ---------------------------------------------------------------- views

COLUMNS = [("model", "model", ""), ("sublayers", "sublayers", "d"), ("runtime", "runtime", ""),
           ("variant", "variant", ""), ("sites", "sites", "d"), ("median_ms", "median ms", ".3f"),
           ("min_ms", "min ms", ".3f"), ("overhead_pct", "overhead %", "+.1f"), ("forward_peak_mb", "fwd peak MiB", ".1f"),
           ("peak_rss_mb", "peak RSS MiB", ".0f"), ("max_abs_err", "max abs err", ".1e"), ("note", "note", "")]


def table(data: dict) -> str:
    """The rows as a text table, then the compile times and the target lines."""
    rows = [{**r, "note": r.get("error") or r.get("memory_error")} for r in data["rows"]]
    lines = [results.table(rows, COLUMNS), ""]
    cfg = data["config"]
    lines.append(f"width {cfg['width']}, seq {cfg['seq']}, batch {cfg['batch']}, Block N={cfg['blocks']}, "
                 f"{cfg['threads']} thread(s), {cfg['device']}; TVM {cfg['tvm']}; overhead = variant / original - 1")
    for c in data["compile"]:
        stages = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in c.items() if k.endswith("_s"))
        lines.append(f"compile {c['model']}/{c['sublayers']} {c['variant']}: {stages}")
    for t in data["targets"]:
        verdict = "not measured" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
        measured = "-" if t["measured"] is None else f"{t['measured']:+.1f}% ({t['where']})"
        lines.append(f"target: {t['name']} {t['target']}: {measured}: {verdict}")
    return "\n".join(lines)


PLOT_COLORS = dict(zip(RUNTIMES, ("tab:blue", "tab:orange", "tab:green")))
PLOT_STYLES = {"original": ("^", ":"), "full": ("s", "--"), "block": ("o", "-")}  # marker, line


def plot(data: dict, out_dir: Path) -> list[Path]:
    """model_overhead.png (overhead % vs depth) and model_latency.png (median ms vs depth), a panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in data["rows"]))
    figures = (("overhead_pct", "latency overhead over the original (%)", ("full", "block"), "model_overhead.png"),
               ("median_ms", "median latency (ms)", VARIANTS, "model_latency.png"))
    paths = []
    for key, ylabel, variants, fname in figures:
        fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models):
            _panel(ax, [r for r in data["rows"] if r["model"] == model], key, variants)
            ax.set_title(model)
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
    if key == "overhead_pct":
        ax.axhline(TARGET_PCT, color="red", lw=0.8, label=f"target {TARGET_PCT:g}% (Block)")
        ax.axhline(0, color="grey", lw=0.5)
    else:
        ax.set_yscale("log")
    ax.set_xticks(sorted({r["sublayers"] for r in rows}))
    ax.set_xlabel("sublayers")
    ax.legend(fontsize=7)
