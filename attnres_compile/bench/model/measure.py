"""`bench model`: what the AttnRes rewrite costs a deployed model, per runtime, side by side.

HF GPT-2 and Llama decoders from random configs (or the user's own with --factory) are exported
once with torch.export; Full and Block are `rewrite`s of that program, and an identical copy of
the original's files gives the noise floor. Per runtime (eager, train, onnxruntime, TVM default
and, when asked, tuned) the variants are checked against the original and timed in interleaved
rounds in a fresh worker (bench/model/worker.py): at 1 thread on CPU time and at --threads on
wall time. docs/bench.md, *`bench model`*, lists the models, runtimes and targets.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from ...core.config import AttnResConfig
from ...core.errors import ConfigError, VerificationError, first_line
from .. import factory, results
from .. import targets as model_targets
from ..timing import paired_ratio, ratio_interval
from . import profile
from .worker import WorkerError, Workers, measure_memory, onnxruntime_providers, time_candidates

MODELS = ("gpt", "llama")
RUNTIMES = ("eager", "train", "onnxruntime", "tvm", "tvm-tuned")
VARIANTS = ("original", "copy", "full", "block")  # what a run times by default
REWRITES = ("full", "block", "delta", "delta-block")  # --variants: Delta AttnRes on request; original and copy always
DEFAULT_REWRITES = ["full", "block"]
# timing groups, each in its own worker processes: interleaved in one process with the training steps, the
# eager forward's overhead read higher (GPT-2 256/24 Block +17% there, +9% timed alone)
GROUPS = {"eager": ("eager",), "train": ("train",), "onnxruntime": ("onnxruntime",), "tvm": ("tvm",),
          "tvm-tuned": ("tvm-tuned",)}
FILES = {"eager": "pt2", "train": "pt2", "onnxruntime": "onnx", "tvm": "tvm", "tvm-tuned": "tvm-tuned"}
ORT_ORIGINAL = "baseline: onnxruntime original"  # the extra candidate of the TVM workers
VOCAB = 1024
HEADS = 4
LLAMA_MLP_RATIO = 11008 / 4096  # Llama-2-7B's intermediate / hidden, ~2.7
TIMING_TIMEOUT_S = 3600
WORKER_TIMEOUT_S = 600
MIB = 2**20

MATRICES = [(256, [12, 24, 48]), (1024, [24])]  # (width, sublayers): every configuration the targets name
DEFAULTS = {"models": list(MODELS), "runtimes": ["eager", "train", "onnxruntime", "tvm"], "width": 256,
            "sublayers": [12, 24, 48], "seq": 128, "batch": 1, "min_time": 0.2, "rounds": 5}
QUICK = {"models": ["gpt"], "runtimes": ["eager", "train", "onnxruntime", "tvm"], "width": 64, "sublayers": [4],
         "seq": 32, "batch": 1, "min_time": 0.05, "rounds": 2}  # the CI smoke test


@dataclass
class Settings:
    """The benchmark's matrix and knobs: flags given win over the (quick) defaults."""

    models: list[str]
    matrices: list[tuple[int, list[int]]]
    runtimes: list[str]
    seq: int
    batch: int
    blocks: int
    trials: int
    tune_minutes: float | None
    tuning_db: Path
    device: str
    threads: int
    rounds: int
    min_time: float
    profile: bool
    factory: str | None = None  # `module:function` of the user's causal LM, timed instead of the random models
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_REWRITES))  # the rewrites timed (REWRITES)
    vocab: int = VOCAB          # token ids are drawn below this (a factory's model: at most its vocabulary)


def settings(args) -> Settings:
    """The Settings for the `bench model` flags in `args` (an argparse.Namespace; absent flags take
    defaults). Without --width and --sublayers the matrix is MATRICES (--quick: one small model)."""
    quick = getattr(args, "quick", False)
    base = QUICK if quick else DEFAULTS
    width, sublayers = getattr(args, "width", None), getattr(args, "sublayers", None)
    matrices = ([(width or base["width"], sublayers or base["sublayers"])] if quick or width or sublayers
                else [(w, list(d)) for w, d in MATRICES])
    trials = getattr(args, "trials", None) or 0
    minutes = getattr(args, "tune_minutes", None)
    tuned = trials > 0 or minutes is not None
    runtimes = getattr(args, "runtimes", None) or base["runtimes"] + (["tvm-tuned"] if tuned else [])
    s = Settings(models=getattr(args, "models", None) or base["models"], matrices=matrices, runtimes=runtimes,
                 seq=getattr(args, "seq", None) or base["seq"], batch=getattr(args, "batch", None) or base["batch"],
                 blocks=getattr(args, "blocks", None) or 8, trials=trials, tune_minutes=minutes,
                 tuning_db=Path(getattr(args, "tuning_db", None) or Path(args.out) / "tuning-db"),
                 device=getattr(args, "device", "cpu"), threads=getattr(args, "threads", None) or os.cpu_count() or 1,
                 rounds=getattr(args, "rounds", None) or base["rounds"], min_time=base["min_time"],
                 profile=bool(getattr(args, "profile", False)), factory=getattr(args, "factory", None),
                 variants=getattr(args, "variants", None) or list(DEFAULT_REWRITES))
    if s.factory and any(getattr(args, flag, None) for flag in ("models", "width", "sublayers")):
        raise ConfigError("--factory times that model at its own size: drop --models, --width and --sublayers")
    depths = [d for _, ds in s.matrices for d in ds]
    if any(d % 2 for d in depths):
        raise ConfigError(f"--sublayers must be even (two sublayers per layer), got {depths}")
    if any(w % HEADS for w, _ in s.matrices):
        raise ConfigError(f"--width must be a multiple of {HEADS} (the number of heads), got {s.matrices[0][0]}")
    if min(s.seq, s.batch, s.blocks) < 1 or min(w for w, _ in s.matrices) < 1 or trials < 0:
        raise ConfigError("--width, --seq, --batch and --blocks must be positive and --trials >= 0")
    if minutes is not None and minutes <= 0:
        raise ConfigError(f"--tune-minutes must be positive, got {minutes:g}")
    if "tvm-tuned" in s.runtimes and not tuned:
        raise ConfigError("--runtimes tvm-tuned needs a tuning budget: --tune-minutes N (or --trials N)")
    if tuned and s.device == "cuda":
        raise ConfigError("tuning measures on the CPU: drop --tune-minutes/--trials with --device cuda")
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


def make_inputs(batch: int, seq: int, vocab: int = VOCAB) -> dict[str, np.ndarray]:
    """Token ids below `vocab` (seed 0) and an all-ones attention mask, in the forward's argument order."""
    ids = np.random.default_rng(0).integers(0, vocab, (batch, seq), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((batch, seq), np.int64)}


def reference_outputs(model: torch.nn.Module, args: tuple) -> dict[str, np.ndarray]:
    """What the original model computes: its logits (forward) and the training step's loss (train)."""
    with torch.no_grad():
        logits = model(*args)
    labels = torch.roll(args[0], -1, dims=-1)  # the same next-token loss as model_worker's train runner
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    return {"logits": logits.cpu().numpy(), "loss": loss.cpu().numpy()}


@dataclass
class Variant:
    """One variant of a model: its exported program (None for the identical copy), its number of sites,
    its files per kind (FILES: path, or the exception that kept it from being made) and stage times."""

    name: str
    program: torch.export.ExportedProgram | None
    sites: int
    files: dict[str, Any] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)  # stage -> seconds
    tuning: dict | None = None                              # TVM's tuning summary (tune.TuningSummary)


def rewrite_config(name: str, blocks: int) -> AttnResConfig:
    """The rewrite a variant name stands for: full, block (N=`blocks`), delta, delta-block (N=`blocks`)."""
    variant, blocked = name.removesuffix("-block"), name.endswith("block")
    return AttnResConfig(variant=variant, num_blocks=blocks if blocked else None)


def make_variants(model: torch.nn.Module, args: tuple, blocks: int,
                  names: list[str] = tuple(DEFAULT_REWRITES)) -> list[Variant]:
    """The exported original and its verified rewrites `names` (full, block, delta, delta-block; N=`blocks`)."""
    from ... import rewrite

    start = time.perf_counter()
    program = torch.export.export(model, args)
    variants = [Variant("original", program, 0, times={"export": time.perf_counter() - start})]
    for name, config in ((n, rewrite_config(n, blocks)) for n in REWRITES if n in names):
        start = time.perf_counter()
        result = rewrite(program, args, config)
        if not result.modified or not all(v["ok"] for v in result.report["verification"]):
            raise VerificationError(f"the {name} rewrite changed nothing or differs from the original model")
        rewritten = torch.export.export(result.graph_module, args)
        variants.append(Variant(name, rewritten, result.report["summary"]["sites_rewritten"],
                                times={"export": time.perf_counter() - start}))
    return variants


# ---------------------------------------------------------------- artifacts

def save_files(variant: Variant, args: tuple, folder: Path, s: Settings, progress: Progress) -> None:
    """Write what each runtime loads: .pt2 (eager, train), .onnx (onnxruntime, and TVM's input), TVM .so."""
    from ...onnx import export as onnx_export
    from ...onnx import io as onnx_io

    kinds = {FILES[r] for r in s.runtimes}
    if "pt2" in kinds:
        variant.files["pt2"] = folder / f"{variant.name}.pt2"
        torch.export.save(variant.program, str(variant.files["pt2"]))
    if not kinds & {"onnx", "tvm", "tvm-tuned"}:
        return
    start = time.perf_counter()
    path = folder / f"{variant.name}.onnx"
    onnx_io.write(onnx_export.export(variant.program.module(), args), path)
    variant.times["onnx"] = time.perf_counter() - start
    variant.files["onnx"] = path
    progress.log(f"  {variant.name}: ONNX exported ({variant.times['onnx']:.1f} s)")
    for kind in ("tvm", "tvm-tuned"):
        if kind in kinds:
            try:
                variant.files[kind] = compile_tvm(variant, path, folder, s, progress, tuned=kind == "tvm-tuned")
            except Exception as exc:  # noqa: BLE001 - recorded in the TVM rows; the other runtimes go on
                variant.files[kind] = WorkerError(f"TVM compile failed: {first_line(exc)}")
                progress.log(f"  {variant.name}: {variant.files[kind]}")


def compile_tvm(variant: Variant, onnx_path: Path, folder: Path, s: Settings, progress: Progress,
                tuned: bool) -> Path:
    """The ONNX file built with static input shapes into an exported library: the default build
    (no tuning), or tuned on the CPU (shared database). Build time is recorded on both clocks."""
    from ...backends.tvm import vm_files
    from ...backends.tvm.importers import import_model
    from ...backends.tvm.pipeline import build, make_target
    from ...kernels.target import host_target

    kind = "tvm-tuned" if tuned else "tvm"
    start, cpu = time.perf_counter(), time.process_time()
    imported = import_model(onnx_path)
    shapes = {name: (s.batch, s.seq) for name in imported.inputs}
    if s.device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        target = make_target("cuda", f"sm_{major}{minor}")
        built = build(imported, target, input_shapes=shapes)
    else:
        tuning = {"tune": True, "trials": s.trials or None, "tune_minutes": s.tune_minutes, "tuning_db": s.tuning_db,
                  "progress": progress.stream}
        built = build(imported, host_target(s.threads), input_shapes=shapes, **(tuning if tuned else {}))
    variant.times[f"{kind}_build"] = time.perf_counter() - start
    variant.times[f"{kind}_build_cpu"] = time.process_time() - cpu
    if tuned:
        variant.tuning = built.tuning
    t = built.tuning
    how = "default build" if t is None else (f"tuned: {t['tuned']} task(s) tuned, {t['reused']} reused"
                                             + (f", {t['untunable']} untunable" if t.get("untunable") else ""))
    progress.log(f"  {variant.name}: TVM compiled, {how} ({variant.times[f'{kind}_build']:.1f} s)")
    path = folder / f"{variant.name}{'.tuned' if tuned else ''}.so"
    vm_files.save(built.executable, path)
    if s.device == "cuda":
        import json

        from ...backends.tvm.cuda_binary import write_device_code

        entries = write_device_code(built.executable, folder, built.target)
        path.with_suffix(".cuda.json").write_text(json.dumps(entries))
    return path


def identical_copy(original: Variant, folder: Path) -> Variant:
    """The original's files copied under new names: loaded again, it is timed as one more variant."""
    copy = Variant("copy", None, 0)
    for kind, path in original.files.items():
        if isinstance(path, Exception):
            copy.files[kind] = path
            continue
        copy.files[kind] = folder / path.name.replace("original", "copy", 1)
        shutil.copyfile(path, copy.files[kind])
        if path.with_suffix(".cuda.json").exists():
            shutil.copyfile(path.with_suffix(".cuda.json"), copy.files[kind].with_suffix(".cuda.json"))
    return copy


# ---------------------------------------------------------------- measurement

def time_group(group: str, variants: list[Variant], paths: dict[str, Path], s: Settings,
               workers: Workers) -> dict[tuple[str, str], dict]:
    """{(runtime, variant): row fields} for the runtimes of one timing group, each variant checked
    against its runtime's original (the original against the torch reference), then timed: once
    at 1 thread (CPU time) and once at s.threads (wall), each in its own worker."""
    fields: dict[tuple[str, str], dict] = {}
    try:
        onnxruntime_providers(s.device)
        ort = variants[0].files.get("onnx")
    except Exception as exc:  # noqa: BLE001 - the onnxruntime rows say why they were skipped
        ort = exc
    candidates = []
    for runtime in (r for r in GROUPS[group] if r in s.runtimes):
        base = ort if runtime == "onnxruntime" and isinstance(ort, Exception) else variants[0].files.get(FILES[runtime])
        for v in variants:
            artifact = v.files.get(FILES[runtime])
            failed = base if isinstance(base, Exception) else artifact if isinstance(artifact, Exception) else None
            if failed is not None:
                fields[(runtime, v.name)] = {"error": str(failed)}
                continue
            candidates.append({"name": f"{runtime} {v.name}", "runtime": "tvm" if runtime == "tvm-tuned" else runtime,
                               "artifact": str(artifact), "key": (runtime, v.name),
                               "check": "reference" if v.name == "original" else f"{runtime} original"})
    if not candidates:
        return fields
    if group.startswith("tvm") and isinstance(ort, Path):
        candidates.append({"name": ORT_ORIGINAL, "runtime": "onnxruntime", "artifact": str(ort), "check": "reference"})
    job = {"candidates": candidates, "inputs": str(paths["inputs"]), "reference": str(paths["reference"]),
           "device": s.device, "rounds": s.rounds, "min_time": s.min_time}
    measured = {}
    for threads in dict.fromkeys((1, s.threads)):
        try:
            measured[threads] = workers.run(time_candidates, {**job, "threads": threads}, TIMING_TIMEOUT_S)
        except WorkerError as exc:
            measured[threads] = exc
    for c in candidates:
        if "key" in c:
            fields[c["key"]] = _timing_fields(c, measured[1], measured[s.threads])
    return fields


def _timing_fields(c: dict, one: Any, many: Any) -> dict:
    """Row fields of candidate `c` from the 1-thread and the many-thread timing results: CPU time
    (1 thread) and wall time (many), each with its overhead over the runtime's original as the
    median of per-round ratios; for TVM the ratio to onnxruntime's original; the output check."""
    out: dict[str, Any] = {"error": None}
    base = c["check"] if c["check"] != "reference" else c["name"]
    for result, clock, prefix in ((one, "cpu", "cpu"), (many, "wall", "wall")):
        if isinstance(result, Exception):
            out["error"] = out["error"] or str(result)
            continue
        samples = result["samples"]
        mine = samples[c["name"]]
        out[f"{prefix}_ms"] = statistics.median(mine[clock]) * 1e3
        out[f"{prefix}_min_ms"] = min(mine[clock]) * 1e3
        out[f"{prefix}_overhead_pct"] = (paired_ratio(mine[clock], samples[base][clock]) - 1) * 100
        low, high, coverage = ratio_interval(mine[clock], samples[base][clock])
        out[f"{prefix}_overhead_interval"] = [(low - 1) * 100, (high - 1) * 100]
        out[f"{prefix}_interval_coverage"] = coverage
        out[f"{prefix}_rounds_ms"] = [t * 1e3 for t in mine[clock]]
        if ORT_ORIGINAL in samples:
            out[f"vs_onnxruntime_{prefix}"] = paired_ratio(mine[clock], samples[ORT_ORIGINAL][clock])
            low, high, _ = ratio_interval(mine[clock], samples[ORT_ORIGINAL][clock])
            out[f"vs_onnxruntime_{prefix}_interval"] = [low, high]
        if clock == "cpu":  # the 1-thread run: is the work in the calling thread, and how much of a core it got
            out["in_thread"] = statistics.median(mine["thread"]) / statistics.median(mine["cpu"])
            out["cpu_share"] = statistics.median(mine["cpu"]) / statistics.median(mine["wall"])
        check = result["checks"][c["name"]]
        errs = [e for e in (out.get("max_abs_err"), check["max_abs_err"]) if e is not None]
        out["max_abs_err"] = max(errs, default=None)
        out["error"] = out["error"] or check["error"]
    return out


def memory_fields(runtime: str, artifact: Any, paths: dict[str, Path], s: Settings, workers: Workers) -> dict:
    """forward_peak_mb and peak_rss_mb of the artifact in a fresh worker, or memory_error."""
    if isinstance(artifact, Exception) or artifact is None:
        return {"memory_error": "no artifact"}
    if s.device == "cuda" and runtime not in ("eager", "train"):
        return {"memory_error": "skipped: on cuda only torch's allocator is measured"}
    job = {"runtime": "tvm" if runtime == "tvm-tuned" else runtime, "artifact": str(artifact),
           "inputs": str(paths["inputs"]), "device": s.device, "threads": s.threads}
    try:
        out = workers.run(measure_memory, job, WORKER_TIMEOUT_S)
    except WorkerError as exc:
        return {"memory_error": str(exc)}
    return {"forward_peak_mb": out["forward_peak_bytes"] / MIB, "peak_rss_mb": out["peak_rss_bytes"] / MIB}


def bench_one(name: str, width: int, sublayers: int, s: Settings, progress: Progress, workers: Workers,
              model: torch.nn.Module | None = None) -> tuple[list[dict], list[dict], list[dict]]:
    """Rows (runtime x variant), compile records (one per variant) and profiles of one model
    configuration (`model`: a factory's causal LM, else the random one of that configuration)."""
    tag = f"{name} {width}/{sublayers}"
    progress.log(f"{tag}: exporting and rewriting ({sublayers // 2} layers, width {width})")
    model = (make_model(name, sublayers // 2, width, s.seq) if model is None else CausalLMLogits(model)).to(s.device)
    inputs = make_inputs(s.batch, s.seq, s.vocab)
    args = tuple(torch.from_numpy(a).to(s.device) for a in inputs.values())
    reference = reference_outputs(model, args)
    variants = make_variants(model, args, s.blocks, s.variants)
    keys = {"model": name, "width": width, "sublayers": sublayers}
    rows, profiles = [], []
    with tempfile.TemporaryDirectory(prefix=f"attnres-bench-{name}-{width}-{sublayers}-") as tmp:
        folder = Path(tmp)
        paths = {"inputs": folder / "inputs.npz", "reference": folder / "reference.npz"}
        np.savez(paths["inputs"], **inputs)
        np.savez(paths["reference"], **reference)
        for v in variants:
            save_files(v, args, folder, s, progress)
        variants.insert(1, identical_copy(variants[0], folder))
        for group, runtimes in GROUPS.items():
            if not set(runtimes) & set(s.runtimes):
                continue
            start = time.perf_counter()
            timed = time_group(group, variants, paths, s, workers)
            for runtime in (r for r in runtimes if r in s.runtimes):
                summary = ", ".join(f"{v.name} {timed[(runtime, v.name)]['cpu_overhead_pct']:+.1f}%"
                                    for v in variants[1:] if "cpu_overhead_pct" in timed[(runtime, v.name)])
                first = timed[(runtime, "original")]
                progress.log(f"{tag} {runtime}: " + (f"original {first['cpu_ms']:.2f} ms CPU at 1 thread, {summary}"
                                                      if "cpu_ms" in first else str(first["error"]))
                             + f" ({time.perf_counter() - start:.1f} s)")
                start = time.perf_counter()
                for v in variants:
                    memory = memory_fields(runtime, v.files.get(FILES[runtime]), paths, s, workers)
                    rows.append({**keys, "runtime": runtime, "variant": v.name, "sites": v.sites,
                                 **timed[(runtime, v.name)], **memory})
                progress.log(f"{tag} {runtime}: peak memory measured ({time.perf_counter() - start:.1f} s)")
        if s.profile:
            start = time.perf_counter()
            profiles = [{**keys, **p} for p in profile.profile_variants(variants, paths["inputs"], s, workers)]
            progress.log(f"{tag}: profiled ({time.perf_counter() - start:.1f} s)")
    compiles = [{**keys, "variant": v.name, "sites": v.sites, **{f"{stage}_s": t for stage, t in v.times.items()},
                 "tuning": v.tuning} for v in variants if v.name != "copy"]
    return rows, compiles, profiles


def run(args, progress: TextIO) -> dict:
    """Every model x (width, depth) x runtime x variant, measured and checked; the targets.

    Row fields: model, width, sublayers, runtime, variant, sites; cpu_* (1 thread, process CPU time)
    and wall_* (--threads, wall time): _ms, _min_ms, _rounds_ms, _overhead_pct (median of per-round
    ratios to the same runtime's original), _overhead_interval ([low, high] %) and
    _interval_coverage; vs_onnxruntime_cpu / _wall (TVM rows) and their _interval; in_thread and
    cpu_share (clock checks, docs/bench.md); forward_peak_mb and peak_rss_mb, or memory_error;
    max_abs_err against the runtime's original; error: None or why there are no numbers."""
    s = settings(args)
    log = Progress(progress)
    rows, compiles, profiles = [], [], []
    with tempfile.TemporaryDirectory(prefix="attnres-bench-logs-") as logs:
        workers = Workers(Path(logs))
        workers.start()
        targets, model = model_targets.TARGETS, None
        if s.factory:  # one model at its own size, every target there
            model = factory.load(s.factory, getattr(args, "factory_timeout", None))
            name, width, sublayers = factory.geometry(s.factory, model)
            s.models, s.matrices, s.vocab = [name], [(width, [sublayers])], factory.vocab(model, VOCAB)
            targets = model_targets.at(targets, (width, sublayers))
        for name in s.models:
            for width, depths in s.matrices:
                for sublayers in depths:
                    more = bench_one(name, width, sublayers, s, log, workers, model)
                    rows += more[0]
                    compiles += more[1]
                    profiles += more[2]
    log.log("model benchmark done")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(s).items()}
    config.update(vocab=VOCAB, heads=HEADS, mlp={"gpt": 4.0, "llama": round(LLAMA_MLP_RATIO, 4)},
                  tvm="default build (no tuning)" + ("; tvm-tuned: " + (f"{s.tune_minutes:g} min" if s.tune_minutes
                                                                        else f"{s.trials} trials per task")
                                                     if "tvm-tuned" in s.runtimes else ""))
    tuning = {"tune_minutes": s.tune_minutes, "trials": s.trials}
    return {"benchmark": "model", "environment": results.environment(s.threads, s.device), "config": config,
            "rows": rows, "compile": compiles, "profiles": profiles,
            "targets": model_targets.evaluate(rows, compiles, tuning, targets, tuple(s.models))}
