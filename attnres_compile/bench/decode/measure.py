"""`bench decode`: what AttnRes costs per generated token with a KV cache, in the same runtime.

Each model is traced once as a decoder with past (fx/decoder.py); Full and Block are
`rewrite(..., with_past=True)` of it, an identical copy is the noise floor. A prefill (untimed),
then --steps one-token steps fed the previous presents; the per-token cost is their time over
--steps. Runtimes: torch eager (and HF's own forward as `hf`), onnxruntime, TVM, and `generate`
(bench/decode/route.py). Timing as in bench model; docs/bench.md, *`bench decode`*, says more.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from ...core.config import AttnResConfig
from ...core.errors import ConfigError, VerificationError
from .. import factory, results
from .. import targets as model_targets
from ..model.measure import HEADS, ORT_ORIGINAL, VOCAB, Progress, Variant, _timing_fields, identical_copy
from ..model.worker import WorkerError, Workers
from ..targets import Target
from . import route as decode_route
from . import sites as decode_sites
from .worker import time_decode

MODELS = ("llama", "gpt")
RUNTIMES = ("eager", "onnxruntime", "tvm", "generate")
FILES = {"eager": "pt2", "onnxruntime": "onnx", "tvm": "tvm"}
TIMEOUT_S = 3600
DEFAULTS = {"models": ["llama"], "runtimes": list(RUNTIMES), "widths": [256, 1024], "sublayers": [24, 48],
            "prefill": 128, "steps": 64, "min_time": 0.2}
QUICK = {"models": ["llama"], "runtimes": ["eager", "onnxruntime"], "widths": [64], "sublayers": [4], "prefill": 8, "steps": 4,
         "min_time": 0.01}  # the CI smoke test
MATRIX = ((256, 24), (256, 48), (1024, 24), (1024, 48))
TARGETS = (  # issue 50's limits (2026-12-04): Block <= +5% a token in every runtime at both widths
    Target("TVM decode, Block", "tvm", "block", "overhead", 5.0, MATRIX),
    Target("onnxruntime decode, Block", "onnxruntime", "block", "overhead", 5.0, MATRIX),
    Target("PyTorch eager decode, Block", "eager", "block", "overhead", 5.0, MATRIX),
    Target("TVM decode, original vs onnxruntime original", "tvm", "original", "vs_onnxruntime", 1.0, MATRIX),
    Target("HF generate() through causal_lm, Block", "generate", "block", "overhead", 5.0, ((256, 24),)),
)


@dataclass
class Settings:
    """The matrix and knobs: flags given win over the (quick) defaults."""

    models: list[str]
    widths: list[int]
    sublayers: list[int]
    runtimes: list[str]
    prefill: int
    steps: int
    blocks: int
    threads: int
    rounds: int
    min_time: float
    factory: str | None = None  # `module:function` of the user's causal LM, timed instead of the random models
    vocab: int = VOCAB  # token ids are drawn below this (a factory's model: at most its vocabulary)


def settings(args) -> Settings:
    """The Settings of the `bench decode` flags in `args` (absent flags take the defaults)."""
    if getattr(args, "device", "cpu") != "cpu":
        raise ConfigError("bench decode runs on the CPU only: drop --device")
    base = QUICK if getattr(args, "quick", False) else DEFAULTS
    s = Settings(models=getattr(args, "models", None) or base["models"],
                 widths=getattr(args, "widths", None) or base["widths"],
                 sublayers=getattr(args, "sublayers", None) or base["sublayers"],
                 runtimes=getattr(args, "runtimes", None) or base["runtimes"],
                 prefill=getattr(args, "prefill", None) or base["prefill"],
                 steps=getattr(args, "steps", None) or base["steps"], blocks=getattr(args, "blocks", None) or 8,
                 threads=getattr(args, "threads", None) or os.cpu_count() or 1,
                 rounds=getattr(args, "rounds", None) or 5, min_time=base["min_time"],
                 factory=getattr(args, "factory", None))
    if s.factory and any(getattr(args, flag, None) for flag in ("models", "widths", "sublayers")):
        raise ConfigError("--factory times that model at its own size: drop --models, --widths and --sublayers")
    if any(d % 2 for d in s.sublayers):
        raise ConfigError(f"--sublayers must be even (two sublayers per layer), got {s.sublayers}")
    if any(w % HEADS for w in s.widths):
        raise ConfigError(f"--widths must be multiples of {HEADS} (the number of heads), got {s.widths}")
    return s


# ---------------------------------------------------------------- variants

def make_variants(model: torch.nn.Module, blocks: int) -> tuple[list[Variant], dict, tuple, tuple]:
    """(variants, geometry job fields, example args, flat dynamic shapes): the traced decoder with
    past of `model` (an HF causal LM) and its verified Full and Block rewrites, as graph modules."""
    from ... import rewrite
    from ...fx import decoder
    from ...fx.trace import trace

    wrapper, args, spec = decoder.wrap(model)
    start = time.perf_counter()
    variants = [Variant("original", trace(wrapper, args, spec).graph_module, 0,
                        times={"trace": time.perf_counter() - start})]
    for name, config in (("full", AttnResConfig(variant="full")),
                         ("block", AttnResConfig(variant="block", num_blocks=blocks))):
        start = time.perf_counter()
        result = rewrite(wrapper, args, config, dynamic_shapes=spec)
        if not result.modified or not all(v["ok"] for v in result.report["verification"]):
            raise VerificationError(f"the {name} rewrite changed nothing or differs from the original decoder")
        variants.append(Variant(name, result.graph_module, result.report["summary"]["sites_rewritten"],
                                times={"trace": time.perf_counter() - start}))
    g = wrapper.geometry
    fields = {"heads": list(g.heads), "head_dims": list(g.head_dims), "geometry": g}
    return variants, fields, args, (*spec[:3], *spec[3])


def save_files(v: Variant, args: tuple, spec: tuple, geometry, folder: Path, runtimes: list[str]) -> None:
    """The .pt2 (eager), the decoder-with-past .onnx (named as export_onnx(with_past=True) names it;
    onnxruntime, and TVM's input) and its TVM library (compile_model's build, symbolic batch, sequence
    and past, default schedules; outputs not verified here: the worker checks every step's logits)."""
    from ...fx import dynamic_dims
    from ...onnx import decoder_names as onnx_decoder_names
    from ...onnx import export as onnx_export
    from ...onnx import io as onnx_io
    from ...pt2 import write

    what, notes = "dynamic batch, sequence and past length", []
    if "eager" in runtimes:
        start = time.perf_counter()
        v.files["pt2"] = folder / f"{v.name}.pt2"
        program = dynamic_dims.export_program(v.program, args, {}, spec, what, notes)
        write.drop_guards(program)  # as `rewrite --with-past -o X.pt2` saves it: guards of `*past` do not load
        torch.export.save(program, str(v.files["pt2"]))
        v.times["pt2"] = time.perf_counter() - start
    if {"onnxruntime", "tvm"} & set(runtimes):
        start = time.perf_counter()
        proto = onnx_export.export_or_static(v.program, args, {}, spec, what, notes)
        onnx_decoder_names.name(proto, geometry.input_names(), geometry.output_names())
        v.files["onnx"] = folder / f"{v.name}.onnx"
        onnx_io.write(proto, v.files["onnx"])
        v.times["onnx"] = time.perf_counter() - start
    if "tvm" in runtimes:  # compile_model's pipeline; compile_model itself refuses a model without sites
        from ...backends.tvm import vm_files
        from ...backends.tvm.importers import import_model
        from ...backends.tvm.pipeline import build, make_target

        start, cpu = time.perf_counter(), time.process_time()
        built = build(import_model(v.files["onnx"]), make_target("llvm"))
        v.files["tvm"] = folder / f"{v.name}.so"
        vm_files.save(built.executable, v.files["tvm"])
        v.times["tvm_build"] = time.perf_counter() - start
        v.times["tvm_build_cpu"] = time.process_time() - cpu
    if notes:
        raise VerificationError(f"the {v.name} decoder was traced with static shapes: {notes[0]}")


def _ids(s: Settings) -> np.ndarray:
    """The prompt and decoded positions' token ids (seed 0): [1, prefill + steps] below s.vocab."""
    return np.random.default_rng(0).integers(0, s.vocab, (1, s.prefill + s.steps), dtype=np.int64)


def reference_logits(model: torch.nn.Module, ids: np.ndarray, prefill: int) -> np.ndarray:
    """The torch model's logits at each decoded position, from one forward over every token: [steps, vocab]."""
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(ids), use_cache=False).logits
    return logits[0, prefill:].numpy()


# ---------------------------------------------------------------- measurement

def time_runtime(runtime: str, variants: list[Variant], base: dict, s: Settings, workers: Workers) -> dict:
    """{variant: row fields} of one runtime: every variant (and, in eager, HF's own forward as `hf`)
    checked against the runtime's original, then timed at 1 thread (CPU time) and at s.threads (wall)."""
    if runtime == "generate":
        candidates = decode_route.candidates()
    else:
        candidates = [{"name": f"{runtime} {v.name}", "runtime": runtime, "artifact": str(v.files[FILES[runtime]]),
                       "variant": v.name, "check": "reference" if v.name == "original" else f"{runtime} original"}
                      for v in variants]
    if runtime == "eager":
        candidates.append({"name": "eager hf", "runtime": "hf", "variant": "hf", "check": "eager original"})
    if runtime == "tvm":  # onnxruntime's original in the same rounds: TVM against onnxruntime
        original = next(v for v in variants if v.name == "original")
        candidates.append({"name": ORT_ORIGINAL, "runtime": "onnxruntime", "artifact": str(original.files["onnx"]),
                           "variant": None, "check": "reference"})
    measured = {}
    for threads in dict.fromkeys((1, s.threads)):
        try:
            job = {**base, "candidates": candidates, "threads": threads}
            measured[threads] = workers.run(time_decode, job, TIMEOUT_S)
        except WorkerError as exc:
            measured[threads] = exc
    out = {}
    for c in (c for c in candidates if c["variant"] is not None):
        fields = _timing_fields(c, measured[1], measured[s.threads])
        for clock in ("cpu", "wall"):
            if f"{clock}_ms" in fields:
                fields[f"{clock}_token_ms"] = fields[f"{clock}_ms"] / s.steps
        out[c["variant"]] = fields
    return out


def bench_one(name: str, width: int, sublayers: int, s: Settings, log: Progress, workers: Workers,
              model: torch.nn.Module | None = None) -> tuple[list, dict]:
    """Rows (runtime x variant) and the site costs of one configuration (`model`: a factory's, else
    bench model's random one of that configuration)."""
    tag = f"{name} {width}/{sublayers}"
    log.log(f"{tag}: tracing and rewriting the decoder with past ({sublayers // 2} layers, width {width})")
    job = {"factory": s.factory, "model": name, "layers": sublayers // 2, "width": width, "prefill": s.prefill,
           "steps": s.steps}
    model = model if model is not None else decode_route.model_of(job)
    ids = _ids(s)
    reference = reference_logits(model, ids, s.prefill)
    variants, geometry, args, spec = make_variants(model, s.blocks)
    sources = {v.name: decode_sites.site_sources(v.program) for v in variants}
    ops = {v.name: decode_sites.op_count(v.program) for v in variants}
    keys = {"model": name, "width": width, "sublayers": sublayers}
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"attnres-decode-{name}-{width}-{sublayers}-") as tmp:
        folder = Path(tmp)
        for v in variants:
            save_files(v, args, spec, geometry["geometry"], folder, s.runtimes)
            log.log(f"  {v.name}: " + ", ".join(f"{k} {t:.1f} s" for k, t in v.times.items()))
            v.program = None  # the files are what the workers load
        del model, args
        variants.insert(1, identical_copy(variants[0], folder))
        np.savez(folder / "inputs.npz", input_ids=ids)
        np.savez(folder / "reference.npz", logits=reference)
        base = {"inputs": str(folder / "inputs.npz"), "reference": str(folder / "reference.npz"),
                "heads": geometry["heads"], "head_dims": geometry["head_dims"], **job, "rounds": s.rounds,
                "min_time": s.min_time}
        for runtime in [r for r in s.runtimes if r in FILES]:
            start = time.perf_counter()
            timed = time_runtime(runtime, variants, base, s, workers)
            for variant, fields in timed.items():
                rows.append({**keys, "runtime": runtime, "variant": variant, "sites": len(sources.get(variant, [])),
                             "ops": ops.get(variant, ops["original"] if variant == "copy" else None), **fields})
            summary = ", ".join(f"{v} {f['cpu_overhead_pct']:+.1f}%" for v, f in timed.items()
                                if v != "original" and "cpu_overhead_pct" in f)
            first = timed["original"]
            log.log(f"{tag} {runtime}: " + (f"original {first['cpu_token_ms']:.3f} ms/token CPU at 1 thread, {summary}"
                                            if "cpu_token_ms" in first else str(first["error"]))
                    + f" ({time.perf_counter() - start:.1f} s)")
    start = time.perf_counter()
    sites = {**keys, **decode_sites.measure(width, sources, s, workers)}
    log.log(f"{tag}: one site at [1, 1, {width}] timed ({time.perf_counter() - start:.1f} s)")
    return rows, sites


def bench_route(name: str, width: int, sublayers: int, s: Settings, log: Progress, workers: Workers) -> list[dict]:
    """The generate runtime's rows of one configuration (bench/decode/route.py): each candidate built and
    timed in the worker, 1 thread (CPU time) and s.threads (wall)."""
    keys = {"model": name, "width": width, "sublayers": sublayers}
    ids = _ids(s)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"attnres-decode-route-{name}-") as tmp:
        np.savez(Path(tmp) / "inputs.npz", input_ids=ids)
        base = {"inputs": str(Path(tmp) / "inputs.npz"), "prefill": s.prefill, "steps": s.steps, "model": name,
                "layers": sublayers // 2, "width": width, "blocks": s.blocks, "factory": s.factory,
                "rounds": s.rounds, "min_time": s.min_time}
        timed = time_runtime("generate", [], base, s, workers)
    rows = [{**keys, "runtime": "generate", "variant": v, "sites": None, "ops": None, **f} for v, f in timed.items()]
    summary = ", ".join(f"{v} {f['cpu_overhead_pct']:+.1f}%" for v, f in timed.items()
                        if v != "original" and "cpu_overhead_pct" in f)
    first = timed["original"]
    log.log(f"{name} {width}/{sublayers} generate: " + (f"original {first['cpu_token_ms']:.3f} ms/token CPU at 1 thread, "
                                                         f"{summary}" if "cpu_token_ms" in first else str(first["error"]))
            + f" ({time.perf_counter() - start:.1f} s)")
    return rows


def run(args, progress: TextIO) -> dict:
    """Every model x width x depth x runtime x variant: per-token decode time, overhead over the
    runtime's original, the output check, one site's cost and the targets (TARGETS). Row fields as
    bench model's (model.run) per call of --steps tokens, plus cpu_token_ms / wall_token_ms and ops
    (operator calls); variant `hf` is HF's own forward with a DynamicCache."""
    s = settings(args)
    log = Progress(progress)
    rows, sites = [], []
    with tempfile.TemporaryDirectory(prefix="attnres-decode-logs-") as logs:
        workers = Workers(Path(logs))
        workers.start()
        matrix = [(n, w, d) for n in s.models for w in s.widths for d in s.sublayers]
        targets, model = TARGETS, None
        if s.factory:  # one model at its own size, every target there
            model = factory.load(s.factory, getattr(args, "factory_timeout", None))
            matrix, s.vocab = [factory.geometry(s.factory, model)], factory.vocab(model, VOCAB)
            s.models, s.widths, s.sublayers = [matrix[0][0]], [matrix[0][1]], [matrix[0][2]]
            targets = model_targets.at(TARGETS, matrix[0][1:])
        for name, width, sublayers in matrix:
            if set(s.runtimes) & set(FILES):
                more, site = bench_one(name, width, sublayers, s, log, workers, model)
                rows += more
                sites.append(site)
            if "generate" in s.runtimes:
                rows += bench_route(name, width, sublayers, s, log, workers)
    log.log("decode benchmark done")
    targets = model_targets.evaluate(rows, [], {}, targets, tuple(s.models))
    config = {**vars(s), "vocab": VOCAB, "heads": HEADS,
              "tvm": "default build (no tuning)" if "tvm" in s.runtimes else "not measured"}
    return {"benchmark": "decode", "environment": results.environment(s.threads, "cpu"), "config": config,
            "rows": rows, "sites": sites, "targets": targets}
